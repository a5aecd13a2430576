/*
 * graph/exec_profile.c — `train --profile`: the device time of every op of one training step,
 * measured at init (ng_exec_profile_step_), and the table of it by op kind and layer type that
 * the init log prints (ng_exec_print_profile).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec_internal.h"
#include "kernels/check.h"
#include "util/rng.h"

/* --profile: each op's device time in one step. With graphs (the default) the step is captured
 * a second time with an event record node after every op and replayed PROFILE_REPLAYS times
 * (the first warms up; each op gets the median of the others), so the figures are those of a
 * replay: no launch gaps, the GPU as busy (and as power-limited) as in training. With
 * --no-graph the ops are timed as launched. Tokens: a fixed pseudo-random batch (the all-zero
 * warm-up batch makes the embedding backward one long run). Runs after the warm-up step and
 * before the state is reset for training (graph/exec.c). */
enum { PROFILE_REPLAYS = 5 };

enum ng_status ng_exec_profile_step_(struct ng_exec *e)
{
	const struct ng_graph *g = &e->train;
	int n = g->n_ops, reps = e->cfg.no_graph ? 2 : PROFILE_REPLAYS;
	size_t tok = (size_t)e->cfg.K * e->cfg.B * (e->cfg.T + 1);
	for (size_t i = 0; i < tok; i++)
		e->h_tokens[i] = (uint16_t)(ng_rng_mix64(0x9e3779b97f4a7c15ull + i) % (uint64_t)g->cfg.V);
	cudaEvent_t *ev = calloc((size_t)n + 1, sizeof(*ev));
	float *ms = calloc((size_t)n * reps, sizeof(float));
	e->op_ms = calloc((size_t)n, sizeof(float));
	if (!ev || !ms || !e->op_ms) {
		free(ev);
		free(ms);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	}
	cudaGraph_t gr = NULL;
	cudaGraphExec_t ex = NULL;
	unsigned flags = e->cfg.no_graph ? cudaEventRecordDefault : cudaEventRecordExternal;
	enum ng_status st = NG_OK;
	for (int i = 0; i <= n && !st; i++)
		st = NG_CUDA_CHECK(cudaEventCreate(&ev[i]));
	if (!st && !e->cfg.no_graph)
		st = NG_CUDA_CHECK(cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeGlobal));
	for (int r = 0; r < (e->cfg.no_graph ? reps : 1) && !st; r++) {
		st = NG_CUDA_CHECK(cudaEventRecordWithFlags(ev[0], e->stream, flags));
		for (int i = 0; i < n && !st; i++) {
			st = ng_exec_run_op_(e, g, &g->ops[i], e->train_plan[i]);
			if (!st)
				st = NG_CUDA_CHECK(cudaEventRecordWithFlags(ev[i + 1], e->stream, flags));
		}
		if (!e->cfg.no_graph)
			break; /* captured: timed by the replays below */
		if (!st)
			st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
		for (int i = 0; i < n && !st; i++)
			st = NG_CUDA_CHECK(cudaEventElapsedTime(&ms[(size_t)i * reps + r], ev[i],
								ev[i + 1]));
	}
	ng_check_set_node(NULL);
	if (!e->cfg.no_graph) {
		cudaError_t ce = cudaStreamEndCapture(e->stream, &gr);
		if (!st)
			st = NG_CUDA_CHECK(ce);
		if (!st)
			st = NG_CUDA_CHECK(cudaGraphInstantiate(&ex, gr, 0));
		for (int r = 0; r < reps && !st; r++) {
			st = NG_CUDA_CHECK(cudaGraphLaunch(ex, e->stream));
			if (!st)
				st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
			for (int i = 0; i < n && !st; i++)
				st = NG_CUDA_CHECK(cudaEventElapsedTime(&ms[(size_t)i * reps + r],
									ev[i], ev[i + 1]));
		}
	}
	for (int i = 0; i < n && !st; i++) { /* median of replays 1..reps-1 */
		float *v = ms + (size_t)i * reps + 1;
		qsort(v, (size_t)reps - 1, sizeof(float), ng_exec_cmp_float_);
		e->op_ms[i] = (reps - 1) % 2 ? v[(reps - 1) / 2]
					     : 0.5f * (v[(reps - 1) / 2 - 1] + v[(reps - 1) / 2]);
	}
	e->profile_replayed = !e->cfg.no_graph;
	if (ex)
		cudaGraphExecDestroy(ex);
	if (gr)
		cudaGraphDestroy(gr);
	for (int i = 0; i <= n; i++)
		if (ev[i])
			cudaEventDestroy(ev[i]);
	free(ev);
	free(ms);
	memset(e->h_tokens, 0, tok * sizeof(uint16_t));
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
	fprintf(f, "profile of one step, %s (%d ops, %.2f ms of device time):\n",
		e->profile_replayed ? "graph replays with an event after each op, median of 4"
				    : "ops launched eagerly", g->n_ops, total);
	for (int j = 0; j < nr; j++)
		fprintf(f, "  %-24s %-8s x%-4d %8.3f ms  %5.1f%%\n", ng_op_kind_name(rows[j].kind),
			ng_op_which_name(rows[j].which), rows[j].count, rows[j].ms,
			100 * rows[j].ms / total);
}
