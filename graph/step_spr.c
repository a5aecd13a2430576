/*
 * graph/step_spr.c — builds the speedrun model's train and eval steps (see step_spr.h for the
 * model, graph/ir.h "The speedrun family" for every op's tensors), then plans the arena.
 *
 * Names as graph/step.c: "<m>L<l>.<what>". Shapes: N = B*T rows; x, xin, n1, n2 (B, T, C);
 * qkv, qkva (B, T, 3C); fch, fcr (B, T, 4C); logits of a chunk (rows, Vp); rstd f32 (N) or
 * (N, 2, H) for QK-norm; lse f32 (B, H, T); bounds i32 (2, B, T).
 */
#include "graph/step_spr.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/optim_muon.h"
#include "graph/step_build.h"

/* Tensors of one block's forward that its backward reads. */
struct spr_layer {
	int xs;          /* after the U-net skip add (the x0 mix's u), or the block's input */
	int xin;         /* after the x0 mix: the block's residual stream in */
	int n1, rstd1;   /* rmsnorm before the attention */
	int qkv, qkva, rstdqk;
	int atty, lse;
	int x1;          /* after the attention's residual add (xin without attention) */
	int n2, rstd2;
	int fch, fcr;    /* fc output, relu^2 of it */
	int xout;        /* the block's output */
};

struct spr_fwd {
	int inputs, targets, sorted, bounds, windows;
	int emb, x0, rstd0;
	int ve[NG_SPR_VE];
	int nf, rstdf, xf;
	struct spr_layer *la;
};

static int emit(struct ng_bld *b, struct ng_op op, size_t ws)
{
	return ng_bld_emit(b, &op, ws);
}

/* A bias-free full-rows matmul forward: out = inp @ W^T (+ resid when resid >= 0). */
static void mm_fwd(struct ng_bld *b, enum ng_op_which w, int l, int param, int inp, int out,
		   int resid)
{
	struct ng_graph *g = b->g;
	struct ng_op op = ng_bld_mk(NG_OP_MATMUL_FWD, w, l, IN(inp, g->t_params_bf16), OUT(out));
	op.row_count = (int)b->N;
	op.param[0] = param;
	/* --fp8: E4M3 operands, the input cast in front of the scratch */
	size_t in8 = ng_bld_fp8_in(b, &op, w == NG_OP_WHICH_FCPROJ ? 4 * b->C : b->C, -1);
	if (resid >= 0) { /* last, after the fp8 inputs */
		op.residual = 1;
		op.in[op.n_in++] = resid;
	}
	emit(b, op, b->ws.matmul + in8);
}

/* dW (grads +=, or = for the step's first writer) then dinp of a bias-free matmul; with
 * --fp8-dw the two share one cast of dout (graph/step.h "FP8"). */
static void mm_bwd(struct ng_bld *b, enum ng_op_which w, int l, int param, int dout, int inp,
		   int dinp)
{
	struct ng_graph *g = b->g;
	struct ng_op op = ng_bld_mk(NG_OP_MATMUL_DW, w, l, IN(dout, inp), OUT(g->t_grads));
	op.row_count = (int)b->N;
	op.param[0] = param;
	int d8;
	size_t front = ng_bld_fp8_dw(b, &op, 1, &d8);
	emit(b, op, b->ws.matmul + front);
	op = ng_bld_mk(NG_OP_MATMUL_DINP, w, l, IN(d8 >= 0 ? d8 : dout, g->t_params_bf16),
		       OUT(dinp));
	op.row_count = (int)b->N;
	op.param[0] = param;
	emit(b, op, b->ws.matmul + ng_bld_fp8_dinp(b, &op));
}

static int rmsnorm_fwd(struct ng_bld *b, enum ng_op_which w, int l, int x, int *rstd,
		       const char *name)
{
	char rn[32];
	snprintf(rn, sizeof(rn), "%s.rstd", name);
	int y = l >= 0 ? ng_bld_lact(b, l, name, NG_DTYPE_BF16, 3, b->B, b->T, b->C)
		       : ng_bld_act(b, name, NG_DTYPE_BF16, 3, b->B, b->T, b->C);
	*rstd = l >= 0 ? ng_bld_lact(b, l, rn, NG_DTYPE_F32, 1, b->N, 1, 1)
		       : ng_bld_act(b, rn, NG_DTYPE_F32, 1, b->N, 1, 1);
	emit(b, ng_bld_mk(NG_OP_RMSNORM_FWD, w, l, IN(x), OUT(y, *rstd)), 0);
	return y;
}

static void rmsnorm_bwd(struct ng_bld *b, enum ng_op_which w, int l, int dy, int x, int rstd,
			int dx, int overwrite)
{
	struct ng_op op = ng_bld_mk(NG_OP_RMSNORM_BWD, w, l, IN(dy, x, rstd), OUT(dx));
	op.overwrite = overwrite;
	emit(b, op, 0);
}

/* A MIX_FWD: out = a u + b w (w may be -1). */
static void mix_fwd(struct ng_bld *b, enum ng_op_which w, int l, int index, int u, int wt,
		    int scalars, int out)
{
	struct ng_op op = wt >= 0 ? ng_bld_mk(NG_OP_MIX_FWD, w, l, IN(u, wt, scalars), OUT(out))
				  : ng_bld_mk(NG_OP_MIX_FWD, w, l, IN(u, scalars), OUT(out));
	op.param[0] = w == NG_OP_WHICH_XMIX ? NG_P_XLAMBDA
		      : w == NG_OP_WHICH_VMIX ? NG_P_VLAMBDA : NG_P_SKIPW;
	op.index = index;
	emit(b, op, 0);
}

/* A MIX_BWD (graph/ir.h): in dout, u (-1: none), w (-1: none), scalars; out du (-1: none),
 * dw (-1: none), grads. The absent ones are left out of the lists. */
static void mix_bwd(struct ng_bld *b, enum ng_op_which w, int l, int index, int dout, int u,
		    int wt, int scalars, int du, int dw)
{
	struct ng_graph *g = b->g;
	struct ng_op op = ng_bld_mk(NG_OP_MIX_BWD, w, l, IN(dout), OUT(-1));
	op.n_out = 0;
	if (u >= 0)
		op.in[op.n_in++] = u;
	if (wt >= 0)
		op.in[op.n_in++] = wt;
	op.in[op.n_in++] = scalars;
	if (du >= 0)
		op.out[op.n_out++] = du;
	if (dw >= 0)
		op.out[op.n_out++] = dw;
	op.out[op.n_out++] = g->t_grads;
	op.param[0] = w == NG_OP_WHICH_XMIX ? NG_P_XLAMBDA
		      : w == NG_OP_WHICH_VMIX ? NG_P_VLAMBDA : NG_P_SKIPW;
	op.index = index;
	emit(b, op, b->ws.gelu_bwd);
}

/* One micro-batch's forward up to the final RMSNorm. */
static void forward(struct ng_bld *b, struct spr_fwd *f, int scalars)
{
	struct ng_graph *g = b->g;
	const struct ng_gpt_config *c = &g->cfg;
	const int L = c->L;
	const size_t B = b->B, T = b->T, C = b->C, N = b->N, H = (size_t)c->H;
	b->phase = NG_PHASE_FORWARD;
	f->inputs = ng_bld_act(b, "inputs", NG_DTYPE_I32, 2, B, T, 1);
	f->targets = ng_bld_act(b, "targets", NG_DTYPE_I32, 2, B, T, 1);
	emit(b, ng_bld_mk(NG_OP_TOKENS_SPLIT, NG_OP_WHICH_NONE, -1, IN(g->t_tokens),
			  OUT(f->inputs, f->targets)), 0);
	f->sorted = -1;
	if (g->kind == NG_GRAPH_TRAIN) { /* early, so that it overlaps the forward */
		f->sorted = ng_bld_act(b, "encoder_sorted", NG_DTYPE_U8, 1, b->ws.encoder_sorted,
				       1, 1);
		emit(b, ng_bld_mk(NG_OP_ENCODER_SORT, NG_OP_WHICH_NONE, -1, IN(f->inputs),
				  OUT(f->sorted)), 0);
	}
	f->bounds = ng_bld_act(b, "attn_bounds", NG_DTYPE_I32, 3, 2, B, T);
	f->windows = ng_bld_act(b, "attn_windows", NG_DTYPE_I32, 1, 2, 1, 1);
	if (g->kind == NG_GRAPH_EVAL) /* the window the host asks for */
		emit(b, ng_bld_mk(NG_OP_ATTN_BOUNDS, NG_OP_WHICH_NONE, -1,
				  IN(f->inputs, g->t_step_state, g->t_eval_window),
				  OUT(f->bounds, f->windows)), 0);
	else /* the schedule's at the step counter */
		emit(b, ng_bld_mk(NG_OP_ATTN_BOUNDS, NG_OP_WHICH_NONE, -1,
				  IN(f->inputs, g->t_step_state), OUT(f->bounds, f->windows)), 0);
	f->emb = ng_bld_act(b, "embed", NG_DTYPE_BF16, 3, B, T, C);
	struct ng_op op = ng_bld_mk(NG_OP_EMBED_FWD, NG_OP_WHICH_NONE, -1,
				    IN(f->inputs, g->t_params_bf16), OUT(f->emb));
	op.param[0] = NG_P_WTE;
	emit(b, op, 0);
	f->x0 = rmsnorm_fwd(b, NG_OP_WHICH_NONE, -1, f->emb, &f->rstd0, "x0");
	for (int t = 0; t < NG_SPR_VE; t++) {
		char name[16];
		snprintf(name, sizeof(name), "ve%d", t);
		f->ve[t] = ng_bld_act(b, name, NG_DTYPE_BF16, 3, B, T, C);
		op = ng_bld_mk(NG_OP_EMBED_FWD, NG_OP_WHICH_NONE, -1,
			       IN(f->inputs, g->t_params_bf16), OUT(f->ve[t]));
		op.param[0] = NG_P_VE;
		op.index = t;
		emit(b, op, 0);
	}
	int x = f->x0;
	for (int l = 0; l < L; l++) {
		struct spr_layer *a = &f->la[l];
		if (l >= L / 2) {
			int j = l - L / 2;
			a->xs = ng_bld_lact(b, l, "xs", NG_DTYPE_BF16, 3, B, T, C);
			mix_fwd(b, NG_OP_WHICH_SKIP, l, j, x, f->la[L / 2 - 1 - j].xout, scalars,
				a->xs);
		} else {
			a->xs = x;
		}
		a->xin = ng_bld_lact(b, l, "xin", NG_DTYPE_BF16, 3, B, T, C);
		mix_fwd(b, NG_OP_WHICH_XMIX, l, 0, a->xs, f->x0, scalars, a->xin);
		a->x1 = a->xin;
		if (ng_spr_has_attn(c, l)) {
			a->n1 = rmsnorm_fwd(b, NG_OP_WHICH_LN1, l, a->xin, &a->rstd1, "n1");
			a->qkv = ng_bld_lact(b, l, "qkv", NG_DTYPE_BF16, 3, B, T, 3 * C);
			mm_fwd(b, NG_OP_WHICH_QKV, l, NG_P_QKVW, a->n1, a->qkv, -1);
			a->qkva = ng_bld_lact(b, l, "qkva", NG_DTYPE_BF16, 3, B, T, 3 * C);
			a->rstdqk = ng_bld_lact(b, l, "qkva.rstd", NG_DTYPE_F32, 3, N, 2, H);
			emit(b, ng_bld_mk(NG_OP_QK_ROTARY_FWD, NG_OP_WHICH_NONE, l, IN(a->qkv),
					  OUT(a->qkva, a->rstdqk)), 0);
			int ve = ng_spr_ve(c, l);
			int vrows = ve >= 0 ? f->ve[ve] : -1;
			mix_fwd(b, NG_OP_WHICH_VMIX, l, 0, a->qkv, vrows, scalars, a->qkva);
			a->atty = ng_bld_lact(b, l, "atty", NG_DTYPE_BF16, 3, B, T, C);
			a->lse = ng_bld_lact(b, l, "lse", NG_DTYPE_F32, 3, B, H, T);
			op = ng_bld_mk(NG_OP_ATTENTION_FWD, NG_OP_WHICH_NONE, l,
				       IN(a->qkva, f->bounds, f->windows), OUT(a->atty, a->lse));
			op.index = ng_spr_long_window(c, l);
			emit(b, op, b->ws.attn_fwd);
			a->x1 = ng_bld_lact(b, l, "x1", NG_DTYPE_BF16, 3, B, T, C);
			mm_fwd(b, NG_OP_WHICH_ATTPROJ, l, NG_P_ATTPROJW, a->atty, a->x1, a->xin);
		}
		a->n2 = rmsnorm_fwd(b, NG_OP_WHICH_LN2, l, a->x1, &a->rstd2, "n2");
		a->fcr = ng_bld_lact(b, l, "fcr", NG_DTYPE_BF16, 3, B, T, 4 * C);
		if (g->fuse_relu2) { /* relu^2 in our GEMM's epilogue: no pre-activation kept */
			a->fch = -1;
			op = ng_bld_mk(NG_OP_MATMUL_FWD, NG_OP_WHICH_FC, l,
				       IN(a->n2, g->t_params_bf16), OUT(a->fcr));
			op.row_count = (int)N;
			op.param[0] = NG_P_FCW;
			op.own = op.relu2 = 1;
			emit(b, op, 0);
		} else {
			a->fch = ng_bld_lact(b, l, "fch", NG_DTYPE_BF16, 3, B, T, 4 * C);
			mm_fwd(b, NG_OP_WHICH_FC, l, NG_P_FCW, a->n2, a->fch, -1);
			emit(b, ng_bld_mk(NG_OP_RELU2_FWD, NG_OP_WHICH_NONE, l, IN(a->fch),
					  OUT(a->fcr)), 0);
		}
		a->xout = ng_bld_lact(b, l, "xout", NG_DTYPE_BF16, 3, B, T, C);
		mm_fwd(b, NG_OP_WHICH_FCPROJ, l, NG_P_FCPROJW, a->fcr, a->xout, a->x1);
		x = a->xout;
	}
	f->xf = x;
	f->nf = rmsnorm_fwd(b, NG_OP_WHICH_LNF, -1, x, &f->rstdf, "nf");
}

/* The head in chunks, the soft-capped loss (with its gradient and the head's backward when
 * dnf >= 0), then the losses' mean into loss_dst. With NG_FP8_HEAD_BWD a chunk of a multiple
 * of 16 rows takes the E5M2 backward (graph/step.h "FP8"): the loss writes g8.c<k>, which the
 * dinp and dW matmuls read instead of the bf16 gradient. */
static void classifier(struct ng_bld *b, const struct spr_fwd *f, int dnf, int loss_dst)
{
	struct ng_graph *g = b->g;
	const int N = (int)b->N, rows = g->head_chunk_rows;
	const int head8 = dnf >= 0 && (g->fp8 & NG_FP8_HEAD) && (g->fp8 & NG_FP8_HEAD_BWD);
	b->phase = NG_PHASE_LOSS;
	int losses = ng_bld_act(b, "losses", NG_DTYPE_F32, 1, b->N, 1, 1);
	for (int c = 0, r0 = 0; r0 < N; c++, r0 += rows) {
		int n = N - r0 < rows ? N - r0 : rows;
		char name[24];
		snprintf(name, sizeof(name), "logits.c%d", c);
		int logits = ng_bld_act(b, name, NG_DTYPE_BF16, 2, (size_t)n, b->Vp, 1);
		struct ng_op op = ng_bld_mk(NG_OP_MATMUL_FWD, NG_OP_WHICH_HEAD, -1,
					    IN(f->nf, g->t_params_bf16), OUT(logits));
		op.param[0] = NG_P_HEADW;
		op.chunk = c;
		op.row_start = r0;
		op.row_count = n;
		size_t in8 = ng_bld_fp8_in(b, &op, b->C, -1); /* the FP8 head: nf cast here */
		emit(b, op, b->ws.matmul + in8);
		int g8 = -1;
		if (head8 && n % 16 == 0) {
			snprintf(name, sizeof(name), "g8.c%d", c);
			g8 = ng_bld_act(b, name, NG_DTYPE_U8, 1, (size_t)n * b->Vp + 16, 1, 1);
		}
		op = dnf < 0 ? ng_bld_mk(NG_OP_SOFTCAP_CE, NG_OP_WHICH_NONE, -1,
					 IN(logits, f->targets), OUT(losses))
		     : g8 >= 0 ? ng_bld_mk(NG_OP_SOFTCAP_CE, NG_OP_WHICH_NONE, -1,
					   IN(logits, f->targets), OUT(g8, losses))
			       : ng_bld_mk(NG_OP_SOFTCAP_CE, NG_OP_WHICH_NONE, -1,
					   IN(logits, f->targets), OUT(logits, losses));
		op.no_grad = dnf < 0;
		op.fp8 = g8 >= 0;
		op.chunk = c;
		op.row_start = r0;
		op.row_count = n;
		emit(b, op, b->ws.crossentropy);
		if (dnf < 0)
			continue;
		op = g8 >= 0 ? ng_bld_mk(NG_OP_MATMUL_DINP, NG_OP_WHICH_HEAD, -1, IN(g8), OUT(dnf))
			     : ng_bld_mk(NG_OP_MATMUL_DINP, NG_OP_WHICH_HEAD, -1,
					 IN(logits, g->t_params_bf16), OUT(dnf));
		op.param[0] = NG_P_HEADW;
		op.chunk = c;
		op.row_start = r0;
		op.row_count = n;
		size_t wt8 = g8 >= 0 ? ng_bld_fp8_weights(b, &op, 1) : 0; /* W^T in E4M3 */
		emit(b, op, b->ws.matmul + wt8);
		op = g8 >= 0 ? ng_bld_mk(NG_OP_MATMUL_DW, NG_OP_WHICH_HEAD, -1,
					 IN(g8, f->nf, g->t_fp8_state), OUT(g->t_grads))
			     : ng_bld_mk(NG_OP_MATMUL_DW, NG_OP_WHICH_HEAD, -1, IN(logits, f->nf),
					 OUT(g->t_grads));
		op.param[0] = NG_P_HEADW;
		op.fp8 = g8 >= 0;
		op.chunk = c;
		op.row_start = r0;
		op.row_count = n;
		emit(b, op, b->ws.matmul + (g8 >= 0 ? ng_fp8_head_dw_bytes(n, b->Vp, b->C) : 0));
	}
	emit(b, ng_bld_mk(NG_OP_LOSS_ACCUMULATE, NG_OP_WHICH_NONE, -1, IN(losses), OUT(loss_dst)),
	     0);
}

static void zero_t(struct ng_bld *b, int t)
{
	struct ng_op op = ng_op_blank(NG_OP_ZERO);
	op.n_out = 1;
	op.out[0] = t;
	ng_bld_emit(b, &op, 0);
}

/* One micro-batch's backward, from dnf down to the embeddings. */
static void backward(struct ng_bld *b, const struct spr_fwd *f, int dnf, int scalars)
{
	struct ng_graph *g = b->g;
	const struct ng_gpt_config *c = &g->cfg;
	const int L = c->L;
	const size_t B = b->B, T = b->T, C = b->C;
	b->phase = NG_PHASE_BACKWARD;
	int dx = ng_bld_act(b, "dresid", NG_DTYPE_BF16, 3, B, T, C);
	rmsnorm_bwd(b, NG_OP_WHICH_LNF, -1, dnf, f->xf, f->rstdf, dx, 1);
	int dx0 = ng_bld_act(b, "dx0", NG_DTYPE_BF16, 3, B, T, C);
	zero_t(b, dx0);
	int dve[NG_SPR_VE];
	for (int t = 0; t < NG_SPR_VE; t++) {
		char name[16];
		snprintf(name, sizeof(name), "dve%d", t);
		dve[t] = ng_bld_act(b, name, NG_DTYPE_BF16, 3, B, T, C);
		zero_t(b, dve[t]);
	}
	int *dskip = calloc((size_t)L / 2, sizeof(int));
	if (!dskip) {
		g->status = ng_fail(NG_ERR_RUNTIME, "step: out of host memory");
		return;
	}
	for (int l = L - 1; l >= 0; l--) {
		const struct spr_layer *a = &f->la[l];
		if (l < L / 2) /* the U-net skip's share of this block's output gradient */
			emit(b, ng_bld_mk(NG_OP_ADD, NG_OP_WHICH_NONE, l,
					  IN(dx, dskip[L / 2 - 1 - l], scalars), OUT(dx)), 0);
		/* MLP: dx is the gradient of xout = x1 + fcproj(relu2(fc(rmsnorm(x1)))) */
		int dfcr = ng_bld_lact(b, l, "dfcr", NG_DTYPE_BF16, 3, B, T, 4 * C);
		mm_bwd(b, NG_OP_WHICH_FCPROJ, l, NG_P_FCPROJW, dx, a->fcr, dfcr);
		/* fused forward: no pre-activation, relu^2's backward from its output */
		struct ng_op rb = ng_bld_mk(NG_OP_RELU2_BWD, NG_OP_WHICH_NONE, l,
					    IN(g->fuse_relu2 ? a->fcr : a->fch, dfcr), OUT(dfcr));
		rb.relu2 = g->fuse_relu2;
		emit(b, rb, 0);
		int dn2 = ng_bld_lact(b, l, "dn2", NG_DTYPE_BF16, 3, B, T, C);
		mm_bwd(b, NG_OP_WHICH_FC, l, NG_P_FCW, dfcr, a->n2, dn2);
		rmsnorm_bwd(b, NG_OP_WHICH_LN2, l, dn2, a->x1, a->rstd2, dx, 0);
		if (ng_spr_has_attn(c, l)) { /* dx: the gradient of x1 = xin + attproj(...) */
			int datty = ng_bld_lact(b, l, "datty", NG_DTYPE_BF16, 3, B, T, C);
			mm_bwd(b, NG_OP_WHICH_ATTPROJ, l, NG_P_ATTPROJW, dx, a->atty, datty);
			int dqkv = ng_bld_lact(b, l, "dqkv", NG_DTYPE_BF16, 3, B, T, 3 * C);
			struct ng_op op = ng_bld_mk(NG_OP_ATTENTION_BWD, NG_OP_WHICH_NONE, l,
						    IN(datty, a->qkva, a->atty, a->lse, f->bounds,
						       f->windows),
						    OUT(dqkv));
			op.index = ng_spr_long_window(c, l);
			emit(b, op, b->ws.attn_bwd);
			int ve = ng_spr_ve(c, l);
			mix_bwd(b, NG_OP_WHICH_VMIX, l, 0, dqkv, a->qkv, ve >= 0 ? f->ve[ve] : -1,
				scalars, dqkv, ve >= 0 ? dve[ve] : -1);
			emit(b, ng_bld_mk(NG_OP_QK_ROTARY_BWD, NG_OP_WHICH_NONE, l,
					  IN(a->qkva, a->rstdqk), OUT(dqkv)), 0);
			int dn1 = ng_bld_lact(b, l, "dn1", NG_DTYPE_BF16, 3, B, T, C);
			mm_bwd(b, NG_OP_WHICH_QKV, l, NG_P_QKVW, dqkv, a->n1, dn1);
			rmsnorm_bwd(b, NG_OP_WHICH_LN1, l, dn1, a->xin, a->rstd1, dx, 0);
		}
		/* dx: the gradient of xin = l0 xs + l1 x0 */
		mix_bwd(b, NG_OP_WHICH_XMIX, l, 0, dx, a->xs, f->x0, scalars, dx, dx0);
		if (l >= L / 2) { /* xs = x + skipw[j] * xout of block L/2-1-j: dx is x's too */
			int j = l - L / 2;
			char name[16];
			snprintf(name, sizeof(name), "dskip%d", j);
			dskip[j] = ng_bld_act(b, name, NG_DTYPE_BF16, 3, B, T, C);
			int src = f->la[L / 2 - 1 - j].xout;
			mix_bwd(b, NG_OP_WHICH_SKIP, l, j, dx, -1, src, scalars, -1, dskip[j]);
		}
	}
	free(dskip);
	/* block 0's input was x0 itself: its gradient joins x0's */
	emit(b, ng_bld_mk(NG_OP_ADD, NG_OP_WHICH_NONE, -1, IN(dx0, dx, scalars), OUT(dx0)), 0);
	int demb = ng_bld_act(b, "dembed", NG_DTYPE_BF16, 3, B, T, C);
	rmsnorm_bwd(b, NG_OP_WHICH_NONE, -1, dx0, f->emb, f->rstd0, demb, 1);
	struct ng_op op = ng_bld_mk(NG_OP_EMBED_BWD, NG_OP_WHICH_NONE, -1,
				    IN(demb, f->sorted, f->inputs), OUT(g->t_grads));
	op.param[0] = NG_P_WTE;
	emit(b, op, b->ws.encoder_bwd);
	for (int t = 0; t < NG_SPR_VE; t++) {
		op = ng_bld_mk(NG_OP_EMBED_BWD, NG_OP_WHICH_NONE, -1,
			       IN(dve[t], f->sorted, f->inputs), OUT(g->t_grads));
		op.param[0] = NG_P_VE;
		op.index = t;
		emit(b, op, b->ws.encoder_bwd);
	}
}

/* The step-level SCALARS op: the fp32 scalars (and the constant 1) every MIX reads. */
static int scalars_op(struct ng_bld *b)
{
	struct ng_graph *g = b->g;
	const struct ng_param_spec *p = g->lay.p;
	size_t n = p[NG_P_SKIPW].offset + p[NG_P_SKIPW].numel - p[NG_P_XLAMBDA].offset + 1;
	int s = ng_bld_act(b, "scalars", NG_DTYPE_F32, 1, n, 1, 1);
	emit(b, ng_bld_mk(NG_OP_SCALARS, NG_OP_WHICH_NONE, -1,
			  IN(g->t_params_bf16, g->t_params_lo), OUT(s)), 0);
	return s;
}

static enum ng_status spr_begin(struct ng_bld *b, struct ng_graph *g, enum ng_graph_kind kind,
				const struct ng_gpt_config *cfg, int B, int T, int K,
				const struct ng_step_options *opt, struct spr_fwd *f)
{
	if (opt && (opt->recompute_gelu || opt->recompute_layernorm || opt->recompute_auto)) {
		ng_fail(NG_ERR_INPUT, "--recompute gelu, layernorm and auto are for the GPT-2 "
			"family");
		ng_hint("the speedrun model recomputes only the E4M3 weights: --fp8 --recompute "
			"fp8");
		return NG_ERR_INPUT;
	}
	struct ng_step_options o;
	if (opt)
		o = *opt;
	else
		ng_step_default_options(&o);
	o.fuse_gelu = 0; /* relu^2 is its own op */
	/* --fp8: the layer matmuls as GPT-2's (graph/step.h "FP8"), their inputs cast by the
	 * matmul itself; the head's forward is FP8 by default (NG_FP8_HEAD alone) */
	if (!(o.fp8 & NG_FP8_EVERY & ~NG_FP8_HEAD))
		o.recompute_fp8 = 0;
	enum ng_status st = ng_bld_begin(b, g, kind, cfg, B, T, K, &o);
	if (st)
		return st;
	memset(f, 0, sizeof(*f));
	f->la = calloc((size_t)cfg->L, sizeof(*f->la));
	if (!f->la) {
		ng_graph_free(g);
		return ng_fail(NG_ERR_RUNTIME, "step: out of host memory for %d layers", cfg->L);
	}
	return NG_OK;
}

static enum ng_status spr_finish(struct ng_graph *g, struct spr_fwd *f)
{
	free(f->la);
	return ng_bld_finish(g);
}

/* ZERO of one parameter's gradient range (the accumulated ones). */
static void zero_grad(struct ng_bld *b, int param)
{
	struct ng_op z = ng_op_blank(NG_OP_ZERO);
	z.n_out = 1;
	z.out[0] = b->g->t_grads;
	z.param[0] = param;
	ng_bld_emit(b, &z, 0);
}

enum ng_status ng_spr_build_train(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				  int T, int K, const struct ng_step_options *opt)
{
	struct ng_bld b;
	struct spr_fwd f;
	enum ng_status st = spr_begin(&b, g, NG_GRAPH_TRAIN, cfg, B, T, K, opt, &f);
	if (st)
		return st;
	/* the embeddings and the scalars are accumulated into; the matrices' dW overwrite */
	static const int accumulated[] = { NG_P_WTE, NG_P_VE, NG_P_XLAMBDA, NG_P_VLAMBDA,
					   NG_P_SKIPW };
	for (size_t i = 0; i < sizeof(accumulated) / sizeof(accumulated[0]); i++)
		zero_grad(&b, accumulated[i]);
	ng_bld_fp8_prep(&b);
	int scalars = scalars_op(&b);
	for (int m = 0; m < K && !g->status; m++) {
		ng_bld_enter_micro(&b, m);
		forward(&b, &f, scalars);
		int dnf = ng_bld_act(&b, "dnf", NG_DTYPE_BF16, 3, b.B, b.T, b.C);
		classifier(&b, &f, dnf, g->t_step_state);
		backward(&b, &f, dnf, scalars);
	}
	ng_bld_leave_micro(&b, NG_PHASE_OPTIMIZER);
	emit(&b, ng_bld_mk(NG_OP_GRAD_NORM, NG_OP_WHICH_NONE, -1, IN(g->t_grads),
			   OUT(g->t_step_state)), b.ws.grad_norm);
	emit(&b, ng_bld_mk(NG_OP_SCHEDULE, NG_OP_WHICH_NONE, -1, IN(g->t_step_state),
			   OUT(g->t_step_state)), 0);
	int muon = opt && opt->muon;
	emit(&b, ng_bld_mk(muon ? NG_OP_MUON : NG_OP_ADAMW, NG_OP_WHICH_NONE, -1,
			   IN(g->t_grads, g->t_step_state),
			   OUT(g->t_params_bf16, g->t_params_lo, g->t_adam_m, g->t_adam_v)),
	     muon ? ng_optim_muon_scratch_bytes(cfg, 1) : 0);
	emit(&b, ng_bld_mk(NG_OP_STEP_FINISH, NG_OP_WHICH_NONE, -1, IN(g->t_step_state),
			   OUT(g->t_step_state)), 0);
	ng_bld_mark_first_writers(g);
	return spr_finish(g, &f);
}

enum ng_status ng_spr_build_eval(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				 int T, int K, const struct ng_step_options *opt)
{
	struct ng_bld b;
	struct spr_fwd f;
	enum ng_status st = spr_begin(&b, g, NG_GRAPH_EVAL, cfg, B, T, K, opt, &f);
	if (st)
		return st;
	zero_t(&b, g->t_eval_loss);
	int scalars = scalars_op(&b);
	for (int m = 0; m < K && !g->status; m++) {
		ng_bld_enter_micro(&b, m);
		forward(&b, &f, scalars);
		classifier(&b, &f, -1, g->t_eval_loss);
	}
	return spr_finish(g, &f);
}

enum ng_status ng_spr_build_sample(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				   int T, const struct ng_step_options *opt)
{
	(void)B;
	(void)T;
	(void)opt;
	ng_graph_init(g);
	ng_fail(NG_ERR_INPUT, "the speedrun model (%d layers) has no sample step to plan: it "
		"decodes outside the step IR", cfg->L);
	ng_hint("`nanograph sample --ckpt PATH` samples from it; plan --step train or eval");
	return NG_ERR_INPUT;
}
