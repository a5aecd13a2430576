/*
 * tests/test_layernorm.c — LayerNorm forward and backward (kernels/layernorm.h) against
 * ng_ref_layernorm_fwd/bwd (graph/cpu_ops.h, double), on fresh seeded random inputs.
 * bf16 outputs: the rounded reference, 2 ulp + a small atol (cancellation in w*xhat + b).
 * mean/rstd (fp32): NMSE <= 1e-7. dw/db (reductions): the FlashAttention rule against a naive
 * fp32 row loop. Backward bytes identical over two runs. The E4M3 copy of the forward: the
 * bytes of a cast of the bf16 output, and its maximum; without statistics (inference) the
 * same output bytes.
 *
 * The shapes reach every path of kernels/layernorm.cu's dispatch: the forward's register
 * classes NCH = ceil(C / 256) = 1..8, then 12 and 16 (C up to 4096), each with a C that is not
 * a multiple of 256 where the class allows (lanes past C masked); the backward's warp per row
 * (C <= 1024, NCH 1..4, with N past one wave of blocks so that warps stride over rows) and its
 * staged kernel above (256-thread class up to C = 2048, 512-thread class up to 4096, N below
 * and above one wave); large-mean inputs; one row. Bad shapes and pointers fail before any
 * launch (those run without a GPU too).
 */
#include <criterion/criterion.h>

#include "graph/cpu_ops.h"
#include "kernels/fp8.h"
#include "kernels/layernorm.h"
#include "tests/kernel_testing.h"

/* The forward with an E4M3 copy (for an fp8 matmul): the same bf16 output byte for byte, the
 * copy byte for byte what ng_fp8_cast_e4m3 makes of that output with the same scale (one large
 * enough that the widest values saturate), and the NG_FP8_AMAX_SUB maxima whose largest is
 * max |out|. */
static void ln_fwd_fp8_same_(int N, int C, const ng_bf16 *out, const void *d_out,
			     const void *d_a, const void *d_w, const void *d_bias)
{
	size_t n = (size_t)N * C;
	float ymax = 0;
	for (size_t i = 0; i < n; i++)
		ymax = fmaxf(ymax, fabsf(kt_bf16_to_f32(out[i])));
	float sc[8] = { 600.0f / (ymax > 0 ? ymax : 1.0f) }; /* scale; then the cast's amax */
	float *d_sc = kt_upload(sc, sizeof(sc));
	float *d_amax = kt_upload(NULL, NG_FP8_AMAX_FLOATS * 4);
	kt_cuda(cudaMemset(d_amax, 0, NG_FP8_AMAX_FLOATS * 4), "cudaMemset");
	void *d_o2 = kt_upload(NULL, n * 2);
	uint8_t *d_8 = kt_upload(NULL, n), *d_c8 = kt_upload(NULL, n);
	kt_ok(ng_layernorm_fwd_fp8(d_o2, d_8, d_sc, d_amax, NULL, NULL, d_a, d_w, d_bias, N, C, 0),
	      "ng_layernorm_fwd_fp8");
	kt_ok(ng_fp8_cast_e4m3(d_c8, d_out, d_sc, n, 0), "ng_fp8_cast_e4m3");
	ng_bf16 *o2 = kt_xmalloc(n * 2);
	uint8_t *g8 = kt_xmalloc(n), *c8 = kt_xmalloc(n);
	static float am[NG_FP8_AMAX_FLOATS];
	kt_download(o2, d_o2, n * 2);
	kt_download(g8, d_8, n);
	kt_download(c8, d_c8, n);
	kt_download(am, d_amax, sizeof(am));
	cr_expect(memcmp(o2, out, n * 2) == 0, "N=%d C=%d: the fp8 forward's bf16 output differs",
		  N, C);
	size_t bad = 0, sat = 0;
	for (size_t i = 0; i < n; i++) {
		bad += g8[i] != c8[i];
		sat += (g8[i] & 0x7f) == 0x7e;
	}
	cr_expect_eq(bad, 0, "N=%d C=%d: %zu of %zu E4M3 bytes differ from the cast's", N, C, bad,
		     n);
	float got = 0;
	for (int j = 0; j < NG_FP8_AMAX_FLOATS; j++) /* the lines' first floats, zeros between */
		got = fmaxf(got, am[j]);
	cr_expect_eq(got, ymax, "N=%d C=%d: amax %a, max |out| %a", N, C, got, ymax);
	cr_log_info("fp8 copy N=%d C=%d: %zu bytes saturated", N, C, sat);
	cudaFree(d_sc), cudaFree(d_amax), cudaFree(d_o2), cudaFree(d_8), cudaFree(d_c8);
	free(o2), free(g8), free(c8);
}

/* One shape: rows, channels, and the inputs' mean (large means test the centred variance). */
struct ln_case {
	int N, C;
	double mean;
};

static void ln_fwd_case(const struct ln_case *c)
{
	const int N = c->N, C = c->C;
	const double mean = c->mean;
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = (size_t)N * C;
	ng_bf16 *a = kt_xmalloc(n * 2), *w = kt_xmalloc(C * 2), *bias = kt_xmalloc(C * 2),
		*out = kt_xmalloc(n * 2);
	double *a_d = kt_xmalloc(n * 8), *w_d = kt_xmalloc(C * 8), *bias_d = kt_xmalloc(C * 8),
	       *ref = kt_xmalloc(n * 8), *mref = kt_xmalloc(N * 8), *rref = kt_xmalloc(N * 8);
	kt_fill_bf16(&r, a, a_d, n, mean, 2.0);
	kt_fill_bf16(&r, w, w_d, C, 1.0, 0.2);
	kt_fill_bf16(&r, bias, bias_d, C, 0.0, 0.2);
	ng_ref_layernorm_fwd(ref, mref, rref, a_d, w_d, bias_d, N, C);

	void *d_a = kt_upload(a, n * 2), *d_w = kt_upload(w, C * 2);
	void *d_bias = kt_upload(bias, C * 2), *d_out = kt_upload(NULL, n * 2);
	float *d_m = kt_upload(NULL, N * 4), *d_r = kt_upload(NULL, N * 4);
	kt_ok(ng_layernorm_fwd(d_out, d_m, d_r, d_a, d_w, d_bias, N, C, 0), "ng_layernorm_fwd");
	float *m = kt_xmalloc(N * 4), *rs = kt_xmalloc(N * 4);
	kt_download(out, d_out, n * 2);
	kt_download(m, d_m, N * 4);
	kt_download(rs, d_r, N * 4);
	char what[128];
	snprintf(what, sizeof(what), "layernorm_fwd out N=%d C=%d mean=%g", N, C, mean);
	double ymax = 0;
	for (size_t i = 0; i < n; i++)
		ymax = fmax(ymax, fabs(ref[i]));
	check_bf16_(what, seed, out, ref, n, 2.0, 1e-5 * ymax);
	ln_fwd_fp8_same_(N, C, out, d_out, d_a, d_w, d_bias);
	void *d_o3 = kt_upload(NULL, n * 2); /* inference: no statistics, the same output */
	ng_bf16 *o3 = kt_xmalloc(n * 2);
	kt_ok(ng_layernorm_fwd(d_o3, NULL, NULL, d_a, d_w, d_bias, N, C, 0), "ng_layernorm_fwd");
	kt_download(o3, d_o3, n * 2);
	cr_expect(memcmp(o3, out, n * 2) == 0, "N=%d C=%d: without mean/rstd the output differs",
		  N, C);
	cudaFree(d_o3), free(o3);
	double *md = kt_f2d(m, N), *rd = kt_f2d(rs, N);
	snprintf(what, sizeof(what), "layernorm_fwd mean N=%d C=%d mean=%g", N, C, mean);
	check_nmse_(what, seed, md, mref, N);
	snprintf(what, sizeof(what), "layernorm_fwd rstd N=%d C=%d mean=%g", N, C, mean);
	check_nmse_(what, seed, rd, rref, N);
	cudaFree(d_a), cudaFree(d_w), cudaFree(d_bias), cudaFree(d_out), cudaFree(d_m);
	cudaFree(d_r);
	free(a), free(w), free(bias), free(out), free(a_d), free(w_d), free(bias_d), free(ref);
	free(mref), free(rref), free(m), free(rs), free(md), free(rd);
}

static void ln_bwd_case(const struct ln_case *c)
{
	const int N = c->N, C = c->C;
	const double mean = c->mean;
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = (size_t)N * C;
	ng_bf16 *x = kt_xmalloc(n * 2), *dout = kt_xmalloc(n * 2), *dinp0 = kt_xmalloc(n * 2),
		*w = kt_xmalloc(C * 2), *got[2];
	double *x_d = kt_xmalloc(n * 8), *dout_d = kt_xmalloc(n * 8), *w_d = kt_xmalloc(C * 8),
	       *dinp_ref = kt_xmalloc(n * 8), *tmp = kt_xmalloc(n * 8), *mref = kt_xmalloc(N * 8),
	       *rref = kt_xmalloc(N * 8);
	kt_fill_bf16(&r, x, x_d, n, mean, 2.0);
	kt_fill_bf16(&r, dout, dout_d, n, 0.0, 1.0);
	kt_fill_bf16(&r, dinp0, dinp_ref, n, 0.0, 1.0);
	kt_fill_bf16(&r, w, w_d, C, 1.0, 0.2);
	float *dw0 = kt_xmalloc(C * 4), *db0 = kt_xmalloc(C * 4), *m = kt_xmalloc(N * 4),
	      *rs = kt_xmalloc(N * 4);
	for (int c = 0; c < C; c++) {
		dw0[c] = (float)ng_rng_normal(&r);
		db0[c] = (float)ng_rng_normal(&r);
	}
	ng_ref_layernorm_fwd(tmp, mref, rref, x_d, w_d, w_d, N, C);
	for (int i = 0; i < N; i++) { /* the kernel gets fp32 statistics; so does the reference */
		m[i] = (float)mref[i];
		rs[i] = (float)rref[i];
		mref[i] = m[i];
		rref[i] = rs[i];
	}
	double *dw_ref = kt_f2d(dw0, C), *db_ref = kt_f2d(db0, C);
	ng_ref_layernorm_bwd(dinp_ref, dw_ref, db_ref, dout_d, x_d, w_d, mref, rref, N, C);
	/* naive fp32 dw/db: a row loop */
	float *nw = kt_xmalloc(C * 4), *nb = kt_xmalloc(C * 4);
	memcpy(nw, dw0, C * 4);
	memcpy(nb, db0, C * 4);
	for (int i = 0; i < N; i++)
		for (int c = 0; c < C; c++) {
			float d = (float)dout_d[(size_t)i * C + c];
			nw[c] += d * (((float)x_d[(size_t)i * C + c] - m[i]) * rs[i]);
			nb[c] += d;
		}

	size_t sb = ng_layernorm_bwd_scratch_bytes(N, C);
	void *d_x = kt_upload(x, n * 2), *d_dout = kt_upload(dout, n * 2), *d_w = kt_upload(w, C * 2);
	void *d_dinp = kt_upload(NULL, n * 2), *d_scr = kt_upload(NULL, sb);
	float *d_dw = kt_upload(NULL, C * 4), *d_db = kt_upload(NULL, C * 4);
	float *d_m = kt_upload(m, N * 4), *d_r = kt_upload(rs, N * 4);
	float *gdw[2], *gdb[2];
	for (int run = 0; run < 2; run++) {
		kt_cuda(cudaMemcpy(d_dinp, dinp0, n * 2, cudaMemcpyHostToDevice), "H2D");
		kt_cuda(cudaMemcpy(d_dw, dw0, C * 4, cudaMemcpyHostToDevice), "H2D");
		kt_cuda(cudaMemcpy(d_db, db0, C * 4, cudaMemcpyHostToDevice), "H2D");
		kt_ok(ng_layernorm_bwd(d_dinp, d_dw, d_db, d_dout, d_x, d_w, d_m, d_r, N, C, d_scr, 0),
		      "ng_layernorm_bwd");
		got[run] = kt_xmalloc(n * 2);
		gdw[run] = kt_xmalloc(C * 4);
		gdb[run] = kt_xmalloc(C * 4);
		kt_download(got[run], d_dinp, n * 2);
		kt_download(gdw[run], d_dw, C * 4);
		kt_download(gdb[run], d_db, C * 4);
	}
	char what[128];
	double gmax = 0;
	for (size_t i = 0; i < n; i++)
		gmax = fmax(gmax, fabs(dinp_ref[i]));
	snprintf(what, sizeof(what), "layernorm_bwd dinp N=%d C=%d mean=%g", N, C, mean);
	check_bf16_(what, seed, got[0], dinp_ref, n, 2.0, 1e-4 * gmax);
	double *g = kt_f2d(gdw[0], C), *nv = kt_f2d(nw, C);
	snprintf(what, sizeof(what), "layernorm_bwd dw N=%d C=%d mean=%g", N, C, mean);
	check_fa_(what, seed, g, nv, dw_ref, C, 1e-5);
	free(g), free(nv);
	g = kt_f2d(gdb[0], C), nv = kt_f2d(nb, C);
	snprintf(what, sizeof(what), "layernorm_bwd db N=%d C=%d mean=%g", N, C, mean);
	check_fa_(what, seed, g, nv, db_ref, C, 1e-5);
	free(g), free(nv);
	cr_expect(memcmp(got[0], got[1], n * 2) == 0 && memcmp(gdw[0], gdw[1], C * 4) == 0 &&
		  memcmp(gdb[0], gdb[1], C * 4) == 0,
		  "layernorm_bwd N=%d C=%d: two runs differ (not deterministic); seed %llu", N, C,
		  (unsigned long long)seed);
	for (int run = 0; run < 2; run++)
		free(got[run]), free(gdw[run]), free(gdb[run]);
	cudaFree(d_x), cudaFree(d_dout), cudaFree(d_w), cudaFree(d_dinp), cudaFree(d_scr);
	cudaFree(d_dw), cudaFree(d_db), cudaFree(d_m), cudaFree(d_r);
	free(x), free(dout), free(dinp0), free(w), free(x_d), free(dout_d), free(w_d);
	free(dinp_ref), free(tmp), free(mref), free(rref), free(dw0), free(db0), free(m), free(rs);
	free(dw_ref), free(db_ref), free(nw), free(nb);
}

/* Forward: every NCH class (C in (256 (NCH - 1), 256 NCH]; 9..12 -> 12, 13..16 -> 16). */
static const struct ln_case fwd_cases[] = {
	{ .N = 1, .C = 8, .mean = 3.0 },       /* NCH 1, one row */
	{ .N = 3, .C = 264 },                  /* 2 */
	{ .N = 5, .C = 520, .mean = 1.0 },     /* 3 */
	{ .N = 3, .C = 776 },                  /* 4 */
	{ .N = 2048, .C = 768, .mean = 0.5 },  /* 3, many blocks */
	{ .N = 7, .C = 1032 },                 /* 5 */
	{ .N = 2, .C = 1288 },                 /* 6 */
	{ .N = 9, .C = 1544 },                 /* 7 */
	{ .N = 517, .C = 1600, .mean = 100.0 }, /* 7, large mean */
	{ .N = 4, .C = 2048 },                 /* 8, full */
	{ .N = 3, .C = 2056 },                 /* 12 (9 chunks used) */
	{ .N = 2, .C = 3072 },                 /* 12, full */
	{ .N = 6, .C = 3080 },                 /* 16 (13 chunks used) */
	{ .N = 2, .C = 4096 },                 /* 16, full: the largest C */
};

/* Backward: warp per row up to C = 1024 (NCH 1..4), staged above (256 threads up to C = 2048,
 * 512 up to 4096); N past one wave where noted (warps or blocks take several rows). */
static const struct ln_case bwd_cases[] = {
	{ .N = 7, .C = 8, .mean = 1.0 },       /* warp, NCH 1 */
	{ .N = 5000, .C = 264 },               /* warp, NCH 2, past one wave (792 blocks) */
	{ .N = 5, .C = 520 },                  /* warp, NCH 3 */
	{ .N = 3, .C = 776 },                  /* warp, NCH 4 */
	{ .N = 4096, .C = 768 },               /* warp, NCH 3, past one wave (528 blocks) */
	{ .N = 1601, .C = 1024 },              /* warp, NCH 4, the largest C, past one wave */
	{ .N = 9, .C = 1032 },                 /* staged 256, the smallest C, a row a block */
	{ .N = 1111, .C = 1600, .mean = 100.0 }, /* staged 256, several rows a block */
	{ .N = 300, .C = 2048 },               /* staged 256, the largest C */
	{ .N = 70, .C = 2056 },                /* staged 512, the smallest C */
	{ .N = 13, .C = 3080 },                /* staged 512 */
	{ .N = 600, .C = 4096 },               /* staged 512, the largest C, several rows a block */
};

Test(layernorm, fwd_shapes)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (size_t i = 0; i < sizeof(fwd_cases) / sizeof(fwd_cases[0]); i++)
		ln_fwd_case(&fwd_cases[i]);
}

Test(layernorm, bwd_shapes_and_determinism, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (size_t i = 0; i < sizeof(bwd_cases) / sizeof(bwd_cases[0]); i++)
		ln_bwd_case(&bwd_cases[i]);
}

/* Bad shapes and pointers: an input error naming the value, before any launch. */
Test(layernorm, bad_arguments_fail_cleanly)
{
	ng_bf16 *p = (ng_bf16 *)(uintptr_t)4096, *odd = (ng_bf16 *)(uintptr_t)4098;
	float *f = (float *)(uintptr_t)8192;
	static const struct ln_case bad[] = {
		{ .N = 4, .C = 12 }, { .N = 4, .C = 4104 }, { .N = 0, .C = 64 }, { .N = 4, .C = 0 },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		cr_expect_eq(ng_layernorm_fwd(p, f, f, p, p, p, bad[i].N, bad[i].C, 0), NG_ERR_INPUT,
			     "fwd N=%d C=%d", bad[i].N, bad[i].C);
		ng_clear_error();
		cr_expect_eq(ng_layernorm_bwd(p, f, f, p, p, p, f, f, bad[i].N, bad[i].C, p, 0),
			     NG_ERR_INPUT, "bwd N=%d C=%d", bad[i].N, bad[i].C);
		ng_clear_error();
	}
	cr_expect_eq(ng_layernorm_fwd(p, f, f, odd, p, p, 4, 64, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "aligned"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_layernorm_fwd_fp8(p, (uint8_t *)(uintptr_t)4100, f, f, f, f, p, p, p, 4, 64,
					  0),
		     NG_ERR_INPUT, "a misaligned E4M3 output");
	ng_clear_error();
	cr_expect_eq(ng_layernorm_fwd_fp8(p, (uint8_t *)(uintptr_t)4096, NULL, f, f, f, p, p, p, 4,
					  64, 0),
		     NG_ERR_INPUT, "an E4M3 output without a scale");
	ng_clear_error();
	cr_expect_eq(ng_layernorm_bwd_scratch_bytes(0, 64), 0);
	cr_expect_eq(ng_layernorm_bwd_scratch_bytes(4, 0), 0);
}
