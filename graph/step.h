/*
 * graph/step.h — the builder: turns a model + batch configuration into the complete step as an
 * IR graph (graph/ir.h), with every tensor's lifetime and arena offset planned.
 *
 * Training step, in order (docs/DESIGN.md "The step, in order"):
 *   TOKENS_H2D once; ZERO grads; for each of K micro-batches: TOKENS_SPLIT, the forward
 *   (encoder, L blocks, final LayerNorm), the classifier (per chunk of head_chunk_rows rows:
 *   MATMUL_FWD HEAD -> CROSSENTROPY -> MATMUL_DINP HEAD -> MATMUL_DW HEAD, so the logits exist
 *   one chunk at a time), LOSS_ACCUMULATE, then the backward in reverse; then GRAD_NORM ->
 *   SCHEDULE -> ADAMW -> STEP_FINISH.
 * Per-layer activations are separate tensors ("L3.qkv", "m1.L3.qkv" when K > 1) so lifetimes
 * are exact. Recompute options drop the stored tensor (GELU output, LN1/LN2 outputs) and add
 * the recompute op in the backward, right before its first backward use. The residual-stream
 * gradient is one bf16 tensor per micro-batch ("dresid"), zeroed before that backward.
 *
 * Workspaces are SCRATCH tensors, one per op that needs one (lifetime: that op), sized by the
 * estimates of ng_step_workspace_estimate — the executor may raise them at plan time (edit the
 * tensor's bytes, then ng_graph_plan again).
 */
#ifndef NG_GRAPH_STEP_H
#define NG_GRAPH_STEP_H

#include <stddef.h>

#include "graph/gpt.h"
#include "graph/ir.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * FP8 (--fp8). In the training step the chosen forward matmuls (qkv, attproj, fc, fcproj of
 * each layer, the classifier) multiply E4M3 operands into bf16 (cuBLASLt, fp32 accumulate);
 * the chosen dinp matmuls of the four layer kinds multiply an E5M2 dout by E4M3 W^T (below);
 * the weight gradients stay bf16 and read the bf16 activations as before. One scale per slot:
 * slot (which - QKV) * L + layer for the four layer matmuls, 4L for the head (E4M3); 4L + 1 +
 * the same for the dinp's dout (E5M2).
 *  - Weights: FP8_PREP casts each layer's matrix once per step with a current scale
 *    (448 / its own max |w|), after the previous step's AdamW.
 *  - Activations: delayed scaling. The cast in front of each matmul uses the slot's scale,
 *    448 / (2^NG_FP8_ACT_MARGIN x the largest maximum of the last NG_FP8_HISTORY steps), and
 *    records the maximum of what it casts; FP8_PREP rolls that into the history. In the first
 *    step (no history) the scale is 1. Values above the scale's range saturate at +-448.
 * fp8_state, f32: the fields of enum ng_fp8_field in order, each for S = 8L + 1 slots (an
 * activation maximum is NG_FP8_ACT_AMAX_SUB floats on 128-byte lines of their own, a descale
 * every 16 bytes: cuBLASLt reads them); the history is S rows of NG_FP8_HISTORY, newest first.
 * With several ranks the step's maxima are max-reduced at its end (GRAD_NORM's NCCL group,
 * through NG_FP8_AMAX_BITS: one word a slot), so between steps every rank holds the same
 * fp8_state, and a checkpoint's (rank 0's) resumes every rank exactly.
 * Eval and sample graphs stay bf16.
 *  - Where the input of an fp8 matmul is a LayerNorm output (qkv: LN1, fc: LN2, head: LNF),
 *    that LayerNorm writes the E4M3 copy itself ("<ln>.e4m3", u8) and the matmul casts
 *    nothing: 1 byte an element instead of a 3-byte cast.
 */
/*
 *  - --recompute fp8 (recompute_fp8): params_fp8 and params_fp8t are not kept; FP8_PREP only
 *    takes the weight maxima and scales, and each fp8 matmul casts its own layer's W (forward)
 *    or W^T (dinp) with that scale into its scratch, in front of the cuBLASLt workspace: the
 *    same bytes as the copies (the same losses, bit for bit), 1.5 bytes a weight less memory.
 *  - Input gradients (NG_FP8_DINP_*): the dinp matmul of a layer kind multiplies dout, cast to
 *    E5M2 in front of it (delayed scaling, a slot of its own: 4L + 1 + (which - QKV) * L +
 *    layer), by W^T in E4M3 ("params_fp8t": FP8_PREP casts each such matrix transposed with the
 *    forward's weight scale, so both share the weight descale).
 *  - Weight gradients (NG_FP8_DW_*, opt-in: --fp8-dw; both families), for a layer kind whose
 *    forward is fp8 and a step of B x T a multiple of 16 rows: the dW matmul multiplies dout^T
 *    in E5M2 (the dinp's slot and scale) by inp^T in E4M3 (the forward's slot and scale, so
 *    the bytes are the forward's input, transposed), fp32 out. Its scratch takes both
 *    transposes and, with a bias, the column sums of dout that the same cast reads
 *    (kernels/fp8.h ng_fp8_cast_wt; cuBLASLt's FP8 GEMM has no bias-gradient epilogue),
 *    reduced into the bias gradient after the matmul. Where the dinp of the kind is fp8 and
 *    comes next (all but GPT-2's FC-proj when its GELU backward is not fused or runs on our
 *    GEMM), the same cast also writes dout in E5M2 row-major as "dout8.<kind>" (u8, N x OC),
 *    which the dinp matmul reads instead of casting: one read of dout for both.
 *  - The speedrun head's backward (NG_FP8_HEAD_BWD, with NG_FP8_HEAD; the speedrun family
 *    only): the soft-capped loss writes its gradient as g8 = E5M2(dz x NG_SPR_HEAD_GSCALE), a
 *    static scale as the speedrun's reference (|dz| <= cap / (4 div) = 0.036 keeps it below
 *    16, far from saturation), with the descale 1 / NG_SPR_HEAD_GSCALE in the 16 bytes after
 *    the chunk's bytes ("g8.c<k>", u8); the dinp matmul multiplies g8 by the head's W^T in
 *    E4M3 (the last block of params_fp8t, cast by FP8_PREP with the forward's weight scale),
 *    and the dW matmul g8^T by nf^T in E4M3 (both transposed into its scratch: FP8 GEMMs take
 *    the reduced dimension contiguous; nf with the forward's input scale), fp32 out. A chunk
 *    of rows not a multiple of 16 keeps the bf16 backward.
 */
/* Which matmuls are fp8 (step options .fp8). AUTO: the executor times each kind both ways at
 * plan time (the cast of the input included) and keeps the faster; with --deterministic,
 * nothing is timed and the kinds whose output is wider than their input (forward qkv, fc,
 * head; dinp fcproj) are fp8. */
enum ng_fp8_kinds { NG_FP8_QKV = 1, NG_FP8_ATTPROJ = 2, NG_FP8_FC = 4, NG_FP8_FCPROJ = 8,
		    NG_FP8_HEAD = 16, NG_FP8_ALL = 31, NG_FP8_AUTO = 32,
		    NG_FP8_DINP_QKV = 64, NG_FP8_DINP_ATTPROJ = 128, NG_FP8_DINP_FC = 256,
		    NG_FP8_DINP_FCPROJ = 512, NG_FP8_DINP_ALL = 960,
		    NG_FP8_EVERY = NG_FP8_ALL | NG_FP8_DINP_ALL, NG_FP8_HEAD_BWD = 1024,
		    NG_FP8_DW_QKV = 2048, NG_FP8_DW_ATTPROJ = 4096, NG_FP8_DW_FC = 8192,
		    NG_FP8_DW_FCPROJ = 16384, NG_FP8_DW_ALL = 30720 };
#define NG_FP8_DINP_SHIFT 6 /* dinp bit of a layer kind = its forward bit << 6 */
#define NG_FP8_DW_SHIFT 11  /* dW bit of a layer kind = its forward bit << 11 */
static inline int ng_fp8_bit(enum ng_op_which w)
{
	if (w == NG_OP_WHICH_HEAD)
		return NG_FP8_HEAD;
	if (w >= NG_OP_WHICH_QKV && w <= NG_OP_WHICH_FCPROJ)
		return 1 << (int)(w - NG_OP_WHICH_QKV);
	return 0;
}
static inline int ng_fp8_dinp_bit(enum ng_op_which w)
{
	return w == NG_OP_WHICH_HEAD ? 0 : ng_fp8_bit(w) << NG_FP8_DINP_SHIFT;
}
static inline int ng_fp8_dw_bit(enum ng_op_which w)
{
	return w == NG_OP_WHICH_HEAD ? 0 : ng_fp8_bit(w) << NG_FP8_DW_SHIFT;
}
#define NG_FP8_ACT_AMAX_SUB 32    /* an activation maximum: NG_FP8_AMAX_SUB floats, */
#define NG_FP8_ACT_AMAX_STRIDE 32 /* NG_FP8_AMAX_STRIDE apart (kernels/fp8.h) */
#define NG_FP8_HISTORY 16
#define NG_FP8_ACT_MARGIN 1
enum ng_fp8_field { NG_FP8_ACT_AMAX, NG_FP8_ACT_SCALE, NG_FP8_ACT_DESCALE, NG_FP8_W_AMAX,
		    NG_FP8_W_SCALE, NG_FP8_W_DESCALE, NG_FP8_AMAX_BITS, NG_FP8_HIST };
static inline int ng_fp8_slots(int L) { return 8 * L + 1; }
static inline int ng_fp8_fwd_slots(int L) { return 4 * L + 1; } /* E4M3; the rest E5M2 */
/* First float of a field (NG_FP8_HIST: of the history rows). Fields start 16-byte aligned; the
 * two descale fields hold one descale per 16 bytes (NG_FP8_DESCALE_STRIDE, kernels/fp8.h). */
static inline size_t ng_fp8_field_at(int L, enum ng_fp8_field f)
{
	size_t s4 = ((size_t)ng_fp8_slots(L) + 3) / 4 * 4, at = 0;
	for (int i = 0; i < (int)f; i++)
		at += i == NG_FP8_ACT_AMAX ? NG_FP8_ACT_AMAX_SUB * NG_FP8_ACT_AMAX_STRIDE * s4
		      : (i == NG_FP8_ACT_DESCALE || i == NG_FP8_W_DESCALE) ? 4 * s4 : s4;
	return at;
}
static inline size_t ng_fp8_state_floats(int L)
{
	return ng_fp8_field_at(L, NG_FP8_HIST) + (size_t)ng_fp8_slots(L) * NG_FP8_HISTORY;
}
/* The slot of a forward matmul (-1 for anything else). */
static inline int ng_fp8_slot(int L, enum ng_op_which w, int layer)
{
	if (w == NG_OP_WHICH_HEAD)
		return 4 * L;
	if (w >= NG_OP_WHICH_QKV && w <= NG_OP_WHICH_FCPROJ && layer >= 0 && layer < L)
		return (int)(w - NG_OP_WHICH_QKV) * L + layer;
	return -1;
}
/* The E5M2 slot of a layer kind's dinp matmul (-1 for anything else). */
static inline int ng_fp8_dinp_slot(int L, enum ng_op_which w, int layer)
{
	if (w == NG_OP_WHICH_HEAD)
		return -1;
	int s = ng_fp8_slot(L, w, layer);
	return s < 0 ? -1 : ng_fp8_fwd_slots(L) + s;
}
/* params_fp8t: the transposed E4M3 weights of the fp8 dinp kinds (bits of mask), one block per
 * kind in the order qkv, attproj, fc, fcproj, each its L matrices back to back, then with
 * NG_FP8_HEAD_BWD the speedrun head's. Elements before kind k's block (k = which - QKV, the
 * head 4); k = 5: the whole tensor. */
static inline size_t ng_fp8t_at(const struct ng_gpt_layout *lay, int mask, int k)
{
	static const int ids[5] = { NG_P_QKVW, NG_P_ATTPROJW, NG_P_FCW, NG_P_FCPROJW, NG_P_HEADW };
	static const int bits[5] = { NG_FP8_DINP_QKV, NG_FP8_DINP_ATTPROJ, NG_FP8_DINP_FC,
				     NG_FP8_DINP_FCPROJ, NG_FP8_HEAD_BWD };
	size_t at = 0;
	for (int j = 0; j < k && j < 5; j++)
		if (mask & bits[j])
			at += lay->p[ids[j]].numel;
	return at;
}
/* The classifier's rows per chunk unless told (train and plan --head-chunk): the logits of 16384
 * rows are 1.6 GB of bf16 at GPT-2's vocabulary; at d12 B=64 the whole 65536 rows would hold
 * 6.6 GB at the step's peak, and four chunks measured as fast (BENCHMARKS "Memory options"). */
#define NG_HEAD_CHUNK_DEFAULT 16384
/* (IC, OC) of a linear layer: W is (OC, IC); the head (anything else) is (C, Vp). */
static inline void ng_linear_dims(const struct ng_gpt_config *m, enum ng_op_which w, int *ic,
				  int *oc)
{
	int C = m->C;
	switch (w) {
	case NG_OP_WHICH_QKV: *ic = C; *oc = 3 * C; break;
	case NG_OP_WHICH_ATTPROJ: *ic = C; *oc = C; break;
	case NG_OP_WHICH_FC: *ic = C; *oc = 4 * C; break;
	case NG_OP_WHICH_FCPROJ: *ic = 4 * C; *oc = C; break;
	default: *ic = C; *oc = m->Vp; break; /* HEAD */
	}
}
/* Bytes of one layer's E4M3 W (or W^T) of a kind (the head: wte), 256-aligned: what a --recompute
 * fp8 matmul casts into its scratch. */
static inline size_t ng_fp8_weight_bytes(const struct ng_gpt_config *c, enum ng_op_which w)
{
	int ic, oc;
	ng_linear_dims(c, w, &ic, &oc);
	return ((size_t)ic * (size_t)oc + 255) / 256 * 256;
}
/* Bytes of the E4M3 input copy at the front of a fp8 matmul's scratch (256-aligned). */
static inline size_t ng_fp8_input_bytes(size_t rows, size_t ic)
{
	return (rows * ic + 255) / 256 * 256;
}
/* Bytes in front of the cuBLASLt workspace in the scratch of the speedrun head's fp8 dW over
 * `rows` rows: g8^T (Vp, rows), then nf^T (C, rows) in E4M3. */
static inline size_t ng_fp8_head_dw_bytes(size_t rows, size_t Vp, size_t C)
{
	return ng_fp8_input_bytes(rows, Vp) + ng_fp8_input_bytes(rows, C);
}
/* Bytes in front of the cuBLASLt workspace in the scratch of a layer's fp8 dW over `rows` rows:
 * dout^T (OC, rows) in E5M2, inp^T (IC, rows) in E4M3, then with a bias the column sums of
 * dout, one row of OC floats a band of 64 rows (kernels/fp8.h ng_fp8_cast_wt). */
#define NG_FP8_DW_BAND 64 /* kernels/fp8.h NG_FP8_COLSUM_BAND */
static inline size_t ng_fp8_dw_bytes(size_t rows, size_t ic, size_t oc, int bias)
{
	size_t bands = (rows + NG_FP8_DW_BAND - 1) / NG_FP8_DW_BAND;
	size_t part = bias ? (bands * oc * 4 + 255) / 256 * 256 : 0;
	return ng_fp8_input_bytes(rows, oc) + ng_fp8_input_bytes(rows, ic) + part;
}

/* Workspace sizes in bytes; estimates made without a GPU. */
struct ng_step_workspace {
	size_t matmul;        /* cuBLASLt workspace per matmul (32 MiB) + bias-grad partials */
	size_t attn_fwd;      /* cuDNN SDPA forward (1 MiB) */
	size_t attn_bwd;      /* cuDNN SDPA backward: B*H*T*4 + B*H*T*D*4 + 1 MiB */
	size_t layernorm_bwd; /* dweight/dbias partials: 2*C floats x 1024 blocks, + 1 MiB */
	size_t encoder_bwd;   /* embedding backward's long-run partial rows: N*C/8 + 1 MiB */
	size_t encoder_sorted;/* the sorted tokens and cub's storage: N*24 + 1 MiB */
	size_t grad_norm;     /* per-block partial sums (1 MiB) */
	size_t crossentropy;  /* per-row partials (rows*8 + 1 MiB) */
	size_t gelu_bwd;      /* the fc bias gradient's partials: 4C floats a 256-row chunk */
};

struct ng_step_options {
	int recompute_gelu;      /* 1: do not keep GELU outputs; recompute them in the backward */
	int recompute_layernorm; /* 1: do not keep LN1/LN2 outputs; recompute from mean/rstd */
	int recompute_fp8;       /* 1 (with fp8): no E4M3 weight copies; each fp8 matmul casts its
				  * layer's W (or W^T) into its scratch (graph/step.h "FP8") */
	int keep_gelu;           /* with recompute_gelu: the last keep_gelu layers keep their GELU
				  * outputs all the same (0: none; >= L: all, as if no recompute) */
	int keep_layernorm;      /* the same for recompute_layernorm */
	int recompute_auto;      /* --recompute auto: ng_step_fit_memory chooses the four above
				  * (and recompute_fp8) for a memory budget; the builder ignores it */
	int head_chunk_rows;     /* rows per classifier chunk; 0 = whole B*T (clamped to B*T) */
	int fuse_gelu;           /* NG_GELU_FUSE_* bits: GELU as the FC matmul's epilogue (FWD),
				  * DGELU as the FC-proj dinp matmul's epilogue (BWD; on our own
				  * GEMM with OWN) */
	int deterministic;       /* 1: deterministic reductions (bigger encoder-backward scratch) */
	int fp8;                 /* NG_FP8_* bits: which matmuls of the training step take fp8
				  * operands (forward kinds, dinp kinds, AUTO; below); 0: none */
	int muon;                /* 1: the update is a MUON op instead of ADAMW (--optimizer muon) */
	int fuse_relu2;          /* the speedrun model: relu^2 in our own GEMM's epilogues (the FC
				  * forward writes max(pre, 0)^2, the FC-proj input gradient
				  * multiplies by 2 sqrt of it; the pre-activation is never
				  * stored; both bf16, so --fp8 leaves those two matmuls out);
				  * needs kernels/gemm_sm90.h's GEMM (the executor clears it where
				  * it cannot run). 0: RELU2_FWD / RELU2_BWD ops */
	size_t align;            /* arena alignment in bytes; 0 = 256 */
	const struct ng_step_workspace *ws; /* NULL: ng_step_workspace_estimate */
};

/* AUTO: the executor times the FC forward both ways, and the FC-proj backward three ways in a
 * bf16 run on an sm_90 GPU (else two), on the device at plan time, and sets or clears FWD, BWD
 * and OWN (until then, with --deterministic, and wherever nothing is timed, the bits as given).
 * OWN (always with BWD; "own" in the text forms): the DGELU epilogue on our own GEMM
 * (kernels/gemm_sm90.h), which also sums the fc bias gradient and writes the recomputed GELU
 * with --recompute gelu, instead of cuBLASLt's. An fp8 FC-proj input gradient (--fp8) stays
 * cuBLASLt's. */
enum ng_gelu_fuse { NG_GELU_FUSE_FWD = 1, NG_GELU_FUSE_BWD = 2, NG_GELU_FUSE_AUTO = 4,
		    NG_GELU_FUSE_OWN = 8 };

/* "auto" | "fwd,bwd" | "fwd,own" | "fwd" | "bwd" | "own" | "none" -> NG_GELU_FUSE_* bits
 * ("auto": FWD | BWD | AUTO; "own": BWD | OWN); NG_ERR_INPUT otherwise. */
enum ng_status ng_step_parse_gelu_fusion(const char *what, int *mask);
/* --recompute's comma list ("gelu", "layernorm", "fp8", or "none"), or "auto" -> the
 * recompute_* options (auto: none until ng_step_fit_memory); NG_ERR_INPUT with a hint
 * otherwise, and for fp8 when fp8 (--fp8 given) is 0. */
enum ng_status ng_step_parse_recompute(const char *what, int fp8, struct ng_step_options *opt);

/* --recompute auto: the least recompute with which the training step of K micro-batches of
 * B x T tokens needs at most `budget` bytes (its graph's total_bytes), built into g (freed and
 * rebuilt; ng_graph_free it). Rungs, in the order of their cost a byte saved (BENCHMARKS.md,
 * "Memory options": the GELU recompute writes each byte it saves once more; the LayerNorm's
 * reads the residual and writes its output, two): nothing recomputed; GELU outputs in 1..L
 * layers (the first ones; the last keep theirs); then with GELU in all, LayerNorm outputs in
 * 1..L layers; then with --fp8 the E4M3 weight copies. Within a rung a bisection over the layer
 * count: the count it takes fits and one fewer does not. The lower bound of the bytes falls with
 * each layer recomputed; the planner's placement follows it but is a heuristic, so a rare layer
 * costs a fraction of a percent more than the one before, and a count further down may then fit
 * as well. *opt gets the choice (recompute_*, keep_*). The head chunk
 * and batch stay as given. NG_ERR_INPUT when even everything recomputed needs more, naming
 * both sizes, with a hint (a smaller --head-chunk or --batch). */
enum ng_status ng_step_fit_memory(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				  int T, int K, struct ng_step_options *opt, size_t budget);

/* Text for a log line: "none", "gelu", "gelu (20 of 24 layers)", "gelu,layernorm (3 of 24)",
 * ... for the options a graph was built with, into buf (returned). */
const char *ng_step_recompute_name(const struct ng_graph *g, char *buf, size_t n);
/* The bits back as text ("fwd,bwd" ..., "auto: fwd" once the device chose). */
const char *ng_step_gelu_fusion_name(int mask);

/* Defaults: no recompute, whole-batch classifier, GELU fusion "auto" (fused until timed), not
 * deterministic, 256 B. */
void ng_step_default_options(struct ng_step_options *opt);

/* The workspace estimates for a shape (B sequences of T tokens). */
void ng_step_workspace_estimate(const struct ng_gpt_config *cfg, int B, int T,
				struct ng_step_workspace *ws);

/* Build and plan the training step of K micro-batches of B x T tokens. `g` is overwritten
 * (free it with ng_graph_free). NG_ERR_INPUT for bad sizes (T > cfg->T, B < 1, ...). */
enum ng_status ng_step_build_train(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				   int T, int K, const struct ng_step_options *opt);
/* Build and plan the eval step: TOKENS_H2D, then for K batches the forward and CROSSENTROPY
 * without gradient, LOSS_ACCUMULATE into the persistent f32 eval_loss (zeroed first; holds the
 * mean loss over the K batches after a replay). Eval ops touch no gradient or optimizer state.
 *
 * Every graph kind declares the same persistent tensors first, in the same order (params_lo,
 * params_bf16, grads, adam_m, adam_v, step_state; then eval_loss or logits_out), so their
 * offsets agree across the train, eval and sample graphs of one model: one arena of the largest
 * total_bytes serves all three. */
enum ng_status ng_step_build_eval(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				  int T, int K, const struct ng_step_options *opt);
/* Build and plan the sampling step: one forward of B x T tokens without targets, then the
 * logits (B, Vp) bf16 of one position per sequence (column T of the token buffer names it) into
 * the persistent tensor g->t_logits_out. */
enum ng_status ng_step_build_sample(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				    int T, const struct ng_step_options *opt);

#ifdef __cplusplus
}
#endif

#endif
