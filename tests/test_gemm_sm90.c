/*
 * tests/test_gemm_sm90.c — our Hopper GEMM (kernels/gemm_sm90.h) against the double reference
 * of graph/cpu_ops.h (the tanh GELU of ng_ref_gelu_fwd), on fresh random inputs.
 *
 * Tolerance, as tests/test_matmul.c (docs/CONTRIBUTING.md, the FlashAttention rule): err(GPU vs
 * fp64) <= 2 * err(naive vs fp64) + atol, where naive is the plain fp32 loop over the same bf16
 * inputs, rounded to bf16 as the GPU's outputs are; atol is 2^-10 of the largest |reference| (a
 * quarter of a bf16 ulp there). Both outputs are checked: aux (the pre-activation) and out (its
 * GELU).
 *
 * Shapes: edges in every dimension (M = 1, 300; N = 3104 = 4 x 776, not a multiple of either
 * tile's width; K = 776, not a multiple of the 64 of a stage), with and without bias
 * and GELU, large-mean inputs, and a d12-like block that is run twice for identical bytes.
 * The DGELU epilogue (ng_gemm_sm90_dgelu) the same way: dpre against ng_ref_gelu_bwd of the fp64
 * product, post against ng_ref_gelu_fwd, pre unchanged. relu^2 (the speedrun model's MLP): the
 * forward's out against max(pre, 0)^2 of the fp64 product.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_ops.h"
#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/gemm_sm90.h"
#include "kernels/types.h"
#include "tests/kernel_testing.h"
#include "util/rng.h"

struct gm_case {
	int M, N, K;
	int gelu, bias;
	int relu2;       /* out = max(pre, 0)^2 (no bias, no gelu) */
	double mean;     /* mean of the activations */
	int determinism; /* run twice, compare the bytes */
};

static float gelu_f_(float x)
{
	return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

/* The FlashAttention rule through kernel_testing.h's check_fa_, atol 2^-10 of max |ref|. */
static void expect_close_(const char *what, const struct gm_case *c, uint64_t seed,
			  const double *ref, const float *naive, const ng_bf16 *gpu, size_t n)
{
	double *g = kt_xmalloc(n * 8), *nv = kt_xmalloc(n * 8), big = 0;
	for (size_t i = 0; i < n; i++) {
		g[i] = kt_bf16_to_f32(gpu[i]);
		nv[i] = naive[i];
		big = fmax(big, fabs(ref[i]));
	}
	char name[160];
	snprintf(name, sizeof(name), "%s M=%d N=%d K=%d gelu %d bias %d mean %g", what, c->M, c->N,
		 c->K, c->gelu, c->bias, c->mean);
	check_fa_(name, seed, g, nv, ref, n, big / 1024);
	free(g);
	free(nv);
}

/* Skips where the kernel cannot run; else seeds r and returns the seed. */
static uint64_t start_(struct ng_rng *r)
{
	if (ng_cuda_device_count() < 1)
		cr_skip_test("no CUDA device");
	if (!ng_gemm_sm90_available())
		cr_skip_test("not an sm_90 GPU (or no sm_90a build): the kernel cannot run here");
	uint64_t seed = kt_seed();
	ng_rng_seed(r, seed);
	return seed;
}

static void run_case_(const struct gm_case *c)
{
	const size_t M = c->M, N = c->N, K = c->K;
	struct ng_rng r;
	uint64_t seed = start_(&r);
	ng_bf16 *ah = kt_xmalloc(M * K * 2), *wh = kt_xmalloc(N * K * 2), *bh = kt_xmalloc(N * 2);
	double *ad = kt_xmalloc(M * K * 8), *wd = kt_xmalloc(N * K * 8), *bd = kt_xmalloc(N * 8);
	kt_fill_bf16(&r, ah, ad, M * K, c->mean, 1.0);
	kt_fill_bf16(&r, wh, wd, N * K, 0.0, 1.0 / sqrt((double)K));
	kt_fill_bf16(&r, bh, bd, N, 0.0, 0.5);

	double *pre = kt_xmalloc(M * N * 8), *g = kt_xmalloc(M * N * 8);
	float *npre = kt_xmalloc(M * N * 4), *ng = kt_xmalloc(M * N * 4);
	for (size_t m = 0; m < M; m++)
		for (size_t n = 0; n < N; n++) {
			double s = c->bias ? bd[n] : 0.0;
			float f = 0.0f;
			for (size_t k = 0; k < K; k++) {
				s += ad[m * K + k] * wd[n * K + k];
				f += (float)ad[m * K + k] * (float)wd[n * K + k];
			}
			if (c->bias)
				f += (float)bd[n];
			pre[m * N + n] = s;
			npre[m * N + n] = (float)kt_round_bf16(f);
			ng[m * N + n] = (float)kt_round_bf16(gelu_f_(f));
			if (c->relu2) { /* max(., 0)^2 of the unrounded sum, rounded once */
				const double rs = s > 0.0 ? s : 0.0;
				const float rf = f > 0.0f ? f : 0.0f;
				pre[m * N + n] = rs * rs;
				npre[m * N + n] = (float)kt_round_bf16(rf * rf);
			}
		}
	ng_ref_gelu_fwd(g, pre, M * N);
	const int act = c->relu2 ? NG_GEMM_ACT_RELU2 : c->gelu;

	void *da = kt_upload(ah, M * K * 2), *dw = kt_upload(wh, N * K * 2);
	void *db = kt_upload(bh, N * 2), *dout = kt_upload(NULL, M * N * 2);
	void *daux = kt_upload(NULL, M * N * 2);
	/* NaN bytes in the outputs: an element the kernel fails to write cannot pass */
	kt_cuda(cudaMemset(dout, 0xff, M * N * 2), "cudaMemset");
	kt_cuda(cudaMemset(daux, 0xff, M * N * 2), "cudaMemset");
	kt_ok(ng_gemm_sm90_fwd(dout, c->gelu ? daux : NULL, da, dw, c->bias ? db : NULL, c->M, c->N,
			       c->K, act, 0), "ng_gemm_sm90_fwd");
	ng_bf16 *out = kt_xmalloc(M * N * 2), *aux = kt_xmalloc(M * N * 2);
	kt_download(out, dout, M * N * 2);
	if (c->gelu) {
		kt_download(aux, daux, M * N * 2);
		expect_close_("aux (pre-activation)", c, seed, pre, npre, aux, M * N);
		expect_close_("out (GELU)", c, seed, g, ng, out, M * N);
	} else {
		expect_close_(c->relu2 ? "out (relu^2)" : "out", c, seed, pre, npre, out, M * N);
	}
	if (c->determinism) {
		ng_bf16 *again = kt_xmalloc(M * N * 2), *again_aux = kt_xmalloc(M * N * 2);
		kt_ok(ng_gemm_sm90_fwd(dout, c->gelu ? daux : NULL, da, dw, c->bias ? db : NULL, c->M,
				       c->N, c->K, act, 0),
		      "ng_gemm_sm90_fwd");
		kt_download(again, dout, M * N * 2);
		cr_expect(!memcmp(again, out, M * N * 2), "out differs between two runs (seed %llu)",
			  (unsigned long long)seed);
		if (c->gelu) {
			kt_download(again_aux, daux, M * N * 2);
			cr_expect(!memcmp(again_aux, aux, M * N * 2),
				  "aux differs between two runs (seed %llu)", (unsigned long long)seed);
		}
		free(again);
		free(again_aux);
	}
	cudaFree(da); cudaFree(dw); cudaFree(db); cudaFree(dout); cudaFree(daux);
	free(ah); free(wh); free(bh); free(ad); free(wd); free(bd);
	free(pre); free(g); free(npre); free(ng); free(out); free(aux);
}

/* ng_gemm_sm90_dgelu: dpre = (dout (M, K) @ W2 (K, N)) * GELU'(pre), post = GELU(pre), with
 * wt = W2^T (N, K) as the kernel takes it. Naive: the fp32 product times the fp32 derivative,
 * rounded once, as the kernel computes it. */
struct dg_case {
	int M, N, K;
	int post;
	double pre_mean; /* mean of the pre-activations */
	int determinism;
	int bias;        /* part: dpre's column sums, reduced by ng_bias_grad_reduce */
};

static float gelu_grad_f_(float x)
{
	const float u = 0.7978845608f * (x + 0.044715f * x * x * x);
	const float th = tanhf(u);
	return 0.5f * (1.0f + th) +
	       0.5f * x * (1.0f - th * th) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
}

static void run_dgelu_(const struct dg_case *c)
{
	const size_t M = c->M, N = c->N, K = c->K;
	struct ng_rng r;
	uint64_t seed = start_(&r);
	ng_bf16 *doh = kt_xmalloc(M * K * 2), *wth = kt_xmalloc(N * K * 2), *ph = kt_xmalloc(M * N * 2);
	double *dod = kt_xmalloc(M * K * 8), *wtd = kt_xmalloc(N * K * 8), *pd = kt_xmalloc(M * N * 8);
	kt_fill_bf16(&r, doh, dod, M * K, 0.0, 1.0);
	kt_fill_bf16(&r, wth, wtd, N * K, 0.0, 1.0 / sqrt((double)K));
	kt_fill_bf16(&r, ph, pd, M * N, c->pre_mean, 1.5);

	double *prod = kt_xmalloc(M * N * 8), *ref = kt_xmalloc(M * N * 8), *gref = kt_xmalloc(M * N * 8);
	float *nd = kt_xmalloc(M * N * 4), *npost = kt_xmalloc(M * N * 4);
	for (size_t m = 0; m < M; m++)
		for (size_t n = 0; n < N; n++) {
			double sd = 0.0;
			float f = 0.0f;
			for (size_t k = 0; k < K; k++) {
				sd += dod[m * K + k] * wtd[n * K + k];
				f += (float)dod[m * K + k] * (float)wtd[n * K + k];
			}
			prod[m * N + n] = sd;
			const float x = (float)pd[m * N + n];
			nd[m * N + n] = (float)kt_round_bf16(f * gelu_grad_f_(x));
			npost[m * N + n] = (float)kt_round_bf16(gelu_f_(x));
		}
	ng_ref_gelu_bwd(ref, pd, prod, M * N);
	ng_ref_gelu_fwd(gref, pd, M * N);

	void *ddo = kt_upload(doh, M * K * 2), *dwt = kt_upload(wth, N * K * 2);
	void *dp = kt_upload(ph, M * N * 2), *dd = kt_upload(NULL, M * N * 2);
	void *dpost = kt_upload(NULL, M * N * 2);
	kt_cuda(cudaMemset(dd, 0xff, M * N * 2), "cudaMemset");
	kt_cuda(cudaMemset(dpost, 0xff, M * N * 2), "cudaMemset");
	const size_t parts = (size_t)ng_gemm_sm90_dgelu_parts(c->M);
	float *dpart = c->bias ? kt_upload(NULL, parts * N * 4) : NULL;
	float *ddb = c->bias ? kt_upload(NULL, N * 4) : NULL;
	if (c->bias) /* NaN: a partial row the kernel fails to write cannot pass */
		kt_cuda(cudaMemset(dpart, 0xff, parts * N * 4), "cudaMemset");
	kt_ok(ng_gemm_sm90_dgelu(dd, c->post ? dpost : NULL, dpart, dp, ddo, dwt, c->M, c->N, c->K,
				 0), "ng_gemm_sm90_dgelu");
	ng_bf16 *got = kt_xmalloc(M * N * 2), *gpost = kt_xmalloc(M * N * 2), *pre_after = kt_xmalloc(M * N * 2);
	kt_download(got, dd, M * N * 2);
	if (c->bias) {
		/* the bias gradient: column sums of dpre as stored, against their fp64 sums (the
		 * naive one: fp32 in row order); then "+=" doubles it exactly */
		kt_ok(ng_bias_grad_reduce(ddb, dpart, (int)parts, c->N, 0, 0), "ng_bias_grad_reduce");
		double *cref = kt_xmalloc(N * 8), *cgot = kt_xmalloc(N * 8), big = 0;
		float *cnaive = kt_xmalloc(N * 4), *db = kt_xmalloc(N * 4), *db2 = kt_xmalloc(N * 4);
		for (size_t n = 0; n < N; n++) {
			double sd = 0;
			float sf = 0;
			for (size_t m = 0; m < M; m++) {
				sd += kt_bf16_to_f32(got[m * N + n]);
				sf += kt_bf16_to_f32(got[m * N + n]);
			}
			cref[n] = sd;
			cnaive[n] = sf;
			big = fmax(big, fabs(sd));
		}
		kt_download(db, ddb, N * 4);
		double *nv = kt_xmalloc(N * 8);
		for (size_t n = 0; n < N; n++) {
			cgot[n] = db[n];
			nv[n] = cnaive[n];
		}
		check_fa_("dgelu bias gradient", seed, cgot, nv, cref, N, big / 1024);
		kt_ok(ng_bias_grad_reduce(ddb, dpart, (int)parts, c->N, 1, 0), "ng_bias_grad_reduce");
		kt_download(db2, ddb, N * 4);
		size_t bad = N;
		for (size_t n = 0; n < N && bad == N; n++)
			if (db2[n] != 2.0f * db[n])
				bad = n;
		cr_expect(bad == N, "bias gradient \"+=\": column %zu is %g, want %g (seed %llu)", bad,
			  bad < N ? db2[bad] : 0.0, bad < N ? 2.0 * db[bad] : 0.0,
			  (unsigned long long)seed);
		free(cref); free(cgot); free(cnaive); free(db); free(db2); free(nv);
	}
	struct gm_case named = { .M = c->M, .N = c->N, .K = c->K, .gelu = 1, .bias = c->post,
				 .mean = c->pre_mean };
	expect_close_("dgelu dpre", &named, seed, ref, nd, got, M * N);
	if (c->post) {
		kt_download(gpost, dpost, M * N * 2);
		expect_close_("dgelu post (GELU)", &named, seed, gref, npost, gpost, M * N);
	}
	kt_download(pre_after, dp, M * N * 2); /* an input: read, never written */
	cr_expect(!memcmp(pre_after, ph, M * N * 2), "pre changed (seed %llu)",
		  (unsigned long long)seed);
	if (c->determinism) {
		ng_bf16 *again = kt_xmalloc(M * N * 2);
		kt_ok(ng_gemm_sm90_dgelu(dd, c->post ? dpost : NULL, dpart, dp, ddo, dwt, c->M, c->N,
					 c->K, 0), "ng_gemm_sm90_dgelu");
		kt_download(again, dd, M * N * 2);
		cr_expect(!memcmp(again, got, M * N * 2), "dpre differs between two runs (seed %llu)",
			  (unsigned long long)seed);
		free(again);
	}
	cudaFree(ddo); cudaFree(dwt); cudaFree(dp); cudaFree(dd); cudaFree(dpost);
	cudaFree(dpart); cudaFree(ddb);
	free(doh); free(wth); free(ph); free(dod); free(wtd); free(pd);
	free(prod); free(ref); free(gref); free(nd); free(npost); free(got); free(gpost);
	free(pre_after);
}

#define C776 776
#define GM_TEST(name, ...) \
	Test(gemm_sm90, name) { run_case_(&(struct gm_case){ __VA_ARGS__ }); }
GM_TEST(gelu_bias_edges, .M = 300, .N = 4 * C776, .K = C776, .gelu = 1, .bias = 1)
GM_TEST(bias_one_row, .M = 1, .N = 3 * C776, .K = C776, .bias = 1)
GM_TEST(plain_deep_k, .M = 257, .N = 264, .K = 4 * C776)
GM_TEST(gelu_large_mean, .M = 130, .N = 1024, .K = 256, .gelu = 1, .bias = 1, .mean = 3.0)
GM_TEST(gelu_d12_block_twice, .M = 1024, .N = 3072, .K = 768, .gelu = 1, .bias = 1,
	.determinism = 1)
GM_TEST(relu2_edges, .M = 300, .N = 4 * C776, .K = C776, .relu2 = 1)
GM_TEST(relu2_one_row, .M = 1, .N = 264, .K = 200, .relu2 = 1, .mean = 0.5)
GM_TEST(relu2_speedrun_block_twice, .M = 1024, .N = 3072, .K = 768, .relu2 = 1,
	.determinism = 1)
GM_TEST(gelu_d24_block_twice, .M = 1536, .N = 4096, .K = 1024, .gelu = 1, .bias = 1,
	.mean = 1.0, .determinism = 1)

/* DGELU: (M, N = 4C, K = C) as the MLP projection's input gradient; edges in every dimension,
 * with and without post, pre-activations centred where GELU' changes fastest. */
#define DG_TEST(name, ...) \
	Test(gemm_sm90, name) { run_dgelu_(&(struct dg_case){ __VA_ARGS__ }); }
DG_TEST(dgelu_post_edges, .M = 300, .N = 4 * C776, .K = C776, .post = 1, .bias = 1)
DG_TEST(dgelu_edges, .M = 300, .N = 4 * C776, .K = C776, .pre_mean = -1.0)
DG_TEST(dgelu_bias_edges, .M = 300, .N = 4 * C776, .K = C776, .pre_mean = 0.5, .bias = 1)
DG_TEST(dgelu_post_edges_m130, .M = 130, .N = 4 * C776, .K = C776, .post = 1, .bias = 1)
DG_TEST(dgelu_post_one_row, .M = 1, .N = 264, .K = 200, .post = 1, .bias = 1)
DG_TEST(dgelu_post_d24_block_twice, .M = 1536, .N = 4096, .K = 1024, .post = 1,
	.determinism = 1, .bias = 1)
DG_TEST(dgelu_d12_block_twice, .M = 1024, .N = 3072, .K = 768, .pre_mean = 0.5,
	.determinism = 1)

/* Bad arguments fail with an input error and a message, before touching the GPU. */
Test(gemm_sm90, bad_inputs_fail_cleanly)
{
	ng_bf16 *p = (ng_bf16 *)(uintptr_t)4096, *odd = (ng_bf16 *)(uintptr_t)4098;
	cr_expect_eq(ng_gemm_sm90_fwd(p, p, p, p, p, 64, 100, 64, 1, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "multiples of 8"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_fwd(p, p, p, p, p, 64, 64, 60, 1, 0), NG_ERR_INPUT);
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_fwd(p, p, p, p, p, 0, 64, 64, 1, 0), NG_ERR_INPUT);
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_fwd(p, NULL, p, p, p, 64, 64, 64, 1, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "NULL"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_fwd(p, p, odd, p, p, 64, 64, 64, 1, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "aligned"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_dgelu(p, p, NULL, p, p, p, 64, 100, 64, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "multiples of 8"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_dgelu(p, NULL, NULL, NULL, p, p, 64, 64, 64, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "NULL"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_dgelu(p, odd, NULL, p, p, p, 64, 64, 64, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "aligned"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_fwd(p, NULL, p, p, p, 64, 64, 64, NG_GEMM_ACT_RELU2, 0),
		     NG_ERR_INPUT); /* relu^2 takes no bias */
	cr_expect(strstr(ng_error_message(), "relu^2"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_gemm_sm90_fwd(p, NULL, p, p, NULL, 64, 64, 64, 7, 0), NG_ERR_INPUT);
	ng_clear_error();
}
