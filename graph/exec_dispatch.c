/*
 * graph/exec_dispatch.c — from an op of the step IR (graph/ir.h) to the kernel launches that
 * compute it, on the executor's stream (see exec.h). ng_exec_run_op_ is the only place that does
 * this; the same function runs the nodes eagerly (--no-graph, the warm-up, the profile) and
 * inside stream capture, so graph and eager execution cannot drift apart. Its helpers are split
 * by op family; the fp8 forms of LayerNorm and the matmuls are graph/step.h's "FP8".
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "graph/exec_internal.h"
#include "graph/optim_muon.h"
#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/encoder.h"
#include "kernels/fp8.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/optim.h"

/* Device address of tensor t of graph g. */
void *ng_exec_tensor_(const struct ng_exec *e, const struct ng_graph *g, int t)
{
	return e->arena + g->tensors[t].offset;
}

/* Device address of parameter `id` (layer `layer`) inside the flat buffer tensor `base`. */
static void *pp(const struct ng_exec *e, const struct ng_graph *g, int base, int id, int layer)
{
	const struct ng_param_spec *p = &g->lay.p[id];
	size_t el = ng_dtype_size(g->tensors[base].dtype);
	if (g->cfg.arch == NG_ARCH_SPEEDRUN && (id == NG_P_QKVW || id == NG_P_ATTPROJW))
		layer = ng_spr_attn_slot(&g->cfg, layer); /* the block without attention has none */
	size_t off = p->offset + (p->per_layer && layer > 0 ? (size_t)layer * (p->numel / p->shape[0])
							    : 0);
	return (char *)ng_exec_tensor_(e, g, base) + off * el;
}


/* The weight-scale slot of an fp8 matmul: its weight's segment in the kind's block, which for
 * the speedrun model's attention weights skips the block without attention (see pp). */
static int fp8_wslot(const struct ng_graph *g, const struct ng_op *op)
{
	int layer = op->layer;
	if (g->cfg.arch == NG_ARCH_SPEEDRUN &&
	    (op->which == NG_OP_WHICH_QKV || op->which == NG_OP_WHICH_ATTPROJ))
		layer = ng_spr_attn_slot(&g->cfg, layer);
	return ng_fp8_slot(g->cfg.L, op->which, layer);
}

/* A LayerNorm that writes the E4M3 input of the next fp8 matmul (graph/step.h "FP8"): that
 * matmul's slot (LN1 -> qkv, LN2 -> fc, LNF -> head); fp8_state is its last input. */
static int ln_fp8_slot(const struct ng_graph *g, const struct ng_op *op)
{
	enum ng_op_which w = op->which == NG_OP_WHICH_LN1 ? NG_OP_WHICH_QKV
			     : op->which == NG_OP_WHICH_LN2 ? NG_OP_WHICH_FC : NG_OP_WHICH_HEAD;
	return ng_fp8_slot(g->cfg.L, w, op->layer);
}

/* That slot's scale or maximum (NG_FP8_ACT_SCALE / NG_FP8_ACT_AMAX). */
static float *ln_fp8_field(const struct ng_exec *e, const struct ng_graph *g,
			   const struct ng_op *op, enum ng_fp8_field f)
{
	float *st = ng_exec_tensor_(e, g, op->in[op->n_in - 1]);
	size_t slot = (size_t)ln_fp8_slot(g, op);
	return st + ng_fp8_field_at(g->cfg.L, f) +
	       (f == NG_FP8_ACT_AMAX ? (size_t)NG_FP8_AMAX_FLOATS * slot : slot);
}

/* --fp8 (graph/step.h "FP8"): roll the activation (E4M3) and gradient (E5M2) scales; cast every
 * fp8 weight matrix with its own current scale, and W^T for the fp8 dinp kinds. At most 18
 * launches whatever the depth: each parameter block's layers are consecutive segments (the
 * speedrun model's attention blocks have one fewer than L: fp8_wslot). */
static enum ng_status run_fp8_prep(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, cudaStream_t s)
{
	const int L = g->cfg.L, S = ng_fp8_slots(L), S4 = ng_fp8_fwd_slots(L);
	float *f = ng_exec_tensor_(e, g, op->in[1]);
	float *w_amax = f + ng_fp8_field_at(L, NG_FP8_W_AMAX);
	float *w_scale = f + ng_fp8_field_at(L, NG_FP8_W_SCALE);
	/* the head: GPT-2's is tied to wte, the speedrun model's is its own */
	const int ids[5] = { NG_P_QKVW, NG_P_ATTPROJW, NG_P_FCW, NG_P_FCPROJW,
			     g->cfg.arch == NG_ARCH_SPEEDRUN ? NG_P_HEADW : NG_P_WTE };
	_Static_assert(NG_FP8_ACT_AMAX_SUB == NG_FP8_AMAX_SUB &&
			       NG_FP8_ACT_AMAX_STRIDE == NG_FP8_AMAX_STRIDE,
		       "graph/step.h and kernels/fp8.h");
	/* with several ranks the maxima arrive here reduced over them (ng_exec_dp_fp8_maxima_) */
	enum ng_status st = NG_OK;
	for (int r = 0; r < 2 && !st; r++) { /* slots [0, S4) E4M3, [S4, S) E5M2 */
		size_t at = r ? (size_t)S4 : 0;
		st = ng_fp8_roll_scales_fmt(r ? NG_FP8_E5M2 : NG_FP8_E4M3,
					    f + ng_fp8_field_at(L, NG_FP8_HIST) + at * NG_FP8_HISTORY,
					    f + ng_fp8_field_at(L, NG_FP8_ACT_AMAX) +
						    at * NG_FP8_AMAX_FLOATS,
					    NG_FP8_AMAX_SUB, NG_FP8_AMAX_STRIDE,
					    f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + at,
					    f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) +
						    at * NG_FP8_DESCALE_STRIDE,
					    r ? S - S4 : S4, NG_FP8_HISTORY, NG_FP8_ACT_MARGIN, s);
	}
	if (!st)
		st = NG_CUDA_CHECK(cudaMemsetAsync(w_amax, 0, (size_t)S4 * sizeof(float), s));
	/* NG_FP8_* bit i: forward kind i; bit i + NG_FP8_DINP_SHIFT: its dinp */
	int wanted = (g->fp8 | g->fp8 >> NG_FP8_DINP_SHIFT) & NG_FP8_ALL;
	for (int i = 0; i < 5 && !st; i++) {
		const struct ng_param_spec *p = &g->lay.p[ids[i]];
		int nseg = i < 4 ? (int)p->shape[0] : 1;
		if (!(wanted & (1 << i)))
			continue;
		st = ng_fp8_amax_seg(w_amax + i * L, pp(e, g, op->in[0], ids[i], 0), p->numel / nseg,
				     nseg, s);
	}
	if (!st)
		st = ng_fp8_scale_seg(w_scale, f + ng_fp8_field_at(L, NG_FP8_W_DESCALE), w_amax, S4,
				      0, s);
	for (int i = 0; i < 5 && !st && !g->recompute_fp8; i++) { /* else each matmul casts */
		const struct ng_param_spec *p = &g->lay.p[ids[i]];
		int nseg = i < 4 ? (int)p->shape[0] : 1, fwd = g->fp8 & (1 << i);
		uint8_t *w8 = fwd ? pp(e, g, g->t_params_fp8, ids[i], 0) : NULL;
		int wt = i < 4 ? g->fp8 & (1 << (i + NG_FP8_DINP_SHIFT)) : g->fp8 & NG_FP8_HEAD_BWD;
		if (wt) /* W and W^T, one read */
			st = ng_fp8_cast_e4m3_wt_seg(w8,
						     (uint8_t *)ng_exec_tensor_(e, g, g->t_params_fp8t) +
							     ng_fp8t_at(&g->lay, g->fp8, i),
						     pp(e, g, op->in[0], ids[i], 0), w_scale + i * L,
						     (int)p->shape[i < 4 ? 1 : 0],
						     (int)p->shape[i < 4 ? 2 : 1], nseg, s);
		else if (fwd)
			st = ng_fp8_cast_e4m3_seg(w8, pp(e, g, op->in[0], ids[i], 0), w_scale + i * L,
						  NULL, p->numel / nseg, nseg, s);
	}
	return st;
}

/* An fp8 forward matmul: the input rows to E4M3 at the front of the scratch (recording their
 * maximum in the slot), then the matmul with the E4M3 weights and both descales. */
static enum ng_status run_matmul_fwd_fp8(struct ng_exec *e, const struct ng_graph *g,
					 const struct ng_op *op, const struct ng_matmul *mm,
					 const ng_bf16 *inp, void *scratch, cudaStream_t s)
{
	const int L = g->cfg.L, slot = ng_fp8_slot(L, op->which, op->layer),
		  wslot = fp8_wslot(g, op);
	const int n_in = op->n_in - op->residual; /* the residual comes last */
	if (slot < 0 || n_in < 4)
		return ng_fail(NG_ERR_RUNTIME, "op %s: not an fp8 matmul of the step", op->name);
	size_t rows = (size_t)op->row_count, ic = (size_t)mm->spec.IC, front = 0;
	float *f = ng_exec_tensor_(e, g, op->in[3]);
	uint8_t *in8;
	if (n_in >= 5) { /* the LayerNorm before wrote the E4M3 copy */
		in8 = (uint8_t *)ng_exec_tensor_(e, g, op->in[4]) + (size_t)op->row_start * ic;
	} else {
		in8 = scratch;
		front = ng_fp8_input_bytes(rows, ic);
		enum ng_status st = ng_fp8_cast_e4m3_seg(
			in8, inp, f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + slot,
			f + ng_fp8_field_at(L, NG_FP8_ACT_AMAX) + (size_t)NG_FP8_AMAX_FLOATS * slot,
			rows * ic, 1, s);
		if (st)
			return st;
	}
	int pb = op->in[1];
	void *w8 = pp(e, g, op->in[2], op->param[0], op->layer);
	if (g->recompute_fp8) { /* in[2] is params_bf16: this layer's W to E4M3 after the input */
		const void *w = w8;
		w8 = (char *)scratch + front;
		front += ng_fp8_weight_bytes(&g->cfg, op->which);
		enum ng_status st = ng_fp8_cast_e4m3_seg(
			w8, w, f + ng_fp8_field_at(L, NG_FP8_W_SCALE) + wslot, NULL,
			(size_t)mm->spec.OC * ic, 1, s);
		if (st)
			return st;
	}
	const float *ad = f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) + NG_FP8_DESCALE_STRIDE * slot;
	const float *wd = f + ng_fp8_field_at(L, NG_FP8_W_DESCALE) + NG_FP8_DESCALE_STRIDE * wslot;
	const void *bias = op->param[1] >= 0 ? pp(e, g, pb, op->param[1], op->layer) : NULL;
	if (op->residual)
		return ng_matmul_run_residual(mm, ng_exec_tensor_(e, g, op->out[0]), in8, w8, bias,
					      ng_exec_tensor_(e, g, op->in[op->n_in - 1]), ad, wd,
					      (char *)scratch + front, s);
	return ng_matmul_run_fp8(mm, ng_exec_tensor_(e, g, op->out[0]), in8, w8, bias,
				 op->gelu ? ng_exec_tensor_(e, g, op->out[1]) : NULL, ad, wd,
				 (char *)scratch + front, s);
}

/* An fp8 dinp matmul: dout to E5M2 at the front of the scratch (recording its maximum in the
 * slot), then dinp = dout8 @ (W^T)8^T with both descales (the weight's is the forward slot's:
 * FP8_PREP casts W and W^T with one scale). */
static enum ng_status run_matmul_dinp_fp8(struct ng_exec *e, const struct ng_graph *g,
					  const struct ng_op *op, const struct ng_matmul *mm,
					  ng_bf16 *dinp, void *scratch, cudaStream_t s)
{
	const int L = g->cfg.L, slot = ng_fp8_dinp_slot(L, op->which, op->layer);
	if (slot < 0 || op->n_in < 4 || (g->t_params_fp8t < 0 && !g->recompute_fp8))
		return ng_fail(NG_ERR_RUNTIME, "op %s: not an fp8 dinp matmul of the step", op->name);
	const int wslot = fp8_wslot(g, op), k = op->which - NG_OP_WHICH_QKV;
	size_t rows = (size_t)op->row_count, oc = (size_t)mm->spec.OC, ic = (size_t)mm->spec.IC;
	float *f = ng_exec_tensor_(e, g, op->in[op->n_in - 1]);
	/* dout in E5M2: the fp8 dW's cast wrote it (a u8 input), or cast here */
	const int cast = g->tensors[op->in[0]].dtype != NG_DTYPE_U8;
	uint8_t *d8 = cast ? (uint8_t *)scratch : (uint8_t *)ng_exec_tensor_(e, g, op->in[0]);
	enum ng_status st = NG_OK;
	if (cast)
		st = ng_fp8_cast_seg(NG_FP8_E5M2, d8, ng_exec_tensor_(e, g, op->in[0]),
				     f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + slot,
				     f + ng_fp8_field_at(L, NG_FP8_ACT_AMAX) +
					     (size_t)NG_FP8_AMAX_FLOATS * slot,
				     rows * oc, 1, s);
	if (st)
		return st;
	size_t front = cast ? ng_fp8_input_bytes(rows, oc) : 0;
	uint8_t *wt;
	if (g->recompute_fp8) { /* in[n-2] is params_bf16: this layer's W^T to E4M3 after dout8 */
		wt = (uint8_t *)scratch + front;
		front += ng_fp8_weight_bytes(&g->cfg, op->which);
		st = ng_fp8_cast_e4m3_wt_seg(NULL, wt,
					     pp(e, g, op->in[op->n_in - 2], op->param[0], op->layer),
					     f + ng_fp8_field_at(L, NG_FP8_W_SCALE) + wslot, (int)oc,
					     (int)ic, 1, s);
		if (st)
			return st;
	} else {
		wt = (uint8_t *)ng_exec_tensor_(e, g, op->in[op->n_in - 2]) +
		     ng_fp8t_at(&g->lay, g->fp8, k) + (size_t)(wslot - k * L) * ic * oc;
	}
	return ng_matmul_run_fp8(mm, dinp, d8, wt, NULL,
				 op->gelu ? ng_exec_tensor_(e, g, op->in[2]) : NULL,
				 f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) + NG_FP8_DESCALE_STRIDE * slot,
				 f + ng_fp8_field_at(L, NG_FP8_W_DESCALE) + NG_FP8_DESCALE_STRIDE * wslot,
				 (char *)scratch + front, s);
}

/* The speedrun head's E5M2 backward (graph/step.h "FP8"): in[0] is g8, the loss's E5M2
 * gradient of this chunk with its descale after the chunk's bytes. */
static const float *head_g8_descale(const struct ng_exec *e, const struct ng_graph *g,
				    const struct ng_op *op)
{
	return (const float *)((const uint8_t *)ng_exec_tensor_(e, g, op->in[0]) +
			       (size_t)op->row_count * g->cfg.Vp);
}

/* dnf rows = g8 @ W8 (W^T in E4M3, the forward's weight scale), bf16. */
static enum ng_status run_head_dinp_fp8(struct ng_exec *e, const struct ng_graph *g,
					const struct ng_op *op, const struct ng_matmul *mm,
					ng_bf16 *dinp, void *scratch, cudaStream_t s)
{
	const int L = g->cfg.L, wslot = ng_fp8_slot(L, NG_OP_WHICH_HEAD, -1);
	float *f = ng_exec_tensor_(e, g, op->in[2]);
	size_t front = 0;
	uint8_t *wt;
	if (g->recompute_fp8) { /* in[1] is params_bf16: W^T to E4M3 in the scratch */
		wt = scratch;
		front = ng_fp8_weight_bytes(&g->cfg, NG_OP_WHICH_HEAD);
		enum ng_status st = ng_fp8_cast_e4m3_wt_seg(
			NULL, wt, pp(e, g, op->in[1], NG_P_HEADW, -1),
			f + ng_fp8_field_at(L, NG_FP8_W_SCALE) + wslot, g->cfg.Vp, g->cfg.C, 1, s);
		if (st)
			return st;
	} else {
		wt = (uint8_t *)ng_exec_tensor_(e, g, op->in[1]) + ng_fp8t_at(&g->lay, g->fp8, 4);
	}
	return ng_matmul_run_fp8(mm, dinp, ng_exec_tensor_(e, g, op->in[0]), wt, NULL, NULL,
				 head_g8_descale(e, g, op),
				 f + ng_fp8_field_at(L, NG_FP8_W_DESCALE) + NG_FP8_DESCALE_STRIDE * wslot,
				 (char *)scratch + front, s);
}

/* dW (+)= g8^T @ nf8 over the chunk's rows: g8 (rows, Vp) and nf (rows, C, in E4M3 with the
 * forward's input scale) transposed into the scratch, then the fp32 FP8 GEMM. */
static enum ng_status run_head_dw_fp8(struct ng_exec *e, const struct ng_graph *g,
				      const struct ng_op *op, const struct ng_matmul *mm,
				      void *scratch, cudaStream_t s)
{
	const int L = g->cfg.L, slot = ng_fp8_slot(L, NG_OP_WHICH_HEAD, -1);
	const int rows = op->row_count, Vp = g->cfg.Vp, C = g->cfg.C;
	float *f = ng_exec_tensor_(e, g, op->in[2]);
	uint8_t *g8t = scratch, *x8t = g8t + ng_fp8_input_bytes((size_t)rows, (size_t)Vp);
	enum ng_status st = ng_transpose_u8(g8t, ng_exec_tensor_(e, g, op->in[0]), rows, Vp, s);
	if (!st)
		st = ng_fp8_cast_e4m3_wt_seg(NULL, x8t,
					     (const ng_bf16 *)ng_exec_tensor_(e, g, op->in[1]) +
						     (size_t)op->row_start * C,
					     f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + slot, rows, C,
					     1, s);
	if (st)
		return st;
	return ng_matmul_run_fp8(mm, pp(e, g, op->out[0], NG_P_HEADW, -1), g8t, x8t, NULL, NULL,
				 head_g8_descale(e, g, op),
				 f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) + NG_FP8_DESCALE_STRIDE * slot,
				 (char *)scratch + ng_fp8_head_dw_bytes((size_t)rows, (size_t)Vp,
									(size_t)C),
				 s);
}

/* A layer's fp8 weight gradient (graph/step.h "FP8", NG_FP8_DW_*): one read of dout casts it to
 * E5M2 with the dinp slot's delayed scale, transposed into the scratch (and row-major into
 * out[1] for the dinp when given), recording its maximum and, with a bias, its column sums;
 * inp^T in E4M3 with the forward's input scale after it; then dW (+)= dout^T x inp in the FP8
 * GEMM, and the sums into the bias gradient. */
static enum ng_status run_matmul_dw_fp8(struct ng_exec *e, const struct ng_graph *g,
					const struct ng_op *op, const struct ng_matmul *mm,
					void *scratch, cudaStream_t s)
{
	const int L = g->cfg.L, dslot = ng_fp8_dinp_slot(L, op->which, op->layer),
		  xslot = ng_fp8_slot(L, op->which, op->layer);
	if (dslot < 0 || xslot < 0 || op->n_in < 3)
		return ng_fail(NG_ERR_RUNTIME, "op %s: not an fp8 dW matmul of a layer", op->name);
	_Static_assert(NG_FP8_DW_BAND == NG_FP8_COLSUM_BAND, "graph/step.h and kernels/fp8.h");
	const int rows = op->row_count, ic = mm->spec.IC, oc = mm->spec.OC,
		  bias = op->param[1] >= 0;
	float *f = ng_exec_tensor_(e, g, op->in[2]);
	uint8_t *dt = scratch, *xt = dt + ng_fp8_input_bytes((size_t)rows, (size_t)oc);
	float *part = bias ? (float *)(xt + ng_fp8_input_bytes((size_t)rows, (size_t)ic)) : NULL;
	void *ws = (char *)scratch + ng_fp8_dw_bytes((size_t)rows, (size_t)ic, (size_t)oc, bias);
	enum ng_status st = ng_fp8_cast_wt(
		NG_FP8_E5M2, op->n_out > 1 ? (uint8_t *)ng_exec_tensor_(e, g, op->out[1]) : NULL, dt,
		part, f + ng_fp8_field_at(L, NG_FP8_ACT_AMAX) + (size_t)NG_FP8_AMAX_FLOATS * dslot,
		ng_exec_tensor_(e, g, op->in[0]), f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + dslot,
		rows, oc, s);
	if (!st)
		st = ng_fp8_cast_e4m3_wt_seg(NULL, xt, ng_exec_tensor_(e, g, op->in[1]),
					     f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + xslot, rows, ic,
					     1, s);
	if (!st)
		st = ng_matmul_run_fp8(
			mm, pp(e, g, op->out[0], op->param[0], op->layer), dt, xt, NULL, NULL,
			f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) + NG_FP8_DESCALE_STRIDE * dslot,
			f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) + NG_FP8_DESCALE_STRIDE * xslot, ws, s);
	if (!st && bias)
		st = ng_bias_grad_reduce(pp(e, g, op->out[0], op->param[1], op->layer), part,
					 ng_fp8_colsum_rows(rows), oc, !op->overwrite, s);
	return st;
}

/* The error for an op kind that no family implements: ng_exec_run_op_'s default, and each
 * family helper's for a kind that is not its own. */
static enum ng_status no_gpu_kernel(const struct ng_op *op)
{
	return ng_fail(NG_ERR_RUNTIME, "op %s (%s) has no GPU implementation", op->name,
		       ng_op_kind_name(op->kind));
}

/* The step's input: the token copy (with the stop flag, and the event the host waits on before
 * refilling the pinned buffer), the split into inputs and targets, and zeroing. */
static enum ng_status run_input_op(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, cudaStream_t s)
{
	const int B = g->B, T = g->T;
	switch (op->kind) {
	case NG_OP_TOKENS_H2D: {
		const struct ng_tensor *t = &g->tensors[op->out[0]];
		const uint16_t *src = g->kind == NG_GRAPH_EVAL ? e->h_eval_tokens : e->h_tokens;
		if (NG_CUDA_CHECK(cudaMemcpyAsync(ng_exec_tensor_(e, g, op->out[0]), src, t->bytes,
						  cudaMemcpyHostToDevice, s)))
			return NG_ERR_RUNTIME;
		if (g->kind != NG_GRAPH_TRAIN)
			return NG_OK;
		struct ng_step_state *sst = ng_exec_tensor_(e, g, g->t_step_state);
		if (NG_CUDA_CHECK(cudaMemcpyAsync(&sst->stop, e->h_stop, sizeof(float),
						  cudaMemcpyHostToDevice, s)))
			return NG_ERR_RUNTIME;
		/* inside capture the record must be an external event node, so that the host can
		 * wait on it after each replay; outside capture it is a plain record */
		enum cudaStreamCaptureStatus cs;
		if (NG_CUDA_CHECK(cudaStreamIsCapturing(s, &cs)))
			return NG_ERR_RUNTIME;
		unsigned flags = cs == cudaStreamCaptureStatusActive ? cudaEventRecordExternal
								      : cudaEventRecordDefault;
		if (NG_CUDA_CHECK(cudaEventRecordWithFlags(e->h2d_done, s, flags)))
			return NG_ERR_RUNTIME;
		return NG_OK;
	}
	case NG_OP_TOKENS_SPLIT: {
		const uint16_t *w = (const uint16_t *)ng_exec_tensor_(e, g, op->in[0]) +
				    (size_t)op->micro * B * (T + 1);
		return ng_tokens_split(ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->out[1]), w, B, T, s);
	}
	case NG_OP_ZERO:
		if (op->param[0] >= 0) /* one parameter's range of a flat buffer, all layers */
			return NG_CUDA_CHECK(cudaMemsetAsync(
				pp(e, g, op->out[0], op->param[0], -1), 0,
				g->lay.p[op->param[0]].numel * ng_dtype_size(g->tensors[op->out[0]].dtype),
				s));
		return NG_CUDA_CHECK(cudaMemsetAsync(ng_exec_tensor_(e, g, op->out[0]), 0,
						     g->tensors[op->out[0]].bytes, s));
	default:
		return no_gpu_kernel(op);
	}
}

/* The embeddings: the forward lookup, and the backward's sort of the tokens (on side_stream,
 * beside the forward) and its sorted accumulation. */
static enum ng_status run_encoder_op(struct ng_exec *e, const struct ng_graph *g,
				     const struct ng_op *op, void *scratch, cudaStream_t s)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	const int B = g->B, T = g->T, C = m->C;
	switch (op->kind) {
	case NG_OP_ENCODER_FWD:
		return ng_encoder_fwd(ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->in[0]),
				      pp(e, g, op->in[1], NG_P_WTE, -1),
				      pp(e, g, op->in[1], NG_P_WPE, -1), B, T, C, s);
	case NG_OP_ENCODER_SORT: { /* on side_stream, forked here, joined by ENCODER_BWD */
		cudaStream_t side = e->side_stream;
		if (NG_CUDA_CHECK(cudaEventRecord(e->side_fork, s)) ||
		    NG_CUDA_CHECK(cudaStreamWaitEvent(side, e->side_fork, 0)))
			return NG_ERR_RUNTIME;
		enum ng_status st = ng_encoder_bwd_sort(ng_exec_tensor_(e, g, op->out[0]),
							g->tensors[op->out[0]].bytes,
							ng_exec_tensor_(e, g, op->in[0]), B, T, m->Vp, side);
		if (st)
			return st;
		return NG_CUDA_CHECK(cudaEventRecord(e->side_join, side));
	}
	case NG_OP_ENCODER_BWD: {
		int gb = op->out[0];
		if (NG_CUDA_CHECK(cudaStreamWaitEvent(s, e->side_join, 0)))
			return NG_ERR_RUNTIME;
		return ng_encoder_bwd_sorted(pp(e, g, gb, NG_P_WTE, -1), pp(e, g, gb, NG_P_WPE, -1),
					     ng_exec_tensor_(e, g, op->in[0]),
					     ng_exec_tensor_(e, g, op->in[1]), B, T, C, m->Vp, scratch,
					     g->tensors[op->scratch].bytes, s);
	}
	default:
		return no_gpu_kernel(op);
	}
}

/* LayerNorm forward (with the E4M3 copy of its output for an fp8 matmul) and backward. */
static enum ng_status run_layernorm_op(struct ng_exec *e, const struct ng_graph *g,
				       const struct ng_op *op, void *scratch, cudaStream_t s)
{
	const int C = e->cfg.model.C, N = g->B * g->T;
	switch (op->kind) {
	case NG_OP_LAYERNORM_FWD: {
		int pb = op->in[1];
		if (op->fp8)
			return ng_layernorm_fwd_fp8(ng_exec_tensor_(e, g, op->out[0]),
						    ng_exec_tensor_(e, g, op->out[3]),
						    ln_fp8_field(e, g, op, NG_FP8_ACT_SCALE), ln_fp8_field(e, g, op, NG_FP8_ACT_AMAX),
						    ng_exec_tensor_(e, g, op->out[1]),
						    ng_exec_tensor_(e, g, op->out[2]),
						    ng_exec_tensor_(e, g, op->in[0]),
						    pp(e, g, pb, op->param[0], op->layer),
						    pp(e, g, pb, op->param[1], op->layer), N, C, s);
		return ng_layernorm_fwd(ng_exec_tensor_(e, g, op->out[0]),
					op->recompute ? NULL : ng_exec_tensor_(e, g, op->out[1]),
					op->recompute ? NULL : ng_exec_tensor_(e, g, op->out[2]), ng_exec_tensor_(e, g, op->in[0]),
					pp(e, g, pb, op->param[0], op->layer),
					pp(e, g, pb, op->param[1], op->layer), N, C, s);
	}
	case NG_OP_LAYERNORM_BWD: {
		int pb = op->in[2], gb = op->out[1];
		return ng_layernorm_bwd(ng_exec_tensor_(e, g, op->out[0]), pp(e, g, gb, op->param[0], op->layer),
					pp(e, g, gb, op->param[1], op->layer), ng_exec_tensor_(e, g, op->in[0]),
					ng_exec_tensor_(e, g, op->in[1]), pp(e, g, pb, op->param[0], op->layer),
					ng_exec_tensor_(e, g, op->in[3]), ng_exec_tensor_(e, g, op->in[4]), N, C, scratch, s);
	}
	default:
		return no_gpu_kernel(op);
	}
}

/* The linear layers: the three matmul kinds (bf16, fp8, our own DGELU), the weights' fp8
 * casts and scales before the step's first use, and the W^T our own DGELU reads. */
static enum ng_status run_matmul_op(struct ng_exec *e, const struct ng_graph *g,
				    const struct ng_op *op, int plan, void *scratch, cudaStream_t s)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	switch (op->kind) {
	case NG_OP_MATMUL_FWD: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		int ic = mm->spec.IC;
		const ng_bf16 *inp = (const ng_bf16 *)ng_exec_tensor_(e, g, op->in[0]) + (size_t)op->row_start * ic;
		int pb = op->in[1];
		if (op->fp8)
			return run_matmul_fwd_fp8(e, g, op, mm, inp, scratch, s);
		if (op->residual)
			return ng_matmul_run_residual(
				mm, ng_exec_tensor_(e, g, op->out[0]), inp,
				pp(e, g, pb, op->param[0], op->layer),
				op->param[1] >= 0 ? pp(e, g, pb, op->param[1], op->layer) : NULL,
				ng_exec_tensor_(e, g, op->in[op->n_in - 1]), NULL, NULL, scratch, s);
		return ng_matmul_run(mm, ng_exec_tensor_(e, g, op->out[0]), inp,
				     pp(e, g, pb, op->param[0], op->layer),
				     op->param[1] >= 0 ? pp(e, g, pb, op->param[1], op->layer) : NULL,
				     op->gelu ? ng_exec_tensor_(e, g, op->out[1]) : NULL, NULL, scratch, s);
	}
	case NG_OP_MATMUL_DINP: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		ng_bf16 *dinp = (ng_bf16 *)ng_exec_tensor_(e, g, op->out[0]) + (size_t)op->row_start * mm->spec.IC;
		if (op->fp8 && op->which == NG_OP_WHICH_HEAD)
			return run_head_dinp_fp8(e, g, op, mm, dinp, scratch, s);
		if (op->fp8)
			return run_matmul_dinp_fp8(e, g, op, mm, dinp, scratch, s);
		if (op->own) /* this layer's W^T of TRANSPOSE_W's; the fc bias gradient */
			return ng_matmul_run_dgelu(mm, dinp, ng_exec_tensor_(e, g, op->in[0]),
						   (ng_bf16 *)ng_exec_tensor_(e, g, op->in[1]) +
							   (size_t)op->layer * mm->spec.IC * mm->spec.OC,
						   ng_exec_tensor_(e, g, op->in[2]),
						   op->n_out > 2 ? ng_exec_tensor_(e, g, op->out[2]) : NULL,
						   pp(e, g, op->out[1], op->param[1], op->layer),
						   !op->overwrite, scratch, s);
		return ng_matmul_run(mm, dinp, ng_exec_tensor_(e, g, op->in[0]),
				     pp(e, g, op->in[1], op->param[0], op->layer), NULL,
				     op->gelu ? ng_exec_tensor_(e, g, op->in[2]) : NULL, NULL, scratch, s);
	}
	case NG_OP_MATMUL_DW: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		if (op->fp8 && op->which == NG_OP_WHICH_HEAD)
			return run_head_dw_fp8(e, g, op, mm, scratch, s);
		if (op->fp8)
			return run_matmul_dw_fp8(e, g, op, mm, scratch, s);
		const ng_bf16 *inp = (const ng_bf16 *)ng_exec_tensor_(e, g, op->in[1]) +
				     (size_t)op->row_start * mm->spec.IC;
		int gb = op->out[0];
		return ng_matmul_run(mm, pp(e, g, gb, op->param[0], op->layer), ng_exec_tensor_(e, g, op->in[0]),
				     inp, NULL, NULL,
				     op->param[1] >= 0 ? pp(e, g, gb, op->param[1], op->layer) : NULL,
				     scratch, s);
	}
	case NG_OP_FP8_PREP:
		return run_fp8_prep(e, g, op, s);
	case NG_OP_TRANSPOSE_W: { /* W (OC, IC) of every layer -> W^T (IC, OC) */
		int ic, oc;
		ng_linear_dims(m, op->which, &ic, &oc);
		return ng_transpose_bf16(ng_exec_tensor_(e, g, op->out[0]),
					 pp(e, g, op->in[0], op->param[0], 0), oc, ic, m->L, s);
	}
	default:
		return no_gpu_kernel(op);
	}
}

/* GELU (where no matmul epilogue computes it) and attention, forward and backward. */
static enum ng_status run_block_op(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, void *scratch, cudaStream_t s)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	switch (op->kind) {
	case NG_OP_GELU_FWD:
		return ng_gelu_fwd(ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->in[0]),
				   g->tensors[op->in[0]].bytes / 2, s);
	case NG_OP_GELU_BWD:
		if (op->param[0] >= 0) /* with the fc bias gradient (and the recomputed GELU) */
			return ng_gelu_bwd_bias(ng_exec_tensor_(e, g, op->out[0]),
						op->n_out > 2 ? ng_exec_tensor_(e, g, op->out[2]) : NULL,
						pp(e, g, op->out[1], op->param[0], op->layer),
						!op->overwrite, ng_exec_tensor_(e, g, op->in[0]),
						ng_exec_tensor_(e, g, op->in[1]), op->row_count,
						4 * m->C, scratch, s);
		return ng_gelu_bwd(ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->in[0]), ng_exec_tensor_(e, g, op->in[1]),
				   g->tensors[op->in[0]].bytes / 2, s);
	case NG_OP_ATTENTION_FWD:
		return ng_attention_fwd(&e->att, ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->out[1]),
					ng_exec_tensor_(e, g, op->in[0]), scratch, s);
	case NG_OP_ATTENTION_BWD:
		return ng_attention_bwd(&e->att, ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->in[0]),
					ng_exec_tensor_(e, g, op->in[1]), ng_exec_tensor_(e, g, op->in[2]), ng_exec_tensor_(e, g, op->in[3]),
					scratch, s);
	default:
		return no_gpu_kernel(op);
	}
}

/* The loss: cross-entropy of the logits (with its gradient in a training step) and the sum of
 * the losses into the step state (or the evaluation's loss). */
static enum ng_status run_loss_op(struct ng_exec *e, const struct ng_graph *g,
				  const struct ng_op *op, void *scratch, cudaStream_t s)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	const int N = g->B * g->T;
	switch (op->kind) {
	case NG_OP_CROSSENTROPY: {
		const int32_t *tg = (const int32_t *)ng_exec_tensor_(e, g, op->in[1]) + op->row_start;
		float *losses = (float *)ng_exec_tensor_(e, g, op->out[op->no_grad ? 0 : 1]) + op->row_start;
		if (op->no_grad)
			return ng_crossentropy_fwd(losses, ng_exec_tensor_(e, g, op->in[0]), tg, op->row_count,
						   m->V, m->Vp, s);
		return ng_crossentropy(losses, ng_exec_tensor_(e, g, op->in[0]), tg, op->row_count, m->V, m->Vp,
				       1.0f / ((float)N * g->K), s);
	}
	case NG_OP_LOSS_ACCUMULATE: {
		float *dst = g->kind == NG_GRAPH_TRAIN
				     ? (float *)((char *)ng_exec_tensor_(e, g, op->out[0]) +
						 offsetof(struct ng_step_state, loss_sum))
				     : (float *)ng_exec_tensor_(e, g, op->out[0]);
		return ng_loss_accumulate(dst, ng_exec_tensor_(e, g, op->in[0]), N, 1.0f / ((float)N * g->K),
					  scratch, s);
	}
	default:
		return no_gpu_kernel(op);
	}
}

/* The update: the gradient norm (all-reduced first with data parallelism), the schedule and
 * clipping, AdamW on every parameter block (or this rank's shard), the metrics record. */
static enum ng_status run_update_op(struct ng_exec *e, const struct ng_graph *g,
				    const struct ng_op *op, void *scratch, cudaStream_t s)
{
	switch (op->kind) {
	case NG_OP_GRAD_NORM: {
		struct ng_step_state *st = ng_exec_tensor_(e, g, op->out[0]);
		if (e->cfg.comm)
			return ng_exec_dp_grad_norm_(e, g, op, scratch, s);
		return ng_grad_norm_squared(&st->grad_norm, ng_exec_tensor_(e, g, op->in[0]), g->lay.total,
					    scratch, s);
	}
	case NG_OP_SCHEDULE: {
		struct ng_step_state *st = ng_exec_tensor_(e, g, op->out[0]);
		return ng_schedule_update(st, &st->grad_norm, e->cfg.sched, e->cfg.clip, s);
	}
	case NG_OP_ADAMW: {
		const struct ng_step_state *st = ng_exec_tensor_(e, g, op->in[1]);
		if (e->cfg.comm && e->cfg.zero1)
			return ng_exec_dp_adamw_shard_(e, g, op, s);
		for (int i = 0; i < NG_P_COUNT; i++) {
			const struct ng_param_spec *p = &g->lay.p[i];
			if (!ng_param_present(p)) /* the other family's */
				continue;
			enum ng_status r = ng_adamw(pp(e, g, op->out[0], i, 0), /* hi, lo */
						    pp(e, g, op->out[1], i, 0),
						    pp(e, g, op->in[0], i, 0),
						    pp(e, g, op->out[2], i, 0),
						    pp(e, g, op->out[3], i, 0), p->numel,
						    p->decay ? e->cfg.wd : 0.0f, e->cfg.beta1,
						    e->cfg.beta2, e->cfg.eps, st, s);
			if (r)
				return r;
		}
		return NG_OK;
	}
	case NG_OP_MUON:
		return ng_optim_muon_run_(e, g, op, scratch, s);
	case NG_OP_STEP_FINISH:
		return ng_step_finish(ng_exec_tensor_(e, g, op->in[0]), e->d_ring, NG_EXEC_RING, s);
	default:
		return no_gpu_kernel(op);
	}
}

/* Enqueue one op on e->stream: the one place that maps an op of the IR to kernel launches,
 * through the helper of its family. */
enum ng_status ng_exec_run_op_(struct ng_exec *e, const struct ng_graph *g, const struct ng_op *op,
			       int plan)
{
	cudaStream_t s = e->stream;
	void *scratch = op->scratch >= 0 ? ng_exec_tensor_(e, g, op->scratch) : NULL;
	ng_check_set_node(op->name);
	if (op->kind >= NG_OP_SCALARS ||
	    (g->cfg.arch == NG_ARCH_SPEEDRUN &&
	     (op->kind == NG_OP_ATTENTION_FWD || op->kind == NG_OP_ATTENTION_BWD)))
		return ng_exec_run_spr_op_(e, g, op, scratch, s);
	switch (op->kind) {
	case NG_OP_TOKENS_H2D: case NG_OP_TOKENS_SPLIT: case NG_OP_ZERO:
		return run_input_op(e, g, op, s);
	case NG_OP_ENCODER_FWD: case NG_OP_ENCODER_SORT: case NG_OP_ENCODER_BWD:
		return run_encoder_op(e, g, op, scratch, s);
	case NG_OP_LAYERNORM_FWD: case NG_OP_LAYERNORM_BWD:
		return run_layernorm_op(e, g, op, scratch, s);
	case NG_OP_MATMUL_FWD: case NG_OP_MATMUL_DINP: case NG_OP_MATMUL_DW:
	case NG_OP_FP8_PREP: case NG_OP_TRANSPOSE_W:
		return run_matmul_op(e, g, op, plan, scratch, s);
	case NG_OP_GELU_FWD: case NG_OP_GELU_BWD: case NG_OP_ATTENTION_FWD:
	case NG_OP_ATTENTION_BWD:
		return run_block_op(e, g, op, scratch, s);
	case NG_OP_CROSSENTROPY: case NG_OP_LOSS_ACCUMULATE:
		return run_loss_op(e, g, op, scratch, s);
	case NG_OP_GRAD_NORM: case NG_OP_SCHEDULE: case NG_OP_ADAMW: case NG_OP_MUON:
	case NG_OP_STEP_FINISH:
		return run_update_op(e, g, op, scratch, s);
	default:
		return no_gpu_kernel(op);
	}
}

enum ng_status ng_exec_run_eager_(struct ng_exec *e, const struct ng_graph *g, const int *pl)
{
	for (int i = 0; i < g->n_ops; i++) {
		enum ng_status st = ng_exec_run_op_(e, g, &g->ops[i], pl[i]);
		if (!st)
			st = ng_exec_dp_after_op_(e, g, i);
		if (st)
			return st;
	}
	ng_check_set_node(NULL);
	return NG_OK;
}

