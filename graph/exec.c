/*
 * graph/exec.c — the GPU executor (see exec.h): one arena, planned kernels, one captured graph.
 * run_op() is the only place that maps an IR op to kernel launches; the same function runs the
 * nodes eagerly (--no-graph, and the warm-up) and inside stream capture, so graph and eager
 * execution cannot drift apart.
 */
#include "graph/exec.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/encoder.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/optim.h"

#define ALIGN_UP(x, a) (((x) + (a) - 1) / (a) * (a))

/* Device address of tensor t of graph g. */
static void *tp(const struct ng_exec *e, const struct ng_graph *g, int t)
{
	return e->arena + g->tensors[t].offset;
}

/* Device address of parameter `id` (layer `layer`) inside the flat buffer tensor `base`. */
static void *pp(const struct ng_exec *e, const struct ng_graph *g, int base, int id, int layer)
{
	const struct ng_param_spec *p = &g->lay.p[id];
	size_t el = ng_dtype_size(g->tensors[base].dtype);
	size_t off = p->offset + (p->per_layer && layer > 0 ? (size_t)layer * (p->numel / p->shape[0])
							    : 0);
	return (char *)tp(e, g, base) + off * el;
}

/* (IC, OC) of a linear layer. */
static void linear_dims(const struct ng_gpt_config *m, enum ng_op_which w, int *ic, int *oc)
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

static bool is_matmul(enum ng_op_kind k)
{
	return k == NG_OP_MATMUL_FWD || k == NG_OP_MATMUL_DINP || k == NG_OP_MATMUL_DW;
}

static struct ng_matmul_spec op_spec(const struct ng_exec *e, const struct ng_op *op)
{
	struct ng_matmul_spec s = { 0 };
	linear_dims(&e->cfg.model, op->which, &s.IC, &s.OC);
	s.N = op->row_count;
	s.gelu = op->gelu;
	s.autotune = e->cfg.autotune;
	if (op->kind == NG_OP_MATMUL_FWD) {
		s.kind = NG_MATMUL_FWD;
		s.bias = op->param[1] >= 0;
	} else if (op->kind == NG_OP_MATMUL_DINP) {
		s.kind = NG_MATMUL_DINP;
	} else {
		s.kind = NG_MATMUL_DW;
		s.gelu = 0;
		s.bias = op->param[1] >= 0;
		s.accumulate = 1;
	}
	return s;
}

/* Find or make the plan of this op's shape. */
static enum ng_status plan_matmul(struct ng_exec *e, const struct ng_op *op, int *idx)
{
	struct ng_matmul_spec s = op_spec(e, op);
	for (int i = 0; i < e->n_plans; i++) {
		if (memcmp(&e->plans[i].spec, &s, sizeof(s)) == 0) {
			*idx = i;
			return NG_OK;
		}
	}
	if (e->n_plans == NG_EXEC_MAX_PLANS)
		return ng_fail(NG_ERR_RUNTIME, "more than %d distinct matmul shapes",
			       NG_EXEC_MAX_PLANS);
	struct ng_exec_matmul *p = &e->plans[e->n_plans];
	memset(p, 0, sizeof(*p));
	p->spec = s;
	enum ng_status st = ng_matmul_plan(&p->mm, &e->mmctx, &s);
	if (st)
		return st;
	*idx = e->n_plans++;
	return NG_OK;
}

/* The bytes op's scratch tensor must have, from the real plans. */
static size_t scratch_need(const struct ng_exec *e, const struct ng_graph *g, const struct ng_op *op,
			   int plan)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	int N = g->B * g->T;
	switch (op->kind) {
	case NG_OP_MATMUL_FWD: case NG_OP_MATMUL_DINP: case NG_OP_MATMUL_DW:
		return e->plans[plan].mm.workspace_need;
	case NG_OP_ATTENTION_FWD:
		return ng_attention_fwd_workspace(&e->att);
	case NG_OP_ATTENTION_BWD:
		return ng_attention_bwd_workspace(&e->att);
	case NG_OP_LAYERNORM_BWD:
		return ng_layernorm_bwd_scratch_bytes(N, m->C);
	case NG_OP_ENCODER_BWD:
		return ng_encoder_bwd_scratch_bytes(g->B, g->T, m->C);
	case NG_OP_GRAD_NORM:
		return ng_grad_norm_scratch_bytes(g->lay.total);
	default:
		return 0;
	}
}

/* Plan every matmul of g, raise scratch tensors to the real needs, re-plan the arena. */
static enum ng_status plan_graph(struct ng_exec *e, struct ng_graph *g, int **plan_of_op)
{
	int *pl = malloc(sizeof(int) * (size_t)g->n_ops);
	if (!pl)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	*plan_of_op = pl;
	bool raised = false;
	for (int i = 0; i < g->n_ops; i++) {
		const struct ng_op *op = &g->ops[i];
		pl[i] = -1;
		if (is_matmul(op->kind)) {
			enum ng_status st = plan_matmul(e, op, &pl[i]);
			if (st)
				return st;
		}
		size_t need = scratch_need(e, g, op, pl[i]);
		if (need == 0)
			continue;
		if (op->scratch < 0)
			return ng_fail(NG_ERR_RUNTIME, "op %s needs %zu bytes of workspace but the "
				       "step builder gave it none", op->name, need);
		struct ng_tensor *t = &g->tensors[op->scratch];
		if (t->bytes < need) {
			t->bytes = need;
			raised = true;
		}
	}
	if (raised)
		return ng_graph_plan(g, g->align);
	return NG_OK;
}

/* ---- data parallelism (cfg.comm): see exec.h ---- */

/* ZeRO-1: pad the flat parameter/gradient buffers to world * shard_len elements and shrink the
 * AdamW moments to one shard; the same persistent layout in every graph of the run. */
static enum ng_status dp_shard_layout(struct ng_exec *e, struct ng_graph *g)
{
	size_t len = e->shard_len, padded = len * (size_t)e->cfg.world;
	struct { int t; size_t n; } set[] = {
		{ g->t_params, padded }, { g->t_params_bf16, padded }, { g->t_grads, padded },
		{ g->t_adam_m, len }, { g->t_adam_v, len },
	};
	for (size_t i = 0; i < sizeof(set) / sizeof(set[0]); i++) {
		if (set[i].t < 0)
			continue;
		struct ng_tensor *t = &g->tensors[set[i].t];
		t->bytes = set[i].n * ng_dtype_size(t->dtype);
		t->shape[0] = set[i].n;
	}
	return ng_graph_plan(g, g->align);
}

/* Overlap: which op completes each layer's gradient (the last op of the last micro-batch that
 * writes a per-layer gradient of that layer), a second stream and an event per layer. */
static enum ng_status dp_plan_overlap(struct ng_exec *e)
{
	const struct ng_graph *g = &e->train;
	int L = g->cfg.L;
	e->dp_bucket = malloc(sizeof(int) * (size_t)g->n_ops);
	e->dp_sent = calloc((size_t)L, sizeof(bool));
	e->dp_ready = calloc((size_t)L, sizeof(cudaEvent_t));
	int *last = malloc(sizeof(int) * (size_t)L);
	if (!e->dp_bucket || !e->dp_sent || !e->dp_ready || !last) {
		free(last);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	}
	for (int l = 0; l < L; l++)
		last[l] = -1;
	for (int i = 0; i < g->n_ops; i++) {
		const struct ng_op *op = &g->ops[i];
		e->dp_bucket[i] = -1;
		int gb = op->kind == NG_OP_MATMUL_DW ? op->out[0]
			 : op->kind == NG_OP_LAYERNORM_BWD ? op->out[1] : -1;
		if (gb == g->t_grads && op->layer >= 0 && op->layer < L && op->param[0] >= 0 &&
		    g->lay.p[op->param[0]].per_layer)
			last[op->layer] = i;
	}
	for (int l = 0; l < L; l++)
		if (last[l] >= 0)
			e->dp_bucket[last[l]] = l;
	free(last);
	if (NG_CUDA_CHECK(cudaStreamCreateWithFlags(&e->dp_stream, cudaStreamNonBlocking)) ||
	    NG_CUDA_CHECK(cudaEventCreateWithFlags(&e->dp_join, cudaEventDisableTiming)))
		return NG_ERR_RUNTIME;
	for (int l = 0; l < L; l++)
		if (NG_CUDA_CHECK(cudaEventCreateWithFlags(&e->dp_ready[l], cudaEventDisableTiming)))
			return NG_ERR_RUNTIME;
	return NG_OK;
}

/* Enqueue the all-reduce of every per-layer gradient slice of layer l on `s` (one NCCL group). */
static enum ng_status dp_reduce_layer(struct ng_exec *e, const struct ng_graph *g, int l,
				      cudaStream_t s)
{
	float *grads = tp(e, g, g->t_grads);
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &g->lay.p[i];
		if (!p->per_layer)
			continue;
		size_t n = p->numel / p->shape[0];
		enum ng_status r = ng_collective_allreduce_mean_f32(e->cfg.comm,
								    grads + p->offset + (size_t)l * n,
								    n, s);
		if (r)
			return r;
	}
	return NG_OK;
}

/* After op i of the train graph: fork layer dp_bucket[i]'s all-reduce onto dp_stream. */
static enum ng_status dp_after_op(struct ng_exec *e, const struct ng_graph *g, int i)
{
	if (!e->dp_bucket || g != &e->train || e->dp_bucket[i] < 0)
		return NG_OK;
	int l = e->dp_bucket[i];
	if (NG_CUDA_CHECK(cudaEventRecord(e->dp_ready[l], e->stream)) ||
	    NG_CUDA_CHECK(cudaStreamWaitEvent(e->dp_stream, e->dp_ready[l], 0)))
		return NG_ERR_RUNTIME;
	enum ng_status r = ng_collective_group_begin();
	if (!r)
		r = dp_reduce_layer(e, g, l, e->dp_stream);
	enum ng_status r2 = ng_collective_group_end();
	e->dp_sent[l] = true;
	return r ? r : r2;
}

/* GRAD_NORM with overlap: join dp_stream, then all-reduce what was not sent (one group). */
static enum ng_status dp_reduce_rest(struct ng_exec *e, const struct ng_graph *g, float *loss,
				     cudaStream_t s)
{
	int L = g->cfg.L, sent = 0;
	for (int l = 0; l < L; l++)
		sent += e->dp_sent[l];
	if (sent && (NG_CUDA_CHECK(cudaEventRecord(e->dp_join, e->dp_stream)) ||
		     NG_CUDA_CHECK(cudaStreamWaitEvent(s, e->dp_join, 0))))
		return NG_ERR_RUNTIME;
	float *grads = tp(e, g, g->t_grads);
	enum ng_status r = ng_collective_group_begin();
	if (!r && sent == 0)
		r = ng_collective_allreduce_mean_f32(e->cfg.comm, grads, g->lay.total, s);
	for (int i = 0; i < NG_P_COUNT && !r && sent; i++) {
		const struct ng_param_spec *p = &g->lay.p[i];
		if (!p->per_layer)
			r = ng_collective_allreduce_mean_f32(e->cfg.comm, grads + p->offset,
							     p->numel, s);
	}
	for (int l = 0; l < L && !r && sent; l++)
		if (!e->dp_sent[l])
			r = dp_reduce_layer(e, g, l, s);
	if (!r)
		r = ng_collective_allreduce_mean_f32(e->cfg.comm, loss, 1, s);
	enum ng_status r2 = ng_collective_group_end();
	memset(e->dp_sent, 0, sizeof(bool) * (size_t)L);
	return r ? r : r2;
}

/* Before GRAD_NORM: the mean gradient (all of it, or this rank's shard with ZeRO-1) and the
 * mean loss over ranks, then the squared norm (ZeRO-1: of the shard, summed across ranks). */
static enum ng_status dp_grad_norm(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, void *scratch, cudaStream_t s)
{
	struct ng_step_state *st = tp(e, g, op->out[0]);
	float *grads = tp(e, g, op->in[0]);
	size_t total = g->lay.total;
	enum ng_status r;
	if (e->dp_bucket) {
		r = dp_reduce_rest(e, g, &st->loss_sum, s);
		return r ? r : ng_grad_norm_squared(&st->grad_norm, grads, total, scratch, s);
	}
	r = ng_collective_group_begin();
	if (!r)
		r = e->cfg.zero1 ? ng_collective_reduce_scatter_mean_f32(e->cfg.comm, grads,
									 e->shard_len, e->cfg.rank, s)
				 : ng_collective_allreduce_mean_f32(e->cfg.comm, grads, total, s);
	if (!r)
		r = ng_collective_allreduce_mean_f32(e->cfg.comm, &st->loss_sum, 1, s);
	enum ng_status r2 = ng_collective_group_end();
	if (r || r2)
		return r ? r : r2;
	if (!e->cfg.zero1)
		return ng_grad_norm_squared(&st->grad_norm, grads, total, scratch, s);
	size_t own = e->shard_off >= total ? 0
			: (total - e->shard_off < e->shard_len ? total - e->shard_off : e->shard_len);
	r = own ? ng_grad_norm_squared(&st->grad_norm, grads + e->shard_off, own, scratch, s)
		: NG_CUDA_CHECK(cudaMemsetAsync(&st->grad_norm, 0, sizeof(float), s));
	return r ? r : ng_collective_allreduce_sum_f32(e->cfg.comm, &st->grad_norm, 1, s);
}

/* ZeRO-1 AdamW: each parameter tensor's part inside [shard_off, shard_off + shard_len), moments
 * indexed from the shard start; then every rank's updated shard to every rank. */
static enum ng_status dp_adamw_shard(struct ng_exec *e, const struct ng_graph *g,
				     const struct ng_op *op, cudaStream_t s)
{
	const struct ng_step_state *st = tp(e, g, op->in[1]);
	float *w = tp(e, g, op->out[0]), *grad = tp(e, g, op->in[0]);
	ng_bf16 *w16 = tp(e, g, op->out[1]);
	float *m = tp(e, g, op->out[2]), *v = tp(e, g, op->out[3]);
	size_t lo = e->shard_off, hi = e->shard_off + e->shard_len;
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &g->lay.p[i];
		size_t a = p->offset > lo ? p->offset : lo;
		size_t b = p->offset + p->numel < hi ? p->offset + p->numel : hi;
		if (a >= b)
			continue;
		enum ng_status r = ng_adamw(w + a, w16 + a, grad + a, m + (a - lo), v + (a - lo),
					    b - a, p->decay ? e->cfg.wd : 0.0f, e->cfg.beta1,
					    e->cfg.beta2, e->cfg.eps, st, s);
		if (r)
			return r;
	}
	enum ng_status r = ng_collective_group_begin();
	if (!r)
		r = ng_collective_allgather(e->cfg.comm, w, e->shard_len, 4, e->cfg.rank, s);
	if (!r)
		r = ng_collective_allgather(e->cfg.comm, w16, e->shard_len, 2, e->cfg.rank, s);
	enum ng_status r2 = ng_collective_group_end();
	return r ? r : r2;
}

/* Enqueue one op on e->stream. */
static enum ng_status run_op(struct ng_exec *e, const struct ng_graph *g, const struct ng_op *op,
			     int plan)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	cudaStream_t s = e->stream;
	int B = g->B, T = g->T, C = m->C, N = B * T;
	void *scratch = op->scratch >= 0 ? tp(e, g, op->scratch) : NULL;
	ng_check_set_node(op->name);
	switch (op->kind) {
	case NG_OP_TOKENS_H2D: {
		const struct ng_tensor *t = &g->tensors[op->out[0]];
		const uint16_t *src = g->kind == NG_GRAPH_EVAL ? e->h_eval_tokens : e->h_tokens;
		if (NG_CUDA_CHECK(cudaMemcpyAsync(tp(e, g, op->out[0]), src, t->bytes,
						  cudaMemcpyHostToDevice, s)))
			return NG_ERR_RUNTIME;
		if (g->kind != NG_GRAPH_TRAIN)
			return NG_OK;
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
		const uint16_t *w = (const uint16_t *)tp(e, g, op->in[0]) +
				    (size_t)op->micro * B * (T + 1);
		return ng_tokens_split(tp(e, g, op->out[0]), tp(e, g, op->out[1]), w, B, T, s);
	}
	case NG_OP_ZERO:
		return NG_CUDA_CHECK(cudaMemsetAsync(tp(e, g, op->out[0]), 0,
						     g->tensors[op->out[0]].bytes, s));
	case NG_OP_ENCODER_FWD:
		return ng_encoder_fwd(tp(e, g, op->out[0]), tp(e, g, op->in[0]),
				      pp(e, g, op->in[1], NG_P_WTE, -1),
				      pp(e, g, op->in[1], NG_P_WPE, -1), B, T, C, s);
	case NG_OP_LAYERNORM_FWD: {
		int pb = op->in[1];
		return ng_layernorm_fwd(tp(e, g, op->out[0]),
					op->recompute ? NULL : tp(e, g, op->out[1]),
					op->recompute ? NULL : tp(e, g, op->out[2]), tp(e, g, op->in[0]),
					pp(e, g, pb, op->param[0], op->layer),
					pp(e, g, pb, op->param[1], op->layer), N, C, s);
	}
	case NG_OP_RESIDUAL_LAYERNORM_FWD: {
		int pb = op->in[2];
		return ng_residual_layernorm_fwd(tp(e, g, op->out[0]), tp(e, g, op->out[1]),
						 tp(e, g, op->out[2]), tp(e, g, op->out[3]),
						 tp(e, g, op->in[0]), tp(e, g, op->in[1]),
						 pp(e, g, pb, op->param[0], op->layer),
						 pp(e, g, pb, op->param[1], op->layer), N, C, s);
	}
	case NG_OP_MATMUL_FWD: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		int ic = mm->spec.IC;
		const ng_bf16 *inp = (const ng_bf16 *)tp(e, g, op->in[0]) + (size_t)op->row_start * ic;
		int pb = op->in[1];
		return ng_matmul_run(mm, tp(e, g, op->out[0]), inp,
				     pp(e, g, pb, op->param[0], op->layer),
				     op->param[1] >= 0 ? pp(e, g, pb, op->param[1], op->layer) : NULL,
				     op->gelu ? tp(e, g, op->out[1]) : NULL, NULL, scratch, s);
	}
	case NG_OP_GELU_FWD:
		return ng_gelu_fwd(tp(e, g, op->out[0]), tp(e, g, op->in[0]),
				   g->tensors[op->in[0]].bytes / 2, s);
	case NG_OP_ATTENTION_FWD:
		return ng_attention_fwd(&e->att, tp(e, g, op->out[0]), tp(e, g, op->out[1]),
					tp(e, g, op->in[0]), scratch, s);
	case NG_OP_CROSSENTROPY: {
		const int32_t *tg = (const int32_t *)tp(e, g, op->in[1]) + op->row_start;
		float *losses = (float *)tp(e, g, op->out[op->no_grad ? 0 : 1]) + op->row_start;
		if (op->no_grad)
			return ng_crossentropy_fwd(losses, tp(e, g, op->in[0]), tg, op->row_count,
						   m->V, m->Vp, s);
		return ng_crossentropy(losses, tp(e, g, op->in[0]), tg, op->row_count, m->V, m->Vp,
				       1.0f / ((float)N * g->K), s);
	}
	case NG_OP_LOSS_ACCUMULATE: {
		float *dst = g->kind == NG_GRAPH_TRAIN
				     ? (float *)((char *)tp(e, g, op->out[0]) +
						 offsetof(struct ng_step_state, loss_sum))
				     : (float *)tp(e, g, op->out[0]);
		return ng_loss_accumulate(dst, tp(e, g, op->in[0]), N, 1.0f / ((float)N * g->K),
					  scratch, s);
	}
	case NG_OP_MATMUL_DINP: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		ng_bf16 *dinp = (ng_bf16 *)tp(e, g, op->out[0]) + (size_t)op->row_start * mm->spec.IC;
		return ng_matmul_run(mm, dinp, tp(e, g, op->in[0]),
				     pp(e, g, op->in[1], op->param[0], op->layer), NULL,
				     op->gelu ? tp(e, g, op->in[2]) : NULL, NULL, scratch, s);
	}
	case NG_OP_MATMUL_DW: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		const ng_bf16 *inp = (const ng_bf16 *)tp(e, g, op->in[1]) +
				     (size_t)op->row_start * mm->spec.IC;
		int gb = op->out[0];
		return ng_matmul_run(mm, pp(e, g, gb, op->param[0], op->layer), tp(e, g, op->in[0]),
				     inp, NULL, NULL,
				     op->param[1] >= 0 ? pp(e, g, gb, op->param[1], op->layer) : NULL,
				     scratch, s);
	}
	case NG_OP_GELU_BWD:
		return ng_gelu_bwd(tp(e, g, op->out[0]), tp(e, g, op->in[0]), tp(e, g, op->in[1]),
				   g->tensors[op->in[0]].bytes / 2, s);
	case NG_OP_ATTENTION_BWD:
		return ng_attention_bwd(&e->att, tp(e, g, op->out[0]), tp(e, g, op->in[0]),
					tp(e, g, op->in[1]), tp(e, g, op->in[2]), tp(e, g, op->in[3]),
					scratch, s);
	case NG_OP_LAYERNORM_BWD: {
		int pb = op->in[2], gb = op->out[1];
		return ng_layernorm_bwd(tp(e, g, op->out[0]), pp(e, g, gb, op->param[0], op->layer),
					pp(e, g, gb, op->param[1], op->layer), tp(e, g, op->in[0]),
					tp(e, g, op->in[1]), pp(e, g, pb, op->param[0], op->layer),
					tp(e, g, op->in[3]), tp(e, g, op->in[4]), N, C, scratch, s);
	}
	case NG_OP_ENCODER_BWD: {
		int gb = op->out[0];
		return ng_encoder_bwd(pp(e, g, gb, NG_P_WTE, -1), pp(e, g, gb, NG_P_WPE, -1),
				      tp(e, g, op->in[0]), tp(e, g, op->in[1]), B, T, C, m->Vp,
				      scratch, g->tensors[op->scratch].bytes, s);
	}
	case NG_OP_GRAD_NORM: {
		struct ng_step_state *st = tp(e, g, op->out[0]);
		if (e->cfg.comm)
			return dp_grad_norm(e, g, op, scratch, s);
		return ng_grad_norm_squared(&st->grad_norm, tp(e, g, op->in[0]), g->lay.total,
					    scratch, s);
	}
	case NG_OP_SCHEDULE: {
		struct ng_step_state *st = tp(e, g, op->out[0]);
		return ng_schedule_update(st, &st->grad_norm, e->cfg.sched, e->cfg.clip, s);
	}
	case NG_OP_ADAMW: {
		const struct ng_step_state *st = tp(e, g, op->in[1]);
		if (e->cfg.comm && e->cfg.zero1)
			return dp_adamw_shard(e, g, op, s);
		for (int i = 0; i < NG_P_COUNT; i++) {
			const struct ng_param_spec *p = &g->lay.p[i];
			enum ng_status r = ng_adamw(pp(e, g, op->out[0], i, 0),
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
	case NG_OP_STEP_FINISH:
		return ng_step_finish(tp(e, g, op->in[0]), e->d_ring, NG_EXEC_RING, s);
	default:
		return ng_fail(NG_ERR_RUNTIME, "op %s (%s) has no GPU implementation", op->name,
			       ng_op_kind_name(op->kind));
	}
}

static enum ng_status run_graph_eager(struct ng_exec *e, const struct ng_graph *g, const int *pl)
{
	for (int i = 0; i < g->n_ops; i++) {
		enum ng_status st = run_op(e, g, &g->ops[i], pl[i]);
		if (!st)
			st = dp_after_op(e, g, i);
		if (st)
			return st;
	}
	ng_check_set_node(NULL);
	return NG_OK;
}

/* One eager run of the train step with an event after every op: e->op_ms[i] = device time of
 * op i (including any gap before it, so launch-bound ops show as such). Init time only. */
static enum ng_status profile_step(struct ng_exec *e)
{
	const struct ng_graph *g = &e->train;
	int n = g->n_ops;
	cudaEvent_t *ev = calloc((size_t)n + 1, sizeof(*ev));
	e->op_ms = calloc((size_t)n, sizeof(float));
	if (!ev || !e->op_ms) {
		free(ev);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	}
	enum ng_status st = NG_OK;
	for (int i = 0; i <= n && !st; i++)
		st = NG_CUDA_CHECK(cudaEventCreate(&ev[i]));
	if (!st)
		st = NG_CUDA_CHECK(cudaEventRecord(ev[0], e->stream));
	for (int i = 0; i < n && !st; i++) {
		st = run_op(e, g, &g->ops[i], e->train_plan[i]);
		if (!st)
			st = NG_CUDA_CHECK(cudaEventRecord(ev[i + 1], e->stream));
	}
	ng_check_set_node(NULL);
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	for (int i = 0; i < n && !st; i++)
		st = NG_CUDA_CHECK(cudaEventElapsedTime(&e->op_ms[i], ev[i], ev[i + 1]));
	for (int i = 0; i <= n; i++)
		if (ev[i])
			cudaEventDestroy(ev[i]);
	free(ev);
	return st;
}

void ng_exec_print_profile(const struct ng_exec *e, void *file)
{
	FILE *f = file;
	const struct ng_graph *g = &e->train;
	if (!e->op_ms)
		return;
	struct row {
		int kind, which;
		double ms;
		int count;
	} rows[NG_OP_KIND_COUNT * NG_OP_WHICH_COUNT];
	int nr = 0;
	double total = 0;
	for (int i = 0; i < g->n_ops; i++) {
		const struct ng_op *op = &g->ops[i];
		int j = 0;
		while (j < nr && !(rows[j].kind == (int)op->kind && rows[j].which == (int)op->which))
			j++;
		if (j == nr)
			rows[nr++] = (struct row){ op->kind, op->which, 0, 0 };
		rows[j].ms += e->op_ms[i];
		rows[j].count++;
		total += e->op_ms[i];
	}
	for (int a = 1; a < nr; a++) /* insertion sort, largest first */
		for (int b = a; b > 0 && rows[b].ms > rows[b - 1].ms; b--) {
			struct row t = rows[b];
			rows[b] = rows[b - 1];
			rows[b - 1] = t;
		}
	fprintf(f, "profile of one eager step (%d ops, %.2f ms of device time):\n", g->n_ops, total);
	for (int j = 0; j < nr; j++)
		fprintf(f, "  %-24s %-8s x%-4d %8.3f ms  %5.1f%%\n", ng_op_kind_name(rows[j].kind),
			ng_op_which_name(rows[j].which), rows[j].count, rows[j].ms,
			100 * rows[j].ms / total);
}

static enum ng_status capture(struct ng_exec *e, const struct ng_graph *g, const int *pl,
			      cudaGraph_t *graph, cudaGraphExec_t *exec)
{
	if (NG_CUDA_CHECK(cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeGlobal)))
		return NG_ERR_RUNTIME;
	enum ng_status st = run_graph_eager(e, g, pl);
	cudaGraph_t gr = NULL;
	cudaError_t ce = cudaStreamEndCapture(e->stream, &gr);
	if (st) {
		if (gr)
			cudaGraphDestroy(gr);
		return st;
	}
	if (NG_CUDA_CHECK(ce))
		return NG_ERR_RUNTIME;
	*graph = gr;
	return NG_CUDA_CHECK(cudaGraphInstantiate(exec, gr, 0));
}

/* Parameters from the seeded init; bf16 copy; zero grads, moments and the step state. */
static enum ng_status reset_state(struct ng_exec *e)
{
	const struct ng_graph *g = &e->train;
	size_t n = g->lay.total;
	float *h = malloc(n * sizeof(float));
	if (!h)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for %zu parameters", n);
	ng_gpt_init(&g->cfg, &g->lay, e->cfg.seed, h);
	enum ng_status st = NG_CUDA_CHECK(cudaMemcpy(tp(e, g, g->t_params), h, n * sizeof(float),
						     cudaMemcpyHostToDevice));
	free(h);
	if (!st)
		st = ng_cast_f32_to_bf16(tp(e, g, g->t_params_bf16), tp(e, g, g->t_params), n,
					 e->stream);
	int zero[] = { g->t_grads, g->t_adam_m, g->t_adam_v, g->t_step_state };
	for (int i = 0; i < 4 && !st; i++)
		st = NG_CUDA_CHECK(cudaMemsetAsync(tp(e, g, zero[i]), 0, g->tensors[zero[i]].bytes,
						   e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	return st;
}

static double peak_for(const char *name)
{
	if (strstr(name, "H100") || strstr(name, "H200") || strstr(name, "H800") ||
	    strstr(name, "GH200"))
		return 989e12;
	if (strstr(name, "A100") || strstr(name, "A800"))
		return 312e12;
	return 0;
}

enum ng_status ng_exec_init(struct ng_exec *e, const struct ng_exec_config *cfg)
{
	memset(e, 0, sizeof(*e));
	e->cfg = *cfg;
	e->inited = true;
	ng_graph_init(&e->train);
	ng_graph_init(&e->eval);
	struct cudaDeviceProp prop;
	int dev = 0;
	if (NG_CUDA_CHECK(cudaGetDevice(&dev)) || NG_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev)))
		return NG_ERR_RUNTIME;
	snprintf(e->device_name, sizeof(e->device_name), "%s", prop.name);
	e->device_total_bytes = prop.totalGlobalMem;
	e->peak_flops = peak_for(prop.name);

	struct ng_step_options opt = cfg->step;
	opt.deterministic = cfg->deterministic;
	enum ng_status st = ng_step_build_train(&e->train, &cfg->model, cfg->B, cfg->T, cfg->K, &opt);
	if (!st && cfg->eval_batches > 0)
		st = ng_step_build_eval(&e->eval, &cfg->model, cfg->B, cfg->T, cfg->eval_batches,
					&opt);
	if (st)
		return st;
	if (e->cfg.world < 1) /* 0: a config that predates data parallelism, one process */
		e->cfg.world = 1;
	if (cfg->rank < 0 || cfg->rank >= e->cfg.world || (e->cfg.world > 1 && !cfg->comm) ||
	    (cfg->zero1 && !cfg->comm))
		return ng_fail(NG_ERR_RUNTIME, "exec: rank %d of world %d%s is not a valid "
			       "data-parallel setup", cfg->rank, e->cfg.world,
			       cfg->comm ? "" : " without a communicator");
	if (cfg->zero1) {
		e->shard_len = ng_collective_shard_len(e->train.lay.total, e->cfg.world);
		e->shard_off = e->shard_len * (size_t)cfg->rank;
		st = dp_shard_layout(e, &e->train);
		if (!st && cfg->eval_batches > 0)
			st = dp_shard_layout(e, &e->eval);
		if (st)
			return st;
	}
	if (cfg->comm && !cfg->zero1 && !cfg->dp_no_overlap && (st = dp_plan_overlap(e)))
		return st;

	if (NG_CUDA_CHECK(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking)) ||
	    NG_CUDNN_CHECK(cudnnCreate(&e->cudnn)))
		return NG_ERR_RUNTIME;
	st = ng_matmul_ctx_init(&e->mmctx, 32u << 20);
	if (!st)
		st = ng_attention_plan(&e->att, e->cudnn, cfg->B, cfg->model.H, cfg->T,
				       cfg->model.C / cfg->model.H, cfg->deterministic,
				       cfg->force_naive_attention);
	if (!st)
		st = plan_graph(e, &e->train, &e->train_plan);
	if (!st && cfg->eval_batches > 0)
		st = plan_graph(e, &e->eval, &e->eval_plan);
	if (st)
		return st;

	e->arena_bytes = e->train.total_bytes;
	if (cfg->eval_batches > 0 && e->eval.total_bytes > e->arena_bytes)
		e->arena_bytes = e->eval.total_bytes;
	size_t free_b = 0, total_b = 0;
	cudaMemGetInfo(&free_b, &total_b);
	if (e->arena_bytes > free_b) {
		ng_fail(NG_ERR_INPUT, "the step needs %.2f GiB of device memory but %s has %.2f GiB "
			"free (of %.2f GiB)", e->arena_bytes / 1073741824.0, e->device_name,
			free_b / 1073741824.0, total_b / 1073741824.0);
		ng_hint("use a smaller --batch with --total-batch to keep the tokens per step, or "
			"see `nanograph plan` for recompute options");
		return NG_ERR_INPUT;
	}
	if (NG_CUDA_CHECK(cudaMalloc((void **)&e->arena, e->arena_bytes)))
		return NG_ERR_RUNTIME;
	size_t tok = (size_t)cfg->K * cfg->B * (cfg->T + 1) * sizeof(uint16_t);
	size_t etok = (size_t)cfg->eval_batches * cfg->B * (cfg->T + 1) * sizeof(uint16_t);
	if (NG_CUDA_CHECK(cudaHostAlloc((void **)&e->h_tokens, tok, cudaHostAllocDefault)) ||
	    (etok && NG_CUDA_CHECK(cudaHostAlloc((void **)&e->h_eval_tokens, etok,
						 cudaHostAllocDefault))) ||
	    NG_CUDA_CHECK(cudaHostAlloc((void **)&e->ring, sizeof(*e->ring) * NG_EXEC_RING,
					cudaHostAllocMapped)) ||
	    NG_CUDA_CHECK(cudaHostGetDevicePointer((void **)&e->d_ring, e->ring, 0)) ||
	    NG_CUDA_CHECK(cudaEventCreateWithFlags(&e->h2d_done, cudaEventDisableTiming)))
		return NG_ERR_RUNTIME;
	for (int i = 0; i < NG_EXEC_RING; i++)
		if (NG_CUDA_CHECK(cudaEventCreate(&e->done[i])))
			return NG_ERR_RUNTIME;
	if (NG_CUDA_CHECK(cudaEventCreate(&e->start)))
		return NG_ERR_RUNTIME;
	memset(e->h_tokens, 0, tok);
	memset(e->ring, 0, sizeof(*e->ring) * NG_EXEC_RING);

	/* Warm-up: one eager step (loads modules; errors name their node), then the real init. */
	st = reset_state(e);
	if (!st)
		st = run_graph_eager(e, &e->train, e->train_plan);
	if (!st && cfg->eval_batches > 0) {
		memset(e->h_eval_tokens, 0, etok);
		st = run_graph_eager(e, &e->eval, e->eval_plan);
	}
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	if (!st && cfg->profile)
		st = profile_step(e);
	if (!st)
		st = reset_state(e);
	if (!st && !cfg->no_graph)
		st = capture(e, &e->train, e->train_plan, &e->train_graph, &e->train_exec);
	if (!st && !cfg->no_graph && cfg->eval_batches > 0)
		st = capture(e, &e->eval, e->eval_plan, &e->eval_graph, &e->eval_exec);
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	memset(e->ring, 0, sizeof(*e->ring) * NG_EXEC_RING);
	return st;
}

void ng_exec_free(struct ng_exec *e)
{
	if (!e->inited)
		return;
	if (e->stream)
		cudaStreamSynchronize(e->stream);
	if (e->dp_stream) {
		cudaStreamSynchronize(e->dp_stream);
		cudaStreamDestroy(e->dp_stream);
	}
	for (int l = 0; e->dp_ready && l < e->train.cfg.L; l++)
		if (e->dp_ready[l])
			cudaEventDestroy(e->dp_ready[l]);
	if (e->dp_join)
		cudaEventDestroy(e->dp_join);
	free(e->dp_ready);
	free(e->dp_bucket);
	free(e->dp_sent);
	if (e->train_exec)
		cudaGraphExecDestroy(e->train_exec);
	if (e->train_graph)
		cudaGraphDestroy(e->train_graph);
	if (e->eval_exec)
		cudaGraphExecDestroy(e->eval_exec);
	if (e->eval_graph)
		cudaGraphDestroy(e->eval_graph);
	for (int i = 0; i < e->n_plans; i++)
		ng_matmul_free(&e->plans[i].mm);
	if (e->mmctx.lt)
		ng_matmul_ctx_free(&e->mmctx);
	ng_attention_free(&e->att);
	if (e->cudnn)
		cudnnDestroy(e->cudnn);
	for (int i = 0; i < NG_EXEC_RING; i++)
		if (e->done[i])
			cudaEventDestroy(e->done[i]);
	if (e->h2d_done)
		cudaEventDestroy(e->h2d_done);
	if (e->start)
		cudaEventDestroy(e->start);
	cudaFreeHost(e->h_tokens);
	cudaFreeHost(e->h_eval_tokens);
	cudaFreeHost(e->ring);
	cudaFree(e->arena);
	if (e->stream)
		cudaStreamDestroy(e->stream);
	free(e->train_plan);
	free(e->eval_plan);
	free(e->op_ms);
	ng_graph_free(&e->train);
	ng_graph_free(&e->eval);
	e->inited = false;
}

enum ng_status ng_exec_input(struct ng_exec *e, uint16_t **tokens)
{
	/* The previous step's token copy must have run before the buffer is refilled. */
	if (NG_CUDA_CHECK(cudaEventSynchronize(e->h2d_done)))
		return NG_ERR_RUNTIME;
	*tokens = e->h_tokens;
	return NG_OK;
}

enum ng_status ng_exec_submit(struct ng_exec *e)
{
	if (e->submitted - e->collected >= NG_EXEC_RING)
		return ng_fail(NG_ERR_RUNTIME, "metrics ring overrun: %lld steps not collected",
			       e->submitted - e->collected);
	enum ng_status st;
	if (e->submitted == 0 && NG_CUDA_CHECK(cudaEventRecord(e->start, e->stream)))
		return NG_ERR_RUNTIME;
	if (e->cfg.no_graph)
		st = run_graph_eager(e, &e->train, e->train_plan);
	else
		st = NG_CUDA_CHECK(cudaGraphLaunch(e->train_exec, e->stream));
	if (st)
		return st;
	if (NG_CUDA_CHECK(cudaEventRecord(e->done[e->submitted % NG_EXEC_RING], e->stream)))
		return NG_ERR_RUNTIME;
	e->submitted++;
	return NG_OK;
}

enum ng_status ng_exec_collect(struct ng_exec *e, struct ng_metrics_record *out, float *ms, int max,
			       bool wait, int *n)
{
	*n = 0;
	while (e->collected < e->submitted && *n < max) {
		cudaEvent_t ev = e->done[e->collected % NG_EXEC_RING];
		cudaError_t q = wait ? cudaEventSynchronize(ev) : cudaEventQuery(ev);
		if (q == cudaErrorNotReady)
			break;
		if (NG_CUDA_CHECK(q))
			return NG_ERR_RUNTIME;
		if (ms) {
			cudaEvent_t prev = e->collected ? e->done[(e->collected - 1) % NG_EXEC_RING]
							: e->start;
			float t = 0;
			if (NG_CUDA_CHECK(cudaEventElapsedTime(&t, prev, ev)))
				return NG_ERR_RUNTIME;
			ms[*n] = t;
		}
		out[(*n)++] = e->ring[(e->collected + e->step_base) % NG_EXEC_RING];
		e->collected++;
	}
	return NG_OK;
}

enum ng_status ng_exec_evaluate(struct ng_exec *e, const uint16_t *tokens, double *loss)
{
	if (e->cfg.eval_batches == 0)
		return ng_fail(NG_ERR_RUNTIME, "no evaluation graph was planned");
	const struct ng_graph *g = &e->eval;
	if (NG_CUDA_CHECK(cudaStreamSynchronize(e->stream)))
		return NG_ERR_RUNTIME;
	memcpy(e->h_eval_tokens, tokens,
	       (size_t)e->cfg.eval_batches * e->cfg.B * (e->cfg.T + 1) * sizeof(uint16_t));
	enum ng_status st = e->cfg.no_graph ? run_graph_eager(e, g, e->eval_plan)
					    : NG_CUDA_CHECK(cudaGraphLaunch(e->eval_exec, e->stream));
	float l = 0;
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpyAsync(&l, tp(e, g, g->t_eval_loss), sizeof(float),
						   cudaMemcpyDeviceToHost, e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	*loss = l;
	return st;
}

enum ng_status ng_exec_download(struct ng_exec *e, int tensor, void *host)
{
	const struct ng_graph *g = &e->train;
	if (NG_CUDA_CHECK(cudaStreamSynchronize(e->stream)))
		return NG_ERR_RUNTIME;
	return NG_CUDA_CHECK(cudaMemcpy(host, tp(e, g, tensor), g->tensors[tensor].bytes,
					cudaMemcpyDeviceToHost));
}

enum ng_status ng_exec_upload(struct ng_exec *e, int tensor, const void *host)
{
	const struct ng_graph *g = &e->train;
	if (NG_CUDA_CHECK(cudaStreamSynchronize(e->stream)))
		return NG_ERR_RUNTIME;
	return NG_CUDA_CHECK(cudaMemcpy(tp(e, g, tensor), host, g->tensors[tensor].bytes,
					cudaMemcpyHostToDevice));
}

enum ng_status ng_exec_restore(struct ng_exec *e, const float *params, const float *m,
			       const float *v, long long step, long long n_skipped)
{
	const struct ng_graph *g = &e->train;
	if (e->submitted != e->collected)
		return ng_fail(NG_ERR_RUNTIME, "restore with %lld steps in flight",
			       e->submitted - e->collected);
	struct ng_step_state ss = { 0 };
	ss.step = (int)step;
	ss.n_skipped = (int)n_skipped;
	enum ng_status st = ng_exec_upload(e, g->t_params, params);
	if (!st)
		st = ng_exec_upload(e, g->t_adam_m, m);
	if (!st)
		st = ng_exec_upload(e, g->t_adam_v, v);
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpy(tp(e, g, g->t_step_state), &ss, sizeof(ss),
					      cudaMemcpyHostToDevice));
	if (!st)
		st = ng_cast_f32_to_bf16(tp(e, g, g->t_params_bf16), tp(e, g, g->t_params),
					 g->lay.total, e->stream);
	if (!st)
		st = NG_CUDA_CHECK(cudaMemsetAsync(tp(e, g, g->t_grads), 0,
						   g->tensors[g->t_grads].bytes, e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	if (!st)
		e->step_base = step - e->collected;
	return st;
}

enum ng_status ng_exec_dump_cuda_graph(struct ng_exec *e, const char *path, char *text, size_t n)
{
	if (!e->train_graph)
		return ng_fail(NG_ERR_RUNTIME, "no captured graph (--no-graph?)");
	if (NG_CUDA_CHECK(cudaGraphDebugDotPrint(e->train_graph, path,
						 cudaGraphDebugDotFlagsVerbose)))
		return NG_ERR_RUNTIME;
	size_t count = 0;
	if (NG_CUDA_CHECK(cudaGraphGetNodes(e->train_graph, NULL, &count)))
		return NG_ERR_RUNTIME;
	cudaGraphNode_t *nodes = malloc(sizeof(*nodes) * (count ? count : 1));
	if (!nodes)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	cudaGraphGetNodes(e->train_graph, nodes, &count);
	size_t by[16] = { 0 };
	for (size_t i = 0; i < count; i++) {
		enum cudaGraphNodeType t;
		cudaGraphNodeGetType(nodes[i], &t);
		by[(unsigned)t < 16 ? (unsigned)t : 15]++;
	}
	free(nodes);
	snprintf(text, n, "%zu nodes: %zu kernel, %zu memcpy, %zu memset, %zu event record, "
		 "%zu other", count, by[cudaGraphNodeTypeKernel], by[cudaGraphNodeTypeMemcpy],
		 by[cudaGraphNodeTypeMemset], by[cudaGraphNodeTypeEventRecord],
		 count - by[cudaGraphNodeTypeKernel] - by[cudaGraphNodeTypeMemcpy] -
			 by[cudaGraphNodeTypeMemset] - by[cudaGraphNodeTypeEventRecord]);
	return NG_OK;
}
