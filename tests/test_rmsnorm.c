/*
 * tests/test_rmsnorm.c — the speedrun model's RMSNorm, QK-norm + rotary and relu^2 kernels
 * (kernels/rmsnorm.h) against the double-precision reference (graph/cpu_spr_ops.h), on fresh
 * seeded random inputs, in place and out of place.
 *
 * Tolerances, with e = 2^-24 (fp32's unit roundoff) and the bf16 outputs compared with the fp64
 * reference rounded to bf16. A kernel whose fp32 value f lies within E of the exact value gives
 * round(f), at most one bf16 ulp (at |ref| + E) plus E from round(ref); so each element may
 * differ by ulp + E_i, E_i a bound of the kernel's fp32 error (check_bf16_bound_):
 *  - RMSNorm forward: the sum of C squares in fp32 is within (C/32 + 5) e relatively (a lane's
 *    sequential C/32 terms, 5 butterfly levels; no cancellation), rs within half that plus 4e
 *    (the division, eps, rsqrtf's 2 ulp), y = x rs one more: far below 2^-9, so E_i = 0 and the
 *    bound is 1 ulp. rstd (fp32): NMSE <= 1e-7.
 *  - RMSNorm backward: g = acc + rs (d - y m), m = rs mean(d x) summed like the forward but with
 *    cancellation, |dm| <= (C/32 + 7) e rs mean|d x|; E_i = (C/32 + 8) e (|acc| + rs |d| +
 *    rs |y| (|m| + rs mean|d x|)), the largest intermediates of element i.
 *  - QK-norm + rotary forward: rs within (V + 6) e (2V squares a lane, 5 levels, rsqrtf), the
 *    rotation's products and sincosf's 2 ulp add ~6e of |y1| + |y2|: E = 32 e (|y1| + |y2|) for
 *    both elements of a pair. Against ng_ref_qk_norm_rotary_fwd, whose angles are exact rather
 *    than the fp32 pos * freq the kernel documents, add |dtheta| (|y1| + |y2|) with |dtheta| <=
 *    2 e theta (the two fp32 roundings of freq and of the product). The test's own reference
 *    with the fp32 angles, qk_ref_f32_angles, is checked against the library one on the CPU.
 *  - QK backward: from the forward's bf16 output o and fp32 rstd, as the kernel gets them: the
 *    fp64 formula on those inputs with E = 32 e rs (|g1| + |g2| + |d1| + |d2| + (|o1| + |o2|)
 *    (|m| + mean|d o|)); against the library backward (which works from the exact input) by
 *    the FlashAttention rule: the kernel's max error <= 2 x that of a naive fp32 loop over the
 *    same rounded inputs (output rounded to bf16) + 2^-16 max|ref|.
 *  - relu^2: exact in fp32 (a bf16's square has 16 significant bits, 2 x d 16 too), so the
 *    bits equal the rounded reference (0 ulp). Its backward from the forward's output y (the
 *    fused forward keeps only y): 2 sqrt(y) d against the fp64 value of the same bf16 y, d;
 *    sqrtf is correctly rounded and the product one more rounding, 2e in all, far below 2^-9:
 *    1 ulp.
 * Bad shapes and pointers fail before any launch (those tests and the CPU reference checks run
 * without a GPU).
 */
#include <criterion/criterion.h>

#include "graph/cpu_spr_ops.h"
#include "graph/gpt.h"
#include "kernels/rmsnorm.h"
#include "tests/kernel_testing.h"

#define E32 (1.0 / 16777216.0) /* 2^-24 */
#define EPS ((float)NG_SPR_RMS_EPS)
#define QK_TEST_MAX_HALF 128 /* D / 2 for D <= 256 */

/* A generator from a fresh seed (kt_seed), which it returns for the messages. */
static uint64_t seeded_(struct ng_rng *r)
{
	uint64_t seed = kt_seed();
	ng_rng_seed(r, seed);
	return seed;
}

/* Each element within 1 ulp (at |ref| + bound) + bound[i] of the rounded reference. */
static void check_bf16_bound_(const char *what, uint64_t seed, const ng_bf16 *got,
			      const double *ref, const double *bound, size_t n)
{
	size_t bad = n, worst = 0;
	double max_abs = 0;
	for (size_t i = 0; i < n; i++) {
		double r = kt_round_bf16(ref[i]), g = kt_bf16_to_f32(got[i]);
		double d = isnan(g) ? INFINITY : fabs(g - r);
		if (d > max_abs) {
			max_abs = d;
			worst = i;
		}
		if (d > kt_bf16_ulp(fabs(r) + bound[i]) + bound[i] && bad == n)
			bad = i;
	}
	cr_expect(bad == n,
		  "%s: element %zu is %.8g, reference %.8g (bound %.3g + 1 ulp); max abs err %.3g at "
		  "%zu; seed %llu",
		  what, bad, bad < n ? kt_bf16_to_f32(got[bad]) : 0.0, bad < n ? ref[bad] : 0.0,
		  bad < n ? bound[bad] : 0.0, max_abs, worst, (unsigned long long)seed);
}

/* ------------------------------------------------------------ RMSNorm */

struct rms_case {
	int N, C;
	double sd; /* the inputs' spread (1e-3: mean(x^2) ~ 1e-6, where eps counts) */
};

/* Every register class NCH = ceil(C / 256): 1..8, 12 (9..12), 16 (13..16), the lanes past C
 * masked where C is not a multiple of 256; one row, odd N, many blocks. */
static const struct rms_case rms_cases[] = {
	{ 1, 24, 1.0 },     { 7, 24, 1.0 },     { 1000, 24, 1e-3 }, { 3, 8, 2.0 },
	{ 5, 264, 1.0 },    { 9, 520, 1.0 },    { 1, 768, 1.0 },    { 7, 768, 1.0 },
	{ 1000, 768, 3.0 }, { 4, 776, 1.0 },    { 6, 1032, 1.0 },   { 2, 1288, 1.0 },
	{ 3, 1544, 1.0 },   { 5, 1600, 50.0 },  { 4, 2048, 1.0 },   { 3, 2056, 1.0 },
	{ 2, 3072, 1.0 },   { 5, 3080, 1.0 },   { 1, 4096, 1.0 },   { 7, 4096, 1.0 },
};

static void rms_fwd_case(const struct rms_case *c)
{
	const int N = c->N, C = c->C;
	size_t n = (size_t)N * C;
	struct ng_rng r;
	uint64_t seed = seeded_(&r);
	ng_bf16 *x = kt_xmalloc(n * 2), *out = kt_xmalloc(n * 2), *io = kt_xmalloc(n * 2);
	double *xd = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8), *rref = kt_xmalloc(N * 8);
	float *rs = kt_xmalloc(N * 4);
	kt_fill_bf16(&r, x, xd, n, 0.0, c->sd);
	ng_ref_rmsnorm_fwd(ref, rref, xd, N, C, (double)EPS);

	ng_bf16 *d_x = kt_upload(x, n * 2), *d_out = kt_upload(NULL, n * 2);
	ng_bf16 *d_io = kt_upload(NULL, (n + 8) * 2); /* in place, 16 bytes past the allocation */
	float *d_r = kt_upload(NULL, N * 4);
	kt_cuda(cudaMemcpy(d_io + 8, x, n * 2, cudaMemcpyHostToDevice), "H2D");
	kt_ok(ng_rmsnorm_fwd(d_out, d_r, d_x, N, C, EPS, 0), "ng_rmsnorm_fwd");
	kt_ok(ng_rmsnorm_fwd(d_io + 8, NULL, d_io + 8, N, C, EPS, 0), "ng_rmsnorm_fwd in place");
	kt_download(out, d_out, n * 2);
	kt_download(io, d_io + 8, n * 2);
	kt_download(rs, d_r, N * 4);
	char what[128];
	snprintf(what, sizeof(what), "rmsnorm_fwd out N=%d C=%d sd=%g", N, C, c->sd);
	check_bf16_(what, seed, out, ref, n, 1.0, 0.0);
	cr_expect(memcmp(io, out, n * 2) == 0,
		  "rmsnorm_fwd N=%d C=%d: in place (no rstd) differs from out of place", N, C);
	double *rsd = kt_f2d(rs, N);
	snprintf(what, sizeof(what), "rmsnorm_fwd rstd N=%d C=%d sd=%g", N, C, c->sd);
	check_nmse_(what, seed, rsd, rref, N);
	cudaFree(d_x), cudaFree(d_out), cudaFree(d_io), cudaFree(d_r);
	free(x), free(out), free(io), free(xd), free(ref), free(rref), free(rs), free(rsd);
}

static void rms_bwd_case(const struct rms_case *c)
{
	const int N = c->N, C = c->C;
	size_t n = (size_t)N * C;
	struct ng_rng r;
	uint64_t seed = seeded_(&r);
	ng_bf16 *x = kt_xmalloc(n * 2), *dout = kt_xmalloc(n * 2), *acc0 = kt_xmalloc(n * 2),
		*got = kt_xmalloc(n * 2), *got2 = kt_xmalloc(n * 2);
	double *xd = kt_xmalloc(n * 8), *dd = kt_xmalloc(n * 8), *ad = kt_xmalloc(n * 8),
	       *y = kt_xmalloc(n * 8), *rref = kt_xmalloc(N * 8), *ref = kt_xmalloc(n * 8),
	       *bound = kt_xmalloc(n * 8);
	float *rs = kt_xmalloc(N * 4);
	kt_fill_bf16(&r, x, xd, n, 0.0, c->sd);
	kt_fill_bf16(&r, dout, dd, n, 0.0, 1.0);
	kt_fill_bf16(&r, acc0, ad, n, 0.0, 1.0);
	ng_ref_rmsnorm_fwd(y, rref, xd, N, C, (double)EPS);
	for (int i = 0; i < N; i++) { /* the kernel gets fp32 statistics; so does the reference */
		rs[i] = (float)rref[i];
		rref[i] = rs[i];
	}
	ng_bf16 *d_x = kt_upload(x, n * 2), *d_dout = kt_upload(dout, n * 2);
	ng_bf16 *d_g = kt_upload(NULL, n * 2);
	float *d_r = kt_upload(rs, N * 4);
	for (int accumulate = 0; accumulate < 2; accumulate++) {
		for (size_t i = 0; i < n; i++)
			ref[i] = accumulate ? ad[i] : 0.0;
		ng_ref_rmsnorm_bwd(ref, dd, xd, rref, N, C);
		for (int i = 0; i < N; i++) { /* E_i of the header, from the row's intermediates */
			const double *xr = xd + (size_t)i * C, *dr = dd + (size_t)i * C;
			double s = 0, sa = 0;
			for (int k = 0; k < C; k++)
				s += dr[k] * xr[k], sa += fabs(dr[k] * xr[k]);
			double q = rref[i], m = q * s / C, ma = q * sa / C;
			for (int k = 0; k < C; k++) {
				size_t j = (size_t)i * C + k;
				bound[j] = (C / 32.0 + 8.0) * E32 *
					   ((accumulate ? fabs(ad[j]) : 0.0) + q * fabs(dr[k]) +
					    q * fabs(xr[k] * q) * (fabs(m) + ma));
			}
		}
		kt_cuda(cudaMemcpy(d_g, acc0, n * 2, cudaMemcpyHostToDevice), "H2D");
		kt_ok(ng_rmsnorm_bwd(d_g, d_dout, d_x, d_r, N, C, accumulate, 0), "ng_rmsnorm_bwd");
		kt_download(got, d_g, n * 2);
		char what[128];
		snprintf(what, sizeof(what), "rmsnorm_bwd N=%d C=%d sd=%g accumulate=%d", N, C, c->sd,
			 accumulate);
		check_bf16_bound_(what, seed, got, ref, bound, n);
	}
	/* "=" in place over dout: the bytes of the out-of-place "=" */
	kt_cuda(cudaMemcpy(d_g, acc0, n * 2, cudaMemcpyHostToDevice), "H2D");
	kt_ok(ng_rmsnorm_bwd(d_g, d_dout, d_x, d_r, N, C, 0, 0), "ng_rmsnorm_bwd");
	kt_download(got, d_g, n * 2);
	kt_ok(ng_rmsnorm_bwd(d_dout, d_dout, d_x, d_r, N, C, 0, 0), "ng_rmsnorm_bwd in place");
	kt_download(got2, d_dout, n * 2);
	cr_expect(memcmp(got, got2, n * 2) == 0,
		  "rmsnorm_bwd N=%d C=%d: dinp == dout differs from out of place; seed %llu", N, C,
		  (unsigned long long)seed);
	cudaFree(d_x), cudaFree(d_dout), cudaFree(d_g), cudaFree(d_r);
	free(x), free(dout), free(acc0), free(got), free(got2), free(xd), free(dd), free(ad);
	free(y), free(rref), free(ref), free(bound), free(rs);
}

Test(rmsnorm, fwd_shapes)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (size_t i = 0; i < sizeof(rms_cases) / sizeof(rms_cases[0]); i++)
		rms_fwd_case(&rms_cases[i]);
}

Test(rmsnorm, bwd_shapes_accumulate_in_place)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (size_t i = 0; i < sizeof(rms_cases) / sizeof(rms_cases[0]); i++)
		rms_bwd_case(&rms_cases[i]);
}

/* ------------------------------------------------------------ QK-norm + rotary */

struct qk_case {
	int N, T, H, D;
};

/* D = 16 .. 256 with 16-byte halves (V = 8; D/16 lanes a head, q = D/4 up to 64 angles, two a
 * lane at D = 256), 8-byte halves (V = 4: D = 8, 24, 40, 200, whose G = 1, 3, 5, 25 chunks round
 * up to 1, 4, 8, 32 lanes), T dividing N or not, one row; and positions up to 49151 (the
 * speedrun's one sequence per step), where fp32 angles differ from exact ones by ~1e-3. */
static const struct qk_case qk_cases[] = {
	{ 1, 1, 3, 16 },   { 7, 3, 3, 16 },  { 1000, 256, 3, 16 }, { 1, 1, 6, 128 },
	{ 7, 7, 6, 128 },  { 1000, 300, 6, 128 }, { 5, 4, 2, 32 }, { 9, 9, 4, 64 },
	{ 3, 3, 2, 256 },  { 6, 5, 3, 24 },  { 4, 4, 2, 8 },       { 5, 5, 2, 40 },
	{ 4, 4, 5, 200 },  { 49152, 49152, 1, 16 },
};

/* The forward with the kernel's angles: y = the fp64 RMSNorm of each head, then pair i rotated
 * by theta = fl32(pos * fl32(freq[i])), cos and sin in fp64 of that fp32 theta. Also returns y
 * (N, 3, H, D; its v part unset), for the bounds. */
static void qk_ref_f32_angles(double *out, double *y, double *rstd, const double *qkv, int N,
			      int T, int H, int D, double eps)
{
	size_t C3 = (size_t)3 * H * D, HD = (size_t)H * D;
	int half = D / 2;
	double freq[QK_TEST_MAX_HALF];
	ng_ref_rotary_freqs(freq, D);
	for (int n = 0; n < N; n++) {
		float pos = (float)(n % T);
		for (int v = 0; v < 2 * H; v++) {
			size_t o = (size_t)n * C3 + (size_t)v * D;
			double rs;
			ng_ref_rmsnorm_fwd(y + o, &rs, qkv + o, 1, D, eps);
			if (rstd)
				rstd[(size_t)n * 2 * H + v] = rs;
			for (int i = 0; i < half; i++) {
				double th = (double)(pos * (float)freq[i]);
				double c = cos(th), s = sin(th), y1 = y[o + i], y2 = y[o + i + half];
				out[o + i] = y1 * c + y2 * s;
				out[o + i + half] = -y1 * s + y2 * c;
			}
		}
		memcpy(out + (size_t)n * C3 + 2 * HD, qkv + (size_t)n * C3 + 2 * HD, HD * 8);
	}
}

/* The v parts of two (N, 3, H, D) bf16 tensors are the same bytes. */
static void qk_expect_same_v_(const char *what, const ng_bf16 *a, const ng_bf16 *b, int N, int H,
			      int D)
{
	size_t HD = (size_t)H * D, bad = 0;
	for (int row = 0; row < N; row++)
		bad += memcmp(a + (size_t)row * 3 * HD + 2 * HD, b + (size_t)row * 3 * HD + 2 * HD,
			      HD * 2) != 0;
	cr_expect_eq(bad, 0, "%s in %zu rows (N=%d H=%d D=%d)", what, bad, N, H, D);
}

/* theta of a pair of frequency freq at row n, as the kernel computes it (fp32) */
static double qk_theta32(int n, int T, double freq)
{
	return (double)((float)(n % T) * (float)freq);
}

static void qk_fwd_case(const struct qk_case *c)
{
	const int N = c->N, T = c->T, H = c->H, D = c->D, half = D / 2;
	size_t HD = (size_t)H * D, C3 = 3 * HD, n = (size_t)N * C3, nr = (size_t)N * 2 * H;
	struct ng_rng r;
	uint64_t seed = seeded_(&r);
	ng_bf16 *x = kt_xmalloc(n * 2), *out = kt_xmalloc(n * 2), *io = kt_xmalloc(n * 2);
	double *xd = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8), *y = kt_xmalloc(n * 8),
	       *lib = kt_xmalloc(n * 8), *b = kt_xmalloc(n * 8), *bl = kt_xmalloc(n * 8),
	       *rref = kt_xmalloc(nr * 8), freq[QK_TEST_MAX_HALF];
	float *rs = kt_xmalloc(nr * 4);
	kt_fill_bf16(&r, x, xd, n, 0.0, 1.5);
	qk_ref_f32_angles(ref, y, rref, xd, N, T, H, D, (double)EPS);
	ng_ref_qk_norm_rotary_fwd(lib, NULL, xd, N, T, H, D, (double)EPS);
	ng_ref_rotary_freqs(freq, D);
	for (size_t i = 0; i < n; i++)
		b[i] = bl[i] = 0.0; /* v: a copy */
	for (int row = 0; row < N; row++)
		for (int v = 0; v < 2 * H; v++)
			for (int i = 0; i < half; i++) {
				size_t o = (size_t)row * C3 + (size_t)v * D + i;
				double a = fabs(y[o]) + fabs(y[o + half]);
				double th = (double)(row % T) * freq[i];
				b[o] = b[o + half] = 32.0 * E32 * a;
				bl[o] = bl[o + half] = b[o] + 2.0 * E32 * th * a;
			}

	ng_bf16 *d_x = kt_upload(x, n * 2), *d_out = kt_upload(NULL, n * 2);
	ng_bf16 *d_io = kt_upload(x, n * 2);
	float *d_r = kt_upload(NULL, nr * 4);
	kt_ok(ng_qk_norm_rotary_fwd(d_out, d_r, d_x, N, T, H, D, EPS, 0), "ng_qk_norm_rotary_fwd");
	kt_ok(ng_qk_norm_rotary_fwd(d_io, NULL, d_io, N, T, H, D, EPS, 0),
	      "ng_qk_norm_rotary_fwd in place");
	kt_download(out, d_out, n * 2);
	kt_download(io, d_io, n * 2);
	kt_download(rs, d_r, nr * 4);
	char what[128];
	snprintf(what, sizeof(what), "qk_norm_rotary_fwd N=%d T=%d H=%d D=%d", N, T, H, D);
	check_bf16_bound_(what, seed, out, ref, b, n);
	snprintf(what, sizeof(what), "qk_norm_rotary_fwd vs the exact angles N=%d T=%d H=%d D=%d",
		 N, T, H, D);
	check_bf16_bound_(what, seed, out, lib, bl, n);
	qk_expect_same_v_("qk_norm_rotary_fwd: v is not a copy", out, x, N, H, D);
	cr_expect(memcmp(io, out, n * 2) == 0,
		  "qk_norm_rotary_fwd N=%d T=%d H=%d D=%d: in place differs from out of place "
		  "(or v was touched); seed %llu", N, T, H, D, (unsigned long long)seed);
	double *rsd = kt_f2d(rs, nr);
	snprintf(what, sizeof(what), "qk_norm_rotary_fwd rstd N=%d H=%d D=%d", N, H, D);
	check_nmse_(what, seed, rsd, rref, nr);
	cudaFree(d_x), cudaFree(d_out), cudaFree(d_io), cudaFree(d_r);
	free(x), free(out), free(io), free(xd), free(ref), free(y), free(lib), free(b), free(bl);
	free(rref), free(rs), free(rsd);
}

/* The backward of one (row, q|k head) vector from the forward's output o and rstd rs, given the
 * output gradient d, as the kernel computes it, in double (dx, bound) or in float (naive, rounded
 * to bf16 like the kernel's output); pairs i < D/4 rotate back by the fp32 angle. */
static void qk_bwd_vec_ref(double *dx, double *bound, double *naive, const double *o,
			   const double *d, double rs, const double *freq, int row, int T, int D)
{
	int half = D / 2;
	double m = 0, ma = 0;
	float mf = 0.0f;
	for (int k = 0; k < D; k++) {
		m += d[k] * o[k];
		ma += fabs(d[k] * o[k]);
		mf += (float)d[k] * (float)o[k];
	}
	m /= D, ma /= D, mf /= (float)D;
	for (int i = 0; i < half; i++) {
		double th = qk_theta32(row, T, freq[i]), c = cos(th), s = sin(th);
		float thf = (float)th, cf = cosf(thf), sf = sinf(thf), rsf = (float)rs;
		double g1 = d[i] - o[i] * m, g2 = d[i + half] - o[i + half] * m;
		float h1 = (float)d[i] - (float)o[i] * mf;
		float h2 = (float)d[i + half] - (float)o[i + half] * mf;
		dx[i] = rs * (c * g1 - s * g2);
		dx[i + half] = rs * (s * g1 + c * g2);
		naive[i] = kt_round_bf16(rsf * (cf * h1 - sf * h2));
		naive[i + half] = kt_round_bf16(rsf * (sf * h1 + cf * h2));
		bound[i] = bound[i + half] =
			32.0 * E32 * rs *
			(fabs(g1) + fabs(g2) + fabs(d[i]) + fabs(d[i + half]) +
			 (fabs(o[i]) + fabs(o[i + half])) * (fabs(m) + ma));
	}
}

static void qk_bwd_case(const struct qk_case *c)
{
	const int N = c->N, T = c->T, H = c->H, D = c->D;
	size_t HD = (size_t)H * D, C3 = 3 * HD, n = (size_t)N * C3, nr = (size_t)N * 2 * H;
	struct ng_rng r;
	uint64_t seed = seeded_(&r);
	ng_bf16 *x = kt_xmalloc(n * 2), *o = kt_xmalloc(n * 2), *dout = kt_xmalloc(n * 2),
		*got = kt_xmalloc(n * 2);
	double *xd = kt_xmalloc(n * 8), *dd = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8),
	       *b = kt_xmalloc(n * 8), *naive = kt_xmalloc(n * 8), *lib = kt_xmalloc(n * 8),
	       *od, *rsd, freq[QK_TEST_MAX_HALF];
	float *rs = kt_xmalloc(nr * 4);
	kt_fill_bf16(&r, x, xd, n, 0.0, 1.5);
	kt_fill_bf16(&r, dout, dd, n, 0.0, 1.0);
	ng_ref_rotary_freqs(freq, D);

	ng_bf16 *d_x = kt_upload(x, n * 2), *d_o = kt_upload(NULL, n * 2);
	ng_bf16 *d_g = kt_upload(dout, n * 2);
	float *d_r = kt_upload(NULL, nr * 4);
	kt_ok(ng_qk_norm_rotary_fwd(d_o, d_r, d_x, N, T, H, D, EPS, 0), "ng_qk_norm_rotary_fwd");
	kt_ok(ng_qk_norm_rotary_bwd(d_g, d_o, d_r, N, T, H, D, 0), "ng_qk_norm_rotary_bwd");
	kt_download(o, d_o, n * 2);
	kt_download(rs, d_r, nr * 4);
	kt_download(got, d_g, n * 2);
	od = kt_b2d(o, n);
	rsd = kt_f2d(rs, nr);
	for (size_t i = 0; i < n; i++) { /* v: left as it is */
		ref[i] = naive[i] = dd[i];
		b[i] = 0.0;
	}
	for (int row = 0; row < N; row++)
		for (int v = 0; v < 2 * H; v++) {
			size_t e = (size_t)row * C3 + (size_t)v * D;
			qk_bwd_vec_ref(ref + e, b + e, naive + e, od + e, dd + e,
				       rsd[(size_t)row * 2 * H + v], freq, row, T, D);
		}
	char what[128];
	snprintf(what, sizeof(what), "qk_norm_rotary_bwd N=%d T=%d H=%d D=%d", N, T, H, D);
	check_bf16_bound_(what, seed, got, ref, b, n);
	qk_expect_same_v_("qk_norm_rotary_bwd: v was changed", got, dout, N, H, D);
	/* against the library's backward from the exact input */
	memset(lib, 0, n * 8);
	ng_ref_qk_norm_rotary_bwd(lib, dd, xd, rsd, N, T, H, D);
	double gmax = 0;
	for (size_t i = 0; i < n; i++)
		gmax = fmax(gmax, fabs(lib[i]));
	double *gd = kt_b2d(got, n);
	snprintf(what, sizeof(what), "qk_norm_rotary_bwd vs the reference N=%d T=%d H=%d D=%d", N,
		 T, H, D);
	check_fa_(what, seed, gd, naive, lib, n, gmax / 65536.0);
	cudaFree(d_x), cudaFree(d_o), cudaFree(d_g), cudaFree(d_r);
	free(x), free(o), free(dout), free(got), free(xd), free(dd), free(ref), free(b);
	free(naive), free(lib), free(od), free(rsd), free(rs), free(gd);
}

Test(rmsnorm, qk_norm_rotary_fwd_shapes, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (size_t i = 0; i < sizeof(qk_cases) / sizeof(qk_cases[0]); i++)
		qk_fwd_case(&qk_cases[i]);
}

Test(rmsnorm, qk_norm_rotary_bwd_shapes, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (size_t i = 0; i < sizeof(qk_cases) / sizeof(qk_cases[0]); i++)
		qk_bwd_case(&qk_cases[i]);
}

/* The test's reference with fp32 angles against the library's exact angles (CPU only): within
 * the angle difference |dtheta| (|y1| + |y2|), |dtheta| <= 2 e theta, at positions up to 49151. */
Test(rmsnorm, f32_angle_reference_matches_the_library)
{
	static const struct qk_case cs[] = { { 300, 300, 2, 128 }, { 49152, 49152, 1, 16 },
					     { 6, 5, 3, 24 } };
	for (size_t k = 0; k < sizeof(cs) / sizeof(cs[0]); k++) {
		const int N = cs[k].N, T = cs[k].T, H = cs[k].H, D = cs[k].D, half = D / 2;
		size_t C3 = (size_t)3 * H * D, n = (size_t)N * C3;
		struct ng_rng r;
		uint64_t seed = seeded_(&r);
		double *xd = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8), *y = kt_xmalloc(n * 8),
		       *lib = kt_xmalloc(n * 8), freq[QK_TEST_MAX_HALF];
		kt_fill_bf16(&r, NULL, xd, n, 0.0, 1.0);
		qk_ref_f32_angles(ref, y, NULL, xd, N, T, H, D, (double)EPS);
		ng_ref_qk_norm_rotary_fwd(lib, NULL, xd, N, T, H, D, (double)EPS);
		ng_ref_rotary_freqs(freq, D);
		size_t bad = 0;
		double worst = 0;
		for (int row = 0; row < N; row++)
			for (int v = 0; v < 2 * H; v++)
				for (int i = 0; i < half; i++) {
					size_t o = (size_t)row * C3 + (size_t)v * D + i;
					double a = fabs(y[o]) + fabs(y[o + half]);
					double lim = 2.0 * E32 * (row % T) * freq[i] * a + 1e-13;
					double d = fmax(fabs(ref[o] - lib[o]),
							fabs(ref[o + half] - lib[o + half]));
					bad += d > lim;
					worst = fmax(worst, d);
				}
		cr_expect_eq(bad, 0, "N=%d T=%d D=%d: %zu pairs beyond the angle bound (worst %.3g); "
			     "seed %llu", N, T, D, bad, worst, (unsigned long long)seed);
		free(xd), free(ref), free(y), free(lib);
	}
}

/* The kernel's frequencies, (float)exp2(-10 i / (D/4 - 1)) in double, are ng_ref_rotary_freqs's
 * rounded to fp32, for every head size the kernel takes (CPU only: the formula, not the device's
 * exp2, which CUDA documents as within 1 ulp in double as well). */
Test(rmsnorm, rotary_frequency_formula)
{
	for (int D = 8; D <= 256; D += 8) {
		double freq[QK_TEST_MAX_HALF];
		ng_ref_rotary_freqs(freq, D);
		int q = D / 4;
		for (int i = 0; i < D / 2; i++) {
			float k = i >= q ? 0.0f : q == 1 ? 1.0f : (float)exp2(-10.0 * i / (q - 1));
			if (i >= q)
				cr_expect_eq(freq[i], 0.0, "D=%d pair %d is not rotated", D, i);
			else
				cr_expect_eq(k, (float)freq[i], "D=%d pair %d: %a vs %a", D, i, k,
					     (float)freq[i]);
		}
	}
}

/* ------------------------------------------------------------ relu^2 */

static void relu_case(size_t n)
{
	struct ng_rng r;
	uint64_t seed = seeded_(&r);
	ng_bf16 *x = kt_xmalloc(n * 2), *d = kt_xmalloc(n * 2), *got = kt_xmalloc(n * 2);
	double *xd = kt_xmalloc(n * 8), *dd = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8);
	kt_fill_bf16(&r, x, xd, n, 0.0, 2.0);
	kt_fill_bf16(&r, d, dd, n, 0.0, 1.0);
	ng_bf16 *d_x = kt_upload(x, n * 2), *d_d = kt_upload(d, n * 2), *d_o = kt_upload(NULL, n * 2);
	char what[96];
	kt_ok(ng_relu2_fwd(d_o, d_x, n, 0), "ng_relu2_fwd");
	kt_download(got, d_o, n * 2);
	ng_ref_relu2_fwd(ref, xd, n);
	snprintf(what, sizeof(what), "relu2_fwd n=%zu", n);
	check_bf16_(what, seed, got, ref, n, 0.0, 0.0);
	ng_ref_relu2_bwd(ref, xd, dd, n);
	kt_ok(ng_relu2_bwd(d_o, d_x, d_d, n, 0), "ng_relu2_bwd");
	kt_download(got, d_o, n * 2);
	snprintf(what, sizeof(what), "relu2_bwd n=%zu", n);
	check_bf16_(what, seed, got, ref, n, 0.0, 0.0);
	kt_ok(ng_relu2_bwd(d_d, d_x, d_d, n, 0), "ng_relu2_bwd in place");
	kt_download(got, d_d, n * 2);
	snprintf(what, sizeof(what), "relu2_bwd in place n=%zu", n);
	check_bf16_(what, seed, got, ref, n, 0.0, 0.0);
	/* from the output: y = the forward's bf16 result (on the GPU), d again */
	ng_bf16 *y = kt_xmalloc(n * 2);
	double *yd = kt_xmalloc(n * 8);
	kt_ok(ng_relu2_fwd(d_o, d_x, n, 0), "ng_relu2_fwd");
	kt_download(y, d_o, n * 2);
	for (size_t i = 0; i < n; i++) {
		yd[i] = kt_bf16_to_f32(y[i]);
		ref[i] = 2.0 * sqrt(yd[i]) * dd[i];
	}
	kt_cuda(cudaMemcpy(d_d, d, n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
	kt_ok(ng_relu2_bwd_from_out(d_d, d_o, d_d, n, 0), "ng_relu2_bwd_from_out in place");
	kt_download(got, d_d, n * 2);
	snprintf(what, sizeof(what), "relu2_bwd_from_out n=%zu", n);
	check_bf16_(what, seed, got, ref, n, 1.0, 0.0);
	free(y), free(yd);
	cudaFree(d_x), cudaFree(d_d), cudaFree(d_o);
	free(x), free(d), free(got), free(xd), free(dd), free(ref);
}

Test(rmsnorm, relu2_exact)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	static const size_t ns[] = { 1, 7, 8, 1000, 1000003, (size_t)49152 * 3072 / 64 + 5 };
	for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++)
		relu_case(ns[i]);
}

/* ------------------------------------------------------------ argument checks */

/* Bad shapes and pointers: an input error naming the value, before any launch. */
Test(rmsnorm, bad_arguments_fail_cleanly)
{
	ng_bf16 *p = (ng_bf16 *)(uintptr_t)4096, *odd = (ng_bf16 *)(uintptr_t)4104;
	float *f = (float *)(uintptr_t)8192;
	static const int bad_c[][2] = { { 4, 12 }, { 4, 4104 }, { 0, 64 }, { 4, 0 }, { -1, 64 } };
	for (size_t i = 0; i < sizeof(bad_c) / sizeof(bad_c[0]); i++) {
		int N = bad_c[i][0], C = bad_c[i][1];
		cr_expect_eq(ng_rmsnorm_fwd(p, f, p, N, C, EPS, 0), NG_ERR_INPUT, "fwd N=%d C=%d", N,
			     C);
		ng_clear_error();
		cr_expect_eq(ng_rmsnorm_bwd(p, p + 64, p, f, N, C, 1, 0), NG_ERR_INPUT,
			     "bwd N=%d C=%d", N, C);
		ng_clear_error();
	}
	cr_expect_eq(ng_rmsnorm_fwd(p, f, odd, 4, 64, EPS, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "aligned"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_rmsnorm_fwd(p, f, p, 4, 64, -1.0f, 0), NG_ERR_INPUT, "a negative eps");
	ng_clear_error();
	cr_expect_eq(ng_rmsnorm_bwd(p, p, p, f, 4, 64, 1, 0), NG_ERR_INPUT,
		     "accumulating into dout itself");
	ng_clear_error();
	cr_expect_eq(ng_rmsnorm_bwd(p, p + 64, p, NULL, 4, 64, 0, 0), NG_ERR_INPUT, "no rstd");
	ng_clear_error();
	static const int bad_qk[][4] = { /* N, T, H, D */
		{ 4, 4, 2, 12 }, { 4, 4, 2, 264 }, { 4, 4, 2, 0 }, { 4, 4, 2, 4 },
		{ 0, 4, 2, 64 }, { 4, 0, 2, 64 },  { 4, 4, 0, 64 },
	};
	for (size_t i = 0; i < sizeof(bad_qk) / sizeof(bad_qk[0]); i++) {
		const int *q = bad_qk[i];
		cr_expect_eq(ng_qk_norm_rotary_fwd(p, f, p, q[0], q[1], q[2], q[3], EPS, 0),
			     NG_ERR_INPUT, "qk fwd N=%d T=%d H=%d D=%d", q[0], q[1], q[2], q[3]);
		ng_clear_error();
		cr_expect_eq(ng_qk_norm_rotary_bwd(p, p, f, q[0], q[1], q[2], q[3], 0), NG_ERR_INPUT,
			     "qk bwd N=%d T=%d H=%d D=%d", q[0], q[1], q[2], q[3]);
		ng_clear_error();
	}
	cr_expect_eq(ng_qk_norm_rotary_fwd(odd, f, p, 4, 4, 2, 64, EPS, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "aligned"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_qk_norm_rotary_bwd(p, p, NULL, 4, 4, 2, 64, 0), NG_ERR_INPUT, "no rstd");
	ng_clear_error();
	cr_expect_eq(ng_relu2_fwd(p, p, 0, 0), NG_ERR_INPUT, "n = 0");
	ng_clear_error();
	cr_expect_eq(ng_relu2_bwd(p, odd, p, 64, 0), NG_ERR_INPUT, "a misaligned input");
	ng_clear_error();
	cr_expect_eq(ng_relu2_bwd_from_out(p, odd, p, 64, 0), NG_ERR_INPUT, "a misaligned input");
	cr_expect(strstr(ng_error_message(), "aligned"), "%s", ng_error_message());
	ng_clear_error();
}
