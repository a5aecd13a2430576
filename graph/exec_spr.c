/*
 * graph/exec_spr.c — the launches of the speedrun model's ops (graph/ir.h "The speedrun
 * family"), called by ng_exec_run_op_ (exec_dispatch.c) for those kinds and for the speedrun's
 * attention and loss. Every coefficient the mixes use is read from the step's fp32 scalars
 * (SCALARS); the windows come from the device step counter (ATTN_BOUNDS), or in the eval graph
 * from the window the host wrote before the evaluation: no host value inside a step.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "graph/exec_internal.h"
#include "kernels/attention.h"
#include "kernels/check.h"
#include "kernels/encoder.h"
#include "kernels/mix.h"
#include "kernels/rmsnorm.h"
#include "kernels/softcap.h"
#include "kernels/spr_step.h"

#define T_(t) ng_exec_tensor_(e, g, (t))

/* The fp32 scalars' float for element `i` of parameter `id` (slot = the per-layer index). */
static float *coef(const struct ng_graph *g, float *scalars, int id, int slot, int i)
{
	const struct ng_param_spec *p = &g->lay.p[id];
	size_t per = p->per_layer ? p->numel / p->shape[0] : 0;
	return scalars + (p->offset - g->lay.p[NG_P_XLAMBDA].offset) + (size_t)slot * per +
	       (size_t)i;
}

/* The same float's gradient in the fp32 gradient buffer. */
static float *coef_grad(const struct ng_exec *e, const struct ng_graph *g, int grads, int id,
			int slot, int i)
{
	const struct ng_param_spec *p = &g->lay.p[id];
	size_t per = p->per_layer ? p->numel / p->shape[0] : 0;
	return (float *)T_(grads) + p->offset + (size_t)slot * per + (size_t)i;
}

/* The constant 1.0 after the scalars (SCALARS writes it). */
static float *one(const struct ng_graph *g, float *scalars)
{
	const struct ng_param_spec *p = g->lay.p;
	return scalars + (p[NG_P_SKIPW].offset + p[NG_P_SKIPW].numel - p[NG_P_XLAMBDA].offset);
}

/* MIX_FWD / MIX_BWD operands by `which` (graph/ir.h): the coefficients' slots and the bf16
 * operands' leading dimensions and column offsets. */
struct mix_args {
	int slot;           /* per-layer index of the coefficients (or the skip weight) */
	int a_id, a_i;      /* a: parameter and element (a_id < 0: a = 1) */
	int b_id, b_i;      /* b */
	int ld_u, off_u;    /* u (and du) */
	int ld_out, off_out;
};

static struct mix_args mix_args(const struct ng_gpt_config *c, const struct ng_op *op)
{
	struct mix_args m = { 0, op->param[0], 0, op->param[0], 1, c->C, 0, c->C, 0 };
	switch (op->which) {
	case NG_OP_WHICH_XMIX:
		m.slot = op->layer;
		break;
	case NG_OP_WHICH_VMIX: /* v inside the fused (N, 3C) buffers */
		m.slot = ng_spr_attn_slot(c, op->layer);
		m.ld_u = m.ld_out = 3 * c->C;
		m.off_u = m.off_out = 2 * c->C;
		break;
	default: /* SKIP: x + skipw[j] * src */
		m.a_id = -1;
		m.b_id = op->param[0];
		m.b_i = op->index;
		break;
	}
	return m;
}

static enum ng_status run_mix_fwd(struct ng_exec *e, const struct ng_graph *g,
				  const struct ng_op *op, cudaStream_t s)
{
	const struct ng_gpt_config *c = &g->cfg;
	const int N = g->B * g->T;
	struct mix_args m = mix_args(c, op);
	float *sc = T_(op->in[op->n_in - 1]);
	const ng_bf16 *w = op->n_in == 3 ? T_(op->in[1]) : NULL;
	const float *a = m.a_id >= 0 ? coef(g, sc, m.a_id, m.slot, m.a_i) : NULL;
	const float *b = w ? coef(g, sc, m.b_id, op->which == NG_OP_WHICH_SKIP ? 0 : m.slot, m.b_i)
			   : NULL;
	return ng_mix2_fwd((ng_bf16 *)T_(op->out[0]) + m.off_out, m.ld_out, a,
			   (const ng_bf16 *)T_(op->in[0]) + m.off_u, m.ld_u, b, w, c->C, N, c->C, s);
}

static enum ng_status run_mix_bwd(struct ng_exec *e, const struct ng_graph *g,
				  const struct ng_op *op, void *scratch, cudaStream_t s)
{
	const struct ng_gpt_config *c = &g->cfg;
	const int N = g->B * g->T, C = c->C;
	struct mix_args m = mix_args(c, op);
	float *sc = T_(op->in[op->n_in - 1]);
	int grads = op->out[op->n_out - 1];
	const ng_bf16 *dout = T_(op->in[0]);
	if (op->which == NG_OP_WHICH_SKIP) { /* in: dout, src, scalars; out: dskip, grads */
		const float *b = coef(g, sc, m.b_id, 0, m.b_i);
		return ng_mix2_bwd(NULL, C, 0, T_(op->out[0]), C, 0, NULL,
				   coef_grad(e, g, grads, m.b_id, 0, m.b_i), dout, C, NULL, NULL, C,
				   b, T_(op->in[1]), C, N, C, scratch, s);
	}
	/* XMIX: in dout, xs, x0, scalars; out dx (in place), dx0 (+=), grads. VMIX with ve: in
	 * dqkv, qkv, ve, scalars; out dqkv (v in place), dve (+=), grads; without: in dqkv, qkv,
	 * scalars; out dqkv, grads. */
	const int has_w = op->n_in == 4;
	const float *a = coef(g, sc, m.a_id, m.slot, m.a_i);
	const float *b = has_w ? coef(g, sc, m.b_id, m.slot, m.b_i) : NULL;
	ng_bf16 *du = (ng_bf16 *)T_(op->out[0]) + m.off_out;
	ng_bf16 *dw = has_w ? T_(op->out[1]) : NULL;
	return ng_mix2_bwd(du, m.ld_out, 0, dw, C, 1, coef_grad(e, g, grads, m.a_id, m.slot, m.a_i),
			   has_w ? coef_grad(e, g, grads, m.b_id, m.slot, m.b_i) : NULL,
			   dout + m.off_out, m.ld_out, a, (const ng_bf16 *)T_(op->in[1]) + m.off_u,
			   m.ld_u, b, has_w ? T_(op->in[2]) : NULL, C, N, C, scratch, s);
}

/* The speedrun's attention: the plan of the band this variant gives its kind (W blocks long,
 * max(1, W / 2) short: graph/exec.h), the bounds and window of its kind (row 1 of bounds and
 * windows[1] for the short window). */
static enum ng_status run_attention(struct ng_exec *e, const struct ng_graph *g,
				    const struct ng_op *op, void *scratch, cudaStream_t s)
{
	int W = e->spr_variant + 1, band = op->index ? W : (W / 2 > 1 ? W / 2 : 1);
	const struct ng_attention *att = &e->att_band[band - 1];
	const size_t BT = (size_t)g->B * g->T;
	int nb = op->kind == NG_OP_ATTENTION_FWD ? 1 : 4; /* bounds' position */
	const int32_t *lo = (const int32_t *)T_(op->in[nb]) + (op->index ? 0 : BT);
	const int32_t *win = (const int32_t *)T_(op->in[nb + 1]) + (op->index ? 0 : 1);
	if (op->kind == NG_OP_ATTENTION_FWD)
		return ng_attention_fwd_masked(att, T_(op->out[0]), T_(op->out[1]), T_(op->in[0]), lo,
					       win, scratch, s);
	return ng_attention_bwd_masked(att, T_(op->out[0]), T_(op->in[0]), T_(op->in[1]),
				       T_(op->in[2]), T_(op->in[3]), lo, win, scratch, s);
}

enum ng_status ng_exec_run_spr_op_(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, void *scratch, cudaStream_t s)
{
	const struct ng_gpt_config *c = &g->cfg;
	const int B = g->B, T = g->T, N = B * T, C = c->C;
	const struct ng_param_spec *p = g->lay.p;
	switch (op->kind) {
	case NG_OP_SCALARS: {
		size_t at = p[NG_P_XLAMBDA].offset;
		size_t n = p[NG_P_SKIPW].offset + p[NG_P_SKIPW].numel - at;
		return ng_split_join_f32(T_(op->out[0]), (const ng_bf16 *)T_(op->in[0]) + at,
					 (const uint16_t *)T_(op->in[1]) + at, n, 1, s);
	}
	case NG_OP_ATTN_BOUNDS: {
		int32_t *lo = T_(op->out[0]), *win = T_(op->out[1]);
		const int32_t *given = op->n_in > 2 ? T_(op->in[2]) : NULL; /* eval graphs */
		enum ng_status st = ng_spr_windows(win, T_(op->in[1]), e->cfg.sched.total,
						   NG_SPR_WINDOW_BLOCK, given, s);
		if (!st)
			st = ng_attention_lower_bound(lo, T_(op->in[0]), win,
						      e->att_band[NG_EXEC_SPR_BANDS - 1].max_window,
						      NG_SPR_WINDOW_BLOCK, B, T, c->V - 1, s);
		if (!st)
			st = ng_attention_lower_bound(lo + (size_t)N, T_(op->in[0]), win + 1,
						      e->att_band[NG_EXEC_SPR_BANDS / 2 - 1].max_window,
						      NG_SPR_WINDOW_BLOCK, B, T, c->V - 1, s);
		return st;
	}
	case NG_OP_EMBED_FWD: {
		const ng_bf16 *table = (const ng_bf16 *)T_(op->in[1]) + p[op->param[0]].offset +
				       (size_t)op->index * c->Vp * C;
		return ng_embed_fwd(T_(op->out[0]), table, T_(op->in[0]), N, C, s);
	}
	case NG_OP_EMBED_BWD: { /* the tokens sorted early by ENCODER_SORT, on side_stream */
		if (NG_CUDA_CHECK(cudaStreamWaitEvent(s, e->side_join, 0)))
			return NG_ERR_RUNTIME;
		float *dtable = (float *)T_(op->out[0]) + p[op->param[0]].offset +
				(size_t)op->index * c->Vp * C;
		return ng_encoder_bwd_sorted(dtable, NULL, T_(op->in[0]), T_(op->in[1]), B, T, C,
					     c->Vp, scratch, g->tensors[op->scratch].bytes, s);
	}
	case NG_OP_RMSNORM_FWD:
		return ng_rmsnorm_fwd(T_(op->out[0]), T_(op->out[1]), T_(op->in[0]), N, C,
				      (float)NG_SPR_RMS_EPS, s);
	case NG_OP_RMSNORM_BWD:
		return ng_rmsnorm_bwd(T_(op->out[0]), T_(op->in[0]), T_(op->in[1]), T_(op->in[2]), N,
				      C, !op->overwrite, s);
	case NG_OP_QK_ROTARY_FWD:
		return ng_qk_norm_rotary_fwd(T_(op->out[0]), T_(op->out[1]), T_(op->in[0]), N, T,
					     c->H, C / c->H, (float)NG_SPR_RMS_EPS, s);
	case NG_OP_QK_ROTARY_BWD:
		return ng_qk_norm_rotary_bwd(T_(op->out[0]), T_(op->in[0]), T_(op->in[1]), N, T,
					     c->H, C / c->H, s);
	case NG_OP_MIX_FWD:
		return run_mix_fwd(e, g, op, s);
	case NG_OP_MIX_BWD:
		return run_mix_bwd(e, g, op, scratch, s);
	case NG_OP_ADD: /* dst = 1 * dst + 1 * src */
		return ng_mix2_fwd(T_(op->out[0]), C, NULL, T_(op->in[0]), C, one(g, T_(op->in[2])),
				   T_(op->in[1]), C, N, C, s);
	case NG_OP_RELU2_FWD:
		return ng_relu2_fwd(T_(op->out[0]), T_(op->in[0]), (size_t)N * 4 * C, s);
	case NG_OP_RELU2_BWD:
		if (op->relu2) /* from the fused forward's output */
			return ng_relu2_bwd_from_out(T_(op->out[0]), T_(op->in[0]), T_(op->in[1]),
						     (size_t)N * 4 * C, s);
		return ng_relu2_bwd(T_(op->out[0]), T_(op->in[0]), T_(op->in[1]), (size_t)N * 4 * C,
				    s);
	case NG_OP_SOFTCAP_CE: {
		const int32_t *tg = (const int32_t *)T_(op->in[1]) + op->row_start;
		float *losses = (float *)T_(op->out[op->no_grad ? 0 : 1]) + op->row_start;
		float div = (float)(NG_SPR_SOFTCAP_DIV * sqrt((double)C));
		if (op->no_grad)
			return ng_softcap_crossentropy_fwd(losses, T_(op->in[0]), tg, op->row_count,
							   c->Vp, (float)NG_SPR_SOFTCAP, div, s);
		/* the gradient of the sum over the step's tokens, as the reference's loss; fp8: in
		 * E5M2 into g8, its descale after the chunk's bytes (graph/step.h "FP8") */
		if (op->fp8) {
			uint8_t *g8 = T_(op->out[0]);
			return ng_softcap_crossentropy_e5m2(
				losses, T_(op->in[0]), g8, (float *)(g8 + (size_t)op->row_count * c->Vp),
				tg, op->row_count, c->Vp, (float)NG_SPR_SOFTCAP, div, 1.0f,
				(float)NG_SPR_HEAD_GSCALE, s);
		}
		return ng_softcap_crossentropy(losses, T_(op->in[0]), tg, op->row_count, c->Vp,
					       (float)NG_SPR_SOFTCAP, div, 1.0f, s);
	}
	case NG_OP_ATTENTION_FWD: case NG_OP_ATTENTION_BWD:
		return run_attention(e, g, op, scratch, s);
	default:
		return ng_fail(NG_ERR_RUNTIME, "op %s (%s) has no GPU implementation", op->name,
			       ng_op_kind_name(op->kind));
	}
}
