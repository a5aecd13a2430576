/*
 * graph/step.c — builds the train, eval and sample steps as IR graphs (see step.h for the order
 * and graph/ir.h for every op kind's inputs and outputs), then plans the arena.
 *
 * Names: activations are "<m>L<l>.<what>" where <m> is "m<k>." when K > 1 (else empty), so
 * "L3.qkv" or "m1.L3.qkv"; recomputed tensors end in ".re"; workspaces are "<op name>.ws".
 * Shapes: N = B*T rows; x, ln, resid (B, T, C); qkv (B, T, 3C); fch (B, T, 4C);
 * logits of a chunk (rows, Vp); LayerNorm statistics f32 (N); lse f32 (B, H, T).
 */
#include "graph/step.h"
#include "graph/step_build.h"
#include "graph/step_spr.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/optim_muon.h"
#include "kernels/types.h"

#define MIB ((size_t)1 << 20)

void ng_step_default_options(struct ng_step_options *opt)
{
	memset(opt, 0, sizeof(*opt));
	opt->fuse_gelu = NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD | NG_GELU_FUSE_AUTO;
	opt->align = 256;
}

/* Indexed by the FWD, BWD and AUTO bits; own_names where OWN is set too. */
static const char *const gelu_names[8] = { "none", "fwd", "bwd", "fwd,bwd", "auto: none",
					   "auto: fwd", "auto: bwd", "auto: fwd,bwd" };
static const char *const own_names[8] = { "own", "fwd,own", "own", "fwd,own", "auto: own",
					  "auto: fwd,own", "auto: own", "auto: fwd,own" };

enum ng_status ng_step_parse_gelu_fusion(const char *what, int *mask)
{
	if (strcmp(what, "auto") == 0) {
		*mask = NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD | NG_GELU_FUSE_AUTO;
		return NG_OK;
	}
	for (int m = 0; m < 4; m++) {
		if (strcmp(what, gelu_names[m]) == 0 || (m == 3 && strcmp(what, "bwd,fwd") == 0)) {
			*mask = m;
			return NG_OK;
		}
		if ((m & NG_GELU_FUSE_BWD) &&
		    (strcmp(what, own_names[m]) == 0 || (m == 3 && strcmp(what, "own,fwd") == 0))) {
			*mask = m | NG_GELU_FUSE_OWN;
			return NG_OK;
		}
	}
	ng_fail(NG_ERR_INPUT, "--gelu-fusion '%s': not auto | fwd,bwd | fwd,own | fwd | bwd | own | "
		"none", what);
	ng_hint("fwd: GELU as the FC matmul's epilogue; bwd: DGELU as the FC-proj backward's "
		"(cuBLASLt); own: the same on our own Hopper GEMM; auto: each of the two where it "
		"times faster on the device");
	return NG_ERR_INPUT;
}

enum ng_status ng_step_parse_recompute(const char *what, int fp8, struct ng_step_options *opt)
{
	opt->recompute_gelu = opt->recompute_layernorm = opt->recompute_fp8 = 0;
	opt->keep_gelu = opt->keep_layernorm = opt->recompute_auto = 0;
	if (strcmp(what, "none") == 0)
		return NG_OK;
	if (strcmp(what, "auto") == 0) {
		opt->recompute_auto = 1;
		return NG_OK;
	}
	char buf[64];
	if (!*what || strlen(what) >= sizeof(buf)) {
		ng_fail(NG_ERR_INPUT, "--recompute '%.20s%s' is %s", what, *what ? "..." : "",
			*what ? "too long" : "empty");
		ng_hint("a comma list of gelu, layernorm and fp8, or none, or auto");
		return NG_ERR_INPUT;
	}
	strcpy(buf, what);
	for (char *save = NULL, *w = strtok_r(buf, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
		if (strcmp(w, "gelu") == 0) {
			opt->recompute_gelu = 1;
		} else if (strcmp(w, "layernorm") == 0) {
			opt->recompute_layernorm = 1;
		} else if (strcmp(w, "fp8") == 0) {
			opt->recompute_fp8 = 1;
		} else {
			ng_fail(NG_ERR_INPUT, "--recompute: unknown item '%s'", w);
			ng_hint("a comma list of gelu, layernorm and fp8 (the E4M3 weight copies of "
				"--fp8), or none, or auto (the least that fits the memory)");
			return NG_ERR_INPUT;
		}
	}
	if (opt->recompute_fp8 && !fp8) {
		ng_fail(NG_ERR_INPUT, "--recompute fp8: there are E4M3 weights to recast only with "
			"--fp8");
		ng_hint("add --fp8, or drop fp8 from --recompute");
		return NG_ERR_INPUT;
	}
	return NG_OK;
}

const char *ng_step_gelu_fusion_name(int mask)
{
	return (mask & NG_GELU_FUSE_OWN ? own_names : gelu_names)[mask & 7];
}

void ng_step_workspace_estimate(const struct ng_gpt_config *cfg, int B, int T,
				struct ng_step_workspace *ws)
{
	size_t C = (size_t)cfg->C, H = (size_t)cfg->H, N = (size_t)B * (size_t)T;
	memset(ws, 0, sizeof(*ws));
	ws->matmul = 32 * MIB + 4 * C * sizeof(float) * 128;
	ws->attn_fwd = 1 * MIB;
	ws->attn_bwd = (size_t)B * H * (size_t)T * 4 + N * C * 4 + 1 * MIB;
	ws->layernorm_bwd = 2 * C * sizeof(float) * 1024 + 1 * MIB;
	ws->encoder_bwd = N * C / 8 + 1 * MIB;
	ws->encoder_sorted = N * 24 + 1 * MIB;
	ws->grad_norm = 1 * MIB;
	ws->crossentropy = 0; /* the fused softmax-cross-entropy writes dlogits in place */
	ws->gelu_bwd = (N + 255) / 256 * 4 * C * sizeof(float); /* the fc bias partials */
}

/* Tensors of one block's forward that its backward reads. */
struct layer_acts {
	int resid_in;        /* the block's input residual stream (encoded or previous resid2) */
	int ln1, mean1, rstd1;
	int qkv, atty, lse;  /* attention input, output, log-sum-exp */
	int resid1;          /* resid_in + the attention projection: input of LN2 */
	int ln2, mean2, rstd2;
	int fch;             /* FC output before GELU (B, T, 4C) */
	int fch_gelu;        /* after GELU */
};

/* What a micro-batch's forward leaves for the classifier and the backward. */
struct fwd_out {
	int inputs, targets;      /* i32 (B, T); targets -1 in sample graphs */
	int positions;            /* sample graphs: i32 (B), else -1 */
	struct layer_acts *la;    /* L entries */
	int resid_final;          /* the last block's output residual (LNF input) */
	int lnf, meanf, rstdf;
	int lnf8;                 /* --fp8 head: LNF's E4M3 copy (u8), else -1 */
	int sorted;               /* train graphs: ENCODER_SORT's output, else -1 */
};

static int act(struct ng_bld *b, const char *name, enum ng_dtype dt, int ndim, size_t s0, size_t s1,
	       size_t s2)
{
	char full[NG_TENSOR_NAME];
	snprintf(full, sizeof(full), "%.8s%.46s", b->pfx, name);
	size_t shape[3] = { s0, s1, s2 };
	return ng_graph_add_tensor(b->g, full, dt, NG_ROLE_ACTIVATION, false, ndim, shape, 0);
}

static int lact(struct ng_bld *b, int l, const char *what, enum ng_dtype dt, int ndim, size_t s0,
		size_t s1, size_t s2)
{
	char name[NG_TENSOR_NAME];
	snprintf(name, sizeof(name), "L%d.%s", l, what);
	return act(b, name, dt, ndim, s0, s1, s2);
}

/* Fill in the op's display name, micro-batch and phase, attach a workspace of `ws_bytes`
 * (none when 0), and add it. */
static int emit(struct ng_bld *b, struct ng_op *op, size_t ws_bytes)
{
	op->micro = b->micro;
	op->phase = b->phase;
	char lay[16] = "", chunk[16] = "";
	if (op->layer >= 0)
		snprintf(lay, sizeof(lay), "L%d.", op->layer);
	if (op->chunk >= 0)
		snprintf(chunk, sizeof(chunk), ".c%d", op->chunk);
	const char *w = ng_op_which_name(op->which);
	snprintf(op->name, sizeof(op->name), "%s%s%s%s%s%s%s", b->micro >= 0 ? b->pfx : "", lay,
		 ng_op_kind_name(op->kind), *w ? "." : "", w, chunk, op->recompute ? ".re" : "");
	if (ws_bytes) {
		char wname[NG_TENSOR_NAME];
		snprintf(wname, sizeof(wname), "%.50s.ws", op->name);
		size_t shape[1] = { ws_bytes };
		op->scratch = ng_graph_add_tensor(b->g, wname, NG_DTYPE_U8, NG_ROLE_SCRATCH, false,
						  1, shape, 0);
	}
	return ng_graph_add_op(b->g, op);
}

/* Small constructors: an op with its tensors listed. */
static struct ng_op mk(enum ng_op_kind kind, enum ng_op_which which, int layer, int n_in,
		       const int *in, int n_out, const int *out)
{
	struct ng_op op = ng_op_blank(kind);
	op.which = which;
	op.layer = layer;
	op.n_in = n_in;
	op.n_out = n_out;
	memcpy(op.in, in, sizeof(int) * (size_t)n_in);
	memcpy(op.out, out, sizeof(int) * (size_t)n_out);
	return op;
}


/* The parameters a `which` reads: {weight, bias}. */
static void which_params(enum ng_op_which w, int *p)
{
	static const int t[NG_OP_WHICH_COUNT][2] = {
		[NG_OP_WHICH_NONE] = { -1, -1 },
		[NG_OP_WHICH_LN1] = { NG_P_LN1W, NG_P_LN1B },
		[NG_OP_WHICH_LN2] = { NG_P_LN2W, NG_P_LN2B },
		[NG_OP_WHICH_LNF] = { NG_P_LNFW, NG_P_LNFB },
		[NG_OP_WHICH_QKV] = { NG_P_QKVW, NG_P_QKVB },
		[NG_OP_WHICH_ATTPROJ] = { NG_P_ATTPROJW, NG_P_ATTPROJB },
		[NG_OP_WHICH_FC] = { NG_P_FCW, NG_P_FCB },
		[NG_OP_WHICH_FCPROJ] = { NG_P_FCPROJW, NG_P_FCPROJB },
		[NG_OP_WHICH_HEAD] = { NG_P_WTE, -1 },
	};
	p[0] = t[w][0];
	p[1] = t[w][1];
}

/* An op that reads parameters: sets param[] from `which`. */
static int emit_p(struct ng_bld *b, struct ng_op op, size_t ws_bytes)
{
	which_params(op.which, op.param);
	return emit(b, &op, ws_bytes);
}

/* --fp8 train graphs (step_build.h): make a forward matmul an fp8 one (its E4M3 weights and scales as inputs
 * 2 and 3, the E4M3 copy of its input as input 4 when a LayerNorm wrote one: inp8 >= 0) and
 * return the bytes its scratch needs in front for casting the input itself; 0 otherwise. */
size_t ng_bld_fp8_weights(struct ng_bld *b, struct ng_op *op, int transposed)
{
	struct ng_graph *g = b->g;
	op->fp8 = 1;
	/* --recompute fp8: W comes as bf16 and the op casts it in its scratch */
	op->in[op->n_in++] = g->recompute_fp8 ? g->t_params_bf16
			     : transposed     ? g->t_params_fp8t
					      : g->t_params_fp8;
	op->in[op->n_in++] = g->t_fp8_state;
	return g->recompute_fp8 ? ng_fp8_weight_bytes(&g->cfg, op->which) : 0;
}

size_t ng_bld_fp8_in(struct ng_bld *b, struct ng_op *op, size_t ic, int inp8)
{
	struct ng_graph *g = b->g;
	if (!(g->fp8 & ng_fp8_bit(op->which)))
		return 0;
	size_t w8 = ng_bld_fp8_weights(b, op, 0);
	if (inp8 >= 0) {
		op->in[op->n_in++] = inp8;
		return w8;
	}
	return ng_fp8_input_bytes((size_t)op->row_count, ic) + w8;
}

size_t ng_bld_fp8_dinp(struct ng_bld *b, struct ng_op *op)
{
	struct ng_graph *g = b->g;
	if (!(g->fp8 & ng_fp8_dinp_bit(op->which)))
		return 0;
	size_t w8 = ng_bld_fp8_weights(b, op, 1);
	if (g->tensors[op->in[0]].dtype == NG_DTYPE_U8) /* an fp8 dW's E5M2 dout: no cast */
		return w8;
	int ic, oc;
	ng_linear_dims(&g->cfg, op->which, &ic, &oc);
	return ng_fp8_input_bytes((size_t)op->row_count, (size_t)oc) + w8; /* dout is (N, OC) */
}

size_t ng_bld_fp8_dw(struct ng_bld *b, struct ng_op *op, int share, int *d8)
{
	static const char *const dout8[4] = { "dout8.qkv", "dout8.attproj", "dout8.fc",
					      "dout8.fcproj" };
	struct ng_graph *g = b->g;
	const enum ng_op_which w = op->which;
	*d8 = -1;
	/* the kind's forward is fp8 too (g->fp8 keeps no dW bit without it): the input's scale */
	if (!(g->fp8 & ng_fp8_dw_bit(w)) || b->N % 16)
		return 0;
	int ic, oc;
	ng_linear_dims(&g->cfg, w, &ic, &oc);
	op->fp8 = 1;
	op->in[op->n_in++] = g->t_fp8_state;
	if (share && (g->fp8 & ng_fp8_dinp_bit(w))) {
		*d8 = lact(b, op->layer, dout8[w - NG_OP_WHICH_QKV], NG_DTYPE_U8, 2, b->N,
			   (size_t)oc, 1);
		op->out[op->n_out++] = *d8;
	}
	return ng_fp8_dw_bytes(b->N, (size_t)ic, (size_t)oc, op->param[1] >= 0);
}

void ng_bld_fp8_prep(struct ng_bld *b)
{
	struct ng_graph *g = b->g;
	if (!g->fp8)
		return;
	struct ng_op op = mk(NG_OP_FP8_PREP, NG_OP_WHICH_NONE, -1,
			     IN(g->t_params_bf16, g->t_fp8_state), OUT(g->t_fp8_state));
	if (g->t_params_fp8 >= 0)
		op.out[op.n_out++] = g->t_params_fp8;
	if (g->t_params_fp8t >= 0)
		op.out[op.n_out++] = g->t_params_fp8t;
	emit(b, &op, 0);
}

/* --fp8: when `consumer` is an fp8 matmul, the LayerNorm op writes its E4M3 input too: a u8
 * tensor "<name>" as its last output, fp8_state as its last input. Returns it, or -1. */
static int ln_fp8_out(struct ng_bld *b, struct ng_op *op, enum ng_op_which consumer, int l,
		      const char *name)
{
	struct ng_graph *g = b->g;
	if (!(g->fp8 & ng_fp8_bit(consumer)))
		return -1;
	int t = l >= 0 ? lact(b, l, name, NG_DTYPE_U8, 2, b->N, b->C, 1)
		       : act(b, name, NG_DTYPE_U8, 2, b->N, b->C, 1);
	op->fp8 = 1;
	op->out[op->n_out++] = t;
	op->in[op->n_in++] = g->t_fp8_state;
	return t;
}

/* A full-rows matmul forward: out = inp @ W^T + b (with the GELU epilogue when aux >= 0; plus
 * the residual stream `resid` when resid >= 0, the block's residual add). */
static void matmul_fwd(struct ng_bld *b, enum ng_op_which w, int l, int inp, int out, int aux,
		       int inp8, int resid)
{
	struct ng_graph *g = b->g;
	struct ng_op op = aux >= 0 ? mk(NG_OP_MATMUL_FWD, w, l, IN(inp, g->t_params_bf16),
					OUT(out, aux))
				   : mk(NG_OP_MATMUL_FWD, w, l, IN(inp, g->t_params_bf16), OUT(out));
	op.gelu = aux >= 0;
	op.row_count = (int)b->N;
	size_t in8 = ng_bld_fp8_in(b, &op, w == NG_OP_WHICH_FCPROJ ? 4 * b->C : b->C, inp8);
	if (resid >= 0) { /* last, after the fp8 inputs */
		op.residual = 1;
		op.in[op.n_in++] = resid;
	}
	emit_p(b, op, b->ws.matmul + in8);
}

/* One micro-batch's forward up to the final LayerNorm. `sample` splits positions instead of
 * targets. */
static void build_forward(struct ng_bld *b, struct fwd_out *f, int sample)
{
	struct ng_graph *g = b->g;
	const int L = g->cfg.L;
	const size_t B = b->B, T = b->T, C = b->C, N = b->N, H = (size_t)g->cfg.H;
	b->phase = NG_PHASE_FORWARD;
	f->inputs = act(b, "inputs", NG_DTYPE_I32, 2, B, T, 1);
	f->positions = f->targets = -1;
	struct ng_op op;
	if (sample) {
		f->positions = act(b, "positions", NG_DTYPE_I32, 1, B, 1, 1);
		op = mk(NG_OP_TOKENS_SPLIT, NG_OP_WHICH_NONE, -1, IN(g->t_tokens),
			OUT(f->inputs, f->positions));
	} else {
		f->targets = act(b, "targets", NG_DTYPE_I32, 2, B, T, 1);
		op = mk(NG_OP_TOKENS_SPLIT, NG_OP_WHICH_NONE, -1, IN(g->t_tokens),
			OUT(f->inputs, f->targets));
	}
	emit(b, &op, 0);
	f->sorted = -1;
	if (b->g->kind == NG_GRAPH_TRAIN) { /* early, so that it overlaps the forward (ir.h) */
		f->sorted = act(b, "encoder_sorted", NG_DTYPE_U8, 1, b->ws.encoder_sorted, 1, 1);
		op = mk(NG_OP_ENCODER_SORT, NG_OP_WHICH_NONE, -1, IN(f->inputs), OUT(f->sorted));
		emit(b, &op, 0);
	}
	int x = act(b, "encoded", NG_DTYPE_BF16, 3, B, T, C);
	op = mk(NG_OP_ENCODER_FWD, NG_OP_WHICH_NONE, -1, IN(f->inputs, g->t_params_bf16), OUT(x));
	op.param[0] = NG_P_WTE;
	op.param[1] = NG_P_WPE;
	emit(b, &op, 0);

	/* The residual adds happen in the epilogues of the attention projection and the MLP
	 * projection (cuBLASLt's C): each writes the residual stream itself, and the LayerNorm
	 * after it only reads it. */
	int resid = x;
	for (int l = 0; l < L; l++) {
		struct layer_acts *a = &f->la[l];
		a->ln1 = lact(b, l, "ln1", NG_DTYPE_BF16, 3, B, T, C);
		a->mean1 = lact(b, l, "ln1.mean", NG_DTYPE_F32, 1, N, 1, 1);
		a->rstd1 = lact(b, l, "ln1.rstd", NG_DTYPE_F32, 1, N, 1, 1);
		a->resid_in = resid;
		op = mk(NG_OP_LAYERNORM_FWD, NG_OP_WHICH_LN1, l, IN(a->resid_in, g->t_params_bf16),
			OUT(a->ln1, a->mean1, a->rstd1));
		int ln1_8 = ln_fp8_out(b, &op, NG_OP_WHICH_QKV, l, "ln1.e4m3");
		emit_p(b, op, 0);
		a->qkv = lact(b, l, "qkv", NG_DTYPE_BF16, 3, B, T, 3 * C);
		matmul_fwd(b, NG_OP_WHICH_QKV, l, a->ln1, a->qkv, -1, ln1_8, -1);
		a->atty = lact(b, l, "atty", NG_DTYPE_BF16, 3, B, T, C);
		a->lse = lact(b, l, "lse", NG_DTYPE_F32, 3, B, H, T);
		op = mk(NG_OP_ATTENTION_FWD, NG_OP_WHICH_NONE, l, IN(a->qkv), OUT(a->atty, a->lse));
		emit(b, &op, b->ws.attn_fwd);
		a->resid1 = lact(b, l, "resid1", NG_DTYPE_BF16, 3, B, T, C);
		matmul_fwd(b, NG_OP_WHICH_ATTPROJ, l, a->atty, a->resid1, -1, -1, a->resid_in);
		a->ln2 = lact(b, l, "ln2", NG_DTYPE_BF16, 3, B, T, C);
		a->mean2 = lact(b, l, "ln2.mean", NG_DTYPE_F32, 1, N, 1, 1);
		a->rstd2 = lact(b, l, "ln2.rstd", NG_DTYPE_F32, 1, N, 1, 1);
		op = mk(NG_OP_LAYERNORM_FWD, NG_OP_WHICH_LN2, l, IN(a->resid1, g->t_params_bf16),
			OUT(a->ln2, a->mean2, a->rstd2));
		int ln2_8 = ln_fp8_out(b, &op, NG_OP_WHICH_FC, l, "ln2.e4m3");
		emit_p(b, op, 0);
		a->fch = lact(b, l, "fch", NG_DTYPE_BF16, 3, B, T, 4 * C);
		a->fch_gelu = lact(b, l, "fch_gelu", NG_DTYPE_BF16, 3, B, T, 4 * C);
		if (g->fuse_gelu & NG_GELU_FUSE_FWD) {
			matmul_fwd(b, NG_OP_WHICH_FC, l, a->ln2, a->fch_gelu, a->fch, ln2_8, -1);
		} else {
			matmul_fwd(b, NG_OP_WHICH_FC, l, a->ln2, a->fch, -1, ln2_8, -1);
			op = mk(NG_OP_GELU_FWD, NG_OP_WHICH_NONE, l, IN(a->fch), OUT(a->fch_gelu));
			emit(b, &op, 0);
		}
		resid = lact(b, l, "resid2", NG_DTYPE_BF16, 3, B, T, C);
		matmul_fwd(b, NG_OP_WHICH_FCPROJ, l, a->fch_gelu, resid, -1, -1, a->resid1);
	}
	f->resid_final = resid;
	f->lnf = act(b, "lnf", NG_DTYPE_BF16, 3, B, T, C);
	f->meanf = act(b, "lnf.mean", NG_DTYPE_F32, 1, N, 1, 1);
	f->rstdf = act(b, "lnf.rstd", NG_DTYPE_F32, 1, N, 1, 1);
	op = mk(NG_OP_LAYERNORM_FWD, NG_OP_WHICH_LNF, -1, IN(f->resid_final, g->t_params_bf16),
		OUT(f->lnf, f->meanf, f->rstdf));
	f->lnf8 = ln_fp8_out(b, &op, NG_OP_WHICH_HEAD, -1, "lnf.e4m3");
	emit_p(b, op, 0);
}

/* The classifier in chunks. Train: head, cross-entropy (dlogits in place), head dinp into
 * dlnf, head dW. Eval (dlnf < 0): head and the loss only. Then the loss into `loss_dst`. */
static void build_classifier(struct ng_bld *b, const struct fwd_out *f, int dlnf, int loss_dst)
{
	struct ng_graph *g = b->g;
	const int N = (int)b->N, rows = g->head_chunk_rows;
	b->phase = NG_PHASE_LOSS;
	int losses = act(b, "losses", NG_DTYPE_F32, 1, b->N, 1, 1);
	for (int c = 0, r0 = 0; r0 < N; c++, r0 += rows) {
		int n = N - r0 < rows ? N - r0 : rows;
		char name[24];
		snprintf(name, sizeof(name), "logits.c%d", c);
		int logits = act(b, name, NG_DTYPE_BF16, 2, (size_t)n, b->Vp, 1);
		struct ng_op op = mk(NG_OP_MATMUL_FWD, NG_OP_WHICH_HEAD, -1,
				     IN(f->lnf, g->t_params_bf16), OUT(logits));
		op.chunk = c;
		op.row_start = r0;
		op.row_count = n;
		size_t in8 = ng_bld_fp8_in(b, &op, b->C, f->lnf8);
		emit_p(b, op, b->ws.matmul + in8);
		if (dlnf < 0) {
			op = mk(NG_OP_CROSSENTROPY, NG_OP_WHICH_NONE, -1, IN(logits, f->targets),
				OUT(losses));
			op.no_grad = 1;
		} else {
			op = mk(NG_OP_CROSSENTROPY, NG_OP_WHICH_NONE, -1, IN(logits, f->targets),
				OUT(logits, losses));
		}
		op.chunk = c;
		op.row_start = r0;
		op.row_count = n;
		emit(b, &op, b->ws.crossentropy);
		if (dlnf < 0)
			continue;
		op = mk(NG_OP_MATMUL_DINP, NG_OP_WHICH_HEAD, -1, IN(logits, g->t_params_bf16),
			OUT(dlnf));
		op.chunk = c;
		op.row_start = r0;
		op.row_count = n;
		emit_p(b, op, b->ws.matmul);
		op = mk(NG_OP_MATMUL_DW, NG_OP_WHICH_HEAD, -1, IN(logits, f->lnf), OUT(g->t_grads));
		op.chunk = c;
		op.row_start = r0;
		op.row_count = n;
		emit_p(b, op, b->ws.matmul);
	}
	struct ng_op op = mk(NG_OP_LOSS_ACCUMULATE, NG_OP_WHICH_NONE, -1, IN(losses),
			     OUT(loss_dst));
	emit(b, &op, 0);
}

/* Whether layer l recomputes (GELU or LayerNorm outputs): the option is on and l is not one of
 * the last `keep` layers. */
static int recomputes(int on, int keep, int L, int l)
{
	return on && l < L - keep;
}

/* LayerNorm output for a backward use: the stored one, or a recompute from the statistics. */
static int ln_for_bwd(struct ng_bld *b, enum ng_op_which w, int l, int x, int stored, int mean,
		      int rstd)
{
	struct ng_graph *g = b->g;
	if (!recomputes(g->recompute_layernorm, g->keep_layernorm, g->cfg.L, l))
		return stored;
	int ln = lact(b, l, w == NG_OP_WHICH_LN1 ? "ln1.re" : "ln2.re", NG_DTYPE_BF16, 3, b->B,
		      b->T, b->C);
	struct ng_op op = mk(NG_OP_LAYERNORM_FWD, w, l, IN(x, g->t_params_bf16, mean, rstd),
			     OUT(ln));
	op.recompute = 1;
	emit_p(b, op, 0);
	return ln;
}

/* The weight gradient of a full-rows linear layer, and its bias gradient unless bias is 0 (the
 * FC layer's when GELU_BWD sums it). In fp8 (ng_bld_fp8_dw), with `share` (the kind's dinp
 * matmul comes next): the E5M2 dout for that dinp, or -1. */
static int matmul_dw(struct ng_bld *b, enum ng_op_which w, int l, int dout, int inp, int bias,
		     int share)
{
	struct ng_graph *g = b->g;
	struct ng_op op = mk(NG_OP_MATMUL_DW, w, l, IN(dout, inp), OUT(g->t_grads));
	op.row_count = (int)b->N;
	which_params(w, op.param);
	if (!bias)
		op.param[1] = -1;
	int d8;
	size_t front = ng_bld_fp8_dw(b, &op, share, &d8);
	emit(b, &op, b->ws.matmul + front);
	return d8;
}

/* The input gradient of a full-rows linear layer (through the DGELU epilogue when aux >= 0). */
static void matmul_dinp(struct ng_bld *b, enum ng_op_which w, int l, int dout, int dinp, int aux)
{
	struct ng_graph *g = b->g;
	struct ng_op op = aux >= 0 ? mk(NG_OP_MATMUL_DINP, w, l, IN(dout, g->t_params_bf16, aux), OUT(dinp))
		      : mk(NG_OP_MATMUL_DINP, w, l, IN(dout, g->t_params_bf16), OUT(dinp));
	op.gelu = aux >= 0;
	op.row_count = (int)b->N;
	size_t d8 = ng_bld_fp8_dinp(b, &op);
	emit_p(b, op, b->ws.matmul + d8);
}

/* A full-rows matmul backward pair: dW (+= grads) then dinp. aux >= 0 fuses DGELU. */
static void matmul_bwd(struct ng_bld *b, enum ng_op_which w, int l, int dout, int inp, int dinp,
		       int aux)
{
	int d8 = matmul_dw(b, w, l, dout, inp, 1, 1);
	matmul_dinp(b, w, l, d8 >= 0 ? d8 : dout, dinp, aux);
}

static void layernorm_bwd(struct ng_bld *b, enum ng_op_which w, int l, int dln, int x, int mean,
			  int rstd, int dresid)
{
	struct ng_graph *g = b->g;
	struct ng_op op = mk(NG_OP_LAYERNORM_BWD, w, l, IN(dln, x, g->t_params_bf16, mean, rstd),
			     OUT(dresid, g->t_grads));
	emit_p(b, op, b->ws.layernorm_bwd);
}

/* One micro-batch's backward, from dlnf down to the embeddings. */
static void build_backward(struct ng_bld *b, const struct fwd_out *f, int dlnf)
{
	struct ng_graph *g = b->g;
	const size_t B = b->B, T = b->T, C = b->C;
	b->phase = NG_PHASE_BACKWARD;
	int dresid = act(b, "dresid", NG_DTYPE_BF16, 3, B, T, C);
	struct ng_op op = ng_op_blank(NG_OP_ZERO);
	op.n_out = 1;
	op.out[0] = dresid;
	emit(b, &op, 0);
	layernorm_bwd(b, NG_OP_WHICH_LNF, -1, dlnf, f->resid_final, f->meanf, f->rstdf, dresid);
	/* own: every layer's fcproj W^T for our GEMM, written now, long before each is read */
	const int own = (g->fuse_gelu & NG_GELU_FUSE_OWN) != 0;
	int wt = -1;
	if (own) {
		wt = act(b, "fcproj_wt", NG_DTYPE_BF16, 3, (size_t)g->cfg.L, 4 * C, C);
		op = mk(NG_OP_TRANSPOSE_W, NG_OP_WHICH_FCPROJ, -1, IN(g->t_params_bf16), OUT(wt));
		op.param[0] = NG_P_FCPROJW;
		emit(b, &op, 0);
	}
	for (int l = g->cfg.L - 1; l >= 0; l--) {
		const struct layer_acts *a = &f->la[l];
		/* MLP: fcproj, GELU, fc */
		const int fused_bwd = own || (g->fuse_gelu & NG_GELU_FUSE_BWD) != 0;
		int gelu_out = a->fch_gelu;
		const int re = recomputes(g->recompute_gelu, g->keep_gelu, g->cfg.L, l);
		if (re) {
			gelu_out = lact(b, l, "fch_gelu.re", NG_DTYPE_BF16, 3, B, T, 4 * C);
			if (fused_bwd && !own) { /* (unfused and own: the backward writes it) */
				op = mk(NG_OP_GELU_FWD, NG_OP_WHICH_NONE, l, IN(a->fch),
					OUT(gelu_out));
				op.recompute = 1;
				emit(b, &op, 0);
			}
		}
		int dfch = lact(b, l, "dfch", NG_DTYPE_BF16, 3, B, T, 4 * C);
		if (own) {
			/* our own GEMM: the input gradient with DGELU, the fc bias gradient (its
			 * column sums), and with --recompute gelu the activation the fcproj weight
			 * gradient reads next, from one read of fch */
			op = re
				     ? mk(NG_OP_MATMUL_DINP, NG_OP_WHICH_FCPROJ, l,
					  IN(dresid, wt, a->fch), OUT(dfch, g->t_grads, gelu_out))
				     : mk(NG_OP_MATMUL_DINP, NG_OP_WHICH_FCPROJ, l,
					  IN(dresid, wt, a->fch), OUT(dfch, g->t_grads));
			op.gelu = 1;
			op.own = 1;
			op.row_count = (int)b->N;
			op.param[0] = NG_P_FCPROJW;
			op.param[1] = NG_P_FCB; /* the bias whose gradient it writes */
			emit(b, &op, b->ws.matmul);
			matmul_dw(b, NG_OP_WHICH_FCPROJ, l, dresid, gelu_out, 1, 0);
		} else if (fused_bwd) {
			matmul_bwd(b, NG_OP_WHICH_FCPROJ, l, dresid, gelu_out, dfch, a->fch);
		} else {
			/* the input gradient first, into dfch; GELU_BWD then turns it into the
			 * gradient of fch in place, sums the fc bias gradient from it, and with
			 * --recompute gelu writes the activation that the fcproj weight gradient
			 * reads next: one pass over fch */
			matmul_dinp(b, NG_OP_WHICH_FCPROJ, l, dresid, dfch, -1);
			op = re
				     ? mk(NG_OP_GELU_BWD, NG_OP_WHICH_NONE, l, IN(a->fch, dfch),
					  OUT(dfch, g->t_grads, gelu_out))
				     : mk(NG_OP_GELU_BWD, NG_OP_WHICH_NONE, l, IN(a->fch, dfch),
					  OUT(dfch, g->t_grads));
			op.param[0] = NG_P_FCB;
			op.row_count = (int)b->N;
			emit(b, &op, b->ws.gelu_bwd);
			matmul_dw(b, NG_OP_WHICH_FCPROJ, l, dresid, gelu_out, 1, 0);
		}
		int ln2 = ln_for_bwd(b, NG_OP_WHICH_LN2, l, a->resid1, a->ln2, a->mean2, a->rstd2);
		int dln2 = lact(b, l, "dln2", NG_DTYPE_BF16, 3, B, T, C);
		int dfch8 = matmul_dw(b, NG_OP_WHICH_FC, l, dfch, ln2, fused_bwd && !own, 1);
		matmul_dinp(b, NG_OP_WHICH_FC, l, dfch8 >= 0 ? dfch8 : dfch, dln2, -1);
		layernorm_bwd(b, NG_OP_WHICH_LN2, l, dln2, a->resid1, a->mean2, a->rstd2, dresid);
		/* attention: proj, SDPA, qkv */
		int datty = lact(b, l, "datty", NG_DTYPE_BF16, 3, B, T, C);
		matmul_bwd(b, NG_OP_WHICH_ATTPROJ, l, dresid, a->atty, datty, -1);
		int dqkv = lact(b, l, "dqkv", NG_DTYPE_BF16, 3, B, T, 3 * C);
		op = mk(NG_OP_ATTENTION_BWD, NG_OP_WHICH_NONE, l, IN(datty, a->qkv, a->atty, a->lse),
			OUT(dqkv));
		emit(b, &op, b->ws.attn_bwd);
		int ln1 = ln_for_bwd(b, NG_OP_WHICH_LN1, l, a->resid_in, a->ln1, a->mean1, a->rstd1);
		int dln1 = lact(b, l, "dln1", NG_DTYPE_BF16, 3, B, T, C);
		matmul_bwd(b, NG_OP_WHICH_QKV, l, dqkv, ln1, dln1, -1);
		layernorm_bwd(b, NG_OP_WHICH_LN1, l, dln1, a->resid_in, a->mean1, a->rstd1, dresid);
	}
	/* inputs: read by ENCODER_SORT on the side stream; listed here so that its memory stays
	 * live (no later tensor shares it) until this op, which joins that stream */
	op = mk(NG_OP_ENCODER_BWD, NG_OP_WHICH_NONE, -1, IN(dresid, f->sorted, f->inputs),
		OUT(g->t_grads));
	op.param[0] = NG_P_WTE;
	op.param[1] = NG_P_WPE;
	emit(b, &op, b->ws.encoder_bwd);
}

/* The first dW matmul of each (linear layer, layer index) in the step overwrites its gradient:
 * micro-batch 0, classifier chunk 0. The tied head's dW comes before the embedding backward that
 * adds into the same wte gradient. A GELU_BWD that sums the fc bias gradient is its only writer,
 * so it overwrites in micro-batch 0 too, as does our own GEMM's DINP, which sums it instead. */
void ng_bld_mark_first_writers(struct ng_graph *g)
{
	for (int i = 0; i < g->n_ops; i++) {
		struct ng_op *op = &g->ops[i];
		if (op->kind == NG_OP_MATMUL_DW || (op->kind == NG_OP_GELU_BWD && op->param[0] >= 0) ||
		    (op->kind == NG_OP_MATMUL_DINP && op->own))
			op->overwrite = op->micro <= 0 && op->chunk <= 0;
	}
}

/* ZERO of one tensor, at step level. */
static void zero(struct ng_bld *b, int t)
{
	struct ng_op op = ng_op_blank(NG_OP_ZERO);
	op.n_out = 1;
	op.out[0] = t;
	emit(b, &op, 0);
}

/* Check the sizes, reset the graph, declare the persistent tensors (same order in every kind)
 * and the token buffer (K, B, T+1). */
static enum ng_status begin(struct ng_bld *b, struct ng_graph *g, enum ng_graph_kind kind,
			    const struct ng_gpt_config *cfg, int B, int T, int K,
			    const struct ng_step_options *opt_in)
{
	struct ng_step_options opt;
	if (opt_in)
		opt = *opt_in;
	else
		ng_step_default_options(&opt);
	ng_graph_init(g);
	if (B < 1 || T < 1 || K < 1)
		return ng_fail(NG_ERR_INPUT, "step: batch %d, sequence %d, micro-batches %d must "
			       "be positive", B, T, K);
	if (T > cfg->T)
		return ng_fail(NG_ERR_INPUT, "step: sequence length %d exceeds the model's "
			       "context %d", T, cfg->T);
	if ((long long)B * T > (1LL << 30))
		return ng_fail(NG_ERR_INPUT, "step: batch %d x sequence %d tokens is too many "
			       "for one micro-batch", B, T);
	if (opt.head_chunk_rows < 0)
		return ng_fail(NG_ERR_INPUT, "step: head chunk rows %d is negative",
			       opt.head_chunk_rows);
	if ((opt.fp8 & NG_FP8_EVERY) && cfg->C % 16) {
		ng_fail(NG_ERR_INPUT, "--fp8: the channels (C = %d) must be a multiple of 16 (E4M3 "
			"rows of 16 bytes for cuBLASLt)", cfg->C);
		ng_hint("drop --fp8, or pick --channels a multiple of 16");
		return NG_ERR_INPUT;
	}
	memset(b, 0, sizeof(*b));
	b->g = g;
	b->micro = -1;
	b->phase = NG_PHASE_INPUT;
	b->B = (size_t)B;
	b->T = (size_t)T;
	b->C = (size_t)cfg->C;
	b->Vp = (size_t)cfg->Vp;
	b->N = (size_t)B * (size_t)T;
	if (opt.ws)
		b->ws = *opt.ws;
	else
		ng_step_workspace_estimate(cfg, B, T, &b->ws);

	g->kind = kind;
	g->cfg = *cfg;
	ng_gpt_layout(cfg, &g->lay);
	g->B = B;
	g->T = T;
	g->K = K;
	int N = B * T;
	g->head_chunk_rows = opt.head_chunk_rows == 0 || opt.head_chunk_rows > N
				     ? N : opt.head_chunk_rows;
	g->recompute_gelu = opt.recompute_gelu;
	g->recompute_layernorm = opt.recompute_layernorm;
	g->keep_gelu = opt.recompute_gelu && opt.keep_gelu > 0 ? opt.keep_gelu : 0;
	g->keep_layernorm = opt.recompute_layernorm && opt.keep_layernorm > 0 ? opt.keep_layernorm : 0;
	g->recompute_fp8 = opt.recompute_fp8 && (opt.fp8 & NG_FP8_EVERY);
	g->fuse_gelu = opt.fuse_gelu;
	g->fuse_relu2 = cfg->arch == NG_ARCH_SPEEDRUN && opt.fuse_relu2;
	g->deterministic = opt.deterministic;
	/* the E5M2 head backward: the speedrun family's own head, in FP8 forward too */
	int fp8 = opt.fp8 & NG_FP8_EVERY;
	if (cfg->arch == NG_ARCH_SPEEDRUN && (opt.fp8 & NG_FP8_HEAD))
		fp8 |= opt.fp8 & NG_FP8_HEAD_BWD;
	/* fp8 weight gradients of the layer kinds whose forward is fp8 (the input's scale; after
	 * the fused relu^2 took the FC forward out) */
	fp8 |= opt.fp8 & (fp8 & (NG_FP8_ALL & ~NG_FP8_HEAD)) << NG_FP8_DW_SHIFT;
	/* the fused relu^2 forward is bf16 (our own GEMM) */
	if (g->fuse_relu2)
		fp8 &= ~NG_FP8_FC;
	g->fp8 = kind == NG_GRAPH_TRAIN ? fp8 : 0;
	/* own is bf16: an fp8 FC-proj input gradient (--fp8) keeps cuBLASLt's DGELU */
	if (g->fp8 & ng_fp8_dinp_bit(NG_OP_WHICH_FCPROJ))
		g->fuse_gelu &= ~NG_GELU_FUSE_OWN;
	g->align = opt.align ? opt.align : 256;

	size_t P[1] = { g->lay.total };
	/* the fp32 master, split (kernels/split.h): its bf16 copy (the high half, what the
	 * matmuls read) and its low half; with ZeRO-1 the low half shrinks to one shard */
	g->t_params_lo = ng_graph_add_tensor(g, "params_lo", NG_DTYPE_U16, NG_ROLE_PARAM, true, 1,
					     P, 0);
	g->t_params_bf16 = ng_graph_add_tensor(g, "params_bf16", NG_DTYPE_BF16,
					       NG_ROLE_PARAM_BF16, true, 1, P, 0);
	g->t_grads = ng_graph_add_tensor(g, "grads", NG_DTYPE_F32, NG_ROLE_GRAD, true, 1, P, 0);
	g->t_adam_m = ng_graph_add_tensor(g, "adam_m", NG_DTYPE_F32, NG_ROLE_OPT_STATE, true, 1,
					  P, 0);
	g->t_adam_v = ng_graph_add_tensor(g, "adam_v", NG_DTYPE_F32, NG_ROLE_OPT_STATE, true, 1,
					  P, 0);
	size_t S[1] = { sizeof(struct ng_step_state) };
	g->t_step_state = ng_graph_add_tensor(g, "step_state", NG_DTYPE_U8, NG_ROLE_METRIC, true,
					      1, S, 0);
	if (opt.fp8 & NG_FP8_EVERY) { /* in every kind, so that the offsets below agree */
		if (!g->recompute_fp8)
			g->t_params_fp8 = ng_graph_add_tensor(g, "params_fp8", NG_DTYPE_U8,
							      NG_ROLE_PARAM_BF16, true, 1, P, 0);
		size_t F[1] = { ng_fp8_state_floats(cfg->L) };
		g->t_fp8_state = ng_graph_add_tensor(g, "fp8_state", NG_DTYPE_F32,
						     NG_ROLE_OPT_STATE, true, 1, F, 0);
	}
	if ((fp8 & (NG_FP8_DINP_ALL | NG_FP8_HEAD_BWD)) && !g->recompute_fp8) {
		size_t P8[1] = { ng_fp8t_at(&g->lay, fp8, 5) };
		g->t_params_fp8t = ng_graph_add_tensor(g, "params_fp8t", NG_DTYPE_U8,
						       NG_ROLE_PARAM_BF16, true, 1, P8, 0);
	}
	if (kind == NG_GRAPH_EVAL) {
		size_t one[1] = { 1 };
		g->t_eval_loss = ng_graph_add_tensor(g, "eval_loss", NG_DTYPE_F32, NG_ROLE_METRIC,
						     true, 1, one, 0);
		if (cfg->arch == NG_ARCH_SPEEDRUN) /* the evaluation's window, not the step's */
			g->t_eval_window = ng_graph_add_tensor(g, "eval_window", NG_DTYPE_I32,
							       NG_ROLE_METRIC, true, 1, one, 0);
	} else if (kind == NG_GRAPH_SAMPLE) {
		size_t lo[2] = { (size_t)B, (size_t)cfg->Vp };
		g->t_logits_out = ng_graph_add_tensor(g, "logits_out", NG_DTYPE_BF16,
						      NG_ROLE_METRIC, true, 2, lo, 0);
	}
	size_t tok[3] = { (size_t)K, (size_t)B, (size_t)T + 1 };
	g->t_tokens = ng_graph_add_tensor(g, "tokens", NG_DTYPE_U16, NG_ROLE_INPUT, false, 3, tok,
					  0);
	struct ng_op op = ng_op_blank(NG_OP_TOKENS_H2D);
	op.n_out = 1;
	op.out[0] = g->t_tokens;
	emit(b, &op, 0);
	return g->status;
}

/* Enter micro-batch m: names get the "m<k>." prefix when K > 1. */
static void enter_micro(struct ng_bld *b, int m)
{
	b->micro = m;
	if (b->g->K > 1)
		snprintf(b->pfx, sizeof(b->pfx), "m%d.", m);
	else
		b->pfx[0] = '\0';
}

/* Leave the micro-batches: step-level names and phase. */
static void leave_micro(struct ng_bld *b, enum ng_phase phase)
{
	b->micro = -1;
	b->pfx[0] = '\0';
	b->phase = phase;
}

enum ng_status ng_bld_finish(struct ng_graph *g)
{
	enum ng_status st = g->status;
	if (!st)
		st = ng_graph_plan(g, g->align);
	if (!st)
		st = ng_graph_validate(g);
	if (st)
		ng_graph_free(g);
	return st;
}

/* Plan, validate; on any failure free the graph and return the status. */
static enum ng_status finish(struct ng_graph *g, struct fwd_out *f)
{
	free(f->la);
	return ng_bld_finish(g);
}

static enum ng_status alloc_layers(struct ng_graph *g, struct fwd_out *f)
{
	memset(f, 0, sizeof(*f));
	f->la = calloc((size_t)g->cfg.L, sizeof(*f->la));
	if (!f->la) {
		ng_graph_free(g);
		return ng_fail(NG_ERR_RUNTIME, "step: out of host memory for %d layers", g->cfg.L);
	}
	return NG_OK;
}

enum ng_status ng_step_build_train(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				   int T, int K, const struct ng_step_options *opt)
{
	if (cfg->arch == NG_ARCH_SPEEDRUN)
		return ng_spr_build_train(g, cfg, B, T, K, opt);
	struct ng_bld b;
	struct fwd_out f;
	enum ng_status st = begin(&b, g, NG_GRAPH_TRAIN, cfg, B, T, K, opt);
	if (st || (st = alloc_layers(g, &f)))
		return st;
	/* the gradients of the matmul weights and biases are overwritten by their first dW matmul
	 * (mark_first_writers); LayerNorm and position-embedding gradients are accumulated into,
	 * so only their ranges are zeroed */
	static const int accumulated[] = { NG_P_WPE, NG_P_LN1W, NG_P_LN1B, NG_P_LN2W, NG_P_LN2B,
					   NG_P_LNFW, NG_P_LNFB };
	for (size_t i = 0; i < sizeof(accumulated) / sizeof(accumulated[0]); i++) {
		struct ng_op z = ng_op_blank(NG_OP_ZERO);
		z.n_out = 1;
		z.out[0] = g->t_grads;
		z.param[0] = accumulated[i];
		emit(&b, &z, 0);
	}
	ng_bld_fp8_prep(&b);
	for (int m = 0; m < K && !g->status; m++) {
		enter_micro(&b, m);
		build_forward(&b, &f, 0);
		int dlnf = act(&b, "dlnf", NG_DTYPE_BF16, 3, b.B, b.T, b.C);
		build_classifier(&b, &f, dlnf, g->t_step_state);
		build_backward(&b, &f, dlnf);
	}
	leave_micro(&b, NG_PHASE_OPTIMIZER);
	struct ng_op op = mk(NG_OP_GRAD_NORM, NG_OP_WHICH_NONE, -1, IN(g->t_grads),
			     OUT(g->t_step_state));
	emit(&b, &op, b.ws.grad_norm);
	op = mk(NG_OP_SCHEDULE, NG_OP_WHICH_NONE, -1, IN(g->t_step_state), OUT(g->t_step_state));
	emit(&b, &op, 0);
	op = mk(opt && opt->muon ? NG_OP_MUON : NG_OP_ADAMW, NG_OP_WHICH_NONE, -1,
		IN(g->t_grads, g->t_step_state),
		OUT(g->t_params_bf16, g->t_params_lo, g->t_adam_m, g->t_adam_v));
	emit(&b, &op, opt && opt->muon ? ng_optim_muon_scratch_bytes(cfg, 1) : 0);
	op = mk(NG_OP_STEP_FINISH, NG_OP_WHICH_NONE, -1, IN(g->t_step_state),
		OUT(g->t_step_state));
	emit(&b, &op, 0);
	ng_bld_mark_first_writers(g);
	return finish(g, &f);
}

/* --recompute auto: one rung's build; *bytes its total, SIZE_MAX when it failed. */
static enum ng_status fit_try(struct ng_graph *g, const struct ng_gpt_config *cfg, int B, int T,
			      int K, const struct ng_step_options *o, size_t *bytes)
{
	ng_graph_free(g);
	enum ng_status st = ng_step_build_train(g, cfg, B, T, K, o);
	*bytes = st ? SIZE_MAX : g->total_bytes;
	return st;
}

/* A count of L layers to recompute (keep = L - n) with which the step fits and with one fewer
 * it does not, given that all L fit: a bisection, since the bytes fall with the count (their
 * lower bound strictly; the placement up to its heuristic); *keep gets it, g holds its build. */
static enum ng_status fit_layers(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				 int T, int K, struct ng_step_options *o, int *keep, size_t budget)
{
	int lo = 0, hi = cfg->L; /* lo layers do not fit, hi do */
	size_t bytes;
	enum ng_status st = NG_OK;
	while (hi - lo > 1 && !st) {
		int mid = lo + (hi - lo) / 2;
		*keep = cfg->L - mid;
		st = fit_try(g, cfg, B, T, K, o, &bytes);
		if (bytes <= budget)
			hi = mid;
		else
			lo = mid;
	}
	*keep = cfg->L - hi;
	return st ? st : fit_try(g, cfg, B, T, K, o, &bytes);
}

enum ng_status ng_step_fit_memory(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				  int T, int K, struct ng_step_options *opt, size_t budget)
{
	struct ng_step_options o = *opt;
	o.recompute_gelu = o.recompute_layernorm = o.recompute_fp8 = 0;
	o.keep_gelu = o.keep_layernorm = 0;
	size_t bytes;
	enum ng_status st = fit_try(g, cfg, B, T, K, &o, &bytes);
	if (!st && bytes > budget) { /* GELU outputs, in all layers first: does it reach? */
		o.recompute_gelu = 1;
		st = fit_try(g, cfg, B, T, K, &o, &bytes);
		if (!st && bytes <= budget)
			st = fit_layers(g, cfg, B, T, K, &o, &o.keep_gelu, budget);
		else if (!st) { /* LayerNorm outputs too */
			o.recompute_layernorm = 1;
			st = fit_try(g, cfg, B, T, K, &o, &bytes);
			if (!st && bytes <= budget)
				st = fit_layers(g, cfg, B, T, K, &o, &o.keep_layernorm, budget);
			else if (!st && (o.fp8 & NG_FP8_EVERY)) { /* the E4M3 weight copies */
				o.recompute_fp8 = 1;
				st = fit_try(g, cfg, B, T, K, &o, &bytes);
			}
		}
	}
	if (st)
		return st;
	if (g->total_bytes > budget) {
		ng_fail(NG_ERR_INPUT, "--recompute auto: the step needs %.2f GiB with every recompute "
			"but has %.2f GiB", g->total_bytes / 1073741824.0, budget / 1073741824.0);
		ng_hint("a smaller --head-chunk, or a smaller --batch with --total-batch to keep the "
			"tokens per step: `nanograph plan` shows what each saves");
		return NG_ERR_INPUT;
	}
	*opt = o;
	return NG_OK;
}

/* "what" or "what (n of L layers)" after a comma when buf holds something already. */
static size_t name_item(char *buf, size_t k, size_t n, const char *what, int layers, int L)
{
	if (!layers || k >= n)
		return k;
	int w = layers < L ? snprintf(buf + k, n - k, "%s%s (%d of %d layers)", k ? "," : "", what,
				      layers, L)
			   : snprintf(buf + k, n - k, "%s%s", k ? "," : "", what);
	return w > 0 ? k + (size_t)w : k;
}

const char *ng_step_recompute_name(const struct ng_graph *g, char *buf, size_t n)
{
	const int L = g->cfg.L;
	size_t k = 0;
	buf[0] = 0;
	k = name_item(buf, k, n, "gelu", g->recompute_gelu ? L - (g->keep_gelu < L ? g->keep_gelu : L)
							    : 0, L);
	k = name_item(buf, k, n, "layernorm",
		      g->recompute_layernorm ? L - (g->keep_layernorm < L ? g->keep_layernorm : L) : 0,
		      L);
	k = name_item(buf, k, n, "fp8", g->recompute_fp8 ? L : 0, L);
	if (!k)
		snprintf(buf, n, "none");
	return buf;
}

enum ng_status ng_step_build_eval(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				  int T, int K, const struct ng_step_options *opt)
{
	if (cfg->arch == NG_ARCH_SPEEDRUN)
		return ng_spr_build_eval(g, cfg, B, T, K, opt);
	struct ng_bld b;
	struct fwd_out f;
	enum ng_status st = begin(&b, g, NG_GRAPH_EVAL, cfg, B, T, K, opt);
	if (st || (st = alloc_layers(g, &f)))
		return st;
	zero(&b, g->t_eval_loss);
	for (int m = 0; m < K && !g->status; m++) {
		enter_micro(&b, m);
		build_forward(&b, &f, 0);
		build_classifier(&b, &f, -1, g->t_eval_loss);
	}
	return finish(g, &f);
}

enum ng_status ng_step_build_sample(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				    int T, const struct ng_step_options *opt)
{
	if (cfg->arch == NG_ARCH_SPEEDRUN)
		return ng_spr_build_sample(g, cfg, B, T, opt);
	struct ng_bld b;
	struct fwd_out f;
	enum ng_status st = begin(&b, g, NG_GRAPH_SAMPLE, cfg, B, T, 1, opt);
	if (st || (st = alloc_layers(g, &f)))
		return st;
	enter_micro(&b, 0);
	build_forward(&b, &f, 1);
	b.phase = NG_PHASE_LOSS;
	int rows = act(&b, "lnf.rows", NG_DTYPE_BF16, 2, b.B, b.C, 1);
	struct ng_op op = mk(NG_OP_GATHER_ROWS, NG_OP_WHICH_NONE, -1, IN(f.lnf, f.positions),
			     OUT(rows));
	emit(&b, &op, 0);
	op = mk(NG_OP_MATMUL_FWD, NG_OP_WHICH_HEAD, -1, IN(rows, g->t_params_bf16),
		OUT(g->t_logits_out));
	op.row_count = B;
	emit_p(&b, op, b.ws.matmul);
	op = mk(NG_OP_LOGITS_OUT, NG_OP_WHICH_NONE, -1, IN(g->t_logits_out), OUT(g->t_logits_out));
	op.n_out = 0;
	emit(&b, &op, 0);
	return finish(g, &f);
}

/* The builder's primitives for graph/step_spr.c (graph/step_build.h). */
int ng_bld_act(struct ng_bld *b, const char *name, enum ng_dtype dt, int ndim, size_t s0,
	       size_t s1, size_t s2)
{
	return act(b, name, dt, ndim, s0, s1, s2);
}

int ng_bld_lact(struct ng_bld *b, int l, const char *what, enum ng_dtype dt, int ndim, size_t s0,
		size_t s1, size_t s2)
{
	return lact(b, l, what, dt, ndim, s0, s1, s2);
}

int ng_bld_emit(struct ng_bld *b, struct ng_op *op, size_t ws_bytes)
{
	return emit(b, op, ws_bytes);
}

struct ng_op ng_bld_mk(enum ng_op_kind kind, enum ng_op_which which, int layer, int n_in,
		       const int *in, int n_out, const int *out)
{
	return mk(kind, which, layer, n_in, in, n_out, out);
}

enum ng_status ng_bld_begin(struct ng_bld *b, struct ng_graph *g, enum ng_graph_kind kind,
			    const struct ng_gpt_config *cfg, int B, int T, int K,
			    const struct ng_step_options *opt)
{
	return begin(b, g, kind, cfg, B, T, K, opt);
}

void ng_bld_enter_micro(struct ng_bld *b, int m)
{
	enter_micro(b, m);
}

void ng_bld_leave_micro(struct ng_bld *b, enum ng_phase phase)
{
	leave_micro(b, phase);
}
