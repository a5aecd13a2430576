/*
 * graph/exec_replay.c — running the captured step after ng_exec_init (see exec.h): the pinned
 * token buffer, one graph launch a step (or the nodes eagerly with --no-graph) with no host
 * synchronisation, the metrics read from the host-mapped ring a step late, the stop request,
 * the evaluation graph, and the DOT dump of the captured graph.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec_internal.h"
#include "graph/step_spr.h"
#include "kernels/check.h"

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
	/* the first step's time, and the first after an evaluation or a checkpoint's snapshot
	 * (with everything collected), counts from here: it leaves those and the host's work
	 * between them out */
	if (e->submitted == 0 || (e->restart_timing && e->collected == e->submitted)) {
		if (NG_CUDA_CHECK(cudaEventRecord(e->start, e->stream)))
			return NG_ERR_RUNTIME;
		e->start_at = e->submitted;
	}
	e->restart_timing = false;
	if (e->cfg.model.arch == NG_ARCH_SPEEDRUN) { /* the variant of this step's window */
		int step = (int)(e->step_base + e->submitted);
		e->spr_variant = ng_spr_window_blocks(step, e->cfg.sched.total) - 1;
		if (e->spr_variant >= NG_EXEC_SPR_BANDS)
			e->spr_variant = NG_EXEC_SPR_BANDS - 1;
	}
	if (e->cfg.no_graph)
		st = ng_exec_run_eager_(e, &e->train, e->train_plan);
	else if (e->cfg.model.arch == NG_ARCH_SPEEDRUN)
		st = NG_CUDA_CHECK(cudaGraphLaunch(e->spr_exec[e->spr_variant], e->stream));
	else
		st = NG_CUDA_CHECK(cudaGraphLaunch(e->train_exec, e->stream));
	e->spr_variant = NG_EXEC_SPR_BANDS - 1;
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
			cudaEvent_t prev = e->collected == e->start_at
						   ? e->start : e->done[(e->collected - 1) % NG_EXEC_RING];
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

enum ng_status ng_exec_evaluate(struct ng_exec *e, const uint16_t *tokens, int window,
				double *loss)
{
	if (e->cfg.eval_batches == 0)
		return ng_fail(NG_ERR_RUNTIME, "no evaluation graph was planned");
	const struct ng_graph *g = &e->eval;
	if (NG_CUDA_CHECK(cudaStreamSynchronize(e->stream)))
		return NG_ERR_RUNTIME;
	memcpy(e->h_eval_tokens, tokens,
	       (size_t)e->cfg.eval_batches * e->cfg.B * (e->cfg.T + 1) * sizeof(uint16_t));
	enum ng_status st = NG_OK;
	if (g->t_eval_window >= 0) { /* the speedrun's window, read by the graph's ATTN_BOUNDS */
		int32_t w = window >= 1 && window <= NG_EXEC_SPR_BANDS ? window : NG_EXEC_SPR_BANDS;
		st = NG_CUDA_CHECK(cudaMemcpyAsync(ng_exec_tensor_(e, g, g->t_eval_window), &w,
						   sizeof(w), cudaMemcpyHostToDevice, e->stream));
		if (!st) /* w lives on this stack frame */
			st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	}
	if (!st)
		st = e->cfg.no_graph ? ng_exec_run_eager_(e, g, e->eval_plan)
				     : NG_CUDA_CHECK(cudaGraphLaunch(e->eval_exec, e->stream));
	float l = 0;
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpyAsync(&l, ng_exec_tensor_(e, g, g->t_eval_loss), sizeof(float),
						   cudaMemcpyDeviceToHost, e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	e->restart_timing = true; /* the next step's time leaves the evaluation out */
	*loss = l;
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
