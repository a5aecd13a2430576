/*
 * tests/test_elementwise.c — GELU forward/backward, bias gradient, casts and token split
 * (kernels/elementwise.h) against graph/cpu_ops.h (double) or exact host results.
 * GELU: bf16 vs the rounded reference, 2 ulp (n odd, so the scalar tail runs; the backward
 * also in place, dinp == dout). Bias gradient: the FlashAttention rule against a naive fp32 row
 * loop, "+=" onto nonzero values, identical bytes over two runs; N = 1 and OC = 776, 2304, 50304.
 * GELU backward with the bias gradient (and the recomputed GELU): as both, and as the bias
 * gradient against the stored-bf16-then-fp32-sum baseline.
 * Casts: exactly round-to-nearest-even / exact widening. Token split: exact, T = 1 and T = 1024.
 */
#include <criterion/criterion.h>

#include "graph/cpu_ops.h"
#include "kernels/elementwise.h"
#include "tests/kernel_testing.h"

static void gelu_case(size_t n, int in_place)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	ng_bf16 *x = kt_xmalloc(n * 2), *d = kt_xmalloc(n * 2), *got = kt_xmalloc(n * 2);
	double *x_d = kt_xmalloc(n * 8), *d_d = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8);
	kt_fill_bf16(&r, x, x_d, n, 0.0, 3.0);
	kt_fill_bf16(&r, d, d_d, n, 0.0, 1.0);
	void *dx = kt_upload(x, n * 2), *dd = kt_upload(d, n * 2), *dy = kt_upload(NULL, n * 2);
	char what[96];
	ng_ref_gelu_fwd(ref, x_d, n);
	kt_ok(ng_gelu_fwd(dy, dx, n, 0), "ng_gelu_fwd");
	kt_download(got, dy, n * 2);
	snprintf(what, sizeof(what), "gelu_fwd n=%zu", n);
	check_bf16_(what, seed, got, ref, n, 2.0, 1e-6);
	ng_ref_gelu_bwd(ref, x_d, d_d, n);
	kt_ok(ng_gelu_bwd(in_place ? dd : dy, dx, dd, n, 0), "ng_gelu_bwd");
	kt_download(got, in_place ? dd : dy, n * 2);
	snprintf(what, sizeof(what), "gelu_bwd n=%zu in_place=%d", n, in_place);
	check_bf16_(what, seed, got, ref, n, 2.0, 1e-6);
	cudaFree(dx), cudaFree(dd), cudaFree(dy);
	free(x), free(d), free(got), free(x_d), free(d_d), free(ref);
}

static void bias_grad_case(int N, int OC)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = (size_t)N * OC;
	ng_bf16 *dout = kt_xmalloc(n * 2);
	double *dout_d = kt_xmalloc(n * 8);
	kt_fill_bf16(&r, dout, dout_d, n, 0.3, 1.0);
	float *b0 = kt_xmalloc(OC * 4), *nv = kt_xmalloc(OC * 4), *got[2];
	for (int c = 0; c < OC; c++)
		b0[c] = nv[c] = (float)ng_rng_normal(&r);
	double *ref = kt_f2d(b0, OC);
	ng_ref_matmul_bwd(NULL, NULL, ref, dout_d, NULL, NULL, N, 0, OC);
	for (int i = 0; i < N; i++)
		for (int c = 0; c < OC; c++)
			nv[c] += (float)dout_d[(size_t)i * OC + c];
	size_t sb = ng_bias_grad_scratch_bytes(N, OC);
	void *d_dout = kt_upload(dout, n * 2), *d_scr = kt_upload(NULL, sb);
	float *d_b = kt_upload(NULL, OC * 4);
	for (int run = 0; run < 2; run++) {
		kt_cuda(cudaMemcpy(d_b, b0, OC * 4, cudaMemcpyHostToDevice), "H2D");
		kt_ok(ng_bias_grad(d_b, d_dout, N, OC, d_scr, 0), "ng_bias_grad");
		got[run] = kt_xmalloc(OC * 4);
		kt_download(got[run], d_b, OC * 4);
	}
	char what[96];
	snprintf(what, sizeof(what), "bias_grad N=%d OC=%d", N, OC);
	double *g = kt_f2d(got[0], OC), *nvd = kt_f2d(nv, OC);
	check_fa_(what, seed, g, nvd, ref, OC, 1e-5);
	cr_expect(memcmp(got[0], got[1], OC * 4) == 0,
		  "bias_grad N=%d OC=%d: two runs differ (not deterministic); seed %llu", N, OC,
		  (unsigned long long)seed);
	cudaFree(d_dout), cudaFree(d_scr), cudaFree(d_b);
	free(dout), free(dout_d), free(b0), free(nv), free(got[0]), free(got[1]), free(ref), free(g);
	free(nvd);
}

/* ng_gelu_bwd_bias: dinp and gelu_out as the two GELU kernels (2 ulp of the rounded double
 * reference); dbias against the double sum of the unrounded gradient by the FlashAttention rule,
 * the naive fp32 baseline being what the step did before: the bf16 gradient stored, then summed
 * row by row in fp32 onto the old value. "=" onto garbage and "+=" onto nonzero values; in place
 * (dinp == dout) or not; identical bytes over two runs. */
static void gelu_bwd_bias_case(int N, int OC, int with_gelu, int accumulate, int in_place)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = (size_t)N * OC;
	ng_bf16 *x = kt_xmalloc(n * 2), *d = kt_xmalloc(n * 2), *got = kt_xmalloc(n * 2);
	double *x_d = kt_xmalloc(n * 8), *d_d = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8);
	kt_fill_bf16(&r, x, x_d, n, 0.0, 3.0);
	kt_fill_bf16(&r, d, d_d, n, 0.0, 1.0);
	float *b0 = kt_xmalloc(OC * 4), *nv = kt_xmalloc(OC * 4), *bias_got[2];
	double *bias_ref = kt_xmalloc(OC * 8);
	for (int c = 0; c < OC; c++) {
		b0[c] = (float)ng_rng_normal(&r);
		nv[c] = accumulate ? b0[c] : 0.0f;
		bias_ref[c] = nv[c];
	}
	ng_ref_gelu_bwd(ref, x_d, d_d, n);
	for (int i = 0; i < N; i++)
		for (int c = 0; c < OC; c++) {
			double v = ref[(size_t)i * OC + c];
			bias_ref[c] += v;
			nv[c] += (float)kt_round_bf16(v);
		}
	size_t sb = ng_bias_grad_scratch_bytes(N, OC);
	void *dx = kt_upload(x, n * 2), *dd = kt_upload(NULL, n * 2), *dy = kt_upload(NULL, n * 2);
	void *dg = with_gelu ? kt_upload(NULL, n * 2) : NULL, *d_scr = kt_upload(NULL, sb);
	float *d_b = kt_upload(NULL, OC * 4);
	char what[128];
	snprintf(what, sizeof(what), "gelu_bwd_bias N=%d OC=%d gelu=%d accumulate=%d in_place=%d",
		 N, OC, with_gelu, accumulate, in_place);
	for (int run = 0; run < 2; run++) {
		kt_cuda(cudaMemcpy(dd, d, n * 2, cudaMemcpyHostToDevice), "H2D");
		kt_cuda(cudaMemcpy(d_b, b0, OC * 4, cudaMemcpyHostToDevice), "H2D");
		kt_ok(ng_gelu_bwd_bias(in_place ? dd : dy, dg, d_b, accumulate, dx, dd, N, OC, d_scr,
				       0), "ng_gelu_bwd_bias");
		bias_got[run] = kt_xmalloc(OC * 4);
		kt_download(bias_got[run], d_b, OC * 4);
	}
	kt_download(got, in_place ? dd : dy, n * 2);
	check_bf16_(what, seed, got, ref, n, 2.0, 1e-6);
	if (with_gelu) {
		ng_ref_gelu_fwd(ref, x_d, n);
		kt_download(got, dg, n * 2);
		check_bf16_(what, seed, got, ref, n, 2.0, 1e-6);
	}
	double *g = kt_f2d(bias_got[0], OC), *nvd = kt_f2d(nv, OC);
	check_fa_(what, seed, g, nvd, bias_ref, OC, 1e-5);
	cr_expect(memcmp(bias_got[0], bias_got[1], OC * 4) == 0,
		  "%s: two runs differ (not deterministic); seed %llu", what,
		  (unsigned long long)seed);
	cudaFree(dx), cudaFree(dd), cudaFree(dy), cudaFree(dg), cudaFree(d_scr), cudaFree(d_b);
	free(x), free(d), free(got), free(x_d), free(d_d), free(ref), free(b0), free(nv);
	free(bias_got[0]), free(bias_got[1]), free(bias_ref), free(g), free(nvd);
}

Test(elementwise, gelu_bwd_bias)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	gelu_bwd_bias_case(1, 776, 1, 0, 0);
	gelu_bwd_bias_case(1000, 3104, 1, 1, 0);
	gelu_bwd_bias_case(1000, 3104, 0, 0, 1);
	gelu_bwd_bias_case(4099, 4096, 1, 0, 1);
	gelu_bwd_bias_case(37, 4104, 0, 1, 0);
	/* argument checks: one error, nothing launched */
	ng_clear_error();
	cr_expect_eq(ng_gelu_bwd_bias(NULL, NULL, NULL, 0, NULL, NULL, 4, 12, NULL, 0),
		     NG_ERR_INPUT);
}

Test(elementwise, gelu)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	gelu_case(1000003, 0);
	gelu_case(1000003, 1);
	gelu_case(5, 1);
	gelu_case(64 * 3104, 0);
}

Test(elementwise, bias_grad_shapes_and_determinism)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	bias_grad_case(1, 776);
	bias_grad_case(4096, 2304);
	bias_grad_case(1000, 3104);
	bias_grad_case(37, 50304);
}

Test(elementwise, casts)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = 1000005;
	float *f = kt_xmalloc(n * 4), *back = kt_xmalloc(n * 4);
	ng_bf16 *h = kt_xmalloc(n * 2);
	for (size_t i = 0; i < n; i++)
		f[i] = (float)(ng_rng_normal(&r) * pow(10.0, (double)ng_rng_below(&r, 9) - 4.0));
	float *df = kt_upload(f, n * 4), *dback = kt_upload(NULL, n * 4);
	ng_bf16 *dh = kt_upload(NULL, n * 2);
	kt_ok(ng_cast_f32_to_bf16(dh, df, n, 0), "ng_cast_f32_to_bf16");
	kt_ok(ng_cast_bf16_to_f32(dback, dh, n, 0), "ng_cast_bf16_to_f32");
	kt_download(h, dh, n * 2);
	kt_download(back, dback, n * 4);
	size_t bad = n, bad2 = n;
	for (size_t i = 0; i < n; i++) {
		if (h[i] != kt_f32_to_bf16(f[i]) && bad == n)
			bad = i;
		if (back[i] != kt_bf16_to_f32(h[i]) && bad2 == n)
			bad2 = i;
	}
	cr_expect(bad == n, "cast_f32_to_bf16: element %zu of %.9g is 0x%04x, want 0x%04x; seed %llu",
		  bad, bad < n ? f[bad] : 0.0, bad < n ? h[bad] : 0,
		  bad < n ? kt_f32_to_bf16(f[bad]) : 0, (unsigned long long)seed);
	cr_expect(bad2 == n, "cast_bf16_to_f32: element %zu not exact; seed %llu", bad2,
		  (unsigned long long)seed);
	cudaFree(df), cudaFree(dback), cudaFree(dh);
	free(f), free(back), free(h);
}

/* The transpose is a copy: every element exactly where it belongs, nothing written past out
 * (a guard row of 0xff bytes after it stays), for shapes with edges in both dimensions. */
static void transpose_case(int R, int C, int count, struct ng_rng *r, uint64_t seed)
{
	const size_t one = (size_t)R * C, n = one * count, guard = 64;
	ng_bf16 *in = kt_xmalloc(n * 2), *out = kt_xmalloc((n + guard) * 2);
	for (size_t i = 0; i < n; i++)
		in[i] = (ng_bf16)ng_rng_below(r, 65536);
	ng_bf16 *din = kt_upload(in, n * 2), *dout = kt_upload(NULL, (n + guard) * 2);
	kt_cuda(cudaMemset(dout, 0xff, (n + guard) * 2), "cudaMemset");
	kt_ok(ng_transpose_bf16(dout, din, R, C, count, 0), "ng_transpose_bf16");
	kt_download(out, dout, (n + guard) * 2);
	size_t bad = n;
	for (int b = 0; b < count; b++)
		for (int i = 0; i < R && bad == n; i++)
			for (int j = 0; j < C; j++)
				if (out[b * one + (size_t)j * R + i] != in[b * one + (size_t)i * C + j]) {
					bad = b * one + (size_t)i * C + j;
					break;
				}
	cr_expect(bad == n, "transpose %d x %d (x %d): element %zu misplaced; seed %llu", R, C,
		  count, bad, (unsigned long long)seed);
	for (size_t i = n; i < n + guard; i++)
		cr_expect(out[i] == 0xffff, "transpose %d x %d wrote past its end", R, C);
	cudaFree(din);
	cudaFree(dout);
	free(in);
	free(out);
}

Test(elementwise, transpose)
{
	cr_expect_eq(ng_transpose_bf16((ng_bf16 *)(uintptr_t)4096, (const ng_bf16 *)(uintptr_t)4096,
				       4, 4, 1, 0), NG_ERR_INPUT); /* overlapping */
	cr_expect_eq(ng_transpose_bf16((ng_bf16 *)(uintptr_t)4096, (const ng_bf16 *)(uintptr_t)8192,
				       0, 4, 1, 0), NG_ERR_INPUT);
	cr_expect_eq(ng_transpose_bf16((ng_bf16 *)(uintptr_t)4096, (const ng_bf16 *)(uintptr_t)8192,
				       4, 4, 0, 0), NG_ERR_INPUT);
	ng_clear_error();
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	static const struct { int R, C, count; } shapes[] = {
		{ .R = 1, .C = 1, .count = 1 },       { .R = 1, .C = 77, .count = 1 },
		{ .R = 77, .C = 1, .count = 1 },      { .R = 33, .C = 65, .count = 3 },
		{ .R = 768, .C = 3072, .count = 1 },  { .R = 1600, .C = 6400, .count = 1 },
		{ .R = 1000, .C = 37, .count = 1 },   { .R = 130, .C = 194, .count = 5 },
		{ .R = 1024, .C = 4096, .count = 3 },
	};
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
		transpose_case(shapes[i].R, shapes[i].C, shapes[i].count, &r, seed);
}

static void split_case(int B, int T)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t nw = (size_t)B * (T + 1), n = (size_t)B * T;
	uint16_t *w = kt_xmalloc(nw * 2);
	for (size_t i = 0; i < nw; i++)
		w[i] = (uint16_t)ng_rng_below(&r, 65536);
	int32_t *in = kt_xmalloc(n * 4), *tg = kt_xmalloc(n * 4);
	void *dw = kt_upload(w, nw * 2), *din = kt_upload(NULL, n * 4), *dtg = kt_upload(NULL, n * 4);
	kt_ok(ng_tokens_split(din, dtg, dw, B, T, 0), "ng_tokens_split");
	kt_download(in, din, n * 4);
	kt_download(tg, dtg, n * 4);
	size_t bad = n;
	for (int b = 0; b < B; b++)
		for (int t = 0; t < T; t++) {
			size_t i = (size_t)b * T + t, j = (size_t)b * (T + 1) + t;
			if ((in[i] != w[j] || tg[i] != w[j + 1]) && bad == n)
				bad = i;
		}
	cr_expect(bad == n, "tokens_split B=%d T=%d: wrong at %zu; seed %llu", B, T, bad,
		  (unsigned long long)seed);
	cudaFree(dw), cudaFree(din), cudaFree(dtg);
	free(w), free(in), free(tg);
}

Test(elementwise, tokens_split)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	split_case(3, 1);
	split_case(8, 1024);
}
