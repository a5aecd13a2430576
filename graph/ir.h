/*
 * graph/ir.h — the step IR: tensors (name, dtype, shape, role, lifetime, arena offset) and ops
 * (kind, input and output tensor indices, attributes). A graph is the whole step known ahead:
 * graph/step.c builds it from a model + batch configuration, alloc/planner.c places every
 * non-persistent tensor in one arena, the GPU executor enqueues the ops in order, graph/dump.c
 * draws it. Why: docs/DESIGN.md "Plan" — every size and lifetime is known before the first step.
 *
 * Memory: ONE arena. Persistent tensors (the flat parameter buffers of graph/gpt.h's layout and
 * the step state) sit first, at offsets [0, persistent_bytes), never reused. Every other tensor
 * lives from the first to the last op that touches it and is placed by the planner at
 * persistent_bytes + its planned offset. ng_tensor.offset is always from the arena start.
 *
 * Parameters: ops name the parameter they read by enum ng_param_id in param[] plus the layer;
 * the executor computes the pointer as base(params_bf16 / grads / ...) + lay.p[id].offset
 * (+ layer * the per-layer numel). The persistent flat buffers are each ONE tensor.
 *
 * Shapes below: B micro-batch, T sequence, C channels, H heads, D = C/H, Vp padded vocabulary,
 * K micro-batches per step, N = B*T rows; "rows" of a chunked op = row_count (row_start first).
 *
 * Op kinds: inputs (in[]) and outputs (out[]) in this order; attributes used. Every op may also
 * name a SCRATCH tensor in `scratch` (workspace; -1 when none). param[] is -1 when unused.
 *   TOKENS_H2D        out: tokens u16 (K, B, T+1). The pinned host buffer is outside the arena.
 *                     Sample graphs: (1, B, T+1) where column T of row b holds the position
 *                     (0..T-1) whose logits sequence b wants.
 *   TOKENS_SPLIT      in: tokens. out: inputs i32 (B, T), targets i32 (B, T); attr micro.
 *                     Sample graphs: out inputs i32 (B, T), positions i32 (B) (no targets).
 *   ZERO              out: the tensor to memset to 0 (grads at step start; the residual-stream
 *                     gradient before each micro-batch's backward; the eval loss metric).
 *   ENCODER_FWD       in: inputs, params_bf16. out: x (B, T, C) bf16. param = {WTE, WPE}.
 *   LAYERNORM_FWD     in: x, params_bf16. out: ln (B, T, C) bf16, mean f32 (N), rstd f32 (N).
 *                     attr layer, which = LN1/LN2/LNF, param = {LNxW, LNxB}.
 *                     recompute = 1 (a backward recompute): in: x, params_bf16, mean, rstd;
 *                     out: ln only (the stored statistics are reused).
 *   MATMUL_FWD        in: inp (rows, IC) bf16, params_bf16. out: out (rows, OC) bf16 [, aux
 *                     pre-activation (rows, OC) bf16 when gelu = 1: out = GELU(aux)].
 *                     attr which = QKV/ATTPROJ/FC/FCPROJ/HEAD, layer, gelu, param = {W, B}
 *                     (HEAD: {WTE, -1}, no bias); HEAD reads rows [row_start, +row_count) of
 *                     inp (N, C) and writes its chunk's logits (row_count, Vp).
 *                     Sample graphs: HEAD reads inp (B, C) (the gathered rows), row_count = B.
 *                     residual = 1 (ATTPROJ, FCPROJ): also in, last: the residual stream
 *                     (rows, OC) bf16; out = it + inp @ W^T + b, the block's residual add
 *                     (cuBLASLt's C, beta = 1: summed in fp32, rounded once).
 *                     fp8 = 1 (train graphs built with --fp8): also in: params_fp8 (--recompute
 *                     fp8: params_bf16, W cast in the scratch), fp8_state;
 *                     the op casts its input rows to E4M3 at the front of its scratch (with the
 *                     slot's delayed scale, recording the rows' maximum) and multiplies them
 *                     with the E4M3 weights (graph/step.h "FP8").
 *                     own = 1, relu2 = 1 (the speedrun model's FC, step option fuse_relu2):
 *                     our own GEMM (kernels/gemm_sm90.h), out = max(inp @ W^T, 0)^2 rounded
 *                     once; the pre-activation is not stored (RELU2_BWD works from out).
 *   GELU_FWD          in: pre (N, 4C) bf16. out: post (N, 4C) bf16. attr layer, recompute.
 *   ATTENTION_FWD     in: qkv (B, T, 3C) bf16. out: y (B, T, C) bf16, lse f32 (B, H, T).
 *                     attr layer.
 *   CROSSENTROPY      in: logits (rows, Vp) bf16, targets i32 (B, T). out: the SAME logits
 *                     tensor (now dlogits = (softmax - onehot) / (B*T*K), in place), losses f32
 *                     (N), rows [row_start, +row_count) written. attr row_start, row_count,
 *                     chunk. no_grad = 1 (eval): logits are only read; out: losses only.
 *   LOSS_ACCUMULATE   in: losses f32 (N). out: step_state (loss_sum += mean(losses) / K), or in
 *                     eval graphs the eval_loss metric f32 (1) (+= mean / K).
 *   MATMUL_DINP       in: dout (rows, OC) bf16, params_bf16 [, aux pre-activation (N, IC) when
 *                     gelu = 1: the DGELU epilogue is fused]. out: dinp (N, IC) bf16 ("=",
 *                     rows [row_start, +row_count) for HEAD). attr which, layer, gelu, param.
 *                     fp8 = 1 (a layer kind in NG_FP8_DINP_*): also in, last: params_fp8t
 *                     (--recompute fp8: params_bf16, W^T cast in the scratch), fp8_state; dout
 *                     is cast to E5M2 at the front of the scratch (the slot's delayed scale,
 *                     recording its maximum) and multiplied by W^T in E4M3; when in[0] is a
 *                     u8 tensor it is that E5M2 dout already (an fp8 MATMUL_DW's out[1]).
 *                     own = 1 (FCPROJ, gelu = 1; --gelu-fusion own, unless --fp8 made this
 *                     dinp fp8): our own GEMM (kernels/gemm_sm90.h); in[1] is then
 *                     TRANSPOSE_W's wt (this layer's W^T at layer * IC * OC); out[1] grads:
 *                     it writes the fc bias gradient param[1] = FCB (the column sums of
 *                     dinp; "=" when overwrite, else "+="); with --recompute gelu also out[2]:
 *                     post (N, IC) bf16 = GELU(aux), what the fcproj dW reads.
 *   MATMUL_DW         in: dout (rows, OC) bf16, inp (N, IC) bf16. out: grads (fp32 +=: weight
 *                     AND bias grad; HEAD: wte only, rows of inp as MATMUL_FWD HEAD).
 *                     attr which, layer, param, row range for HEAD.
 *                     A layer kind with fp8 = 1 (NG_FP8_DW_*, graph/step.h "FP8"): also in[2]
 *                     fp8_state; dout^T in E5M2 and inp^T in E4M3 in its scratch, with a bias
 *                     the column sums of dout there too; optional out[1]: dout (rows, OC) in
 *                     E5M2 (u8) for the fp8 MATMUL_DINP that follows.
 *                     The speedrun head with fp8 = 1 (graph/step.h "FP8", NG_FP8_HEAD_BWD):
 *                     MATMUL_DINP in: g8 (rows x Vp E5M2 bytes and the descale after them),
 *                     params_fp8t (--recompute fp8: params_bf16), fp8_state; MATMUL_DW in: g8,
 *                     nf (N, C) bf16, fp8_state, g8^T and nf^T in E4M3 made in its scratch.
 *   GELU_BWD          in: pre (N, 4C) bf16, dout (N, 4C) bf16. out: dpre (N, 4C) bf16
 *                     [, grads, post (N, 4C) bf16]. attr layer. param[0] = FC bias (>= 0, with
 *                     grads): also the fc bias gradient, the column sums of dpre ("=" when
 *                     overwrite, else "+="); with post also GELU(pre) (--recompute gelu).
 *                     row_count = N. dpre may be the dout tensor itself (in place).
 *   ATTENTION_BWD     in: dy (B, T, C), qkv (B, T, 3C), y (B, T, C), lse (B, H, T).
 *                     out: dqkv (B, T, 3C) bf16. attr layer.
 *   LAYERNORM_BWD     in: dln (N, C) bf16, x (the LN input, N, C) bf16, params_bf16, mean, rstd.
 *                     out: dx (accumulated += into the residual-stream gradient), grads.
 *                     attr layer, which, param.
 *   ENCODER_SORT      (train graphs, right after TOKENS_SPLIT) in: inputs i32 (B, T).
 *                     out: sorted (u8, ng_encoder_bwd_sorted_bytes): the tokens sorted for the
 *                     embedding backward. The executor runs it on a second stream forked from
 *                     the step's and joined by ENCODER_BWD, so it overlaps the forward; its
 *                     output holds everything it writes (cub's temporary storage too), and
 *                     ENCODER_BWD lists its input too, so no tensor of the ops it overlaps
 *                     shares the memory it reads or writes.
 *   TRANSPOSE_W       in: params_bf16. out: wt (L, IC, OC) bf16, every layer's W^T of `which`
 *                     (FCPROJ: what an own MATMUL_DINP reads). param = {W, -1}. At the start
 *                     of each micro-batch's backward: read right after its transpose, W^T made
 *                     our GEMM ~10% slower (BENCHMARKS.md).
 *   ENCODER_BWD       in: dx (B, T, C) bf16, sorted (ENCODER_SORT's), inputs (only to keep
 *                     ENCODER_SORT's input live until this join). out: grads.
 *                     param = {WTE, WPE}.
 *   GRAD_NORM         in: grads. out: step_state (grad_norm).
 *   SCHEDULE          in: step_state. out: step_state (lr, clip_scale, skipped).
 *   ADAMW             in: grads, step_state. out: params_bf16, params_lo (the two halves of the
 *                     fp32 master, kernels/split.h), adam_m, adam_v.
 *   MUON              (--optimizer muon, in place of ADAMW) in: grads, step_state. out:
 *                     params_bf16, params_lo, adam_m (the hidden matrices' ranges: Muon's
 *                     momentum), adam_v; scratch: graph/optim_muon.h. Muon on the hidden
 *                     matrices, the speedrun's Adam on the rest (kernels/muon.h).
 *   STEP_FINISH       in: step_state. out: step_state (step += 1, metrics record written to the
 *                     host ring, loss_sum reset to 0 for the next step).
 *   GATHER_ROWS       (sample graphs) in: x (B, T, C) bf16, positions i32 (B).
 *                     out: rows (B, C) bf16 = x[b, positions[b]].
 *   LOGITS_OUT        (sample graphs) a marker the executor may ignore: in: logits (B, Vp) bf16,
 *                     the persistent METRIC tensor the host reads after the replay.
 *   FP8_PREP          (train graphs with --fp8, first op after the tokens) in: params_bf16,
 *                     fp8_state. out: fp8_state (weight scales; activation and gradient scales
 *                     rolled from the last steps' maxima), then unless --recompute fp8:
 *                     params_fp8 (E4M3 weights of the forward matmuls, each layer's matrix
 *                     with its own current scale) [, params_fp8t: W^T of the fp8 dinp kinds,
 *                     same scales].
 *
 * The speedrun family (graph/step_spr.c; docs/DESIGN.md "The speedrun model"). Its matmuls are
 * MATMUL_* without bias (param[1] = -1); the attention tensors of block l are at its slot
 * ng_spr_attn_slot(l) of dim 0 (the executor maps the layer). N = B*T, C channels.
 *   SCALARS           (step level, first) in: params_bf16, params_lo. out: scalars f32: the fp32
 *                     master of xlambda, vlambda and skipw (the layout's range from xlambda to
 *                     the end of skipw), then the constant 1.0.
 *   ATTN_BOUNDS       in: inputs i32 (B, T), step_state[, eval_window]. out: bounds i32
 *                     (2, B, T): for each query the first key it may see (its document's
 *                     start, and t - window + 1), row 0 for the long window, row 1 for the
 *                     short one; windows i32 (2): the two windows in tokens, of the window W
 *                     the step counter gives (graph/step_spr.h), or in eval graphs of the W
 *                     in eval_window (the host writes it before each evaluation).
 *                     The speedrun's ATTENTION_FWD / _BWD read bounds and windows after their
 *                     GPT-2 inputs; index 1 = the long window.
 *   EMBED_FWD         in: inputs, params_bf16. out: rows (N, C) bf16 = table[tok]. param[0] =
 *                     WTE or VE, index = the table.
 *   EMBED_BWD         in: drows (N, C) bf16, sorted (ENCODER_SORT's), inputs. out: grads (+=
 *                     into the table's rows). param[0], index as EMBED_FWD.
 *   RMSNORM_FWD       in: x (N, C). out: y (N, C) bf16, rstd f32 (N). which LN1 (before the
 *                     attention), LN2 (before the MLP), LNF (before the head), NONE (the
 *                     embedding).
 *   RMSNORM_BWD       in: dy, x, rstd. out: dx (+=; overwrite: "=").
 *   QK_ROTARY_FWD     in: qkv (N, 3C) (the matmul's). out: qkva (N, 3C): q and k RMS-normed per
 *                     head and rotated, v copied; rstd f32 (N, 2, H).
 *   QK_ROTARY_BWD     in: qkva, rstd. out: dqkva: its q and k parts turned in place into the
 *                     gradients of the matmul's q and k (v untouched).
 *   MIX_FWD           out = a u + b w (kernels/mix.h) by which: XMIX (in: x, x0, scalars; a, b =
 *                     xlambda[l]); VMIX (in: qkv (v read at column 2C), ve rows or -1, scalars;
 *                     out: qkva, v written at column 2C; a, b = vlambda[slot]); SKIP (in: x,
 *                     skip source, scalars; a = 1, b = skipw[index]).
 *   MIX_BWD           the gradients of MIX_FWD: in: dout, u, w (or -1), scalars. out: du (or
 *                     -1), dw (or -1), grads (the scalars', +=). XMIX: du = dx "=" (in place on
 *                     dout), dw = dx0 +=; VMIX: du = the v part of dqkva "=" (in place), dw =
 *                     dve +=; SKIP: du -1 (the identity), dw = dskip "=".
 *   ADD               in: dst, src, scalars (its constant 1). out: dst += src (bf16).
 *   RELU2_FWD         in: pre (N, 4C). out: post = relu(pre)^2.
 *   RELU2_BWD         in: pre, dpost. out: dpre (in place on dpost). relu2 = 1 (the fc forward
 *                     fused): in[0] is post = max(pre, 0)^2 and dpre = 2 sqrt(post) dpost.
 *   SOFTCAP_CE        as CROSSENTROPY, over all Vp columns of soft-capped logits
 *                     (kernels/softcap.h); training: the gradient of the SUM of the losses.
 *                     fp8 = 1: out[0] is g8 (u8, rows x Vp + 16): the gradient in E5M2 times
 *                     NG_SPR_HEAD_GSCALE, then its descale (float); the logits are only read.
 *
 * References: docs/DESIGN.md ("The step, in order", "Memory"), llm.c train_gpt2.cu for the op
 * order.
 */
#ifndef NG_GRAPH_IR_H
#define NG_GRAPH_IR_H

#include <stdbool.h>
#include <stddef.h>

#include "graph/gpt.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NG_OP_MAX_IO 6      /* inputs or outputs of one op, at most */
#define NG_TENSOR_NAME 56   /* bytes of a tensor name, NUL included */
#define NG_OP_NAME 48       /* bytes of an op's display name, NUL included */

enum ng_dtype {
	NG_DTYPE_BF16, /* bfloat16, 2 bytes */
	NG_DTYPE_F32,  /* float, 4 bytes */
	NG_DTYPE_I32,  /* int32, 4 bytes */
	NG_DTYPE_U16,  /* uint16 (tokens), 2 bytes */
	NG_DTYPE_U8,   /* raw bytes (the step state struct) */
	NG_DTYPE_COUNT
};

enum ng_role {
	NG_ROLE_PARAM,      /* the low half of the fp32 master (u16; kernels/split.h) */
	NG_ROLE_PARAM_BF16, /* the bf16 copy forward/backward read (the master's high half) */
	NG_ROLE_GRAD,       /* fp32 gradients */
	NG_ROLE_OPT_STATE,  /* AdamW m and v */
	NG_ROLE_ACTIVATION, /* forward activations, backward gradients of activations, logits */
	NG_ROLE_SCRATCH,    /* workspaces (cuBLASLt, cuDNN, reduction partials) */
	NG_ROLE_INPUT,      /* tokens, inputs, targets */
	NG_ROLE_METRIC,     /* step state, eval loss, sample logits: read by the host */
	NG_ROLE_COUNT
};

enum ng_op_kind {
	NG_OP_TOKENS_H2D, NG_OP_TOKENS_SPLIT, NG_OP_ZERO, NG_OP_ENCODER_FWD, NG_OP_LAYERNORM_FWD,
	NG_OP_MATMUL_FWD, NG_OP_GELU_FWD, NG_OP_ATTENTION_FWD,
	NG_OP_CROSSENTROPY, NG_OP_LOSS_ACCUMULATE, NG_OP_MATMUL_DINP, NG_OP_MATMUL_DW,
	NG_OP_GELU_BWD, NG_OP_ATTENTION_BWD, NG_OP_LAYERNORM_BWD, NG_OP_ENCODER_BWD,
	NG_OP_GRAD_NORM, NG_OP_SCHEDULE, NG_OP_ADAMW, NG_OP_STEP_FINISH, NG_OP_GATHER_ROWS,
	NG_OP_LOGITS_OUT, NG_OP_FP8_PREP, NG_OP_ENCODER_SORT, NG_OP_TRANSPOSE_W, NG_OP_MUON,
	/* the speedrun family (graph/step_spr.c) */
	NG_OP_SCALARS, NG_OP_ATTN_BOUNDS, NG_OP_EMBED_FWD, NG_OP_EMBED_BWD, NG_OP_RMSNORM_FWD,
	NG_OP_RMSNORM_BWD, NG_OP_QK_ROTARY_FWD, NG_OP_QK_ROTARY_BWD, NG_OP_MIX_FWD, NG_OP_MIX_BWD,
	NG_OP_ADD, NG_OP_RELU2_FWD, NG_OP_RELU2_BWD, NG_OP_SOFTCAP_CE,
	NG_OP_KIND_COUNT
};

/* The `which` attribute: which LayerNorm or which linear layer an op is. */
enum ng_op_which {
	NG_OP_WHICH_NONE, NG_OP_WHICH_LN1, NG_OP_WHICH_LN2, NG_OP_WHICH_LNF, NG_OP_WHICH_QKV,
	NG_OP_WHICH_ATTPROJ, NG_OP_WHICH_FC, NG_OP_WHICH_FCPROJ, NG_OP_WHICH_HEAD,
	NG_OP_WHICH_XMIX, NG_OP_WHICH_VMIX, NG_OP_WHICH_SKIP, /* the speedrun's MIX ops */
	NG_OP_WHICH_COUNT
};

/* Which phase of the step an op belongs to (the dump draws them as clusters). */
enum ng_phase {
	NG_PHASE_INPUT,     /* tokens in, grads zeroed */
	NG_PHASE_FORWARD,   /* forward of one micro-batch */
	NG_PHASE_LOSS,      /* classifier: head, cross-entropy, head backward */
	NG_PHASE_BACKWARD,  /* backward of one micro-batch */
	NG_PHASE_OPTIMIZER, /* norm, schedule, AdamW, step finish */
	NG_PHASE_COUNT
};

enum ng_graph_kind {
	NG_GRAPH_TRAIN,  /* the training step: K micro-batches, then the update */
	NG_GRAPH_EVAL,   /* K batches of forward + loss into the eval_loss metric */
	NG_GRAPH_SAMPLE, /* one forward, the logits of one position per sequence */
};

struct ng_tensor {
	char name[NG_TENSOR_NAME]; /* unique: "L3.qkv", "m1.L3.qkv" when K > 1, "params" */
	enum ng_dtype dtype;
	int ndim;                  /* 1..4 */
	size_t shape[4];           /* shape[0..ndim-1], row-major; unused dims are 1 */
	size_t bytes;              /* product of shape x dtype size (scratch: the estimate) */
	enum ng_role role;
	bool persistent;           /* lives for the whole run; placed first, never reused */
	int first_op;              /* first op that reads or writes it (-1: never touched) */
	int last_op;               /* last op that reads or writes it */
	size_t offset;             /* bytes from the arena start, valid after ng_graph_plan */
};

struct ng_op {
	enum ng_op_kind kind;
	int n_in;                  /* used entries of in[] */
	int n_out;                 /* used entries of out[] */
	int in[NG_OP_MAX_IO];      /* tensor indices, order per kind (see the top of this file) */
	int out[NG_OP_MAX_IO];     /* tensor indices, order per kind */
	int scratch;               /* SCRATCH tensor index or -1 */
	enum ng_op_which which;    /* LN1/.../HEAD, or NONE */
	enum ng_phase phase;       /* for display and statistics */
	int param[2];              /* enum ng_param_id read: {weight, bias}; -1 when none */
	int layer;                 /* 0..L-1, or -1 */
	int micro;                 /* micro-batch 0..K-1, or -1 (step-level ops) */
	int chunk;                 /* classifier chunk index, or -1 */
	int row_start;             /* chunked ops: first row of N = B*T (0 otherwise) */
	int row_count;             /* chunked ops: rows; otherwise N (or B for sample heads) */
	int gelu;                  /* MATMUL_FWD: GELU epilogue; MATMUL_DINP: DGELU epilogue */
	int recompute;             /* 1: a forward op recomputed in the backward */
	int no_grad;               /* CROSSENTROPY in eval: losses only, no dlogits */
	int overwrite;             /* MATMUL_DW: the step's first writer of its gradient: "=" (beta
	                            * 0) instead of "+="; ZERO with param[0] >= 0: that parameter's
	                            * gradient range only; GELU_BWD with the fc bias: "=" too */
	int fp8;                   /* MATMUL_FWD / DINP (the speedrun head: DW, SOFTCAP_CE): fp8
	                            * operands or output (see the kind's comment) */
	int residual;              /* MATMUL_FWD: 1 = out = in[n_in - 1] (rows, OC) bf16 + the
	                            * product (the block's residual add, in the matmul's epilogue) */
	int own;                   /* MATMUL_DINP: 1 = our own GEMM's DGELU (see the kind);
	                            * MATMUL_FWD with relu2: its relu^2 epilogue */
	int relu2;                 /* MATMUL_FWD (the speedrun model's FC, own = 1): writes
	                            * max(pre, 0)^2 (see the kind); RELU2_BWD: in[0] is that
	                            * output, not the pre-activation */
	int index;                 /* EMBED_FWD / EMBED_BWD: the table (ve: 0..2; wte: 0); MIX
	                            * with SKIP: the skip weight j; ATTENTION_*: 1 = long window */
	char name[NG_OP_NAME];     /* display: "m0.L3.matmul_fwd.qkv" */
};

struct ng_step_options;

struct ng_graph {
	enum ng_graph_kind kind;
	struct ng_gpt_config cfg;  /* the model */
	struct ng_gpt_layout lay;  /* its flat parameter layout */
	int B, T, K;               /* micro-batch, sequence length, micro-batches per step */
	int head_chunk_rows;       /* rows per classifier chunk actually used (N when unchunked) */
	int recompute_gelu;        /* options the graph was built with */
	int recompute_layernorm;
	int recompute_fp8;         /* fp8 matmuls cast their weights themselves (graph/step.h) */
	int keep_gelu;             /* with recompute_gelu: the last keep_gelu layers keep theirs */
	int keep_layernorm;        /* the same for recompute_layernorm */
	int fuse_gelu;
	int fuse_relu2;            /* the speedrun model's relu^2 in our GEMM's epilogues */
	int deterministic;
	int fp8;                   /* train graphs: NG_FP8_* bits (graph/step.h) of the matmuls
	                            * that take fp8 operands; 0 in other kinds */
	size_t align;              /* arena alignment used by the plan, bytes */

	struct ng_tensor *tensors; /* n_tensors entries */
	int n_tensors;
	int cap_tensors;           /* allocated entries */
	struct ng_op *ops;         /* n_ops entries, in execution order */
	int n_ops;
	int cap_ops;

	/* well-known tensors (-1 when the graph has none) */
	int t_params_lo, t_params_bf16, t_grads, t_adam_m, t_adam_v, t_step_state, t_tokens;
	int t_eval_loss;           /* eval graphs: the f32 (1) metric */
	int t_eval_window;         /* speedrun eval graphs: the window in blocks, i32 (1),
	                            * persistent, written before each evaluation */
	int t_logits_out;          /* sample graphs: logits (B, Vp) bf16, persistent */
	int t_params_fp8;          /* --fp8 (every kind, for equal offsets): E4M3 weights u8 (P) */
	int t_fp8_state;           /* --fp8: scales and maxima f32 (graph/step.h "FP8") */
	int t_params_fp8t;         /* --fp8 dinp kinds: their W^T in E4M3 u8 (graph/step.h) */

	size_t persistent_bytes;   /* the persistent region, aligned */
	size_t arena_bytes;        /* the planned region (non-persistent tensors) */
	size_t lower_bound_bytes;  /* max over ops of live planned bytes (aligned sizes) */
	size_t total_bytes;        /* persistent_bytes + arena_bytes: the one cudaMalloc */
	enum ng_status status;     /* sticky: first failure of an add (allocation), else NG_OK */
};

/* Sizes and names. */
size_t ng_dtype_size(enum ng_dtype dt);
const char *ng_dtype_name(enum ng_dtype dt);         /* "bf16", "f32", ... */
const char *ng_role_name(enum ng_role role);         /* "param", "activation", ... */
const char *ng_op_kind_name(enum ng_op_kind kind);   /* "matmul_fwd", ... */
const char *ng_op_which_name(enum ng_op_which which); /* "qkv", "ln1", "" for NONE */
const char *ng_phase_name(enum ng_phase phase);      /* "forward", ... */

/* An empty graph (no allocation yet). */
void ng_graph_init(struct ng_graph *g);
/* Free tensors and ops; the graph becomes empty. Safe on an initialised or zeroed graph. */
void ng_graph_free(struct ng_graph *g);

/* Add a tensor; returns its index, or -1 with g->status set (allocation failure). `bytes` = 0
 * means shape x dtype size; a SCRATCH tensor passes its estimate. */
int ng_graph_add_tensor(struct ng_graph *g, const char *name, enum ng_dtype dt, enum ng_role role,
			bool persistent, int ndim, const size_t *shape, size_t bytes);
/* Add an op (copied); returns its index, or -1 with g->status set. */
int ng_graph_add_op(struct ng_graph *g, const struct ng_op *op);
/* A blank op of `kind`: no tensors, scratch/param/layer/micro/chunk -1, the rest 0. */
struct ng_op ng_op_blank(enum ng_op_kind kind);

/* Find a tensor by name (-1 when absent). Linear: for tests and tools, not hot paths. */
int ng_graph_find_tensor(const struct ng_graph *g, const char *name);

/* first_op / last_op of every tensor from op order. */
void ng_graph_compute_lifetimes(struct ng_graph *g);
/* Lifetimes, then place persistent tensors first and plan the rest with alloc/planner (align 0
 * = 256 B); fills offsets, persistent_bytes, arena_bytes, lower_bound_bytes, total_bytes. Call
 * again after raising a SCRATCH tensor's bytes (the executor may, at plan time). */
enum ng_status ng_graph_plan(struct ng_graph *g, size_t align);
/* Check the graph: tensor indices in range, every op's tensors inside the arena, and no two
 * tensors alive at the same op overlap in memory. NG_ERR_RUNTIME naming the pair otherwise. */
enum ng_status ng_graph_validate(const struct ng_graph *g);

/* Bytes of all tensors of a role (persistent or not, unaligned). */
size_t ng_graph_role_bytes(const struct ng_graph *g, enum ng_role role);

/* The op where the planned (non-persistent) live bytes peak — the lower bound's op — and the
 * aligned live bytes per role there (by_role[NG_ROLE_COUNT]; they sum to lower_bound_bytes).
 * Returns the op index (-1 for a graph with no planned tensor). Needs ng_graph_plan first. */
int ng_graph_peak(const struct ng_graph *g, size_t *by_role);

/* An impossible plan: NG_OK when total_bytes fits in gpu_bytes, else NG_ERR_INPUT with both
 * numbers in the message and a hint naming recompute, the chunked classifier and a smaller
 * batch. */
enum ng_status ng_plan_check_fit(size_t total_bytes, size_t gpu_bytes);

#ifdef __cplusplus
}
#endif

#endif
