/*
 * tests/test_attention_masked.c — the speedrun model's attention (kernels/attention.h's masked
 * plans: causal within a document, within a sliding window, scale 0.12), both backends, against
 * ng_ref_attention_masked_fwd/bwd (graph/cpu_spr_ops.h, double), and the lower-bound kernel
 * ng_attention_lower_bound against a CPU loop.
 *
 * Tolerance: the FlashAttention rule of docs/CONTRIBUTING.md, as tests/test_attention.c: the
 * naive bf16 witness (tests/attention_testing.h) over the same keys, and
 *     max|kernel - fp64| <= 2 * max|naive bf16 - fp64| + atol,
 * atol = 2^-8 * max|ref| for the bf16 outputs (one bf16 ulp, unit roundoff 2^-8 relative, at
 * the largest magnitude: the output's own rounding) and max(1e-5 * max|ref|, 1e-5) for the fp32
 * log-sum-exp, whose error is the fp32 accumulation's (~1e-7 relative) times a growth factor
 * of ~100 for sums of up to a few thousand terms. The lower bound is integers: exact.
 * Shapes: T not a multiple of 128 (33, 130, 257, 300, 1000), several documents a sequence, a
 * window of 1 token, windows >= T, the window from the plan's band, from the device window (lo)
 * and from a device band, D in {32, 64, 128}, B x T batches; lo on real sizes (T = 49152) and on
 * every token a BOS. Also: graph replay equals eager (bytes) for the naive backend, and a new
 * window written to the device between replays changes the replay exactly as an eager run.
 * cuDNN cases accept a plan-time fallback to the naive kernels (whether cuDNN takes a masked
 * graph is known only on the GPU: tools/probe_attention_mask.c); the plan's line is printed.
 * Inputs are fresh N(0,1) bf16 each run; the seed is printed in failure messages.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_spr_ops.h"
#include "graph/gpt.h"
#include "kernels/attention.h"
#include "tests/attention_testing.h"
#include "tests/kernel_testing.h"

/* One masked problem. */
struct mcase {
	int B, H, T, D;
	int naive;         /* 1: force the plain CUDA kernels */
	int deterministic; /* 1: the deterministic backward */
	float scale;       /* softmax scale (0: 1/sqrt(D)) */
	int max_window;    /* the plan's band (tokens, 0: none) */
	int lower_bound;   /* 1: lo from ng_attention_lower_bound over the tokens */
	int band_dev;      /* 1: the band's width is the device window */
	int window;        /* the device window (tokens, 0: none) */
	int docs;          /* BOS tokens placed at random in each sequence */
	int lo_before;     /* 1: cuDNN graphs select lo before the causal mask only */
	int block;         /* lo's window granularity (0 or 1: tokens; the model's 128: blocks) */
};

/* The window the lower-bound kernel applies: the device window capped at the band. */
static int lo_window(int window, int max_window)
{
	if (max_window > 0 && (window <= 0 || window > max_window))
		return max_window;
	return window > 0 ? window : 0;
}

/* The window of the whole mask (0: none): lo's, the band's, whichever is narrower. */
static int effective_window(const struct mcase *c)
{
	int w = c->lower_bound ? lo_window(c->window, c->max_window) : 0;
	int band = c->max_window;
	if (c->band_dev && c->window > 0 && c->window < band)
		band = c->window;
	if (band > 0 && (w <= 0 || band < w))
		w = band;
	return w;
}

/* The granularity of the case's window: blocks only where lo carries the window. A block case
 * keeps its window a multiple of the block and the band at least as wide, so that the whole
 * mask is the block window (kernels/window.h). */
static int effective_block(const struct mcase *c)
{
	return c->lower_bound && c->block > 1 ? c->block : 1;
}

/* The CPU lower bound: lo[b, t] = max(last BOS position <= t (0: none), the window's first
 * key): t - w + 1 in tokens (block 1), else the start of the block n - 1 blocks before t's, n =
 * max(1, w / block). */
static void cpu_lower_bound(int32_t *lo, const int32_t *tok, int w, int block, int B, int T)
{
	for (int b = 0; b < B; b++) {
		int start = 0;
		for (int t = 0; t < T; t++) {
			if (tok && tok[(size_t)b * T + t] == NG_SPR_BOS)
				start = t;
			int l = start;
			int n = w / block > 0 ? w / block : 1;
			int first = block == 1 ? t - w + 1 : t - t % block - (n - 1) * block;
			if (w > 0 && first > l)
				l = first;
			lo[(size_t)b * T + t] = l;
		}
	}
}

/* Tokens below BOS, then `docs` BOS at random places a sequence (at 0 in even sequences). */
static void make_tokens(int32_t *tok, int B, int T, int docs, struct ng_rng *r)
{
	for (size_t i = 0; i < (size_t)B * T; i++)
		tok[i] = (int32_t)ng_rng_below(r, NG_SPR_BOS);
	for (int b = 0; b < B && docs > 0; b++) {
		if (b % 2 == 0)
			tok[(size_t)b * T] = NG_SPR_BOS;
		for (int k = 0; k < docs; k++)
			tok[(size_t)b * T + ng_rng_below(r, (uint64_t)T)] = NG_SPR_BOS;
	}
}

static void case_name(char *ctx, size_t n, const struct mcase *c, uint64_t seed)
{
	snprintf(ctx, n, "[%s%s B=%d H=%d T=%d D=%d scale=%g band=%d%s lo=%d%s window=%d block=%d "
		 "docs=%d seed=%llu]", c->naive ? "naive" : "cuDNN",
		 c->deterministic ? " deterministic" : "", c->B, c->H, c->T, c->D, (double)c->scale,
		 c->max_window, c->band_dev ? " (device)" : "", c->lower_bound,
		 c->lo_before ? " (first)" : "", c->window, effective_block(c), c->docs,
		 (unsigned long long)seed);
}

static void plan_case(const struct mcase *c, const char *ctx, cudnnHandle_t *h,
		      struct ng_attention *att)
{
	struct ng_attention_opts o = {.scale = c->scale, .max_window = c->max_window,
				      .lower_bound = c->lower_bound,
				      .band_on_device = c->band_dev,
				      .lo_order = c->lo_before ? NG_ATTENTION_LO_BEFORE
							       : NG_ATTENTION_LO_AUTO};
	cr_assert_eq(cudnnCreate(h), CUDNN_STATUS_SUCCESS);
	cr_assert_eq(ng_attention_plan_masked(att, *h, c->B, c->H, c->T, c->D, c->deterministic,
					      c->naive, &o),
		     NG_OK, "%s plan: %s", ctx, ng_error_message());
	fprintf(stderr, "%s %s\n", ctx, ng_attention_describe(att));
}

/* Device buffers of one problem. */
struct mdev {
	ng_bf16 *qkv, *out, *dout, *dqkv;
	float *lse;
	int32_t *tok, *lo, *window;
	void *wsf, *wsb;
	int block; /* lo's window granularity */
};

static void mdev_alloc(struct mdev *d, const struct ng_attention *att, const ng_bf16 *qkv,
		       const ng_bf16 *dout, const int32_t *tok, int window)
{
	size_t n_qkv = (size_t)att->B * att->T * 3 * att->H * att->D, n_o = n_qkv / 3;
	size_t n_t = (size_t)att->B * att->T;
	d->qkv = kt_upload(qkv, n_qkv * 2);
	d->dout = kt_upload(dout, n_o * 2);
	d->dqkv = kt_upload(NULL, n_qkv * 2);
	d->out = kt_upload(NULL, n_o * 2);
	d->lse = kt_upload(NULL, (size_t)att->B * att->H * att->T * 4);
	d->tok = kt_upload(tok, n_t * 4);
	d->lo = kt_upload(NULL, n_t * 4);
	d->window = kt_upload(&window, 4);
	d->wsf = kt_upload(NULL, ng_attention_fwd_workspace(att) + 256);
	d->wsb = kt_upload(NULL, ng_attention_bwd_workspace(att) + 256);
}

static void mdev_free(struct mdev *d)
{
	cudaFree(d->qkv), cudaFree(d->dqkv), cudaFree(d->out), cudaFree(d->dout);
	cudaFree(d->lse), cudaFree(d->tok), cudaFree(d->lo), cudaFree(d->window);
	cudaFree(d->wsf), cudaFree(d->wsb);
}

/* lo (when the plan has a lower bound), forward, backward: what one step enqueues. */
static void mrun_step(const struct ng_attention *att, struct mdev *d, cudaStream_t s)
{
	if (att->lower_bound)
		kt_ok(ng_attention_lower_bound(d->lo, d->tok, d->window, att->max_window, d->block,
					       att->B, att->T, NG_SPR_BOS, s),
		      "ng_attention_lower_bound");
	kt_ok(ng_attention_fwd_masked(att, d->out, d->lse, d->qkv, d->lo, d->window, d->wsf, s),
	      "ng_attention_fwd_masked");
	kt_ok(ng_attention_bwd_masked(att, d->dqkv, d->dout, d->qkv, d->out, d->lse, d->lo,
				      d->window, d->wsb, s),
	      "ng_attention_bwd_masked");
}

ParameterizedTestParameters(attention_masked, matches_reference)
{
	static struct mcase cases[] = {
		/* naive: every shape and mask */
		{ .B = 2, .H = 3, .T = 257, .D = 64, .naive = 1, .scale = 0.12f, .lower_bound = 1,
		  .window = 1, .docs = 5 },
		{ .B = 1, .H = 2, .T = 300, .D = 128, .naive = 1, .scale = 0.12f, .lower_bound = 1,
		  .window = 64, .docs = 3 },
		{ .B = 3, .H = 2, .T = 33, .D = 32, .naive = 1, .lower_bound = 1, .docs = 2 },
		{ .B = 2, .H = 2, .T = 130, .D = 64, .naive = 1, .scale = 0.12f, .max_window = 40 },
		{ .B = 1, .H = 3, .T = 200, .D = 128, .naive = 1, .scale = 0.12f, .max_window = 1000,
		  .lower_bound = 1, .window = 5000, .docs = 3 },
		{ .B = 2, .H = 2, .T = 257, .D = 128, .naive = 1, .scale = 0.12f, .max_window = 128,
		  .lower_bound = 1, .band_dev = 1, .window = 50, .docs = 2 },
		{ .B = 2, .H = 2, .T = 257, .D = 64, .naive = 1, .scale = 0.12f, .max_window = 100,
		  .band_dev = 1, .window = 30 },
		{ .B = 1, .H = 6, .T = 1024, .D = 128, .naive = 1, .scale = 0.12f, .max_window = 256,
		  .lower_bound = 1, .window = 200, .docs = 4 },
		{ .B = 4, .H = 1, .T = 1, .D = 64, .naive = 1, .scale = 0.12f, .lower_bound = 1,
		  .window = 1, .docs = 1 },
		{ .B = 8, .H = 2, .T = 130, .D = 40, .naive = 1, .scale = 0.12f, .max_window = 128,
		  .lower_bound = 1, .window = 128, .docs = 2 },
		{ .B = 2, .H = 2, .T = 300, .D = 64, .naive = 1, .scale = 0.12f, .max_window = 96,
		  .lower_bound = 1, .band_dev = 1, .window = 96, .docs = 3, .block = 32 },
		/* cuDNN where it takes the graph (else its fallback) */
		{ .B = 1, .H = 6, .T = 1024, .D = 128, .scale = 0.12f, .max_window = 256,
		  .lower_bound = 1, .window = 256, .docs = 6 },
		{ .B = 1, .H = 6, .T = 1024, .D = 128, .scale = 0.12f, .max_window = 384,
		  .lower_bound = 1, .band_dev = 1, .window = 256, .docs = 4, .block = 128 },
		{ .B = 2, .H = 2, .T = 1000, .D = 128, .scale = 0.12f, .max_window = 128,
		  .lower_bound = 1, .window = 100, .docs = 3 },
		{ .B = 2, .H = 2, .T = 512, .D = 64, .scale = 0.12f, .max_window = 128 },
		{ .B = 1, .H = 2, .T = 384, .D = 32, .scale = 0.12f, .lower_bound = 1, .docs = 3 },
		{ .B = 1, .H = 2, .T = 256, .D = 128, .scale = 0.12f, .max_window = 256,
		  .lower_bound = 1, .band_dev = 1, .window = 64, .docs = 2 },
		{ .B = 1, .H = 2, .T = 256, .D = 64, .scale = 0.12f, .max_window = 128,
		  .lower_bound = 1, .window = 1, .docs = 2 },
		{ .B = 1, .H = 2, .T = 512, .D = 128, .deterministic = 1, .scale = 0.12f,
		  .max_window = 128, .lower_bound = 1, .window = 128, .docs = 2 },
		{ .B = 6, .H = 2, .T = 256, .D = 128, .scale = 0.12f, .max_window = 384,
		  .lower_bound = 1, .window = 384, .docs = 2 },
		{ .B = 2, .H = 2, .T = 640, .D = 128, .scale = 0.12f, .max_window = 256,
		  .lower_bound = 1, .window = 200, .docs = 3, .lo_before = 1 },
	};
	return cr_make_param_array(struct mcase, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(struct mcase *c, attention_masked, matches_reference, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	int B = c->B, H = c->H, T = c->T, D = c->D;
	uint64_t seed = kt_seed();
	char ctx[200];
	case_name(ctx, sizeof(ctx), c, seed);
	cudnnHandle_t h;
	struct ng_attention att;
	plan_case(c, ctx, &h, &att);
	if (c->naive) {
		cr_assert_eq(att.fwd_backend, NG_ATTENTION_BACKEND_NAIVE);
		cr_assert_eq(att.bwd_backend, NG_ATTENTION_BACKEND_NAIVE);
	}

	size_t n_qkv = (size_t)B * T * 3 * H * D, n_o = n_qkv / 3, n_l = (size_t)B * H * T;
	size_t n_t = (size_t)B * T;
	struct ng_rng rng;
	ng_rng_seed(&rng, seed);
	ng_bf16 *qkv = kt_xmalloc(n_qkv * 2), *dout = kt_xmalloc(n_o * 2);
	double *qkv_d = kt_xmalloc(n_qkv * 8), *dout_d = kt_xmalloc(n_o * 8);
	int32_t *tok = kt_xmalloc(n_t * 4), *doc = kt_xmalloc(n_t * 4), *first = kt_xmalloc(n_t * 4);
	kt_fill_bf16(&rng, qkv, qkv_d, n_qkv, 0.0, 1.0);
	kt_fill_bf16(&rng, dout, dout_d, n_o, 0.0, 1.0);
	make_tokens(tok, B, T, c->docs, &rng);

	struct mdev d;
	mdev_alloc(&d, &att, qkv, dout, tok, c->window);
	d.block = effective_block(c);
	mrun_step(&att, &d, 0);
	ng_bf16 *out = kt_xmalloc(n_o * 2), *dqkv = kt_xmalloc(n_qkv * 2);
	float *lse = kt_xmalloc(n_l * 4);
	kt_download(out, d.out, n_o * 2);
	kt_download(lse, d.lse, n_l * 4);
	kt_download(dqkv, d.dqkv, n_qkv * 2);

	/* fp64 reference and the naive bf16 witness, from the same bf16 inputs and tokens */
	int w = effective_window(c), blk = effective_block(c);
	ng_ref_doc_ids(doc, tok, B, T, NG_SPR_BOS);
	cpu_lower_bound(first, c->lower_bound ? tok : NULL, w, blk, B, T);
	double *out_r = kt_xmalloc(n_o * 8), *lse_r = kt_xmalloc(n_l * 8);
	double *dqkv_r = calloc(n_qkv, 8);
	ng_ref_attention_masked_fwd(out_r, lse_r, qkv_d, c->lower_bound ? doc : NULL, w, blk,
				    att.scale, B, T, H, D);
	ng_ref_attention_masked_bwd(dqkv_r, dout_d, qkv_d, c->lower_bound ? doc : NULL, w, blk,
				    att.scale, B, T, H, D);
	float *qkv_f = kt_xmalloc(n_qkv * 4), *dout_f = kt_xmalloc(n_o * 4);
	float *out_l = kt_xmalloc(n_o * 4), *lse_l = kt_xmalloc(n_l * 4);
	float *dqkv_l = kt_xmalloc(n_qkv * 4), *out_g = kt_xmalloc(n_o * 4);
	float *dqkv_g = kt_xmalloc(n_qkv * 4);
	for (size_t i = 0; i < n_qkv; i++)
		qkv_f[i] = (float)qkv_d[i], dqkv_g[i] = kt_bf16_to_f32(dqkv[i]);
	for (size_t i = 0; i < n_o; i++)
		dout_f[i] = (float)dout_d[i], out_g[i] = kt_bf16_to_f32(out[i]);
	at_lowp_attention(out_l, lse_l, dqkv_l, qkv_f, dout_f, first, att.scale, B, H, T, D);

	at_check_rule("out", out_g, out_l, out_r, n_o, 0x1p-8, 0.0, ctx);
	at_check_rule("lse", lse, lse_l, lse_r, n_l, 1e-5, 1e-5, ctx);
	at_check_rule("dqkv", dqkv_g, dqkv_l, dqkv_r, n_qkv, 0x1p-8, 0.0, ctx);

	mdev_free(&d);
	ng_attention_free(&att);
	cudnnDestroy(h);
	free(qkv), free(dout), free(qkv_d), free(dout_d), free(tok), free(doc), free(first);
	free(out), free(dqkv), free(lse), free(out_r), free(lse_r), free(dqkv_r), free(qkv_f);
	free(dout_f), free(out_l), free(lse_l), free(dqkv_l), free(out_g), free(dqkv_g);
}

/* Sequences of the lower-bound test: B, T and BOS tokens placed a sequence. */
struct lbcase {
	int B, T, docs;
};

ParameterizedTestParameters(attention_masked, lower_bound_matches_cpu)
{
	static struct lbcase cases[] = {
		{1, 1, 0},    {1, 1, 1},     {3, 257, 4},       {2, 1024, 0},   {2, 1024, 30},
		{1, 49152, 40}, {48, 1024, 3}, {5, 3000, 1}, {1, 2049, 4000}, {2, 1025, 1},
	};
	return cr_make_param_array(struct lbcase, cases, sizeof(cases) / sizeof(cases[0]));
}

/* Every window (none as NULL, 0, 1, small, the real ones, beyond T) under no band and a band
 * of 128, with the tokens and without (tok NULL: one document): exact. */
ParameterizedTest(struct lbcase *c, attention_masked, lower_bound_matches_cpu)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	size_t n = (size_t)c->B * c->T;
	struct ng_rng rng;
	ng_rng_seed(&rng, seed);
	int32_t *tok = kt_xmalloc(n * 4), *got = kt_xmalloc(n * 4), *want = kt_xmalloc(n * 4);
	make_tokens(tok, c->B, c->T, c->docs, &rng);
	int32_t *d_tok = kt_upload(tok, n * 4), *d_lo = kt_upload(NULL, n * 4);
	int32_t *d_w = kt_upload(NULL, 16);
	int windows[] = {-1, 0, 1, 7, 128, 1792, c->T + 5};
	for (int wi = 0; wi < 7; wi++)
		for (int band = 0; band <= 128; band += 128)
			for (int k = 0; k < 4; k++) {
				int with_tok = k % 2, block = k < 2 ? 1 : 128;
				int w = windows[wi];
				kt_cuda(cudaMemcpy(d_w, &w, 4, cudaMemcpyHostToDevice), "window");
				kt_cuda(cudaMemset(d_lo, 0xff, n * 4), "cudaMemset");
				kt_ok(ng_attention_lower_bound(d_lo, with_tok ? d_tok : NULL,
							       w < 0 ? NULL : d_w, band, block, c->B,
							       c->T, NG_SPR_BOS, 0),
				      "ng_attention_lower_bound");
				kt_download(got, d_lo, n * 4);
				cpu_lower_bound(want, with_tok ? tok : NULL,
						lo_window(w < 0 ? 0 : w, band), block, c->B, c->T);
				size_t bad = n;
				for (size_t i = 0; i < n && bad == n; i++)
					if (got[i] != want[i])
						bad = i;
				cr_expect(bad == n,
					  "B=%d T=%d docs=%d window=%d band=%d block=%d tok=%d: lo[%zu] "
					  "= %d, want %d; seed %llu", c->B, c->T, c->docs, w, band, block,
					  with_tok,
					  bad, bad < n ? got[bad] : 0, bad < n ? want[bad] : 0,
					  (unsigned long long)seed);
			}
	cudaFree(d_tok), cudaFree(d_lo), cudaFree(d_w);
	free(tok), free(got), free(want);
}

ParameterizedTestParameters(attention_masked, graph_replay_equals_eager)
{
	static struct mcase cases[] = {
		{ .B = 2, .H = 2, .T = 300, .D = 64, .naive = 1, .scale = 0.12f, .lower_bound = 1,
		  .window = 50, .docs = 3 },
		{ .B = 1, .H = 3, .T = 257, .D = 128, .naive = 1, .scale = 0.12f, .max_window = 128,
		  .lower_bound = 1, .band_dev = 1, .window = 96, .docs = 2 },
	};
	return cr_make_param_array(struct mcase, cases, sizeof(cases) / sizeof(cases[0]));
}

/* The outputs of one step: out, lse, dqkv bytes. */
struct mouts {
	ng_bf16 *out, *dqkv;
	float *lse;
};

static void mouts_get(struct mouts *o, const struct mdev *d, size_t n_o, size_t n_qkv, size_t n_l)
{
	o->out = kt_xmalloc(n_o * 2), o->dqkv = kt_xmalloc(n_qkv * 2), o->lse = kt_xmalloc(n_l * 4);
	kt_download(o->out, d->out, n_o * 2);
	kt_download(o->lse, d->lse, n_l * 4);
	kt_download(o->dqkv, d->dqkv, n_qkv * 2);
}

static void mouts_same(const struct mouts *a, const struct mouts *b, size_t n_o, size_t n_qkv,
		       size_t n_l, const char *what, const char *ctx)
{
	cr_expect(!memcmp(a->out, b->out, n_o * 2), "%s out of %s differs", ctx, what);
	cr_expect(!memcmp(a->lse, b->lse, n_l * 4), "%s lse of %s differs", ctx, what);
	cr_expect(!memcmp(a->dqkv, b->dqkv, n_qkv * 2), "%s dqkv of %s differs", ctx, what);
}

static void mouts_free(struct mouts *o) { free(o->out), free(o->dqkv), free(o->lse); }

/* Eager twice (same bytes: deterministic), then lo + forward + backward captured once and
 * replayed: the eager bytes. Then a narrower window written into the device scalar: an eager
 * run and a replay of the same graph again agree, and differ from the first window's. */
ParameterizedTest(struct mcase *c, attention_masked, graph_replay_equals_eager, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	char ctx[200];
	case_name(ctx, sizeof(ctx), c, seed);
	cudnnHandle_t h;
	struct ng_attention att;
	plan_case(c, ctx, &h, &att);
	size_t n_qkv = (size_t)c->B * c->T * 3 * c->H * c->D, n_o = n_qkv / 3;
	size_t n_l = (size_t)c->B * c->H * c->T, n_t = (size_t)c->B * c->T;
	struct ng_rng rng;
	ng_rng_seed(&rng, seed);
	ng_bf16 *qkv = kt_xmalloc(n_qkv * 2), *dout = kt_xmalloc(n_o * 2);
	int32_t *tok = kt_xmalloc(n_t * 4);
	kt_fill_bf16(&rng, qkv, NULL, n_qkv, 0.0, 1.0);
	kt_fill_bf16(&rng, dout, NULL, n_o, 0.0, 1.0);
	make_tokens(tok, c->B, c->T, c->docs, &rng);
	struct mdev d;
	mdev_alloc(&d, &att, qkv, dout, tok, c->window);
	d.block = effective_block(c);
	cudaStream_t s;
	kt_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");

	struct mouts e1, e1b, r1, e2, r2;
	mrun_step(&att, &d, s);
	mouts_get(&e1, &d, n_o, n_qkv, n_l);
	mrun_step(&att, &d, s);
	mouts_get(&e1b, &d, n_o, n_qkv, n_l);
	mouts_same(&e1, &e1b, n_o, n_qkv, n_l, "a second eager run", ctx);

	cudaGraph_t graph;
	cudaGraphExec_t exec;
	kt_cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
	mrun_step(&att, &d, s);
	kt_cuda(cudaStreamEndCapture(s, &graph), "end capture");
	kt_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
	for (int w = 0; w < 2; w++) {
		if (w == 1) { /* the step's new window, as data */
			int w2 = c->window / 2 + 1;
			kt_cuda(cudaMemcpy(d.window, &w2, 4, cudaMemcpyHostToDevice), "window");
			mrun_step(&att, &d, s);
			mouts_get(&e2, &d, n_o, n_qkv, n_l);
		}
		cudaMemsetAsync(d.out, 0xff, n_o * 2, s);
		cudaMemsetAsync(d.lse, 0xff, n_l * 4, s);
		cudaMemsetAsync(d.dqkv, 0xff, n_qkv * 2, s);
		cudaMemsetAsync(d.lo, 0xff, n_t * 4, s);
		kt_cuda(cudaGraphLaunch(exec, s), "launch");
		kt_cuda(cudaStreamSynchronize(s), "replay");
		mouts_get(w ? &r2 : &r1, &d, n_o, n_qkv, n_l);
	}
	mouts_same(&e1, &r1, n_o, n_qkv, n_l, "graph replay", ctx);
	mouts_same(&e2, &r2, n_o, n_qkv, n_l, "graph replay after a new window", ctx);
	cr_expect(memcmp(e1.out, e2.out, n_o * 2), "%s a narrower window left out unchanged", ctx);

	cudaGraphExecDestroy(exec);
	cudaGraphDestroy(graph);
	cudaStreamDestroy(s);
	mdev_free(&d);
	ng_attention_free(&att);
	cudnnDestroy(h);
	mouts_free(&e1), mouts_free(&e1b), mouts_free(&r1), mouts_free(&e2), mouts_free(&r2);
	free(qkv), free(dout), free(tok);
}

/* The test's own mask (effective_window, cpu_lower_bound: the witness's first keys) is the
 * reference's (doc ids + window): on the CPU, the bf16 witness stays within 2^-4 of max|ref|
 * of ng_ref_attention_masked_* (its rounding errors are ~2^-8 relative; a key too many or too
 * few moves outputs by O(1)). Runs without a GPU. */
Test(attention_masked, witness_follows_reference_mask)
{
	static const struct mcase cases[] = {
		{ .B = 2, .H = 1, .T = 97, .D = 16, .lower_bound = 1, .window = 1, .docs = 4 },
		{ .B = 2, .H = 2, .T = 130, .D = 16, .lower_bound = 1, .window = 9, .docs = 5 },
		{ .B = 1, .H = 1, .T = 130, .D = 8, .max_window = 40 },
		{ .B = 2, .H = 1, .T = 200, .D = 8, .max_window = 64, .lower_bound = 1,
		  .band_dev = 1, .window = 20, .docs = 3 },
		{ .B = 1, .H = 1, .T = 150, .D = 8, .max_window = 100, .band_dev = 1, .window = 30 },
		{ .B = 3, .H = 1, .T = 64, .D = 8, .max_window = 16, .lower_bound = 1, .window = 500,
		  .docs = 2 },
		{ .B = 2, .H = 1, .T = 200, .D = 8, .max_window = 64, .lower_bound = 1,
		  .band_dev = 1, .window = 48, .docs = 3, .block = 16 },
		{ .B = 1, .H = 1, .T = 130, .D = 8, .lower_bound = 1, .window = 32, .block = 16 },
	};
	uint64_t seed = kt_seed();
	struct ng_rng rng;
	ng_rng_seed(&rng, seed);
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		const struct mcase *c = &cases[ci];
		int B = c->B, H = c->H, T = c->T, D = c->D;
		size_t n_qkv = (size_t)B * T * 3 * H * D, n_o = n_qkv / 3, n_l = (size_t)B * H * T;
		size_t n_t = (size_t)B * T;
		double *qkv_d = kt_xmalloc(n_qkv * 8), *dout_d = kt_xmalloc(n_o * 8);
		double *out_r = kt_xmalloc(n_o * 8), *lse_r = kt_xmalloc(n_l * 8);
		double *dqkv_r = calloc(n_qkv, 8);
		float *qkv_f = kt_xmalloc(n_qkv * 4), *dout_f = kt_xmalloc(n_o * 4);
		float *out_l = kt_xmalloc(n_o * 4), *lse_l = kt_xmalloc(n_l * 4);
		float *dqkv_l = kt_xmalloc(n_qkv * 4);
		int32_t *tok = kt_xmalloc(n_t * 4), *doc = kt_xmalloc(n_t * 4);
		int32_t *first = kt_xmalloc(n_t * 4);
		kt_fill_bf16(&rng, NULL, qkv_d, n_qkv, 0.0, 1.0);
		kt_fill_bf16(&rng, NULL, dout_d, n_o, 0.0, 1.0);
		for (size_t i = 0; i < n_qkv; i++)
			qkv_f[i] = (float)qkv_d[i];
		for (size_t i = 0; i < n_o; i++)
			dout_f[i] = (float)dout_d[i];
		make_tokens(tok, B, T, c->docs, &rng);
		int w = effective_window(c), blk = effective_block(c);
		ng_ref_doc_ids(doc, tok, B, T, NG_SPR_BOS);
		cpu_lower_bound(first, c->lower_bound ? tok : NULL, w, blk, B, T);
		ng_ref_attention_masked_fwd(out_r, lse_r, qkv_d, c->lower_bound ? doc : NULL, w, blk,
					    0.12, B, T, H, D);
		ng_ref_attention_masked_bwd(dqkv_r, dout_d, qkv_d, c->lower_bound ? doc : NULL, w,
					    blk, 0.12, B, T, H, D);
		at_lowp_attention(out_l, lse_l, dqkv_l, qkv_f, dout_f, first, 0.12f, B, H, T, D);
		struct at_err eo = at_compare(out_l, out_r, n_o), el = at_compare(lse_l, lse_r, n_l);
		struct at_err eg = at_compare(dqkv_l, dqkv_r, n_qkv);
		cr_expect(eo.abs <= 0x1p-4 * eo.ref_max && el.abs <= 0x1p-4 * el.ref_max &&
			  eg.abs <= 0x1p-4 * eg.ref_max,
			  "case %zu (window %d): witness vs reference: out %.3e (max %.3e), lse "
			  "%.3e (max %.3e), dqkv %.3e (max %.3e); seed %llu", ci, w, eo.abs,
			  eo.ref_max, el.abs, el.ref_max, eg.abs, eg.ref_max,
			  (unsigned long long)seed);
		free(qkv_d), free(dout_d), free(out_r), free(lse_r), free(dqkv_r), free(qkv_f);
		free(dout_f), free(out_l), free(lse_l), free(dqkv_l), free(tok), free(doc);
		free(first);
	}
}

Test(attention_masked, plan_rejects_bad_options)
{
	struct ng_attention att;
	struct ng_attention_opts bad[] = {
		{.max_window = -1},
		{.scale = -0.5f},
		{.scale = NAN},
		{.band_on_device = 1},
		{.lo_order = (enum ng_attention_lo_order)7},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ng_clear_error();
		cr_expect_eq(ng_attention_plan_masked(&att, NULL, 1, 6, 128, 128, 0, 0, &bad[i]),
			     NG_ERR_INPUT, "options %zu", i);
		cr_expect(strstr(ng_error_message(), "mask options"), "options %zu: %s", i,
			  ng_error_message());
	}
	ng_clear_error();
}

/* Planning needs no GPU without a cuDNN handle: the naive kernels, with the mask in the line. */
Test(attention_masked, plan_without_cudnn_describes_mask)
{
	struct ng_attention att;
	struct ng_attention_opts o = {.scale = 0.12f, .max_window = 1792, .lower_bound = 1};
	cr_assert_eq(ng_attention_plan_masked(&att, NULL, 1, 6, 49152, 128, 0, 0, &o), NG_OK, "%s",
		     ng_error_message());
	const char *txt = ng_attention_describe(&att);
	cr_expect_eq(att.fwd_backend, NG_ATTENTION_BACKEND_NAIVE);
	cr_expect(att.scale == 0.12f && att.max_window == 1792 && att.lower_bound, "%s", txt);
	cr_expect(strstr(txt, "scale 0.12") && strstr(txt, "band 1792") &&
		  strstr(txt, "lower bound") && strstr(txt, "no cuDNN handle"), "%s", txt);
	ng_attention_free(&att);
	cr_assert_eq(ng_attention_plan(&att, NULL, 2, 3, 64, 64, 0, 0), NG_OK);
	txt = ng_attention_describe(&att);
	cr_expect(att.scale == 0.125f && !att.max_window && !att.lower_bound, "%s", txt);
	cr_expect(strstr(txt, "scale 0.125") && !strstr(txt, "mask"), "%s", txt);
	ng_attention_free(&att);
}

/* Missing mask inputs fail as input errors before anything is launched (no GPU needed). */
Test(attention_masked, calls_need_their_mask_inputs)
{
	struct ng_attention att;
	struct ng_attention_opts o = {.max_window = 128, .lower_bound = 1, .band_on_device = 1};
	cr_assert_eq(ng_attention_plan_masked(&att, NULL, 1, 2, 256, 64, 0, 0, &o), NG_OK);
	int32_t fake[4];
	ng_clear_error();
	cr_expect_eq(ng_attention_fwd_masked(&att, NULL, NULL, NULL, NULL, fake, NULL, 0),
		     NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "lo"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_attention_bwd_masked(&att, NULL, NULL, NULL, NULL, NULL, fake, NULL, NULL,
					     0),
		     NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "window"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_attention_fwd(&att, NULL, NULL, NULL, NULL, 0), NG_ERR_INPUT);
	ng_clear_error();
	cr_expect_eq(ng_attention_lower_bound(fake, NULL, NULL, 0, 1, 0, 4, NG_SPR_BOS, 0),
		     NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "B=0"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_attention_lower_bound(fake, NULL, NULL, 0, 0, 1, 4, NG_SPR_BOS, 0),
		     NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "block=0"), "%s", ng_error_message());
	ng_clear_error();
	ng_attention_free(&att);
}
