/*
 * tools/probe_attention_mask.c — which cuDNN graphs of the speedrun model's attention mask
 * (kernels/attention.h: causal, a sliding-window band, a per-query lower bound lo) the loaded
 * cuDNN takes, how right they are and how fast. cuDNN's heuristics decide at plan time whether
 * a graph has a fused engine; only the GPU can say, so this program asks.
 *
 * Variants (each planned with ng_attention_plan_masked, scale 0.12, D = 128, H = 6):
 *   causal        the causal mask alone (GPT-2's graph at scale 0.12): the cost of no window
 *   band          causal + the band as a by-value scalar (one plan per window)
 *   band+lo       band, then the lower-bound select (lo [B,1,T,1] int32)
 *   lo+band       the lower-bound select first (where cudnn-frontend puts its padding mask)
 *   lo            causal + lower bound, no band (the window only through lo: no tile skipping)
 *   devband       causal + the band's width read from a device int32 tensor (one plan)
 *   devband+lo    devband, then the lower bound
 * 1. Check: B=2 T=1024 (3 documents a sequence, window 256; device bands: a band of 512 run at
 *    device windows 256 and 100): the engine and workspace of each direction (or the fallback's
 *    reason), and the max |cuDNN - naive| of out, lse and dqkv (the naive kernels are the
 *    oracle; "ok" when within 2^-6 of max|naive|, a few bf16 ulps).
 * 2. Time: forward + backward medians (CUDA events, 10 runs after 3) at B=1 T=49152 and B=48
 *    T=1024, windows 128, 896, 1792 (1792 only at T=49152), documents ~800 tokens long; the
 *    naive kernels beside them. Variants that have no cuDNN engine are not timed. No cuDNN plan
 *    is made after 150 s (no naive one after 170 s), so the run stays within ~3 minutes.
 * Usage: probe_attention_mask   (no arguments; prints one line per result)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/attention.h"
#include "kernels/check.h"
#include "util/rng.h"

#define BOS 50256
#define HEADS 6
#define HEAD 128
#define MAX_TOKENS 49152 /* tokens of the largest shape (B x T) */
#define BUDGET_S 150.0   /* no new plan after this many seconds */

struct variant {
	const char *name;
	int band;     /* 1: a band (by value, or on the device) */
	int lo;       /* 1: the lower bound */
	int dev;      /* 1: the band's width on the device */
	enum ng_attention_lo_order order;
};

static const struct variant variants[] = {
	{"band+lo", 1, 1, 0, NG_ATTENTION_LO_AFTER},
	{"devband+lo", 1, 1, 1, NG_ATTENTION_LO_AFTER},
	{"band", 1, 0, 0, NG_ATTENTION_LO_AUTO},
	{"causal", 0, 0, 0, NG_ATTENTION_LO_AUTO},
	{"lo+band", 1, 1, 0, NG_ATTENTION_LO_BEFORE},
	{"devband", 1, 0, 1, NG_ATTENTION_LO_AUTO},
	{"lo", 0, 1, 0, NG_ATTENTION_LO_AFTER},
};
#define N_VARIANTS ((int)(sizeof(variants) / sizeof(variants[0])))

/* Device buffers sized for the largest shape, shared by every plan. */
struct bufs {
	ng_bf16 *qkv, *dqkv, *out, *dout, *out2, *dqkv2;
	float *lse, *lse2;
	int32_t *tok, *lo, *window;
};

static double t0;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* cuDNN plans compile kernels (seconds each) and stop at BUDGET_S; the naive ones are instant
 * and run until BUDGET_S + 20 s, so the baseline is there whenever there is time for it. */
static int over_budget(int naive) { return now_s() - t0 > BUDGET_S + (naive ? 20.0 : 0.0); }

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

static float bf2f(ng_bf16 b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* N(0,1) bf16 values into a device buffer (top 16 bits of the float). */
static int fill_normal(ng_bf16 *d, size_t n, struct ng_rng *r)
{
	ng_bf16 *h = malloc(n * 2);
	if (!h)
		return 1;
	for (size_t i = 0; i < n; i++) {
		float f = (float)ng_rng_normal(r);
		uint32_t u;
		memcpy(&u, &f, 4);
		h[i] = (ng_bf16)(u >> 16);
	}
	int bad = NG_CUDA_CHECK(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice)) != NG_OK;
	free(h);
	return bad;
}

/* Tokens of B sequences of T with a BOS about every doc_len tokens (and at 0). */
static int fill_tokens(int32_t *d, int B, int T, int doc_len, struct ng_rng *r)
{
	size_t n = (size_t)B * T;
	int32_t *h = malloc(n * 4);
	if (!h)
		return 1;
	for (size_t i = 0; i < n; i++)
		h[i] = (int32_t)ng_rng_below(r, BOS);
	for (int b = 0; b < B; b++) {
		h[(size_t)b * T] = BOS;
		for (int k = 0; k < T / doc_len; k++)
			h[(size_t)b * T + ng_rng_below(r, (uint64_t)T)] = BOS;
	}
	int bad = NG_CUDA_CHECK(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice)) != NG_OK;
	free(h);
	return bad;
}

static struct ng_attention_opts opts_of(const struct variant *v, int band)
{
	struct ng_attention_opts o = {.scale = 0.12f, .max_window = v->band ? band : 0,
				      .lower_bound = v->lo, .band_on_device = v->dev,
				      .lo_order = v->order};
	return o;
}

/* Plans (timed); returns 0 on success. */
static int plan(struct ng_attention *att, cudnnHandle_t h, int B, int T,
		const struct ng_attention_opts *o, int naive, double *secs)
{
	double t = now_s();
	if (ng_attention_plan_masked(att, h, B, HEADS, T, HEAD, 0, naive, o)) {
		ng_print_error();
		ng_clear_error();
		return 1;
	}
	*secs = now_s() - t;
	return 0;
}

/* lo from the tokens and the device window, then forward + backward; 0 on success. */
static int step(const struct ng_attention *att, struct bufs *d, int dev_window, ng_bf16 *out,
		float *lse, ng_bf16 *dqkv, void *wsf, void *wsb, cudaStream_t s)
{
	if (NG_CUDA_CHECK(cudaMemcpyAsync(d->window, &dev_window, 4, cudaMemcpyHostToDevice, s)))
		return 1;
	if (att->lower_bound && ng_attention_lower_bound(d->lo, d->tok, d->window, att->max_window,
							 1 /* which engines take it, not lo */,
							 att->B, att->T, BOS, s))
		return 1;
	if (ng_attention_fwd_masked(att, out, lse, d->qkv, d->lo, d->window, wsf, s))
		return 1;
	return ng_attention_bwd_masked(att, dqkv, d->dout, d->qkv, out, lse, d->lo, d->window, wsb,
				       s) != NG_OK;
}

static int alloc_ws(const struct ng_attention *att, void **wsf, void **wsb)
{
	*wsf = *wsb = NULL;
	return NG_CUDA_CHECK(cudaMalloc(wsf, ng_attention_fwd_workspace(att) + 256)) ||
	       NG_CUDA_CHECK(cudaMalloc(wsb, ng_attention_bwd_workspace(att) + 256));
}

/* max |a - b| over n device bf16 values, and max |b|. */
static void diff_bf16(const ng_bf16 *a, const ng_bf16 *b, size_t n, double *err, double *mx)
{
	ng_bf16 *ha = malloc(n * 2), *hb = malloc(n * 2);
	*err = INFINITY, *mx = 0;
	if (ha && hb && !cudaMemcpy(ha, a, n * 2, cudaMemcpyDeviceToHost) &&
	    !cudaMemcpy(hb, b, n * 2, cudaMemcpyDeviceToHost)) {
		*err = 0;
		for (size_t i = 0; i < n; i++) {
			double x = bf2f(ha[i]), y = bf2f(hb[i]), e = fabs(x - y);
			if (!(e <= *err))
				*err = isnan(e) ? INFINITY : e;
			*mx = fmax(*mx, fabs(y));
		}
	}
	free(ha), free(hb);
}

static void diff_f32(const float *a, const float *b, size_t n, double *err, double *mx)
{
	float *ha = malloc(n * 4), *hb = malloc(n * 4);
	*err = INFINITY, *mx = 0;
	if (ha && hb && !cudaMemcpy(ha, a, n * 4, cudaMemcpyDeviceToHost) &&
	    !cudaMemcpy(hb, b, n * 4, cudaMemcpyDeviceToHost)) {
		*err = 0;
		for (size_t i = 0; i < n; i++) {
			double e = fabs((double)ha[i] - hb[i]);
			if (!(e <= *err))
				*err = isnan(e) ? INFINITY : e;
			*mx = fmax(*mx, fabs((double)hb[i]));
		}
	}
	free(ha), free(hb);
}

/* Phase 1 for one variant: plan at the check shape, report, compare with the naive kernels.
 * Returns 1 when at least one direction runs on cuDNN. */
static int check_variant(const struct variant *v, cudnnHandle_t h, struct bufs *d)
{
	const int B = 2, T = 1024, W = 256, band = v->dev ? 512 : W;
	struct ng_attention_opts o = opts_of(v, band);
	struct ng_attention att, ref;
	double secs, rs;
	if (plan(&att, h, B, T, &o, 0, &secs))
		return 0;
	int fwd_c = att.fwd_backend == NG_ATTENTION_BACKEND_CUDNN;
	int bwd_c = att.bwd_backend == NG_ATTENTION_BACKEND_CUDNN;
	printf("check %-11s fwd %s engine %lld ws %lld, bwd %s engine %lld ws %lld, plan %.2f s\n",
	       v->name, fwd_c ? "cuDNN" : "naive", (long long)att.fwd.engine,
	       (long long)att.fwd.workspace, bwd_c ? "cuDNN" : "naive", (long long)att.bwd.engine,
	       (long long)att.bwd.workspace, secs);
	printf("      %s\n", ng_attention_describe(&att));
	if (!fwd_c && !bwd_c) {
		ng_attention_free(&att);
		return 0;
	}
	void *wsf, *wsb, *rf, *rb;
	if (plan(&ref, NULL, B, T, &o, 1, &rs) || alloc_ws(&att, &wsf, &wsb) ||
	    alloc_ws(&ref, &rf, &rb)) {
		ng_print_error();
		ng_attention_free(&att);
		return 0;
	}
	size_t n_qkv = (size_t)B * T * 3 * HEADS * HEAD, n_o = n_qkv / 3;
	size_t n_l = (size_t)B * HEADS * T;
	int wins[2] = {W, 100};
	for (int k = 0; k < (v->dev ? 2 : 1); k++) {
		int ok = !step(&att, d, wins[k], d->out, d->lse, d->dqkv, wsf, wsb, 0) &&
			 !step(&ref, d, wins[k], d->out2, d->lse2, d->dqkv2, rf, rb, 0) &&
			 !NG_CUDA_CHECK(cudaDeviceSynchronize());
		if (!ok) {
			ng_print_error();
			ng_clear_error();
			printf("check %-11s window %d: run failed\n", v->name, wins[k]);
			continue;
		}
		double eo, mo, el, ml, eg, mg;
		diff_bf16(d->out, d->out2, n_o, &eo, &mo);
		diff_f32(d->lse, d->lse2, n_l, &el, &ml);
		diff_bf16(d->dqkv, d->dqkv2, n_qkv, &eg, &mg);
		int good = eo <= 0x1p-6 * mo && el <= 1e-3 * fmax(1.0, ml) && eg <= 0x1p-6 * mg;
		printf("check %-11s window %d vs naive: max|d out| %.3e (max %.3e), max|d lse| %.3e, "
		       "max|d dqkv| %.3e (max %.3e): %s\n", v->name, wins[k], eo, mo, el, eg, mg,
		       good ? "ok" : "WRONG");
	}
	cudaFree(wsf), cudaFree(wsb), cudaFree(rf), cudaFree(rb);
	ng_attention_free(&ref);
	ng_attention_free(&att);
	return 1;
}

/* Median fwd+bwd ms of a planned attention at device window w (negative on failure). */
static float time_plan(const struct ng_attention *att, struct bufs *d, int w, int iters)
{
	void *wsf, *wsb;
	if (alloc_ws(att, &wsf, &wsb)) {
		ng_print_error();
		return -1.0f;
	}
	cudaEvent_t ev[2];
	cudaEventCreate(&ev[0]);
	cudaEventCreate(&ev[1]);
	float *ms = malloc(sizeof(float) * (size_t)iters), result = -1.0f;
	int ok = ms != NULL;
	for (int it = -3; it < iters && ok; it++) {
		cudaEventRecord(ev[0], 0);
		ok = !step(att, d, w, d->out, d->lse, d->dqkv, wsf, wsb, 0);
		cudaEventRecord(ev[1], 0);
		ok = ok && !NG_CUDA_CHECK(cudaEventSynchronize(ev[1]));
		if (ok && it >= 0)
			cudaEventElapsedTime(&ms[it], ev[0], ev[1]);
	}
	if (ok) {
		qsort(ms, (size_t)iters, sizeof(float), cmp_float);
		result = ms[iters / 2];
	} else {
		ng_print_error();
		ng_clear_error();
	}
	free(ms);
	cudaEventDestroy(ev[0]);
	cudaEventDestroy(ev[1]);
	cudaFree(wsf), cudaFree(wsb);
	return result;
}

/* Phase 2 for one variant (naive: the plain kernels) at one shape and its windows. */
static void time_variant(const struct variant *v, int naive, cudnnHandle_t h, struct bufs *d,
			 int B, int T, const int *wins, int n_wins)
{
	struct ng_attention att;
	int planned = 0;
	for (int k = 0; k < n_wins; k++) {
		int w = wins[k];
		/* one plan for device bands (band 1792) and for no band; one a window otherwise */
		if (!planned || (v->band && !v->dev)) {
			if (planned)
				ng_attention_free(&att);
			planned = 0;
			if (over_budget(naive)) {
				printf("time  %-11s B=%d T=%d window %d: skipped (time budget)\n",
				       naive ? "naive" : v->name, B, T, w);
				continue;
			}
			struct ng_attention_opts o = opts_of(v, v->dev ? 1792 : w);
			double secs;
			if (plan(&att, naive ? NULL : h, B, T, &o, naive, &secs))
				return;
			planned = 1;
			if (!naive && (att.fwd_backend != NG_ATTENTION_BACKEND_CUDNN ||
				       att.bwd_backend != NG_ATTENTION_BACKEND_CUDNN))
				printf("time  %-11s B=%d T=%d: fwd %s, bwd %s at this shape: %s\n",
				       v->name, B, T,
				       att.fwd_backend == NG_ATTENTION_BACKEND_CUDNN ? "cuDNN" : "naive",
				       att.bwd_backend == NG_ATTENTION_BACKEND_CUDNN ? "cuDNN" : "naive",
				       att.reason);
		}
		float ms = time_plan(&att, d, w, naive ? 3 : 10);
		printf("time  %-11s B=%d T=%d H=%d D=%d window %4d: fwd+bwd %.3f ms\n",
		       naive ? "naive" : v->name, B, T, HEADS, HEAD, w, ms);
		fflush(stdout);
		if (!v->band && !v->lo)
			break; /* causal: the window changes nothing */
	}
	if (planned)
		ng_attention_free(&att);
}

int main(void)
{
	t0 = now_s();
	if (ng_cuda_device_count() == 0) {
		fprintf(stderr, "probe_attention_mask: no CUDA device\n");
		return 1;
	}
	cudnnHandle_t h;
	if (NG_CUDNN_CHECK(cudnnCreate(&h))) {
		ng_print_error();
		return 1;
	}
	printf("cuDNN %zu; variants: %d; budget %.0f s\n", cudnnGetVersion(), N_VARIANTS, BUDGET_S);
	struct bufs d;
	size_t n_qkv = (size_t)MAX_TOKENS * 3 * HEADS * HEAD, n_o = n_qkv / 3;
	size_t n_l = (size_t)MAX_TOKENS * HEADS;
	struct ng_rng r;
	ng_rng_seed(&r, 20261202);
	if (NG_CUDA_CHECK(cudaMalloc((void **)&d.qkv, n_qkv * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.dqkv, n_qkv * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.dqkv2, n_qkv * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.out, n_o * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.out2, n_o * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.dout, n_o * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.lse, n_l * 4)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.lse2, n_l * 4)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.tok, MAX_TOKENS * 4)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.lo, MAX_TOKENS * 4)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&d.window, 16)) || fill_normal(d.qkv, n_qkv, &r) ||
	    fill_normal(d.dout, n_o, &r)) {
		ng_print_error();
		return 1;
	}

	/* 1. check: B=2 T=1024, 3 documents a sequence */
	int has_cudnn[N_VARIANTS];
	if (fill_tokens(d.tok, 2, 1024, 1024 / 3, &r))
		return 1;
	for (int i = 0; i < N_VARIANTS; i++)
		has_cudnn[i] = check_variant(&variants[i], h, &d);

	/* 2. time: documents ~800 tokens long */
	static const int wins_long[] = {128, 896, 1792}, wins_batch[] = {128, 896};
	const struct variant naive = {"naive", 1, 1, 0, NG_ATTENTION_LO_AUTO};
	for (int shape = 0; shape < 2; shape++) {
		int B = shape ? 48 : 1, T = shape ? 1024 : MAX_TOKENS;
		const int *wins = shape ? wins_batch : wins_long;
		int n_wins = shape ? 2 : 3;
		if (fill_tokens(d.tok, B, T, 800, &r))
			return 1;
		for (int i = 0; i < N_VARIANTS; i++)
			if (has_cudnn[i])
				time_variant(&variants[i], 0, h, &d, B, T, wins, n_wins);
		time_variant(&naive, 1, h, &d, B, T, wins, n_wins);
	}
	printf("probe done in %.1f s\n", now_s() - t0);
	cudnnDestroy(h);
	return 0;
}
