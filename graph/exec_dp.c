/*
 * graph/exec_dp.c — data parallelism inside the captured step: the gradient all-reduce (per layer
 * on a second stream as each layer's backward finishes, the rest before GRAD_NORM), the ZeRO-1
 * shard layout, the sharded gradient norm and AdamW. Called from exec.c's plan and run_op.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec_internal.h"
#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/encoder.h"
#include "kernels/fp8.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/optim.h"

/* ZeRO-1: pad the flat bf16 parameter and gradient buffers to world * shard_len elements (they
 * are all-gathered and reduce-scattered) and shrink what only AdamW touches (the low half of
 * the master, the moments) to one shard; the same persistent layout in every graph of the run. */
enum ng_status ng_exec_dp_shard_layout_(struct ng_exec *e, struct ng_graph *g)
{
	size_t len = e->shard_len, padded = len * (size_t)e->cfg.world;
	struct { int t; size_t n; } set[] = {
		{ g->t_params_lo, len }, { g->t_params_bf16, padded }, { g->t_grads, padded },
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
enum ng_status ng_exec_dp_plan_overlap_(struct ng_exec *e)
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
			 : op->kind == NG_OP_LAYERNORM_BWD ? op->out[1]
			 : op->kind == NG_OP_GELU_BWD && op->param[0] >= 0 ? op->out[1]
			 : op->kind == NG_OP_MATMUL_DINP && op->own ? op->out[1] : -1;
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
static enum ng_status ng_exec_dp_reduce_layer_(struct ng_exec *e, const struct ng_graph *g, int l,
				      cudaStream_t s)
{
	float *grads = ng_exec_tensor_(e, g, g->t_grads);
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
enum ng_status ng_exec_dp_after_op_(struct ng_exec *e, const struct ng_graph *g, int i)
{
	if (!e->dp_bucket || g != &e->train || e->dp_bucket[i] < 0)
		return NG_OK;
	int l = e->dp_bucket[i];
	if (NG_CUDA_CHECK(cudaEventRecord(e->dp_ready[l], e->stream)) ||
	    NG_CUDA_CHECK(cudaStreamWaitEvent(e->dp_stream, e->dp_ready[l], 0)))
		return NG_ERR_RUNTIME;
	enum ng_status r = ng_collective_group_begin();
	if (!r)
		r = ng_exec_dp_reduce_layer_(e, g, l, e->dp_stream);
	enum ng_status r2 = ng_collective_group_end();
	e->dp_sent[l] = true;
	return r ? r : r2;
}

/* --fp8 with several ranks: fold this step's maxima to a word a slot before the group that
 * fp8_maxima_ joins (unfold = 0), and back after it (unfold = 1). Each rank saw its own
 * batch; the ranks share one scale a slot, the maximum over them, as one process with the whole
 * batch would; reduced at the step's end, the state between steps (what a checkpoint keeps) is
 * the same on every rank. */
static enum ng_status fp8_fold_(struct ng_exec *e, const struct ng_graph *g, int unfold,
				cudaStream_t s)
{
	if (!g->fp8 || g->t_fp8_state < 0)
		return NG_OK;
	const int L = g->cfg.L;
	float *f = ng_exec_tensor_(e, g, g->t_fp8_state);
	return ng_fp8_amax_fold(f + ng_fp8_field_at(L, NG_FP8_ACT_AMAX), NG_FP8_AMAX_SUB,
				NG_FP8_AMAX_STRIDE, ng_fp8_slots(L),
				(unsigned *)(f + ng_fp8_field_at(L, NG_FP8_AMAX_BITS)), unfold, s);
}

/* Inside GRAD_NORM's NCCL group: the folded maxima, max-reduced (a no-op without --fp8). */
static enum ng_status fp8_maxima_(struct ng_exec *e, const struct ng_graph *g, cudaStream_t s)
{
	if (!g->fp8 || g->t_fp8_state < 0)
		return NG_OK;
	float *f = ng_exec_tensor_(e, g, g->t_fp8_state);
	return ng_collective_allreduce_max_u32(e->cfg.comm,
					       (unsigned *)(f + ng_fp8_field_at(g->cfg.L,
										 NG_FP8_AMAX_BITS)),
					       (size_t)ng_fp8_slots(g->cfg.L), s);
}

/* GRAD_NORM with overlap: join dp_stream, then all-reduce what was not sent (one group). */
/* The step state's loss_sum and stop are mean-reduced as two adjacent floats. */
_Static_assert(offsetof(struct ng_step_state, stop) ==
		       offsetof(struct ng_step_state, loss_sum) + sizeof(float),
	       "ng_step_state: stop must follow loss_sum");
_Static_assert(sizeof(struct ng_metrics_record) == 32, "ng_metrics_record: 32 bytes");

/* loss: the step state's {loss_sum, stop}, mean-reduced together. */
static enum ng_status ng_exec_dp_reduce_rest_(struct ng_exec *e, const struct ng_graph *g, float *loss,
				     cudaStream_t s)
{
	int L = g->cfg.L, sent = 0;
	for (int l = 0; l < L; l++)
		sent += e->dp_sent[l];
	if (sent && (NG_CUDA_CHECK(cudaEventRecord(e->dp_join, e->dp_stream)) ||
		     NG_CUDA_CHECK(cudaStreamWaitEvent(s, e->dp_join, 0))))
		return NG_ERR_RUNTIME;
	float *grads = ng_exec_tensor_(e, g, g->t_grads);
	enum ng_status r = fp8_fold_(e, g, 0, s);
	if (r)
		return r;
	r = ng_collective_group_begin();
	if (!r)
		r = fp8_maxima_(e, g, s);
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
			r = ng_exec_dp_reduce_layer_(e, g, l, s);
	if (!r)
		r = ng_collective_allreduce_mean_f32(e->cfg.comm, loss, 2, s); /* loss_sum, stop */
	enum ng_status r2 = ng_collective_group_end();
	memset(e->dp_sent, 0, sizeof(bool) * (size_t)L);
	if (!r && !r2)
		r = fp8_fold_(e, g, 1, s);
	return r ? r : r2;
}

/* Before GRAD_NORM: the mean gradient (all of it, or this rank's shard with ZeRO-1) and the
 * mean loss over ranks, then the squared norm (ZeRO-1: of the shard, summed across ranks). */
enum ng_status ng_exec_dp_grad_norm_(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, void *scratch, cudaStream_t s)
{
	struct ng_step_state *st = ng_exec_tensor_(e, g, op->out[0]);
	float *grads = ng_exec_tensor_(e, g, op->in[0]);
	size_t total = g->lay.total;
	enum ng_status r;
	if (e->dp_bucket) {
		r = ng_exec_dp_reduce_rest_(e, g, &st->loss_sum, s);
		return r ? r : ng_grad_norm_squared(&st->grad_norm, grads, total, scratch, s);
	}
	r = fp8_fold_(e, g, 0, s);
	if (!r)
		r = ng_collective_group_begin();
	if (!r)
		r = fp8_maxima_(e, g, s);
	if (!r)
		r = e->cfg.zero1 ? ng_collective_reduce_scatter_mean_f32(e->cfg.comm, grads,
									 e->shard_len, e->cfg.rank, s)
				 : ng_collective_allreduce_mean_f32(e->cfg.comm, grads, total, s);
	if (!r)
		r = ng_collective_allreduce_mean_f32(e->cfg.comm, &st->loss_sum, 2, s); /* + stop */
	enum ng_status r2 = ng_collective_group_end();
	if (!r && !r2)
		r = fp8_fold_(e, g, 1, s);
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

/* ZeRO-1 AdamW: each parameter tensor's part inside [shard_off, shard_off + shard_len), the low
 * half of the master and the moments indexed from the shard start; then every rank's updated
 * shard of the bf16 copy to every rank (the low halves stay where they are). */
enum ng_status ng_exec_dp_adamw_shard_(struct ng_exec *e, const struct ng_graph *g,
				     const struct ng_op *op, cudaStream_t s)
{
	const struct ng_step_state *st = ng_exec_tensor_(e, g, op->in[1]);
	ng_bf16 *w16 = ng_exec_tensor_(e, g, op->out[0]);
	uint16_t *wlo = ng_exec_tensor_(e, g, op->out[1]);
	float *grad = ng_exec_tensor_(e, g, op->in[0]);
	float *m = ng_exec_tensor_(e, g, op->out[2]), *v = ng_exec_tensor_(e, g, op->out[3]);
	size_t lo = e->shard_off, hi = e->shard_off + e->shard_len;
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &g->lay.p[i];
		size_t a = p->offset > lo ? p->offset : lo;
		size_t b = p->offset + p->numel < hi ? p->offset + p->numel : hi;
		if (a >= b)
			continue;
		enum ng_status r = ng_adamw(w16 + a, wlo + (a - lo), grad + a, m + (a - lo),
					    v + (a - lo), b - a, p->decay ? e->cfg.wd : 0.0f,
					    e->cfg.beta1, e->cfg.beta2, e->cfg.eps, st, s);
		if (r)
			return r;
	}
	return ng_collective_allgather(e->cfg.comm, w16, e->shard_len, 2, e->cfg.rank, s);
}

/* A ZeRO-1 checkpoint: every rank's shard of the master's low half and of the AdamW moments
 * gathered through the gradient buffer (world * shard_len floats, free between steps; zeroed
 * afterwards, as a restore leaves it) into host params (joined with the full bf16 copy), m and
 * v (lay.total floats each; NULL on the ranks that do not write). Collective: every rank calls
 * it between the same two steps. */
enum ng_status ng_exec_dp_gather_state_(struct ng_exec *e, float *params, float *m, float *v)
{
	const struct ng_graph *g = &e->train;
	float *buf = ng_exec_tensor_(e, g, g->t_grads);
	uint16_t *buf16 = (uint16_t *)buf;
	size_t len = e->shard_len, total = g->lay.total;
	float *host[2] = { m, v };
	int moment[2] = { g->t_adam_m, g->t_adam_v };
	enum ng_status st = NG_CUDA_CHECK(cudaMemcpyAsync(buf16 + e->shard_off,
							  ng_exec_tensor_(e, g, g->t_params_lo),
							  len * sizeof(uint16_t),
							  cudaMemcpyDeviceToDevice, e->stream));
	if (!st)
		st = ng_collective_allgather(e->cfg.comm, buf16, len, 2, e->cfg.rank, e->stream);
	if (!st && params)
		st = ng_exec_join_params_(e, params, buf16); /* waits for the gather */
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	for (int k = 0; k < 2 && !st; k++) {
		st = NG_CUDA_CHECK(cudaMemcpyAsync(buf + e->shard_off, ng_exec_tensor_(e, g, moment[k]),
						   len * sizeof(float), cudaMemcpyDeviceToDevice,
						   e->stream));
		if (!st)
			st = ng_collective_allgather(e->cfg.comm, buf, len, 4, e->cfg.rank, e->stream);
		if (!st && host[k])
			st = NG_CUDA_CHECK(cudaMemcpyAsync(host[k], buf, total * sizeof(float),
							   cudaMemcpyDeviceToHost, e->stream));
		if (!st)
			st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	}
	if (!st)
		st = NG_CUDA_CHECK(cudaMemsetAsync(buf, 0, g->tensors[g->t_grads].bytes, e->stream));
	return st ? st : NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
}
