/*
 * tools/bench_matmul.c — times every matmul of the GPT-2 step (kernels/matmul.h) at the d12
 * (B=64, T=1024, C=768) and d48 (B=16, T=1024, C=1600) shapes, Vp = 50304.
 *
 * For each matmul, planned with the heuristic's first choice and again with autotune, it times
 * the wrapper (ng_matmul_run) and the same cuBLASLt call(s) made directly (same descriptor,
 * layouts, algorithm, buffers and workspace; plus the same bias-gradient call after it),
 * alternating launch by launch, each launch bracketed by CUDA events, the launches back to back
 * (no host sync between them, as in a replayed graph). It prints the median ms, TFLOP/s, the
 * wrapper/direct ratio (the wrapper's target: <= 1.05), the per-step GEMM total, and what the
 * BGRADB bias gradient costs next to a separate column-sum kernel estimated at the 4.28 TB/s copy
 * bandwidth of docs/GPU.md.
 *
 * Usage: bench_matmul [--sustained | --algos] [reps] [d12|d24|d48 ...]   (default 30 launches
 *        of each, wrapper and direct; d12 and d48 unless sizes are named; d24 is B=32, C=1024, L=24)
 *        --sustained: instead, every heuristic candidate of each matmul timed in
 *        bursts (synchronised launches) and under sustained load (~150 ms back to back after
 *        ~150 ms of heating); the per-step GEMM time of three choices, all timed sustained.
 *        --algos: the heuristic's algorithms and their split-K variants (see algos_config_).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/check.h"
#include "kernels/matmul.h"
#include "tools/bench_sustained.h"
#include "util/rng.h"

#define BENCH_MAX_REPS 200
#define BENCH_COPY_BW 4.28e12 /* bytes/s, device-to-device copy ceiling on the H200 */

/* One configuration's device buffers, sized for its largest matmul. */
struct bench_bufs {
	void *a;    /* activations / dout: N * Vp bf16 */
	void *b;    /* weights or inp: max(Vp*C, N*4C) bf16 */
	void *out;  /* outputs: max(N*Vp*2, Vp*C*4) bytes */
	void *aux;  /* GELU aux: N * 4C bf16 */
	void *bias; /* bias (bf16) / dbias (fp32): Vp fp32 */
	void *ws;   /* workspace: ctx limit + dbias scratch */
	float *descale; /* fp8 plans: two device floats of 1, 16 bytes apart (cuBLASLt wants each
	                 * 16-byte aligned; the inputs are whatever bytes a and b hold: the timing
	                 * does not depend on the values) */
};

/* One matmul of the step. */
struct bench_mm {
	const char *name;        /* layer name */
	struct ng_matmul_spec s; /* its spec (autotune set per run) */
	int per_step;            /* how many times per step (L for per-layer matmuls, 1 for head) */
};

static int cmp_f_(const void *x, const void *y)
{
	float a = *(const float *)x, b = *(const float *)y;
	return (a > b) - (a < b);
}

static int fill_(void *dst, size_t bytes, const void *chunk, size_t chunk_bytes)
{
	for (size_t off = 0; off < bytes; off += chunk_bytes) {
		size_t n = bytes - off < chunk_bytes ? bytes - off : chunk_bytes;
		if (NG_CUDA_CHECK(cudaMemcpy((char *)dst + off, chunk, n, cudaMemcpyHostToDevice)))
			return 1;
	}
	return 0;
}

/* The direct calls, mirroring ng_matmul_run without its checks and attribute writes. */
static int direct_(const struct ng_matmul *mm, const struct bench_bufs *bb, cudaStream_t s)
{
	const float one = 1.0f;
	if (cublasLtMatmul(mm->lt, mm->desc, &one, bb->b, mm->a, bb->a, mm->b, &mm->beta, bb->out,
			   mm->c, bb->out, mm->d, &mm->algo, mm->algo_ws ? bb->ws : NULL,
			   mm->algo_ws, s) != CUBLAS_STATUS_SUCCESS)
		return 1;
	if (mm->colsum) {
		const float third = 1.0f / 3.0f;
		void *v = (char *)bb->ws + mm->threes_off;
		if (cudaMemsetAsync(v, 0x40, (size_t)mm->spec.N * 2, s) != cudaSuccess ||
		    cublasLtMatmul(mm->lt, mm->sdesc, &third, bb->a, mm->sa, v, mm->sb, &mm->beta,
				   bb->bias, mm->sd, bb->bias, mm->sd, &mm->salgo,
				   mm->salgo_ws ? bb->ws : NULL, mm->salgo_ws,
				   s) != CUBLAS_STATUS_SUCCESS)
			return 1;
	}
	if (mm->add && cublasLtMatrixTransform(mm->lt, mm->add, &one,
					       (const char *)bb->ws + mm->scratch_off, mm->vec,
					       &one, bb->bias, mm->vec, bb->bias, mm->vec,
					       s) != CUBLAS_STATUS_SUCCESS)
		return 1;
	return 0;
}

static int wrapper_(const struct ng_matmul *mm, const struct bench_bufs *bb, cudaStream_t s)
{
	if (mm->spec.fp8)
		return ng_matmul_run_fp8(mm, bb->out, bb->a, bb->b, bb->bias, bb->aux, bb->descale,
					 bb->descale + 4, bb->ws, s) != NG_OK;
	return ng_matmul_run(mm, bb->out, bb->a, bb->b, bb->bias, bb->aux, bb->bias, bb->ws, s) !=
	       NG_OK;
}

/* Median ms of the wrapper and of the direct calls: 2 * reps launches back to back,
 * alternating wrapper / direct so both see the same clocks, each between two CUDA events. */
static int time_plan_(const struct ng_matmul *mm, const struct bench_bufs *bb, int reps,
		      cudaEvent_t *ev, float *wms, float *dms)
{
	float tw[BENCH_MAX_REPS], td[BENCH_MAX_REPS];
	for (int r = 0; r < 6; r++) /* warm-up */
		if ((r & 1) ? direct_(mm, bb, 0) : wrapper_(mm, bb, 0))
			return 1;
	for (int r = 0; r < 2 * reps; r++) {
		cudaEventRecord(ev[r], 0);
		if ((r & 1) ? direct_(mm, bb, 0) : wrapper_(mm, bb, 0))
			return 1;
	}
	cudaEventRecord(ev[2 * reps], 0);
	if (NG_CUDA_CHECK(cudaEventSynchronize(ev[2 * reps])))
		return 1;
	for (int r = 0; r < 2 * reps; r++)
		cudaEventElapsedTime((r & 1) ? &td[r / 2] : &tw[r / 2], ev[r], ev[r + 1]);
	qsort(tw, (size_t)reps, sizeof(float), cmp_f_);
	qsort(td, (size_t)reps, sizeof(float), cmp_f_);
	*wms = tw[reps / 2];
	*dms = td[reps / 2];
	return 0;
}

static const char *epi_name_(const struct ng_matmul_spec *s, int colsum)
{
	if (s->kind == NG_MATMUL_FWD)
		return s->gelu ? "GELU_AUX_BIAS" : s->bias ? "BIAS" : "-";
	if (s->kind == NG_MATMUL_DINP)
		return s->gelu ? "DGELU" : "-";
	return !s->bias ? "-" : colsum ? "colsum" : "BGRADB+add";
}

static int sustained; /* --sustained: time every candidate under sustained load instead */

/* ms per launch of mm with the GPU held busy (tools/bench_sustained.h; est_ms: a first
 * estimate). */
struct launch_arg {
	const struct ng_matmul *mm;
	const struct bench_bufs *bb;
};

static int launch_(const void *arg)
{
	const struct launch_arg *la = arg;
	return wrapper_(la->mm, la->bb, 0);
}

static int time_sustained_(const struct ng_matmul *mm, const struct bench_bufs *bb,
			   cudaEvent_t *ev, float est_ms, float *ms)
{
	struct launch_arg la = { mm, bb };
	return ng_time_sustained(launch_, &la, ev, est_ms, ms);
}

/* --sustained: each matmul's heuristic candidates timed in bursts (autotune's way) and under
 * sustained load; per step: the heuristic's first, the burst-autotuned and the sustained-best
 * choice, all three timed sustained. */
static int sustained_config_(struct ng_matmul_ctx *ctx, const char *cfg, const struct bench_mm *mms,
			     int nm, const struct bench_bufs *bb, cudaEvent_t *ev)
{
	double step[3] = {0, 0, 0};
	printf("\n== %s, sustained load: per candidate burst ms / sustained ms ==\n", cfg);
	for (int i = 0; i < nm; i++) {
		struct ng_matmul mm;
		struct ng_matmul_spec sp = mms[i].s;
		sp.autotune = 1;
		float keep = ctx->tune_sustained_ms;
		ctx->force_candidate = -1;
		ctx->tune_sustained_ms = 0.0f; /* the burst ranking, as autotune did before */
		int bad_plan = ng_matmul_plan(&mm, ctx, &sp) != NG_OK;
		ctx->tune_sustained_ms = keep;
		if (bad_plan)
			return 1;
		int cands = mm.n_candidates, burst_pick = mm.chosen;
		float burst[8];
		memcpy(burst, mm.tuned_ms, sizeof(burst));
		ng_matmul_free(&mm);
		float sus[8] = {0};
		int best = 0;
		printf("%-8s %d N=%d IC=%d OC=%d:", mms[i].name, (int)sp.kind, sp.N, sp.IC, sp.OC);
		for (int c = 0; c < cands && c < 8; c++) {
			ctx->force_candidate = c;
			if (ng_matmul_plan(&mm, ctx, &sp))
				return 1;
			int bad = burst[c] > 0.0f ? time_sustained_(&mm, bb, ev, burst[c], &sus[c]) : 1;
			ng_matmul_free(&mm);
			if (bad) {
				ng_clear_error();
				cudaGetLastError();
				sus[c] = 0.0f;
				printf("  #%d -", c);
				continue;
			}
			if (sus[c] < sus[best] || sus[best] <= 0.0f)
				best = c;
			printf("  #%d %.4f/%.4f", c, burst[c], sus[c]);
		}
		ctx->force_candidate = -1;
		printf("  | burst pick #%d, sustained best #%d (%+.1f%% vs #0)\n", burst_pick, best,
		       sus[0] > 0 ? 100.0 * (sus[best] - sus[0]) / sus[0] : 0.0);
		step[0] += sus[0] * mms[i].per_step;
		step[1] += sus[burst_pick] * mms[i].per_step;
		step[2] += sus[best] * mms[i].per_step;
	}
	printf("%s: GEMM ms per step under sustained load: heuristic %.2f, burst-autotuned %.2f, "
	       "sustained-best %.2f\n", cfg, step[0], step[1], step[2]);
	return 0;
}

/* --algos: every heuristic algorithm (up to 32) of each matmul and, for the first six, the
 * split-K variants (2..8 parts, in-place and compute-type reduction) that
 * cublasLtMatmulAlgoCheck accepts, each timed under sustained load on the direct cuBLASLt
 * call (no bias-gradient column sum); the per-step GEMM time of the heuristic's first, of the
 * best heuristic algorithm and of the best of all. */
static int algos;

#define ALGOS_MAX 256

struct algo_cfg_ {
	int32_t id, splitk;
	uint32_t tile, stages, red, swz;
	uint16_t inner, cluster;
};

static void algo_cfg_(const cublasLtMatmulAlgo_t *a, struct algo_cfg_ *c)
{
	size_t wr;
	memset(c, 0, sizeof(*c));
	cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_ID, &c->id, 4, &wr);
	cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_TILE_ID, &c->tile, 4, &wr);
	cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c->splitk, 4, &wr);
	cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c->red, 4,
					     &wr);
	cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &c->swz, 4, &wr);
	cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &c->stages, 4, &wr);
	cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &c->inner, 2,
					     &wr);
	cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c->cluster, 2,
					     &wr);
}

static void algo_print_(const cublasLtMatmulAlgo_t *a, size_t ws)
{
	struct algo_cfg_ c;
	algo_cfg_(a, &c);
	printf("id %d tile %u stages %u splitk %d red %u swz %u inner %u cluster %u ws %.1fM", c.id,
	       c.tile, c.stages, c.splitk, c.red, c.swz, c.inner, c.cluster, ws / 1048576.0);
}

/* ms per launch of the bare cuBLASLt call with algo: k launches between two events. */
static int time_algo_(const struct ng_matmul *mm, const cublasLtMatmulAlgo_t *algo, size_t ws,
		      const struct bench_bufs *bb, cudaEvent_t *ev, int k, float *ms)
{
	const float one = 1.0f;
	cudaEventRecord(ev[0], 0);
	for (int r = 0; r < k; r++)
		if (cublasLtMatmul(mm->lt, mm->desc, &one, bb->b, mm->a, bb->a, mm->b, &mm->beta,
				   bb->out, mm->c, bb->out, mm->d, algo, ws ? bb->ws : NULL, ws,
				   0) != CUBLAS_STATUS_SUCCESS)
			return 1;
	cudaEventRecord(ev[1], 0);
	if (cudaEventSynchronize(ev[1]) != cudaSuccess)
		return 1;
	cudaEventElapsedTime(ms, ev[0], ev[1]);
	*ms /= (float)k;
	return 0;
}

static int algos_config_(struct ng_matmul_ctx *ctx, const char *cfg, const struct bench_mm *mms,
			 int nm, const struct bench_bufs *bb, cudaEvent_t *ev)
{
	static cublasLtMatmulAlgo_t cand[ALGOS_MAX];
	static size_t cws[ALGOS_MAX];
	static float cms[ALGOS_MAX];
	double step[3] = {0, 0, 0};
	printf("\n== %s: heuristic algorithms and split-K variants, sustained ms ==\n", cfg);
	for (int i = 0; i < nm; i++) {
		struct ng_matmul mm;
		struct ng_matmul_spec sp = mms[i].s;
		if (ng_matmul_plan(&mm, ctx, &sp) || wrapper_(&mm, bb, 0)) /* sets the pointers */
			return 1;
		cublasLtMatmulPreference_t pref;
		uint64_t wsl = ctx->workspace_bytes;
		uint32_t al = ctx->align_bytes; /* as the plans ask (matmul.c, heuristic_) */
		cublasLtMatmulPreferenceCreate(&pref);
		cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
						     &wsl, sizeof(wsl));
		cublasLtMatmulPreferenceAttributes_t at[4] = {
			CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
			CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
			CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
			CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
		for (int j = 0; j < 4; j++)
			cublasLtMatmulPreferenceSetAttribute(pref, at[j], &al, sizeof(al));
		cublasLtMatmulHeuristicResult_t res[32];
		int got = 0, n = 0;
		cublasLtMatmulAlgoGetHeuristic(mm.lt, mm.desc, mm.a, mm.b, mm.c, mm.d, pref, 32, res,
					       &got);
		cublasLtMatmulPreferenceDestroy(pref);
		for (int j = 0; j < got; j++) {
			cand[n] = res[j].algo;
			cws[n++] = res[j].workspaceSize;
		}
		for (int j = 0; j < got && j < 6; j++) {
			int32_t sup = 0;
			uint32_t mask = 0;
			size_t wr;
			cublasLtMatmulAlgoCapGetAttribute(&res[j].algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT,
							  &sup, 4, &wr);
			cublasLtMatmulAlgoCapGetAttribute(&res[j].algo,
							  CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK,
							  &mask, 4, &wr);
			if (!sup)
				continue;
			static const int32_t ks[5] = {2, 3, 4, 6, 8};
			static const uint32_t rs[2] = {CUBLASLT_REDUCTION_SCHEME_INPLACE,
						       CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
			for (int a = 0; a < 5; a++)
				for (int b = 0; b < 2 && n < ALGOS_MAX; b++) {
					if (!(mask & rs[b]))
						continue;
					cublasLtMatmulAlgo_t v = res[j].algo;
					cublasLtMatmulHeuristicResult_t chk;
					cublasLtMatmulAlgoConfigSetAttribute(
						&v, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &ks[a], 4);
					cublasLtMatmulAlgoConfigSetAttribute(
						&v, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &rs[b], 4);
					if (cublasLtMatmulAlgoCheck(mm.lt, mm.desc, mm.a, mm.b, mm.c,
								    mm.d, &v, &chk) !=
						    CUBLAS_STATUS_SUCCESS ||
					    chk.workspaceSize > ctx->workspace_bytes)
						continue;
					cand[n] = v;
					cws[n++] = chk.workspaceSize;
				}
		}
		float t0;
		if (!got || time_algo_(&mm, &cand[0], cws[0], bb, ev, 20, &t0)) {
			ng_matmul_free(&mm);
			printf("%-8s %d: no heuristic algorithm ran\n", mms[i].name, (int)sp.kind);
			continue;
		}
		int k = (int)(150.0f / t0); /* heat ~150 ms, then ~40 ms a candidate */
		time_algo_(&mm, &cand[0], cws[0], bb, ev, k < 20 ? 20 : k, &t0);
		k = (int)(40.0f / t0);
		if (k < 10)
			k = 10;
		int best = 0, best_h = 0;
		for (int c = 0; c < n; c++) {
			if (time_algo_(&mm, &cand[c], cws[c], bb, ev, k, &cms[c])) {
				cudaGetLastError();
				cms[c] = 1e30f;
				continue;
			}
			if (cms[c] < cms[best])
				best = c;
			if (c < got && cms[c] < cms[best_h])
				best_h = c;
		}
		if (time_algo_(&mm, &cand[0], cws[0], bb, ev, k, &t0)) /* #0 again, after the rest */
			t0 = cms[0];
		double fl = ng_matmul_flops(&sp);
		printf("%-8s %-4s N=%d IC=%d OC=%d: %d heuristic + %d split variants | #0 %.4f/%.4f "
		       "ms (%.0f TFLOP/s) | best heuristic #%d %.4f | best #%d %.4f ms (%.0f TFLOP/s, "
		       "%+.1f%%): ", mms[i].name, sp.kind == NG_MATMUL_FWD ? "FWD" : sp.kind ==
		       NG_MATMUL_DINP ? "DINP" : "DW", sp.N, sp.IC, sp.OC, got, n - got, cms[0], t0,
		       fl / (cms[0] * 1e-3) / 1e12, best_h, cms[best_h], best, cms[best],
		       fl / (cms[best] * 1e-3) / 1e12, 100.0 * (cms[best] - cms[0]) / cms[0]);
		algo_print_(&cand[best], cws[best]);
		printf("\n    #0: ");
		algo_print_(&cand[0], cws[0]);
		printf("\n");
		step[0] += cms[0] * mms[i].per_step;
		step[1] += cms[best_h] * mms[i].per_step;
		step[2] += cms[best] * mms[i].per_step;
		for (int r = 0; r < 4; r++) { /* the next four fastest, for the record */
			int nb = -1;
			for (int c = 0; c < n; c++)
				if (c != best && cms[c] < 1e29f && (nb < 0 || cms[c] < cms[nb]))
					nb = c;
			if (nb < 0)
				break;
			printf("    %s#%d %.4f: ", nb < got ? "h" : "s", nb, cms[nb]);
			algo_print_(&cand[nb], cws[nb]);
			printf("\n");
			cms[nb] = 1e30f; /* printed */
		}
		ng_matmul_free(&mm);
	}
	printf("%s: GEMM ms per step (bare matmuls, sustained): heuristic #0 %.2f, best heuristic "
	       "%.2f, best with split-K %.2f\n", cfg, step[0], step[1], step[2]);
	return 0;
}

static int bench_config_(struct ng_matmul_ctx *ctx, const char *cfg, int B, int T, int C, int L,
			 int Vp, int reps, cudaEvent_t *ev)
{
	const int N = B * T;
	const char *kn[3] = {"FWD", "DINP", "DW"};
	struct bench_mm mms[15];
	int nm = 0;
	struct { const char *name; int IC, OC, gelu, bias, per; } lin[5] = {
		{"qkv", C, 3 * C, 0, 1, L},     {"attproj", C, C, 0, 1, L},
		{"fc", C, 4 * C, 1, 1, L},      {"fcproj", 4 * C, C, 0, 1, L},
		{"head", C, Vp, 0, 0, 1}};
	for (int i = 0; i < 5; i++) {
		struct ng_matmul_spec f = {NG_MATMUL_FWD, N, lin[i].IC, lin[i].OC, lin[i].gelu,
					   lin[i].bias, 0, 0, 0, 0, 0};
		/* DGELU belongs to the layer whose INPUT is a GELU output: fcproj */
		struct ng_matmul_spec d = {NG_MATMUL_DINP, N, lin[i].IC, lin[i].OC,
					   i == 3, 0, 0, 0, 0, 0, 0};
		struct ng_matmul_spec w = {NG_MATMUL_DW, N, lin[i].IC, lin[i].OC, 0, lin[i].bias, 1,
					   0, 0, 0, 0};
		mms[nm++] = (struct bench_mm){lin[i].name, f, lin[i].per};
		mms[nm++] = (struct bench_mm){lin[i].name, d, lin[i].per};
		mms[nm++] = (struct bench_mm){lin[i].name, w, lin[i].per};
	}

	struct bench_bufs bb = {0};
	size_t chunk_bytes = (size_t)64 << 20;
	size_t a_bytes = (size_t)N * Vp * 2;
	size_t b_bytes = (size_t)Vp * C * 2 > (size_t)N * 4 * C * 2 ? (size_t)Vp * C * 2
								      : (size_t)N * 4 * C * 2;
	size_t o_bytes = (size_t)N * Vp * 2 > (size_t)Vp * C * 4 ? (size_t)N * Vp * 2
								  : (size_t)Vp * C * 4;
	size_t x_bytes = (size_t)N * 4 * C * 2;
	uint16_t *chunk = malloc(chunk_bytes);
	struct ng_rng rng;
	ng_rng_seed(&rng, 1234);
	for (size_t i = 0; i < chunk_bytes / 2; i++) { /* bf16 of N(0, 0.5): top half of fp32 */
		float f = (float)(0.5 * ng_rng_normal(&rng));
		uint32_t u;
		memcpy(&u, &f, 4);
		chunk[i] = (uint16_t)(u >> 16);
	}
	int rc = 1;
	if (NG_CUDA_CHECK(cudaMalloc(&bb.a, a_bytes)) || NG_CUDA_CHECK(cudaMalloc(&bb.b, b_bytes)) ||
	    NG_CUDA_CHECK(cudaMalloc(&bb.out, o_bytes)) || NG_CUDA_CHECK(cudaMalloc(&bb.aux, x_bytes)) ||
	    NG_CUDA_CHECK(cudaMalloc(&bb.bias, (size_t)Vp * 4)) ||
	    NG_CUDA_CHECK(cudaMalloc(&bb.ws, ctx->workspace_bytes + 256 + (size_t)Vp * 4)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&bb.descale, 8 * sizeof(float))))
		goto out_free;
	const float ones[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
	if (NG_CUDA_CHECK(cudaMemcpy(bb.descale, ones, sizeof(ones), cudaMemcpyHostToDevice)))
		goto out_free;
	if (fill_(bb.a, a_bytes, chunk, chunk_bytes) || fill_(bb.b, b_bytes, chunk, chunk_bytes) ||
	    fill_(bb.out, o_bytes, chunk, chunk_bytes) || fill_(bb.aux, x_bytes, chunk, chunk_bytes) ||
	    fill_(bb.bias, (size_t)Vp * 4, chunk, chunk_bytes))
		goto out_free;

	if (sustained) {
		rc = sustained_config_(ctx, cfg, mms, nm, &bb, ev);
		goto out_free;
	}
	if (algos) {
		rc = algos_config_(ctx, cfg, mms, nm, &bb, ev);
		goto out_free;
	}
	printf("\n== %s: B=%d T=%d C=%d L=%d Vp=%d (N=%d), median of %d launches each ==\n", cfg,
	       B, T, C, L, Vp, N, reps);
	printf("%-8s %-4s %6s %6s %6s %-13s | %-9s %9s %9s %7s %6s | %-7s %9s %7s %6s\n", "layer",
	       "kind", "N", "IC", "OC", "epilogue", "heur: ws", "wrap ms", "direct", "TFLOP/s",
	       "ratio", "tuned:", "wrap ms", "TFLOP/s", "ratio");
	double step_ms[2] = {0, 0}, worst_ratio = 0;
	for (int i = 0; i < nm; i++) {
		float wms[2], dms[2];
		size_t ws[2];
		int chosen = 0, cands = 0, colsum = 0;
		for (int tune = 0; tune < 2; tune++) {
			struct ng_matmul mm;
			struct ng_matmul_spec s = mms[i].s;
			s.autotune = tune;
			if (ng_matmul_plan(&mm, ctx, &s))
				goto out_free;
			if (mm.workspace_need > ctx->workspace_bytes + 256 + (size_t)Vp * 4) {
				fprintf(stderr, "workspace need %zu too large\n", mm.workspace_need);
				ng_matmul_free(&mm);
				goto out_free;
			}
			ws[tune] = mm.workspace_need;
			chosen = mm.chosen;
			colsum = mm.colsum;
			cands = mm.n_candidates;
			int bad = time_plan_(&mm, &bb, reps, ev, &wms[tune], &dms[tune]);
			ng_matmul_free(&mm);
			if (bad) {
				if (!ng_error_message()[0])
					ng_fail(NG_ERR_RUNTIME, "%s %s: a timed launch failed", cfg,
						mms[i].name);
				goto out_free;
			}
			step_ms[tune] += wms[tune] * mms[i].per_step;
			double r = wms[tune] / dms[tune];
			if (r > worst_ratio)
				worst_ratio = r;
		}
		double fl = ng_matmul_flops(&mms[i].s);
		printf("%-8s %-4s %6d %6d %6d %-13s | %7.1fM %9.4f %9.4f %7.1f %6.3f | #%d/%-4d %9.4f "
		       "%7.1f %6.3f\n", mms[i].name, kn[mms[i].s.kind], N, mms[i].s.IC, mms[i].s.OC,
		       epi_name_(&mms[i].s, colsum), ws[0] / 1048576.0, wms[0], dms[0],
		       fl / (wms[0] * 1e-3) / 1e12, wms[0] / dms[0], chosen, cands, wms[1],
		       fl / (wms[1] * 1e-3) / 1e12, wms[1] / dms[1]);
	}
	printf("%s: GEMM time per step (all micro-batch matmuls, wrapper): heuristic %.2f ms, "
	       "autotuned %.2f ms; worst wrapper/direct ratio %.3f\n", cfg, step_ms[0], step_ms[1],
	       worst_ratio);

	/* FP8 (E4M3 inputs, bf16 out, same epilogue) against bf16, forward shapes, heuristic's
	 * algorithm: what an FP8 forward would buy (docs/GPU.md: 1.45-1.68x with
	 * torch._scaled_mm). */
	double fp8_ms = 0, bf16_ms = 0;
	for (int i = 0; i < nm; i++) {
		if (mms[i].s.kind != NG_MATMUL_FWD)
			continue;
		float w[2], d[2];
		struct ng_matmul_spec v[2] = {mms[i].s, mms[i].s};
		v[1].fp8 = 1;
		int ok = 1;
		for (int j = 0; j < 2 && ok; j++) {
			struct ng_matmul mm;
			if (ng_matmul_plan(&mm, ctx, &v[j])) {
				printf("%s %-8s FWD fp8: no plan (%s)\n", cfg, mms[i].name,
				       ng_error_message());
				ng_clear_error();
				ok = 0;
				break;
			}
			int bad = time_plan_(&mm, &bb, reps, ev, &w[j], &d[j]);
			ng_matmul_free(&mm);
			if (bad)
				goto out_free;
		}
		if (!ok)
			continue;
		double fl = ng_matmul_flops(&mms[i].s);
		printf("%s %-8s FWD %-13s bf16 %.4f ms (%.1f TFLOP/s), fp8 %.4f ms (%.1f TFLOP/s): "
		       "%.2fx\n", cfg, mms[i].name, epi_name_(&mms[i].s, 0), w[0],
		       fl / (w[0] * 1e-3) / 1e12, w[1], fl / (w[1] * 1e-3) / 1e12, w[0] / w[1]);
		bf16_ms += w[0] * mms[i].per_step;
		fp8_ms += w[1] * mms[i].per_step;
	}
	if (fp8_ms > 0)
		printf("%s: forward GEMMs per step: bf16 %.2f ms, fp8 %.2f ms (casts not counted)\n",
		       cfg, bf16_ms, fp8_ms);

	/* Bias gradient: BGRADB (+ the scratch add) against the DW matmul alone, and against a
	 * separate column-sum kernel that reads dout once at copy bandwidth (an estimate). */
	for (int i = 0; i < nm; i++) {
		if (mms[i].s.kind != NG_MATMUL_DW || !mms[i].s.bias)
			continue;
		float w[4], d[4];
		int used_colsum[4];
		struct ng_matmul_spec v[4] = {mms[i].s, mms[i].s, mms[i].s, mms[i].s};
		v[1].bias = 0;                       /* no bias gradient at all */
		v[2].accumulate = 0;                 /* BGRADB straight into dbias, no add */
		int keep = ctx->dbias_colsum;
		for (int j = 0; j < 4; j++) {        /* j = 3: the column-sum matmul */
			struct ng_matmul mm;
			ctx->dbias_colsum = j == 3;
			enum ng_status pst = ng_matmul_plan(&mm, ctx, &v[j]);
			ctx->dbias_colsum = keep;
			if (pst)
				goto out_free;
			used_colsum[j] = mm.colsum;
			int bad = time_plan_(&mm, &bb, reps, ev, &w[j], &d[j]);
			ng_matmul_free(&mm);
			if (bad)
				goto out_free;
		}
		double sep_ms = ((double)N * mms[i].s.OC * 2 + mms[i].s.OC * 8.0) / BENCH_COPY_BW * 1e3;
		printf("%s %-8s DW bias grad (+=): %s %.4f ms, colsum matmul %.4f ms, DW alone %.4f "
		       "ms -> BGRADB costs %+.4f ms, colsum %+.4f ms; %s(=) %.4f ms; a column-sum "
		       "kernel at copy bandwidth >= %.4f ms\n", cfg, mms[i].name,
		       used_colsum[0] ? "colsum(fallback)" : "BGRADB+add", w[0], w[3], w[1],
		       w[0] - w[1], w[3] - w[1], used_colsum[2] ? "colsum" : "BGRADB", w[2], sep_ms);
	}
	rc = 0;
out_free:
	if (rc)
		ng_print_error();
	void *p[7] = {bb.a, bb.b, bb.out, bb.aux, bb.bias, bb.ws, bb.descale};
	for (int i = 0; i < 7; i++)
		if (p[i])
			cudaFree(p[i]);
	free(chunk);
	return rc;
}

int main(int argc, char **argv)
{
	sustained = argc > 1 && !strcmp(argv[1], "--sustained");
	algos = argc > 1 && !strcmp(argv[1], "--algos");
	if (sustained || algos)
		argc--, argv++;
	int reps = 30, first_size = 1; /* [reps] [sizes...] */
	if (argc > 1 && argv[1][0] >= '0' && argv[1][0] <= '9')
		reps = atoi(argv[1]), first_size = 2;
	setvbuf(stdout, NULL, _IOLBF, 0); /* lines survive a timeout kill */
	if (reps < 1 || reps > BENCH_MAX_REPS) {
		fprintf(stderr, "bench_matmul: reps must be 1..%d\n", BENCH_MAX_REPS);
		return 2;
	}
	if (ng_cuda_device_count() == 0) {
		fprintf(stderr, "bench_matmul: no CUDA device\n");
		return 1;
	}
	struct ng_matmul_ctx ctx;
	cudaEvent_t ev[2 * BENCH_MAX_REPS + 1];
	if (ng_matmul_ctx_init(&ctx, (size_t)32 << 20)) {
		ng_print_error();
		return 1;
	}
	for (int i = 0; i <= 2 * reps; i++)
		if (NG_CUDA_CHECK(cudaEventCreate(&ev[i]))) {
			ng_print_error();
			return 1;
		}
	static const struct { const char *name; int B, C, L; } sizes[3] = {
		{ "d12", 64, 768, 12 }, { "d24", 32, 1024, 24 }, { "d48", 16, 1600, 48 } };
	int want[3] = { argc <= first_size, 0, argc <= first_size }, rc = 0;
	for (int a = first_size; a < argc; a++) {
		int k = 0;
		while (k < 3 && strcmp(argv[a], sizes[k].name))
			k++;
		if (k == 3) {
			fprintf(stderr, "bench_matmul: unknown size '%s' (hint: d12, d24 or d48)\n",
				argv[a]);
			rc = 2;
			break;
		}
		want[k] = 1;
	}
	for (int k = 0; k < 3 && !rc; k++)
		if (want[k])
			rc = bench_config_(&ctx, sizes[k].name, sizes[k].B, 1024, sizes[k].C,
					   sizes[k].L, 50304, reps, ev);
	for (int i = 0; i <= 2 * reps; i++)
		cudaEventDestroy(ev[i]);
	ng_matmul_ctx_free(&ctx);
	return rc;
}
