/*
 * graph/exec_host.c — the host side of the GPU executor after ng_exec_init: feeding tokens,
 * launching a step (graph replay or eager), collecting metrics from the pinned ring a step late,
 * evaluation, copying persistent tensors in and out (checkpoints, tests), the per-op profile
 * table and the captured graph's DOT dump. Planning, capture and run_op live in exec.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec.h"
#include "graph/exec_internal.h"
#include "kernels/check.h"
#include "kernels/split.h"

/* Elements per host staging chunk of the split master (2 x 2 bytes each: 64 MiB). */
#define SPLIT_CHUNK ((size_t)1 << 24)

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
	fprintf(f, "profile of one step, %s (%d ops, %.2f ms of device time):\n",
		e->profile_replayed ? "graph replays with an event after each op, median of 4"
				    : "ops launched eagerly", g->n_ops, total);
	for (int j = 0; j < nr; j++)
		fprintf(f, "  %-24s %-8s x%-4d %8.3f ms  %5.1f%%\n", ng_op_kind_name(rows[j].kind),
			ng_op_which_name(rows[j].which), rows[j].count, rows[j].ms,
			100 * rows[j].ms / total);
}

void ng_exec_request_stop(struct ng_exec *e)
{
	*(volatile float *)e->h_stop = 1.0f;
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
		st = ng_exec_run_eager_(e, &e->train, e->train_plan);
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
	enum ng_status st = e->cfg.no_graph ? ng_exec_run_eager_(e, g, e->eval_plan)
					    : NG_CUDA_CHECK(cudaGraphLaunch(e->eval_exec, e->stream));
	float l = 0;
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpyAsync(&l, ng_exec_tensor_(e, g, g->t_eval_loss), sizeof(float),
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
	return NG_CUDA_CHECK(cudaMemcpy(host, ng_exec_tensor_(e, g, tensor), g->tensors[tensor].bytes,
					cudaMemcpyDeviceToHost));
}

enum ng_status ng_exec_upload(struct ng_exec *e, int tensor, const void *host)
{
	const struct ng_graph *g = &e->train;
	if (NG_CUDA_CHECK(cudaStreamSynchronize(e->stream)))
		return NG_ERR_RUNTIME;
	/* on e->stream: a pageable cudaMemcpy may return before its DMA lands, unordered with the
	 * (non-blocking) stream's next kernels */
	if (NG_CUDA_CHECK(cudaMemcpyAsync(ng_exec_tensor_(e, g, tensor), host,
					  g->tensors[tensor].bytes, cudaMemcpyHostToDevice, e->stream)))
		return NG_ERR_RUNTIME;
	return NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
}

/* Host <-> device copies of `bytes` of a persistent tensor from byte `off`, on e->stream and
 * waited for (a pageable host-to-device cudaMemcpy may return before its DMA lands, unordered
 * with the non-blocking stream). */
static enum ng_status copy_(struct ng_exec *e, int tensor, size_t off, void *host, size_t bytes,
			    enum cudaMemcpyKind kind)
{
	char *dev = (char *)ng_exec_tensor_(e, &e->train, tensor) + off;
	if (NG_CUDA_CHECK(cudaMemcpyAsync(kind == cudaMemcpyHostToDevice ? (void *)dev : host,
					  kind == cudaMemcpyHostToDevice ? host : (void *)dev, bytes,
					  kind, e->stream)))
		return NG_ERR_RUNTIME;
	return NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
}

static bool zero1_sharded(const struct ng_exec *e) { return e->cfg.zero1 && e->cfg.world > 1; }

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* Split host fp32 params (lay.total) into the bf16 copy (all of it) and the low half (this
 * rank's shard with ZeRO-1, its padding zeroed; else all of it), through a host staging chunk:
 * the host API stays fp32 (checkpoints, init, tests). */
enum ng_status ng_exec_upload_params_(struct ng_exec *e, const float *params)
{
	const struct ng_graph *g = &e->train;
	size_t total = g->lay.total, lo_off = 0, lo_n = total;
	ng_bf16 *d_hi = ng_exec_tensor_(e, g, g->t_params_bf16);
	uint16_t *d_lo = ng_exec_tensor_(e, g, g->t_params_lo);
	enum ng_status st = NG_OK;
	if (zero1_sharded(e)) {
		lo_off = min_sz(e->shard_off, total);
		lo_n = min_sz(total - lo_off, e->shard_len);
		st = NG_CUDA_CHECK(cudaMemsetAsync(d_lo, 0, g->tensors[g->t_params_lo].bytes,
						   e->stream));
	}
	uint16_t *hi = malloc(2 * SPLIT_CHUNK * sizeof(uint16_t));
	if (!hi)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for the parameter upload");
	uint16_t *lo = hi + SPLIT_CHUNK;
	for (size_t a = 0; a < total && !st; a += SPLIT_CHUNK) {
		long long n = (long long)min_sz(SPLIT_CHUNK, total - a);
#pragma omp parallel for schedule(static)
		for (long long i = 0; i < n; i++)
			ng_split_encode(params[a + (size_t)i], &hi[i], &lo[i]);
		/* stream-ordered, then waited for: a pageable cudaMemcpy may return before its DMA
		 * lands, and the staging chunk is refilled next */
		st = NG_CUDA_CHECK(cudaMemcpyAsync(d_hi + a, hi, (size_t)n * sizeof(ng_bf16),
						   cudaMemcpyHostToDevice, e->stream));
		size_t x = a > lo_off ? a : lo_off, y = min_sz(a + (size_t)n, lo_off + lo_n);
		if (!st && x < y)
			st = NG_CUDA_CHECK(cudaMemcpyAsync(d_lo + (x - lo_off), lo + (x - a),
							   (y - x) * sizeof(uint16_t),
							   cudaMemcpyHostToDevice, e->stream));
		if (!st)
			st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	}
	free(hi);
	return st;
}

/* The fp32 master (lay.total floats) joined from the bf16 copy and a device low half of all
 * lay.total elements (params_lo, or with ZeRO-1 the halves gathered from every rank). */
enum ng_status ng_exec_join_params_(struct ng_exec *e, float *params, const uint16_t *d_lo)
{
	const struct ng_graph *g = &e->train;
	size_t total = g->lay.total;
	const ng_bf16 *d_hi = ng_exec_tensor_(e, g, g->t_params_bf16);
	uint16_t *hi = malloc(2 * SPLIT_CHUNK * sizeof(uint16_t));
	if (!hi)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for the parameter download");
	uint16_t *lo = hi + SPLIT_CHUNK;
	enum ng_status st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	for (size_t a = 0; a < total && !st; a += SPLIT_CHUNK) {
		long long n = (long long)min_sz(SPLIT_CHUNK, total - a);
		st = NG_CUDA_CHECK(cudaMemcpyAsync(hi, d_hi + a, (size_t)n * sizeof(ng_bf16),
						   cudaMemcpyDeviceToHost, e->stream));
		if (!st)
			st = NG_CUDA_CHECK(cudaMemcpyAsync(lo, d_lo + a,
							   (size_t)n * sizeof(uint16_t),
							   cudaMemcpyDeviceToHost, e->stream));
		if (!st)
			st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
		if (st)
			break;
#pragma omp parallel for schedule(static)
		for (long long i = 0; i < n; i++)
			params[a + (size_t)i] = ng_split_decode(hi[i], lo[i]);
	}
	free(hi);
	return st;
}

enum ng_status ng_exec_snapshot(struct ng_exec *e, float *params, float *m, float *v,
				long long *step, long long *n_skipped)
{
	const struct ng_graph *g = &e->train;
	if (e->submitted != e->collected)
		return ng_fail(NG_ERR_RUNTIME, "checkpoint with %lld steps in flight",
			       e->submitted - e->collected);
	size_t bytes = g->lay.total * sizeof(float);
	struct ng_step_state ss = { 0 };
	enum ng_status st = ng_exec_download(e, g->t_step_state, &ss);
	if (zero1_sharded(e)) {
		/* collective: joined even after a failure above, or the other ranks would wait in
		 * it for ever (nothing is copied out then) */
		enum ng_status g2 = ng_exec_dp_gather_state_(e, st ? NULL : params, st ? NULL : m,
							     st ? NULL : v);
		if (!st)
			st = g2;
	} else {
		if (!st && params)
			st = ng_exec_join_params_(e, params, ng_exec_tensor_(e, g, g->t_params_lo));
		if (!st && m)
			st = copy_(e, g->t_adam_m, 0, m, bytes, cudaMemcpyDeviceToHost);
		if (!st && v)
			st = copy_(e, g->t_adam_v, 0, v, bytes, cudaMemcpyDeviceToHost);
	}
	*step = ss.step;
	*n_skipped = ss.n_skipped;
	return st;
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
	size_t total = g->lay.total, off = 0, n = total;
	if (zero1_sharded(e)) { /* this rank's shard of the moments; padding 0 */
		off = e->shard_off < total ? e->shard_off : total;
		n = total - off < e->shard_len ? total - off : e->shard_len;
		if (NG_CUDA_CHECK(cudaMemsetAsync(ng_exec_tensor_(e, g, g->t_adam_m), 0,
						  e->shard_len * sizeof(float), e->stream)) ||
		    NG_CUDA_CHECK(cudaMemsetAsync(ng_exec_tensor_(e, g, g->t_adam_v), 0,
						  e->shard_len * sizeof(float), e->stream)))
			return NG_ERR_RUNTIME;
	}
	enum ng_status st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	if (!st)
		st = ng_exec_upload_params_(e, params);
	if (!st)
		st = copy_(e, g->t_adam_m, 0, (void *)(m + off), n * sizeof(float),
			   cudaMemcpyHostToDevice);
	if (!st)
		st = copy_(e, g->t_adam_v, 0, (void *)(v + off), n * sizeof(float),
			   cudaMemcpyHostToDevice);
	if (!st)
		st = copy_(e, g->t_step_state, 0, &ss, sizeof(ss), cudaMemcpyHostToDevice);
	if (!st)
		st = NG_CUDA_CHECK(cudaMemsetAsync(ng_exec_tensor_(e, g, g->t_grads), 0,
						   g->tensors[g->t_grads].bytes, e->stream));
	/* --fp8: the scales restart here (seeded as at init); the caller uploads the state file's
	 * fp8_state over them when it has one of this size (src/backend_cuda.c) */
	if (!st && g->t_fp8_state >= 0)
		st = NG_CUDA_CHECK(cudaMemsetAsync(ng_exec_tensor_(e, g, g->t_fp8_state), 0,
						   g->tensors[g->t_fp8_state].bytes, e->stream));
	if (!st && (g->fp8 & NG_FP8_DINP_ALL))
		st = ng_exec_seed_grad_scales_(e, g);
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
