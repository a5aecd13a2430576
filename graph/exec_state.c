/*
 * graph/exec_state.c — the training state in the arena and the host (see exec.h): the seeded
 * initial state, copies of persistent tensors in and out (checkpoints, tests), and the fp32
 * master, which the arena keeps split into its bf16 copy and a low half (kernels/split.h) while
 * the host API stays fp32; with ZeRO-1 the low half and the moments are this rank's shard.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec_internal.h"
#include "kernels/check.h"
#include "kernels/fp8.h"
#include "kernels/split.h"

/* Elements per host staging chunk of the split master (2 x 2 bytes each: 64 MiB). */
#define SPLIT_CHUNK ((size_t)1 << 24)

/* --fp8 dinp and dW: before any step has recorded a gradient maximum, an E5M2 scale of 1 would flush
 * the first steps' gradients to zero (the loss is a mean over the N*K tokens of a step, so they
 * are ~1/(N*K) small; E5M2's smallest is 2^-16). Each gradient slot's history starts with the
 * maximum that gives the scale N*K (undoing the mean) instead; the real maxima replace it as it
 * leaves the window (NG_FP8_HISTORY steps). Fields as graph/step.h "FP8". */
enum ng_status ng_exec_seed_grad_scales_(struct ng_exec *e, const struct ng_graph *g)
{
	const int L = g->cfg.L, S4 = ng_fp8_fwd_slots(L), n = ng_fp8_slots(L) - S4;
	float *h = calloc((size_t)n * NG_FP8_HISTORY, sizeof(float));
	if (!h)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	double tokens = (double)g->B * g->T * g->K;
	for (int k = 0; k < n; k++)
		h[(size_t)k * NG_FP8_HISTORY] =
			(float)(NG_FP8_E5M2_MAX / (ldexp(1.0, NG_FP8_ACT_MARGIN) * tokens));
	float *f = ng_exec_tensor_(e, g, g->t_fp8_state);
	/* on e->stream, after the memset that zeroed the state (a plain cudaMemcpy would run on
	 * the legacy stream, unordered with this non-blocking one), and waited for before h goes */
	enum ng_status st = NG_CUDA_CHECK(cudaMemcpyAsync(
		f + ng_fp8_field_at(L, NG_FP8_HIST) + (size_t)S4 * NG_FP8_HISTORY, h,
		(size_t)n * NG_FP8_HISTORY * sizeof(float), cudaMemcpyHostToDevice, e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	free(h);
	return st;
}

/* Parameters from the seeded init (split into the bf16 copy and the low half); zero grads,
 * moments and the step state. */
enum ng_status ng_exec_reset_state_(struct ng_exec *e)
{
	const struct ng_graph *g = &e->train;
	size_t n = g->lay.total;
	float *h = malloc(n * sizeof(float));
	if (!h)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for %zu parameters", n);
	ng_gpt_init(&g->cfg, &g->lay, e->cfg.seed, h);
	enum ng_status st = ng_exec_upload_params_(e, h);
	free(h);
	int zero[] = { g->t_grads, g->t_adam_m, g->t_adam_v, g->t_step_state, g->t_fp8_state };
	for (int i = 0; i < 5 && !st && zero[i] >= 0; i++)
		st = NG_CUDA_CHECK(cudaMemsetAsync(ng_exec_tensor_(e, g, zero[i]), 0, g->tensors[zero[i]].bytes,
						   e->stream));
	if (!st && (g->fp8 & (NG_FP8_DINP_ALL | NG_FP8_DW_ALL)))
		st = ng_exec_seed_grad_scales_(e, g);
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
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
	e->restart_timing = true; /* the next step's time leaves the checkpoint out */
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
	if (!st && (g->fp8 & (NG_FP8_DINP_ALL | NG_FP8_DW_ALL)))
		st = ng_exec_seed_grad_scales_(e, g);
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	if (!st)
		e->step_base = step - e->collected;
	return st;
}
