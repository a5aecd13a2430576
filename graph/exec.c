/*
 * graph/exec.c — the executor's life (see exec.h): ng_exec_init plans the step, allocates the
 * arena, warms up and captures the step as one CUDA Graph; ng_exec_free undoes it. Each phase
 * is a function of its own here or in the file named for it: graph/exec_plan.c (with the timed
 * choices of graph/exec_trials.c), graph/exec_dispatch.c (the ops' launches),
 * graph/exec_state.c (the initial state), graph/exec_profile.c; after init, replay is
 * graph/exec_replay.c. docs/DESIGN.md says why the whole step is planned ahead.
 */
#include "graph/exec.h"
#include "graph/exec_internal.h"
#include "graph/optim_muon.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/check.h"

static double peak_for(const char *name)
{
	if (strstr(name, "H100") || strstr(name, "H200") || strstr(name, "H800") ||
	    strstr(name, "GH200"))
		return 989e12;
	if (strstr(name, "A100") || strstr(name, "A800"))
		return 312e12;
	return 0;
}

/* The device and what every phase shares: its properties, the streams and their events, the
 * cuDNN and cuBLASLt handles. NG_ERR_INPUT for --fp8 on a GPU without FP8 tensor cores. */
static enum ng_status open_device(struct ng_exec *e, struct cudaDeviceProp *prop)
{
	int dev = 0;
	if (NG_CUDA_CHECK(cudaGetDevice(&dev)) || NG_CUDA_CHECK(cudaGetDeviceProperties(prop, dev)))
		return NG_ERR_RUNTIME;
	snprintf(e->device_name, sizeof(e->device_name), "%s", prop->name);
	e->peak_flops = peak_for(prop->name);
	int has_fp8 = prop->major * 10 + prop->minor >= 89;
	if (e->cfg.model.arch == NG_ARCH_SPEEDRUN &&
	    (e->cfg.step.fp8 & ~NG_FP8_HEAD_BWD) == NG_FP8_HEAD && !has_fp8)
		e->cfg.step.fp8 = 0; /* the FP8 head where the GPU has FP8, else bf16 */
	if (e->cfg.step.fp8 && !has_fp8) {
		ng_fail(NG_ERR_INPUT, "--fp8: %s (sm_%d%d) has no FP8 tensor cores (sm_89 and newer "
			"have)", prop->name, prop->major, prop->minor);
		ng_hint("drop --fp8: the bf16 step runs on this GPU");
		return NG_ERR_INPUT;
	}
	if (NG_CUDA_CHECK(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking)) ||
	    NG_CUDA_CHECK(cudaStreamCreateWithFlags(&e->side_stream, cudaStreamNonBlocking)) ||
	    NG_CUDA_CHECK(cudaEventCreateWithFlags(&e->side_fork, cudaEventDisableTiming)) ||
	    NG_CUDA_CHECK(cudaEventCreateWithFlags(&e->side_join, cudaEventDisableTiming)) ||
	    NG_CUDNN_CHECK(cudnnCreate(&e->cudnn)))
		return NG_ERR_RUNTIME;
	enum ng_status st = ng_matmul_ctx_init(&e->mmctx, 32u << 20);
	e->mmctx.own_gemm = !e->cfg.no_own_gemm;
	return st;
}

/* The one arena of the planned size (NG_ERR_INPUT with the numbers and a hint when the GPU has
 * less free), the pinned token buffers, the host-mapped metrics ring, the events. */
static enum ng_status allocate(struct ng_exec *e)
{
	const struct ng_exec_config *c = &e->cfg;
	e->arena_bytes = e->train.total_bytes;
	if (c->eval_batches > 0 && e->eval.total_bytes > e->arena_bytes)
		e->arena_bytes = e->eval.total_bytes;
	size_t free_b = 0, total_b = 0;
	cudaMemGetInfo(&free_b, &total_b);
	if (e->arena_bytes > free_b) {
		ng_fail(NG_ERR_INPUT, "the step needs %.2f GiB of device memory but %s has %.2f GiB "
			"free (of %.2f GiB)", e->arena_bytes / 1073741824.0, e->device_name,
			free_b / 1073741824.0, total_b / 1073741824.0);
		ng_hint("--recompute auto recomputes as little as fits; or use a smaller --batch "
			"with --total-batch to keep the tokens per step, or --recompute "
			"gelu,layernorm (with --fp8 also fp8) and a smaller --head-chunk: `nanograph "
			"plan` shows what each saves");
		return NG_ERR_INPUT;
	}
	if (NG_CUDA_CHECK(cudaMalloc((void **)&e->arena, e->arena_bytes)))
		return NG_ERR_RUNTIME;
	size_t tok = (size_t)c->K * c->B * (c->T + 1) * sizeof(uint16_t);
	size_t etok = (size_t)c->eval_batches * c->B * (c->T + 1) * sizeof(uint16_t);
	if (NG_CUDA_CHECK(cudaHostAlloc((void **)&e->h_stop, sizeof(float), cudaHostAllocDefault)) ||
	    NG_CUDA_CHECK(cudaHostAlloc((void **)&e->h_tokens, tok, cudaHostAllocDefault)) ||
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
	*e->h_stop = 0.0f;
	memset(e->ring, 0, sizeof(*e->ring) * NG_EXEC_RING);
	return NG_OK;
}

/* One eager step on zero tokens (loads every module; an error names its node), the eval step
 * likewise, the profile when asked, then the initial state again for training. */
static enum ng_status warm_up(struct ng_exec *e)
{
	const struct ng_exec_config *c = &e->cfg;
	enum ng_status st = ng_exec_reset_state_(e);
	if (!st)
		st = ng_exec_run_eager_(e, &e->train, e->train_plan);
	if (!st && c->eval_batches > 0) {
		memset(e->h_eval_tokens, 0,
		       (size_t)c->eval_batches * c->B * (c->T + 1) * sizeof(uint16_t));
		st = ng_exec_run_eager_(e, &e->eval, e->eval_plan);
	}
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	if (!st && c->profile)
		st = ng_exec_profile_step_(e);
	if (!st)
		st = ng_exec_reset_state_(e);
	return st;
}

static enum ng_status capture(struct ng_exec *e, const struct ng_graph *g, const int *pl,
			      cudaGraph_t *graph, cudaGraphExec_t *exec)
{
	if (NG_CUDA_CHECK(cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeGlobal)))
		return NG_ERR_RUNTIME;
	enum ng_status st = ng_exec_run_eager_(e, g, pl);
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


/* The train step (and the eval step) captured and instantiated, unless --no-graph launches the
 * nodes eagerly; the metrics ring cleared of the warm-up's records. */
static enum ng_status capture_step(struct ng_exec *e)
{
	enum ng_status st = NG_OK;
	const int spr = e->cfg.model.arch == NG_ARCH_SPEEDRUN;
	for (int v = 0; spr && v < NG_EXEC_SPR_BANDS && !st && !e->cfg.no_graph; v++) {
		e->spr_variant = v; /* the step of window W = v + 1 */
		st = capture(e, &e->train, e->train_plan, &e->spr_graph[v], &e->spr_exec[v]);
	}
	e->spr_variant = NG_EXEC_SPR_BANDS - 1; /* eval: the widest bands, right at any window */
	if (!st && !e->cfg.no_graph && !spr)
		st = capture(e, &e->train, e->train_plan, &e->train_graph, &e->train_exec);
	if (!st && !e->cfg.no_graph && e->cfg.eval_batches > 0)
		st = capture(e, &e->eval, e->eval_plan, &e->eval_graph, &e->eval_exec);
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	memset(e->ring, 0, sizeof(*e->ring) * NG_EXEC_RING);
	return st;
}

/* Every time "not timed" until a trial says otherwise. */
static void clear_report(struct ng_exec_report *r)
{
	memset(r, 0, sizeof(*r));
	r->gelu_fwd_ms[0] = r->gelu_fwd_ms[1] = -1.0f;
	for (int v = 0; v < 3; v++)
		r->dgelu_ms[v] = -1.0f;
	for (int k = 0; k < NG_EXEC_FP8_KINDS; k++)
		r->fp8_ms[k][0] = r->fp8_ms[k][1] = -1.0f;
}

enum ng_status ng_exec_init(struct ng_exec *e, const struct ng_exec_config *cfg,
			    struct ng_exec_report *report)
{
	struct ng_exec_report rep;
	clear_report(&rep);
	memset(e, 0, sizeof(*e));
	e->cfg = *cfg;
	if (cfg->deterministic) /* a timed choice could differ between two runs */
		e->cfg.autotune = 0;
	e->inited = true;
	e->spr_variant = NG_EXEC_SPR_BANDS - 1; /* the warm-up's: the widest bands */
	ng_graph_init(&e->train);
	ng_graph_init(&e->eval);
	struct cudaDeviceProp prop;
	enum ng_status st = open_device(e, &prop);
	if (!st)
		st = ng_exec_plan_(e, &prop, &rep);
	if (!st)
		st = allocate(e);
	if (!st)
		st = warm_up(e);
	if (!st)
		st = capture_step(e);
	if (report)
		*report = rep;
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
	ng_optim_muon_free_(e);
	for (int i = 0; i < e->n_plans; i++)
		ng_matmul_free(&e->plans[i].mm);
	if (e->mmctx.lt)
		ng_matmul_ctx_free(&e->mmctx);
	ng_attention_free(&e->att);
	for (int k = 0; k < NG_EXEC_SPR_BANDS; k++) {
		ng_attention_free(&e->att_band[k]);
		if (e->spr_exec[k])
			cudaGraphExecDestroy(e->spr_exec[k]);
		if (e->spr_graph[k])
			cudaGraphDestroy(e->spr_graph[k]);
	}
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
	cudaFreeHost(e->h_stop);
	cudaFreeHost(e->h_eval_tokens);
	cudaFreeHost(e->ring);
	cudaFree(e->arena);
	if (e->stream)
		cudaStreamDestroy(e->stream);
	if (e->side_stream)
		cudaStreamDestroy(e->side_stream);
	if (e->side_fork)
		cudaEventDestroy(e->side_fork);
	if (e->side_join)
		cudaEventDestroy(e->side_join);
	free(e->train_plan);
	free(e->eval_plan);
	free(e->op_ms);
	ng_graph_free(&e->train);
	ng_graph_free(&e->eval);
	e->inited = false;
}

