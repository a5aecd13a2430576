/*
 * tests/test_fp8.c — FP8 (E4M3): kernels/fp8.h (amax, scale, cast) bit for bit against a CPU
 * encoder of the format, and the fp8 matmul plans of kernels/matmul.h against the double
 * reference over the same E4M3 inputs.
 *
 * Cast: the GPU multiplies in fp32 and rounds to nearest even with saturation; the CPU does the
 * same product in float and encodes it exactly, so every byte must match, including the
 * saturated (|x * scale| > 448), subnormal (< 2^-6) and zero cases; n is not a multiple of 8 (the
 * scalar tail) and the input sits 16 bytes past an allocation.
 *
 * Matmul tolerance (docs/CONTRIBUTING.md, the FlashAttention rule, as tests/test_matmul.c):
 * err(GPU vs fp64) <= 2 x err(naive vs fp64) + atol, where the fp64 reference and the naive fp32
 * loop take the same decoded E4M3 inputs (their products are exact in fp32) and the naive result
 * is rounded to bf16 like the GPU's; atol is 2^-10 of the largest |reference|. Shapes: IC = 784 =
 * 16 x 49, the MLP widths, N = 1 and an odd N, the padded vocabulary 50304. Fresh inputs each run
 * (seed printed on failure). Skipped without a GPU; an fp8 plan on a GPU without FP8 (sm_80) is
 * expected to fail cleanly, which the matmul cases report as a skip.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/cpu_ops.h"
#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/fp8.h"
#include "kernels/matmul.h"
#include "tests/kernel_testing.h"
#include "util/rng.h"

/* The byte of x in an FP8 format of `mb` mantissa bits and exponent bias `bias`: nearest even,
 * saturated to +-maxv (byte maxbyte), NaN -> 0x7f (a NaN in both formats). */
static uint8_t fp8_encode_(float x, int mb, int bias, double maxv, uint8_t maxbyte)
{
	if (isnan(x))
		return 0x7f;
	uint8_t sign = signbit(x) ? 0x80 : 0;
	double a = fabs((double)x);
	if (a >= maxv)
		return sign | maxbyte;
	if (a == 0.0)
		return sign;
	int e, emin = 1 - bias; /* the smallest normal exponent */
	frexp(a, &e); /* a = f 2^e, f in [0.5, 1): the leading bit is 2^(e-1) */
	double q = e - 1 < emin ? ldexp(1.0, emin - mb) : ldexp(1.0, e - 1 - mb);
	double r = nearbyint(a / q) * q; /* ties to even: the default rounding mode */
	if (r == 0.0)
		return sign;
	if (r >= maxv)
		return sign | maxbyte;
	frexp(r, &e);
	if (e - 1 < emin)
		return sign | (uint8_t)(r / ldexp(1.0, emin - mb));
	int mant = (int)(r / ldexp(1.0, e - 1 - mb)) - (1 << mb);
	return sign | (uint8_t)((e - 1 + bias) << mb) | (uint8_t)mant;
}

/* E4M3 (activations, weights): 4 exponent bits (bias 7), 3 mantissa; +-448; S.1111.111 NaN. */
static uint8_t e4m3_encode_(float x) { return fp8_encode_(x, 3, 7, 448.0, 0x7e); }

static double e4m3_decode_(uint8_t b)
{
	int exp = (b >> 3) & 15, mant = b & 7;
	if (exp == 15 && mant == 7)
		return NAN;
	double v = exp == 0 ? ldexp(mant, -9) : ldexp(8 + mant, exp - 7 - 3);
	return b & 0x80 ? -v : v;
}

/* E5M2 (gradients): 5 exponent bits (bias 15), 2 mantissa; +-57344 (saturated; finite x). */
static uint8_t e5m2_encode_(float x) { return fp8_encode_(x, 2, 15, 57344.0, 0x7b); }

static double e5m2_decode_(uint8_t b)
{
	int exp = (b >> 2) & 31, mant = b & 3;
	if (exp == 31)
		return mant ? NAN : (b & 0x80 ? -INFINITY : INFINITY);
	double v = exp == 0 ? ldexp(mant, -16) : ldexp(4 + mant, exp - 15 - 2);
	return b & 0x80 ? -v : v;
}

static void *dev_(void **base, size_t bytes, size_t offset)
{
	cr_assert(!NG_CUDA_CHECK(cudaMalloc(base, bytes + 256)), "%s", ng_error_message());
	return (char *)*base + offset;
}

Test(fp8, codec_round_trips)
{
	/* every finite byte decodes and encodes back to itself; 448 + a bit saturates */
	for (int b = 0; b < 256; b++) {
		double v = e4m3_decode_((uint8_t)b);
		if (isnan(v))
			continue;
		uint8_t back = e4m3_encode_((float)v);
		cr_assert(back == b || (v == 0 && (back & 0x7f) == 0), "byte 0x%02x -> %g -> 0x%02x",
			  b, v, back);
	}
	cr_assert_eq(e4m3_encode_(1000.0f), 0x7e);
	cr_assert_eq(e4m3_encode_(-1e30f), 0xfe);
	cr_assert_eq(e4m3_encode_(1.0625f), 0x38); /* a tie between 1 and 1.125: to even (1) */
	cr_assert_eq(e4m3_encode_(1.1875f), 0x3a); /* between 1.125 and 1.25: to even (1.25) */
}

static void cast_case_(size_t n, int margin, double spread)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	uint16_t *h = malloc(n * 2);
	float amax = 0;
	for (size_t i = 0; i < n; i++) {
		double x = ng_rng_normal(&r) * ldexp(1.0, (int)(ng_rng_below(&r, 2 * (int)spread + 1)) -
							    (int)spread);
		if (i % 97 == 5)
			x = 0.0;
		h[i] = kt_f32_to_bf16((float)x);
		amax = fmaxf(amax, fabsf(kt_bf16_to_f32(h[i])));
	}
	void *bi, *bo, *bs;
	uint16_t *din = dev_(&bi, n * 2, 16);
	uint8_t *dout = dev_(&bo, n, 8);
	float *dsc = dev_(&bs, 16, 0); /* amax, scale, descale */
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(din, h, n * 2, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemset(dsc, 0, 16)));
	cr_assert_eq(ng_fp8_amax(dsc, din, n, 0), NG_OK, "%s", ng_error_message());
	cr_assert_eq(ng_fp8_scale_from_amax(dsc + 1, dsc + 2, dsc, margin, 0), NG_OK);
	cr_assert_eq(ng_fp8_cast_e4m3(dout, din, dsc + 1, n, 0), NG_OK, "%s", ng_error_message());
	float sc[3];
	uint8_t *got = malloc(n);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(sc, dsc, 12, cudaMemcpyDeviceToHost)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(got, dout, n, cudaMemcpyDeviceToHost)));
	cr_assert_eq(sc[0], amax, "seed %llu: amax gpu %a cpu %a", (unsigned long long)seed, sc[0],
		     amax);
	float want_scale = 448.0f / ldexpf(amax, margin);
	cr_assert_eq(sc[1], want_scale, "scale %a, want %a", sc[1], want_scale);
	cr_assert_eq(sc[2], 1.0f / want_scale);
	size_t bad = 0, sat = 0;
	for (size_t i = 0; i < n; i++) {
		uint8_t want = e4m3_encode_(kt_bf16_to_f32(h[i]) * want_scale);
		sat += (want & 0x7f) == 0x7e;
		if (got[i] != want && bad++ < 5)
			cr_log_error("seed %llu i=%zu x=%a: gpu 0x%02x cpu 0x%02x",
				     (unsigned long long)seed, i, (double)kt_bf16_to_f32(h[i]), got[i], want);
	}
	cr_expect_eq(bad, 0, "seed %llu: %zu of %zu bytes differ", (unsigned long long)seed, bad, n);
	cr_log_info("n=%zu margin %d: amax %g, %zu values at +-448", n, margin, amax, sat);
	free(h);
	free(got);
	cudaFree(bi);
	cudaFree(bo);
	cudaFree(bs);
}

Test(fp8, cast_exact_wide_range) { cast_case_(100003, 0, 12.0); }
Test(fp8, cast_exact_margin) { cast_case_(4099, 2, 4.0); }

Test(fp8, amax_nan_and_bad_args)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint16_t h[40];
	for (int i = 0; i < 40; i++)
		h[i] = kt_f32_to_bf16((float)i);
	h[33] = 0x7fc0; /* NaN in the scalar tail */
	void *bi, *bs;
	uint16_t *din = dev_(&bi, sizeof(h), 0);
	float *dsc = dev_(&bs, 16, 0);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(din, h, sizeof(h), cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemset(dsc, 0, 16)));
	cr_assert_eq(ng_fp8_amax(dsc, din, 35, 0), NG_OK);
	cr_assert_eq(ng_fp8_scale_from_amax(dsc + 1, dsc + 2, dsc, 0, 0), NG_OK);
	float sc[3];
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(sc, dsc, 12, cudaMemcpyDeviceToHost)));
	cr_expect(isnan(sc[0]), "amax %g", sc[0]);
	cr_expect_eq(sc[1], 1.0f, "a NaN amax keeps scale 1, got %g", sc[1]);
	ng_clear_error();
	cr_expect_eq(ng_fp8_cast_e4m3((uint8_t *)dsc + 1, din, dsc + 1, 8, 0), NG_ERR_INPUT);
	cr_expect_eq(ng_fp8_amax(dsc, din, 0, 0), NG_ERR_INPUT);
	ng_clear_error();
	cudaFree(bi);
	cudaFree(bs);
}

/* Segmented forms, as FP8_PREP and the fp8 matmuls use them: 5 segments of 3 x 1000 values,
 * each segment at its own magnitude (2^-6 .. 2^6): per-segment amax, scale, a cast that also
 * records the maximum, every byte against the CPU encoder. */
Test(fp8, segments_amax_scale_cast)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	enum { NSEG = 5, SEG = 3000 };
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	static uint16_t h[NSEG * SEG];
	static uint8_t got[NSEG * SEG];
	float amax[NSEG] = { 0 };
	for (int k = 0; k < NSEG; k++)
		for (int i = 0; i < SEG; i++) {
			double x = ng_rng_normal(&r) * ldexp(1.0, 3 * k - 6);
			h[k * SEG + i] = kt_f32_to_bf16((float)x);
			amax[k] = fmaxf(amax[k], fabsf(kt_bf16_to_f32(h[k * SEG + i])));
		}
	void *bi, *bo, *bs;
	uint16_t *din = dev_(&bi, sizeof(h), 0);
	uint8_t *dout = dev_(&bo, sizeof(got), 0);
	/* amax, scale, descale (NG_FP8_DESCALE_STRIDE apart), amax2 */
	float *d = dev_(&bs, 8 * NSEG * sizeof(float), 0);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(din, h, sizeof(h), cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemset(d, 0, 8 * NSEG * sizeof(float))));
	cr_assert_eq(ng_fp8_amax_seg(d, din, SEG, NSEG, 0), NG_OK, "%s", ng_error_message());
	cr_assert_eq(ng_fp8_scale_seg(d + NSEG, d + 2 * NSEG, d, NSEG, 0, 0), NG_OK);
	cr_assert_eq(ng_fp8_cast_e4m3_seg(dout, din, d + NSEG, d + 7 * NSEG, SEG, NSEG, 0), NG_OK,
		     "%s", ng_error_message());
	float hd[8 * NSEG];
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(hd, d, sizeof(hd), cudaMemcpyDeviceToHost)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(got, dout, sizeof(got), cudaMemcpyDeviceToHost)));
	size_t bad = 0;
	for (int k = 0; k < NSEG; k++) {
		float sc = 448.0f / amax[k];
		cr_expect_eq(hd[k], amax[k], "seed %llu seg %d: amax gpu %a cpu %a",
			     (unsigned long long)seed, k, hd[k], amax[k]);
		cr_expect_eq(hd[7 * NSEG + k], amax[k], "seg %d: the cast's recorded maximum %a", k,
			     hd[7 * NSEG + k]);
		cr_expect_eq(hd[NSEG + k], sc, "seg %d: scale %a want %a", k, hd[NSEG + k], sc);
		cr_expect_eq(hd[2 * NSEG + NG_FP8_DESCALE_STRIDE * k], 1.0f / sc);
		for (int i = 0; i < SEG; i++)
			if (got[k * SEG + i] != e4m3_encode_(kt_bf16_to_f32(h[k * SEG + i]) * sc))
				bad++;
	}
	cr_expect_eq(bad, 0, "seed %llu: %zu bytes differ", (unsigned long long)seed, bad);
	ng_clear_error();
	cr_expect_eq(ng_fp8_amax_seg(d, din, 1001, 2, 0), NG_ERR_INPUT, "segments must be whole "
		     "16-byte rows");
	ng_clear_error();
	cudaFree(bi);
	cudaFree(bo);
	cudaFree(bs);
}

/* Delayed scaling: three slots of two amax floats each (a step's maximum lands in one of them),
 * history 4, margin 1, over 6 steps of maxima (one NaN): after each roll the scale is 448 / (2 x
 * the largest of the last 4 maxima) and both amax floats are zeroed; a NaN in the window keeps
 * scale 1. Against the same rule on the host. */
Test(fp8, roll_scales_history)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	enum { S = 3, H = 4, STEPS = 6 };
	const float seq[STEPS][S] = { { 0, 1, 2 },  { 3, 0.5f, 2 }, { 1, 0.25f, NAN },
				      { 1, 0.125f, 1 }, { 1, 4, 1 },  { 0.5f, 0.125f, 1 } };
	enum { SUB = 2 }; /* each slot's maximum in two floats, written one step each */
	/* history, amax (SUB per slot), scale, descales 16 bytes apart */
	enum { F = S * H + SUB * S + S + 4 * S };
	void *bs;
	float *d = dev_(&bs, F * sizeof(float), 0);
	float *hist = d, *amax = d + S * H, *sc = amax + SUB * S, *dsc = sc + S;
	cr_assert(!NG_CUDA_CHECK(cudaMemset(d, 0, F * sizeof(float))));
	float win[S][H] = { { 0 } };
	for (int t = 0; t < STEPS; t++) {
		float a2[SUB * S] = { 0 };
		for (int k = 0; k < S; k++)
			a2[k * SUB + t % SUB] = seq[t][k];
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(amax, a2, sizeof(a2), cudaMemcpyHostToDevice)));
		cr_assert_eq(ng_fp8_roll_scales(hist, amax, SUB, 1, sc, dsc, S, H, 1, 0), NG_OK, "%s",
			     ng_error_message());
		float out[SUB * S + 5 * S];
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(out, amax, sizeof(out),
						    cudaMemcpyDeviceToHost)));
		const float *osc = out + SUB * S, *odsc = osc + S;
		for (int k = 0; k < S; k++) {
			memmove(&win[k][1], &win[k][0], (H - 1) * sizeof(float));
			win[k][0] = seq[t][k];
			float m = 0;
			int nan = 0;
			for (int j = 0; j < H; j++) {
				nan |= isnan(win[k][j]);
				m = fmaxf(m, win[k][j]);
			}
			float want = (!nan && m > 0) ? 448.0f / (2.0f * m) : 1.0f;
			cr_expect(out[k * SUB] == 0.0f && out[k * SUB + 1] == 0.0f,
				  "step %d slot %d: amax not zeroed", t, k);
			cr_expect_eq(osc[k], want, "step %d slot %d: scale %g want %g", t, k,
				     osc[k], want);
			cr_expect_eq(odsc[NG_FP8_DESCALE_STRIDE * k], 1.0f / want);
		}
	}
	cudaFree(bs);
}

/* Maxima whose scale 448 / (2^margin amax) is not a finite positive float (a denormal-small
 * maximum, one near FLT_MAX with margin 1) get scale 1, as 0 and NaN do: never 0 or Inf, whose
 * products with zeros would be NaN. */
Test(fp8, scale_extremes_are_one)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	float am[4] = { 1e-38f, 3e38f, 0.0f, 2.0f }, want[4] = { 1.0f, 1.0f, 1.0f, 112.0f };
	void *bs;
	float *d = dev_(&bs, 64 * sizeof(float), 0); /* amax, scale, descales 16 bytes apart */
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d, am, sizeof(am), cudaMemcpyHostToDevice)));
	cr_assert_eq(ng_fp8_scale_seg(d + 4, d + 8, d, 4, 1, 0), NG_OK, "%s", ng_error_message());
	float h[24];
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost)));
	for (int k = 0; k < 4; k++) {
		cr_expect_eq(h[4 + k], want[k], "amax %g: scale %g, want %g", am[k], h[4 + k],
			     want[k]);
		cr_expect_eq(h[8 + NG_FP8_DESCALE_STRIDE * k], 1.0f / want[k]);
	}
	cudaFree(bs);
}

/* The matmul rule: max |gpu - fp64| <= 2 x max |naive fp32 - fp64| + atol, atol the largest
 * |fp64| / atol_div, over n outputs gv (the GPU's, as doubles; the naive loop already rounded
 * as the GPU's output is). */
static void expect_rule_d_(const double *gv, const double *rf, const float *nvp, size_t n,
			   double atol_div, const char *what, uint64_t seed)
{
	double ek = 0, en = 0, big = 0;
	size_t worst = 0;
	for (size_t i = 0; i < n; i++) {
		double a = fabs(gv[i] - rf[i]), b = fabs(nvp[i] - rf[i]);
		if (!(a <= ek)) {
			ek = isnan(a) ? INFINITY : a;
			worst = i;
		}
		en = fmax(en, b);
		big = fmax(big, fabs(rf[i]));
	}
	double atol = big / atol_div;
	cr_expect(ek <= 2 * en + atol, "%s (seed %llu): max abs err %.3g > 2 x naive %.3g + atol "
		  "%.3g (worst %zu: gpu %.8g ref %.8g)", what, (unsigned long long)seed, ek, en,
		  atol, worst, gv[worst], rf[worst]);
}

/* Sum k < K of a[k sa] b[k sb] in fp64 (*acc) and, naively, in fp32 (*accf): each product of
 * FP8 values is exact in both. */
static void dot2_(const double *a, size_t sa, const double *b, size_t sb, int K, double *acc,
		  float *accf)
{
	double d = 0;
	float f = 0;
	for (int k = 0; k < K; k++) {
		double p = a[(size_t)k * sa] * b[(size_t)k * sb];
		d += p;
		f += (float)p;
	}
	*acc = d;
	*accf = f;
}

/* The rule for bf16 outputs g: atol 2^-10 of the largest |fp64|. */
static void expect_rule_(const uint16_t *g, const double *rf, const float *nvp, size_t n,
			 const char *what, uint64_t seed)
{
	double *gv = malloc(n * sizeof(double));
	cr_assert(gv);
	for (size_t i = 0; i < n; i++)
		gv[i] = kt_bf16_to_f32(g[i]);
	expect_rule_d_(gv, rf, nvp, n, 1024, what, seed);
	free(gv);
}

/* E5M2: the codec round-trips every finite byte; the GPU cast (a gradient's format) matches
 * it byte for byte over ~40 binades, saturating at 57344; the transposing E4M3 cast of three
 * 40 x 56 segments (tiles cut by the edges) matches the CPU encoder of the transpose. */
Test(fp8, e5m2_and_transposed_casts_exact)
{
	for (int b = 0; b < 256; b++) {
		double v = e5m2_decode_((uint8_t)b);
		if (!isfinite(v))
			continue;
		uint8_t back = e5m2_encode_((float)v);
		cr_assert(back == b || (v == 0 && (back & 0x7f) == 0), "E5M2 0x%02x -> %g -> 0x%02x",
			  b, v, back);
	}
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	enum { N = 20011, S = 3, R = 40, CC = 56 };
	static uint16_t h[N], ht[S * R * CC];
	static uint8_t got[N], gt[S * R * CC];
	for (int i = 0; i < N; i++)
		h[i] = kt_f32_to_bf16((float)(ng_rng_normal(&r) *
				       ldexp(1.0, (int)ng_rng_below(&r, 41) - 24)));
	for (int i = 0; i < S * R * CC; i++)
		ht[i] = kt_f32_to_bf16((float)ng_rng_normal(&r));
	void *bi, *bo, *bs, *bti, *bto;
	uint16_t *din = dev_(&bi, sizeof(h), 0), *dti = dev_(&bti, sizeof(ht), 0);
	uint8_t *dout = dev_(&bo, sizeof(got), 0), *dto = dev_(&bto, sizeof(gt), 0);
	float sc[S] = { 3.0f, 100.0f, 0.5f }, *dsc = dev_(&bs, sizeof(sc), 0);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(din, h, sizeof(h), cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dti, ht, sizeof(ht), cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dsc, sc, sizeof(sc), cudaMemcpyHostToDevice)));
	cr_assert_eq(ng_fp8_cast_seg(NG_FP8_E5M2, dout, din, dsc, NULL, N, 1, 0), NG_OK, "%s",
		     ng_error_message());
	cr_assert_eq(ng_fp8_cast_e4m3_t_seg(dto, dti, dsc, R, CC, S, 0), NG_OK, "%s",
		     ng_error_message());
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(got, dout, sizeof(got), cudaMemcpyDeviceToHost)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(gt, dto, sizeof(gt), cudaMemcpyDeviceToHost)));
	size_t bad = 0, badt = 0;
	for (int i = 0; i < N; i++)
		if (got[i] != e5m2_encode_(kt_bf16_to_f32(h[i]) * sc[0]) && bad++ < 5)
			cr_log_error("seed %llu E5M2 i=%d x=%a: gpu 0x%02x cpu 0x%02x",
				     (unsigned long long)seed, i, (double)kt_bf16_to_f32(h[i]), got[i],
				     e5m2_encode_(kt_bf16_to_f32(h[i]) * sc[0]));
	for (int k = 0; k < S; k++)
		for (int rr = 0; rr < R; rr++)
			for (int c = 0; c < CC; c++) {
				size_t src = ((size_t)k * R + rr) * CC + c;
				size_t dst = ((size_t)k * CC + c) * R + rr;
				badt += gt[dst] != e4m3_encode_(kt_bf16_to_f32(ht[src]) * sc[k]);
			}
	cr_expect_eq(bad, 0, "seed %llu: %zu of %d E5M2 bytes differ", (unsigned long long)seed,
		     bad, N);
	cr_expect_eq(badt, 0, "seed %llu: %zu transposed E4M3 bytes differ",
		     (unsigned long long)seed, badt);
	cudaFree(bi), cudaFree(bo), cudaFree(bs), cudaFree(bti), cudaFree(bto);
}

/* W and W^T from one read (FP8_PREP for a kind with fp8 forward and dinp), bit-exact against
 * the CPU encoder: whole 64 x 64 tiles with 16-byte rows, and a ragged shape that takes the
 * scalar paths (C not a multiple of 8, R not of 4); and each output alone. */
Test(fp8, cast_w_and_wt_in_one_pass)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	static const struct { int R, C, S; } shapes[] = {
		{ .R = 128, .C = 192, .S = 2 }, { .R = 37, .C = 50, .S = 3 }, { .R = 200, .C = 72, .S = 1 },
	};
	for (int t = 0; t < 3; t++) {
		const int R = shapes[t].R, CC = shapes[t].C, S = shapes[t].S;
		size_t n = (size_t)S * R * CC;
		uint16_t *h = malloc(n * 2);
		uint8_t *g8 = malloc(n), *gt = malloc(n);
		cr_assert(h && g8 && gt);
		for (size_t i = 0; i < n; i++)
			h[i] = kt_f32_to_bf16((float)(ng_rng_normal(&r) *
					       ldexp(1.0, (int)ng_rng_below(&r, 21) - 10)));
		void *bi, *bo, *bt, *bs;
		uint16_t *din = dev_(&bi, n * 2, 0);
		uint8_t *dw = dev_(&bo, n, 0), *dt = dev_(&bt, n, 0);
		float sc[3] = { 2.0f, 0.25f, 40.0f }, *dsc = dev_(&bs, sizeof(sc), 0);
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(din, h, n * 2, cudaMemcpyHostToDevice)));
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dsc, sc, sizeof(sc), cudaMemcpyHostToDevice)));
		for (int mode = 0; mode < 3; mode++) { /* both, W alone, W^T alone */
			cr_assert(!NG_CUDA_CHECK(cudaMemset(dw, 0xAB, n)));
			cr_assert(!NG_CUDA_CHECK(cudaMemset(dt, 0xAB, n)));
			cr_assert_eq(ng_fp8_cast_e4m3_wt_seg(mode != 2 ? dw : NULL,
							     mode != 1 ? dt : NULL, din, dsc, R, CC,
							     S, 0),
				     NG_OK, "%s", ng_error_message());
			cr_assert(!NG_CUDA_CHECK(cudaMemcpy(g8, dw, n, cudaMemcpyDeviceToHost)));
			cr_assert(!NG_CUDA_CHECK(cudaMemcpy(gt, dt, n, cudaMemcpyDeviceToHost)));
			size_t bad = 0, badt = 0;
			for (int k = 0; k < S; k++)
				for (int rr = 0; rr < R; rr++)
					for (int c = 0; c < CC; c++) {
						size_t src = ((size_t)k * R + rr) * CC + c;
						size_t dst = ((size_t)k * CC + c) * R + rr;
						uint8_t want = e4m3_encode_(kt_bf16_to_f32(h[src]) * sc[k]);
						bad += g8[src] != (mode != 2 ? want : 0xAB);
						badt += gt[dst] != (mode != 1 ? want : 0xAB);
					}
			cr_expect_eq(bad + badt, 0, "seed %llu, R %d C %d x%d, mode %d: %zu W and "
				     "%zu W^T bytes differ", (unsigned long long)seed, R, CC, S, mode,
				     bad, badt);
		}
		cudaFree(bi), cudaFree(bo), cudaFree(bt), cudaFree(bs);
		free(h), free(g8), free(gt);
	}
}

/* The gradient cast of an fp8 weight-gradient matmul (ng_fp8_cast_wt), in both formats: the
 * row-major and transposed bytes bit-exact against the CPU encoder, the recorded maximum exact
 * (a maximum does not round), and each 64-row band's column sums against double: fp32 adds at
 * most 63 terms a band, so within 63 u32 (u32 = 2^-24) of the sum of their magnitudes; the
 * bands added by ng_bias_grad_reduce within R u32 of the column's. Shapes: whole tiles with
 * 16-byte rows, R cut by the tile and not a multiple of 4, C not a multiple of 8. */
Test(fp8, gradient_cast_rows_transpose_amax_colsums)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	static const struct { int R, C; } shapes[] = { { 256, 192 }, { 97, 200 }, { 130, 50 } };
	const double u32 = ldexp(1.0, -24);
	for (int t = 0; t < 6; t++) {
		const int R = shapes[t % 3].R, CC = shapes[t % 3].C;
		const enum ng_fp8_format fmt = t < 3 ? NG_FP8_E5M2 : NG_FP8_E4M3;
		const int bands = ng_fp8_colsum_rows(R);
		size_t n = (size_t)R * CC;
		uint16_t *h = malloc(n * 2);
		uint8_t *g8 = malloc(n), *gt = malloc(n);
		float *part = malloc((size_t)bands * CC * 4), *sum = malloc((size_t)CC * 4);
		float amax[NG_FP8_AMAX_FLOATS];
		cr_assert(h && g8 && gt && part && sum);
		double want_max = 0;
		for (size_t i = 0; i < n; i++) {
			h[i] = kt_f32_to_bf16((float)(ng_rng_normal(&r) *
					       ldexp(1.0, (int)ng_rng_below(&r, 17) - 8)));
			want_max = fmax(want_max, fabs(kt_bf16_to_f32(h[i])));
		}
		void *bi, *bo, *bt, *bs, *bp, *ba, *bsum;
		uint16_t *din = dev_(&bi, n * 2, 0);
		uint8_t *dw = dev_(&bo, n, 0), *dt = dev_(&bt, n, 0);
		float *dp = dev_(&bp, (size_t)bands * CC * 4, 0), *da = dev_(&ba, sizeof(amax), 0);
		float *dsum = dev_(&bsum, (size_t)CC * 4, 0);
		float sc = fmt == NG_FP8_E5M2 ? 512.0f : 3.0f, *dsc = dev_(&bs, 4, 0);
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(din, h, n * 2, cudaMemcpyHostToDevice)));
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dsc, &sc, 4, cudaMemcpyHostToDevice)));
		cr_assert(!NG_CUDA_CHECK(cudaMemset(da, 0, sizeof(amax))));
		cr_assert(!NG_CUDA_CHECK(cudaMemset(dsum, 0, (size_t)CC * 4)));
		cr_assert_eq(ng_fp8_cast_wt(fmt, dw, dt, dp, da, din, dsc, R, CC, 0), NG_OK, "%s",
			     ng_error_message());
		cr_assert_eq(ng_bias_grad_reduce(dsum, dp, bands, CC, 1, 0), NG_OK, "%s",
			     ng_error_message());
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(g8, dw, n, cudaMemcpyDeviceToHost)));
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(gt, dt, n, cudaMemcpyDeviceToHost)));
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(part, dp, (size_t)bands * CC * 4,
						    cudaMemcpyDeviceToHost)));
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(sum, dsum, (size_t)CC * 4,
						    cudaMemcpyDeviceToHost)));
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(amax, da, sizeof(amax), cudaMemcpyDeviceToHost)));
		size_t bad = 0, badt = 0, badp = 0, bads = 0;
		for (int rr = 0; rr < R; rr++)
			for (int c = 0; c < CC; c++) {
				float x = kt_bf16_to_f32(h[(size_t)rr * CC + c]) * sc;
				uint8_t want = fmt == NG_FP8_E5M2 ? e5m2_encode_(x) : e4m3_encode_(x);
				bad += g8[(size_t)rr * CC + c] != want;
				badt += gt[(size_t)c * R + rr] != want;
			}
		for (int c = 0; c < CC; c++) {
			double col = 0, col_abs = 0;
			for (int b = 0; b < bands; b++) {
				double s = 0, a = 0;
				for (int rr = b * 64; rr < R && rr < b * 64 + 64; rr++) {
					double x = kt_bf16_to_f32(h[(size_t)rr * CC + c]);
					s += x, a += fabs(x);
				}
				double got = part[(size_t)b * CC + c];
				if (fabs(got - s) > 63 * u32 * a && badp++ < 3)
					cr_log_error("seed %llu R %d C %d band %d col %d: %.9g, double "
						     "%.9g", (unsigned long long)seed, R, CC, b, c, got, s);
				col += s, col_abs += a;
			}
			bads += fabs(sum[c] - col) > R * u32 * col_abs;
		}
		float got_max = 0;
		for (int j = 0; j < NG_FP8_AMAX_SUB; j++)
			got_max = fmaxf(got_max, amax[j * NG_FP8_AMAX_STRIDE]);
		cr_expect(bad + badt == 0, "seed %llu, %s R %d C %d: %zu row-major and %zu transposed "
			  "bytes differ", (unsigned long long)seed, fmt == NG_FP8_E5M2 ? "E5M2" : "E4M3",
			  R, CC, bad, badt);
		cr_expect(badp + bads == 0, "seed %llu, R %d C %d: %zu band sums and %zu column sums "
			  "off", (unsigned long long)seed, R, CC, badp, bads);
		cr_expect(got_max == (float)want_max, "seed %llu, R %d C %d: amax %a, want %a",
			  (unsigned long long)seed, R, CC, (double)got_max, want_max);
		cudaFree(bi), cudaFree(bo), cudaFree(bt), cudaFree(bs), cudaFree(bp), cudaFree(ba),
			cudaFree(bsum);
		free(h), free(g8), free(gt), free(part), free(sum);
	}
	/* no output, two segments with a maximum: argument errors, not launches */
	float *f = (float *)(uintptr_t)256;
	cr_expect_eq(ng_fp8_cast_wt(NG_FP8_E5M2, NULL, NULL, NULL, NULL, (const ng_bf16 *)f, f, 64,
				    64, 0),
		     NG_ERR_INPUT);
	ng_clear_error();
}

/* The byte transpose (ng_transpose_u8) against a CPU loop, byte for byte: the head's 50304
 * columns on the 16-byte path (whole 128 x 128 tiles), a shape cut by the tile edges on it (272
 * x 400), odd and thin shapes and pointers 4 bytes past a 16-byte boundary (the byte path). The
 * 64 bytes past the output stay as they were. */
Test(fp8, transpose_u8_exact)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	static const struct { int rows, cols, off; } shapes[] = {
		{ 1024, 50304, 0 }, { 272, 400, 0 }, { 16, 16, 0 }, { 333, 777, 0 },
		{ 1, 16, 0 },       { 16, 1, 0 },    { 64, 48, 4 },
	};
	for (size_t t = 0; t < sizeof(shapes) / sizeof(shapes[0]); t++) {
		const int R = shapes[t].rows, C = shapes[t].cols, off = shapes[t].off;
		const size_t n = (size_t)R * C, pad = 64;
		uint8_t *h = malloc(n), *got = malloc(n + pad);
		cr_assert(h && got);
		for (size_t i = 0; i < n; i += 8) {
			uint64_t u = ng_rng_u64(&r);
			memcpy(h + i, &u, n - i < 8 ? n - i : 8);
		}
		void *bi, *bo;
		uint8_t *din = dev_(&bi, n, off), *dout = dev_(&bo, n + pad, off);
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(din, h, n, cudaMemcpyHostToDevice)));
		cr_assert(!NG_CUDA_CHECK(cudaMemset(dout, 0xAB, n + pad)));
		cr_assert_eq(ng_transpose_u8(dout, din, R, C, 0), NG_OK, "%s", ng_error_message());
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(got, dout, n + pad, cudaMemcpyDeviceToHost)));
		size_t bad = 0, first = 0, over = 0;
		for (int i = 0; i < R; i++)
			for (int c = 0; c < C; c++) {
				size_t d = (size_t)c * R + i;
				if (got[d] != h[(size_t)i * C + c] && bad++ == 0)
					first = d;
			}
		for (size_t i = n; i < n + pad; i++)
			over += got[i] != 0xAB;
		cr_expect(bad == 0 && over == 0, "seed %llu, %d x %d at offset %d: %zu bytes differ "
			  "(the first out[%zu] = 0x%02x, want 0x%02x), %zu written past the end",
			  (unsigned long long)seed, R, C, off, bad, first, got[first],
			  h[first % R * C + first / R], over);
		cudaFree(bi), cudaFree(bo);
		free(h), free(got);
	}
}

/* Its refusals come before any device work, so this runs without a GPU. */
Test(fp8, transpose_u8_bad_args)
{
	static uint8_t a[64], b[64];
	ng_clear_error();
	cr_expect_eq(ng_transpose_u8(NULL, a, 4, 4, 0), NG_ERR_INPUT);
	ng_clear_error();
	cr_expect_eq(ng_transpose_u8(b, a, 0, 4, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "rows 0"), "%s", ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_transpose_u8(b, a, 4, -1, 0), NG_ERR_INPUT);
	ng_clear_error();
	cr_expect_eq(ng_transpose_u8(a + 8, a, 4, 4, 0), NG_ERR_INPUT, "out overlapping in");
	cr_expect(strstr(ng_error_message(), "overlaps"), "%s", ng_error_message());
	ng_clear_error();
}

/* One fp8 DINP matmul: dinp (N, IC) = dout (N, OC, E5M2) @ W (OC, IC, given as W^T in E4M3),
 * times both descales, DGELU'd by aux when gelu; against the fp64 and naive fp32 loops over the
 * same decoded inputs (the rule of matmul_case_ below). */
static void dinp_case_(int N, int IC, int OC, int gelu)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t dn = (size_t)N * OC, wn = (size_t)OC * IC, on = (size_t)N * IC;
	uint8_t *dq = malloc(dn), *wtq = malloc(wn);
	uint16_t *auxh = malloc(on * 2);
	double *dd = malloc(dn * 8), *wd = malloc(wn * 8), *auxd = malloc(on * 8);
	float ds = 57344.0f / 4.5f, wsc = 448.0f / (4.5f / sqrtf((float)OC));
	for (size_t i = 0; i < dn; i++) {
		dq[i] = e5m2_encode_((float)ng_rng_normal(&r) * ds);
		dd[i] = e5m2_decode_(dq[i]);
	}
	for (int o = 0; o < OC; o++) /* W[o][i] lives at W^T[i][o] */
		for (int i = 0; i < IC; i++) {
			uint8_t q = e4m3_encode_((float)(ng_rng_normal(&r) / sqrt(OC)) * wsc);
			wtq[(size_t)i * OC + o] = q;
			wd[(size_t)o * IC + i] = e4m3_decode_(q);
		}
	for (size_t i = 0; i < on; i++) {
		auxh[i] = kt_f32_to_bf16((float)ng_rng_normal(&r));
		auxd[i] = kt_bf16_to_f32(auxh[i]);
	}
	float dsc[2] = { 1.0f / ds, 1.0f / wsc };
	double *ref = malloc(on * 8);
	float *nv = malloc(on * 4);
	for (int n = 0; n < N; n++)
		for (int i = 0; i < IC; i++) {
			double acc;
			float accf;
			dot2_(dd + (size_t)n * OC, 1, wd + i, (size_t)IC, OC, &acc, &accf);
			size_t j = (size_t)n * IC + i;
			ref[j] = acc * dsc[0] * dsc[1];
			nv[j] = accf * dsc[0] * dsc[1];
			if (gelu) {
				double g, gf, nvd = nv[j]; /* the epilogue sees the fp32 sum */
				ng_ref_gelu_bwd(&g, &auxd[j], &ref[j], 1);
				ng_ref_gelu_bwd(&gf, &auxd[j], &nvd, 1);
				ref[j] = g;
				nv[j] = (float)gf;
			}
			nv[j] = kt_bf16_to_f32(kt_f32_to_bf16(nv[j]));
		}
	struct ng_matmul_ctx ctx;
	struct ng_matmul mm;
	struct ng_matmul_spec sp = { NG_MATMUL_DINP, N, IC, OC, gelu, 0, 0, 0, 1, 0, 0 };
	cr_assert(!ng_matmul_ctx_init(&ctx, (size_t)32 << 20), "%s", ng_error_message());
	if (ng_matmul_plan(&mm, &ctx, &sp))
		cr_assert_fail("seed %llu: %s", (unsigned long long)seed, ng_error_message());
	void *bd, *bw, *bo, *ba, *bs, *bws;
	void *d_d = dev_(&bd, dn, 0), *d_w = dev_(&bw, wn, 0), *d_o = dev_(&bo, on * 2, 0);
	void *d_a = dev_(&ba, on * 2, 0);
	float *d_s = dev_(&bs, 32, 0);
	void *dws = mm.workspace_need ? dev_(&bws, mm.workspace_need, 0) : (bws = NULL);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_d, dq, dn, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_w, wtq, wn, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_a, auxh, on * 2, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_s, &dsc[0], 4, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_s + 4, &dsc[1], 4, cudaMemcpyHostToDevice)));
	cr_assert_eq(ng_matmul_run_fp8(&mm, d_o, d_d, d_w, NULL, gelu ? d_a : NULL, d_s, d_s + 4,
				       dws, 0), NG_OK, "%s", ng_error_message());
	uint16_t *go = malloc(on * 2);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(go, d_o, on * 2, cudaMemcpyDeviceToHost)));
	char what[96];
	snprintf(what, sizeof(what), "dinp N=%d IC=%d OC=%d gelu %d", N, IC, OC, gelu);
	expect_rule_(go, ref, nv, on, what, seed);
	ng_matmul_free(&mm);
	ng_matmul_ctx_free(&ctx);
	void *bufs[] = { bd, bw, bo, ba, bs, bws };
	for (int i = 0; i < 6; i++)
		if (bufs[i])
			cudaFree(bufs[i]);
	free(dq), free(wtq), free(auxh), free(dd), free(wd), free(auxd), free(ref), free(nv);
	free(go);
}

Test(fp8, dinp_e5m2_dout) { dinp_case_(96, 4 * 784, 784, 0); }
Test(fp8, dinp_dgelu) { dinp_case_(64, 784, 3 * 784, 1); }

/* One FWD fp8 matmul against the fp64 and naive fp32 loops over the same E4M3 inputs; resid:
 * the output adds a bf16 residual (ng_matmul_run_residual). */
static void matmul_case_(int N, int IC, int OC, int gelu, int bias, int resid)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t xn = (size_t)N * IC, wn = (size_t)OC * IC, on = (size_t)N * OC;
	uint8_t *xq = malloc(xn), *wq = malloc(wn);
	uint16_t *bh = malloc((size_t)OC * 2);
	double *xd = malloc(xn * 8), *wd = malloc(wn * 8), *bd = malloc((size_t)OC * 8);
	/* inputs ~N(0, 1) and weights ~N(0, 1/IC), quantized with scales from their maxima */
	float xs = 448.0f / 4.5f, ws = 448.0f / (4.5f / sqrtf((float)IC));
	for (size_t i = 0; i < xn; i++) {
		xq[i] = e4m3_encode_((float)ng_rng_normal(&r) * xs);
		xd[i] = e4m3_decode_(xq[i]);
	}
	for (size_t i = 0; i < wn; i++) {
		wq[i] = e4m3_encode_((float)(ng_rng_normal(&r) / sqrt(IC)) * ws);
		wd[i] = e4m3_decode_(wq[i]);
	}
	for (int o = 0; o < OC; o++) {
		bh[o] = kt_f32_to_bf16((float)(bias ? 0.5 * ng_rng_normal(&r) : 0.0));
		bd[o] = kt_bf16_to_f32(bh[o]);
	}
	float dsc[2] = { 1.0f / xs, 1.0f / ws }; /* descale of x, of W */
	uint16_t *rh = malloc(on * 2); /* the residual, bf16 ~N(0, 1) (zeros without resid) */
	for (size_t i = 0; i < on; i++)
		rh[i] = kt_f32_to_bf16(resid ? (float)ng_rng_normal(&r) : 0.0f);
	double *ref = malloc(on * 8), *pre = malloc(on * 8);
	float *nv = malloc(on * 4), *nv_pre = malloc(on * 4);
	for (int n = 0; n < N; n++)
		for (int o = 0; o < OC; o++) {
			double acc = 0;
			float accf = 0;
			for (int k = 0; k < IC; k++) {
				double p = xd[(size_t)n * IC + k] * wd[(size_t)o * IC + k];
				acc += p;
				accf += (float)p; /* products of two E4M3 values are exact in fp32 */
			}
			size_t i = (size_t)n * OC + o;
			pre[i] = acc * dsc[0] * dsc[1] + bd[o];
			nv_pre[i] = accf * dsc[0] * dsc[1] + (float)bd[o];
		}
	if (gelu) {
		ng_ref_gelu_fwd(ref, pre, on);
		for (size_t i = 0; i < on; i++) {
			double g;
			ng_ref_gelu_fwd(&g, &(double){ kt_bf16_to_f32(kt_f32_to_bf16(nv_pre[i])) }, 1);
			nv[i] = kt_bf16_to_f32(kt_f32_to_bf16((float)g));
			nv_pre[i] = kt_bf16_to_f32(kt_f32_to_bf16(nv_pre[i]));
		}
	} else {
		for (size_t i = 0; i < on; i++) { /* the residual summed in fp32, rounded once */
			ref[i] = pre[i] + kt_bf16_to_f32(rh[i]);
			nv[i] = kt_bf16_to_f32(kt_f32_to_bf16(nv_pre[i] + kt_bf16_to_f32(rh[i])));
		}
	}

	struct ng_matmul_ctx ctx;
	struct ng_matmul mm;
	struct ng_matmul_spec sp = { NG_MATMUL_FWD, N, IC, OC, gelu, bias, resid, 0, 1, 0, 0 };
	cr_assert(!ng_matmul_ctx_init(&ctx, (size_t)32 << 20), "%s", ng_error_message());
	if (ng_matmul_plan(&mm, &ctx, &sp)) {
		int major = 0;
		cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
		if (major < 9)
			cr_skip_test("no FP8 matmul on this GPU (compute capability %d.x): %s", major,
				     ng_error_message());
		cr_assert_fail("seed %llu: %s", (unsigned long long)seed, ng_error_message());
	}
	void *bx, *bw, *bb, *bo, *ba, *bs, *bws;
	void *dx = dev_(&bx, xn, 16), *dw = dev_(&bw, wn, 0), *db = dev_(&bb, (size_t)OC * 2, 0);
	void *dout = dev_(&bo, on * 2, 0), *daux = dev_(&ba, on * 2, 0);
	void *br = NULL, *dres = resid ? dev_(&br, on * 2, 0) : NULL;
	if (resid)
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dres, rh, on * 2, cudaMemcpyHostToDevice)));
	float *ds = dev_(&bs, 32, 0); /* descales 16 bytes apart: cuBLASLt's alignment for them */
	void *dws = mm.workspace_need ? dev_(&bws, mm.workspace_need, 0) : (bws = NULL);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dx, xq, xn, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dw, wq, wn, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(db, bh, (size_t)OC * 2, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(ds, &dsc[0], 4, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(ds + 4, &dsc[1], 4, cudaMemcpyHostToDevice)));
	if (resid) {
		cr_assert_eq(ng_matmul_run_fp8(&mm, dout, dx, dw, bias ? db : NULL, NULL, ds, ds + 4,
					       dws, 0), NG_ERR_INPUT, "a residual plan run without "
			     "its residual must be refused");
		ng_clear_error();
		cr_assert_eq(ng_matmul_run_residual(&mm, dout, dx, dw, bias ? db : NULL, dres, ds,
						    ds + 1, dws, 0), NG_ERR_INPUT);
		ng_clear_error();
		cr_assert_eq(ng_matmul_run_residual(&mm, dout, dx, dw, bias ? db : NULL, dres, ds,
						    ds + 4, dws, 0), NG_OK, "%s", ng_error_message());
	} else {
		cr_assert_eq(ng_matmul_run_fp8(&mm, dout, dx, dw, bias ? db : NULL,
					       gelu ? daux : NULL, ds, ds + 1, dws, 0), NG_ERR_INPUT,
			     "a descale that is not 16-byte aligned must be refused (cuBLASLt: "
			     "status 15)");
		ng_clear_error();
		cr_assert_eq(ng_matmul_run_fp8(&mm, dout, dx, dw, bias ? db : NULL,
					       gelu ? daux : NULL, ds, ds + 4, dws, 0), NG_OK, "%s",
			     ng_error_message());
	}
	cr_assert_eq(ng_matmul_run(&mm, dout, dx, dw, NULL, NULL, NULL, dws, 0), NG_ERR_INPUT,
		     "an fp8 plan without descales must be refused");
	ng_clear_error();
	uint16_t *go = malloc(on * 2), *ga = malloc(on * 2);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(go, dout, on * 2, cudaMemcpyDeviceToHost)));
	if (gelu)
		cr_assert(!NG_CUDA_CHECK(cudaMemcpy(ga, daux, on * 2, cudaMemcpyDeviceToHost)));
	for (int pass = 0; pass < 1 + gelu; pass++) {
		char what[96];
		snprintf(what, sizeof(what), "%s N=%d IC=%d OC=%d gelu %d bias %d resid %d",
			 pass ? "aux" : "out", N, IC, OC, gelu, bias, resid);
		expect_rule_(pass ? ga : go, pass ? pre : ref, pass ? nv_pre : nv, on, what, seed);
	}
	ng_matmul_free(&mm);
	ng_matmul_ctx_free(&ctx);
	void *bufs[] = { bx, bw, bb, bo, ba, bs, bws, br };
	for (int i = 0; i < 8; i++)
		if (bufs[i])
			cudaFree(bufs[i]);
	free(rh);
	free(xq), free(wq), free(bh), free(xd), free(wd), free(bd), free(ref), free(pre);
	free(nv), free(nv_pre), free(go), free(ga);
}

Test(fp8, matmul_fwd_bias) { matmul_case_(111, 784, 3 * 784, 0, 1, 0); }
Test(fp8, matmul_fwd_gelu_bias) { matmul_case_(64, 784, 4 * 784, 1, 1, 0); }
Test(fp8, matmul_fwd_n1) { matmul_case_(1, 4 * 784, 784, 0, 1, 0); }
Test(fp8, matmul_head_vp) { matmul_case_(24, 784, 50304, 0, 0, 0); }
Test(fp8, matmul_fwd_bias_residual) { matmul_case_(111, 4 * 784, 784, 0, 1, 1); }

Test(fp8, matmul_bad_specs)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_matmul_ctx ctx;
	struct ng_matmul mm;
	cr_assert(!ng_matmul_ctx_init(&ctx, (size_t)32 << 20), "%s", ng_error_message());
	struct ng_matmul_spec dw = { NG_MATMUL_DW, 24, 784, 784, 0, 0, 0, 0, 1, 0, 0 };
	struct ng_matmul_spec odd = { NG_MATMUL_FWD, 4, 776, 784, 0, 0, 0, 0, 1, 0, 0 };
	ng_clear_error();
	cr_expect_eq(ng_matmul_plan(&mm, &ctx, &dw), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "a DW also N a multiple of 16"), "%s",
		  ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_matmul_plan(&mm, &ctx, &odd), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "IC=776"), "%s", ng_error_message());
	ng_clear_error();
	ng_matmul_ctx_free(&ctx);
}

/* Data parallelism: each slot's 32 sub maxima folded to one word (the float's bits, NaN as
 * 0x7fc00000 above every number), the slot zeroed, then unfolded into its first sub maximum;
 * the roll that follows reads the same maximum as from the unfolded slots. */
Test(fp8, amax_fold_and_unfold)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	enum { S = 7, SUB = NG_FP8_AMAX_SUB, STRIDE = NG_FP8_AMAX_STRIDE };
	static float h[S * SUB * STRIDE], back[S * SUB * STRIDE];
	unsigned want[S], got[S];
	for (int k = 0; k < S; k++) {
		float m = 0;
		for (int j = 0; j < SUB; j++) {
			float v = k == 2 ? 0.0f : (float)fabs(ng_rng_normal(&r)) *
							  (float)ldexp(1.0, (int)ng_rng_below(&r, 60) - 30);
			h[((size_t)k * SUB + j) * STRIDE] = v;
			m = v > m ? v : m;
		}
		memcpy(&want[k], &m, 4);
	}
	h[((size_t)4 * SUB + 5) * STRIDE] = NAN; /* slot 4 saw a NaN */
	want[4] = 0x7fc00000u;
	void *ba, *bb;
	float *da = dev_(&ba, sizeof(h), 0);
	unsigned *db = dev_(&bb, sizeof(want), 0);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(da, h, sizeof(h), cudaMemcpyHostToDevice)));
	cr_assert_eq(ng_fp8_amax_fold(da, SUB, STRIDE, S, db, 0, 0), NG_OK, "%s",
		     ng_error_message());
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(got, db, sizeof(got), cudaMemcpyDeviceToHost)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(back, da, sizeof(back), cudaMemcpyDeviceToHost)));
	for (int k = 0; k < S; k++)
		cr_expect_eq(got[k], want[k], "seed %llu slot %d: %08x vs %08x",
			     (unsigned long long)seed, k, got[k], want[k]);
	for (size_t i = 0; i < S * SUB * STRIDE; i++)
		cr_expect_eq(back[i], 0.0f, "folded slots are zeroed (%zu)", i);
	cr_assert_eq(ng_fp8_amax_fold(da, SUB, STRIDE, S, db, 1, 0), NG_OK);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(back, da, sizeof(back), cudaMemcpyDeviceToHost)));
	for (int k = 0; k < S; k++) {
		unsigned b;
		memcpy(&b, &back[(size_t)k * SUB * STRIDE], 4);
		cr_expect(b == want[k] || (k == 4 && back[(size_t)k * SUB * STRIDE] !=
							    back[(size_t)k * SUB * STRIDE]),
			  "slot %d unfolded %08x vs %08x", k, b, want[k]);
	}
	cr_expect_eq(ng_fp8_amax_fold(NULL, SUB, STRIDE, S, db, 0, 0), NG_ERR_INPUT);
	ng_clear_error();
	cudaFree(ba), cudaFree(bb);
}

/* One fp8 DW matmul: dW (OC, IC) fp32 (+)= dout^T (OC, N, E5M2) @ inp^T (IC, N, E4M3)^T times
 * both descales, against the fp64 and naive fp32 loops over the same decoded inputs: the rule
 * of expect_rule_ with the output in fp32 (atol 2^-16 of the largest |reference|). */
static void dw_case_(int N, int IC, int OC, int accumulate)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t dn = (size_t)OC * N, xn = (size_t)IC * N, on = (size_t)OC * IC;
	uint8_t *dq = malloc(dn), *xq = malloc(xn);
	double *dd = malloc(dn * 8), *xd = malloc(xn * 8), *ref = malloc(on * 8);
	float *init = malloc(on * 4), *nv = malloc(on * 4), *go = malloc(on * 4);
	float ds = 57344.0f / 4.5f, xs = 448.0f / 4.5f;
	for (size_t i = 0; i < dn; i++) {
		dq[i] = e5m2_encode_((float)ng_rng_normal(&r) * ds);
		dd[i] = e5m2_decode_(dq[i]);
	}
	for (size_t i = 0; i < xn; i++) {
		xq[i] = e4m3_encode_((float)ng_rng_normal(&r) * xs);
		xd[i] = e4m3_decode_(xq[i]);
	}
	float dsc[2] = { 1.0f / ds, 1.0f / xs };
	for (size_t i = 0; i < on; i++)
		init[i] = accumulate ? (float)ng_rng_normal(&r) * 4.0f : 0.0f;
	double *sabs = malloc(on * 8), *na = malloc(N * 8), *nb = malloc(N * 8);
	cr_assert(sabs && na && nb);
	for (int o = 0; o < OC; o++)
		for (int i = 0; i < IC; i++) {
			double acc, sa;
			float accf, saf;
			dot2_(dd + (size_t)o * N, 1, xd + (size_t)i * N, 1, N, &acc, &accf);
			for (int n = 0; n < N; n++) {
				na[n] = fabs(dd[(size_t)o * N + n]);
				nb[n] = fabs(xd[(size_t)i * N + n]);
			}
			dot2_(na, 1, nb, 1, N, &sa, &saf);
			size_t j = (size_t)o * IC + i;
			ref[j] = init[j] + acc * dsc[0] * dsc[1];
			nv[j] = init[j] + accf * dsc[0] * dsc[1];
			sabs[j] = sa * dsc[0] * dsc[1];
		}
	struct ng_matmul_ctx ctx;
	struct ng_matmul mm;
	struct ng_matmul_spec sp = { NG_MATMUL_DW, N, IC, OC, 0, 0, accumulate, 0, 1, 0, 0 };
	cr_assert(!ng_matmul_ctx_init(&ctx, (size_t)32 << 20), "%s", ng_error_message());
	if (ng_matmul_plan(&mm, &ctx, &sp)) {
		int major = 0;
		cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
		if (major < 9)
			cr_skip_test("no FP8 matmul on this GPU (compute capability %d.x): %s", major,
				     ng_error_message());
		cr_assert_fail("seed %llu: %s", (unsigned long long)seed, ng_error_message());
	}
	void *bd, *bx, *bo, *bs, *bws;
	void *d_d = dev_(&bd, dn, 0), *d_x = dev_(&bx, xn, 0), *d_o = dev_(&bo, on * 4, 0);
	float *d_s = dev_(&bs, 32, 0);
	void *dws = mm.workspace_need ? dev_(&bws, mm.workspace_need, 0) : (bws = NULL);
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_d, dq, dn, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_x, xq, xn, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_o, init, on * 4, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_s, &dsc[0], 4, cudaMemcpyHostToDevice)));
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(d_s + 4, &dsc[1], 4, cudaMemcpyHostToDevice)));
	cr_assert_eq(ng_matmul_run_fp8(&mm, d_o, d_d, d_x, NULL, NULL, d_s, d_s + 4, dws, 0),
		     NG_OK, "%s", ng_error_message());
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(go, d_o, on * 4, cudaMemcpyDeviceToHost)));
	/* FP8 tensor cores add the products into an accumulator of about 14 bits (DeepSeek-AI,
	 * "DeepSeek-V3 Technical Report", 2024, sec. 3.3.2), promoted to fp32 by cuBLASLt at
	 * intervals: each add errs by ~2^-14 of the partial sum, a random walk over K = N adds,
	 * so the fp32 output of K products is allowed 2^-12 sqrt(K) of the sum of their |p|
	 * beyond the rule (four times that walk); measured 6e-4 relative at N = 160 */
	double ek = 0, en = 0, big = 0, slack = ldexp(sqrt((double)N), -12);
	size_t worst = 0, nbad = 0;
	for (size_t i = 0; i < on; i++) {
		en = fmax(en, fabs(nv[i] - ref[i]));
		big = fmax(big, fabs(ref[i]));
	}
	for (size_t i = 0; i < on; i++) {
		double a = fabs(go[i] - ref[i]), lim = 2 * en + big / 65536 + slack * sabs[i];
		if (!(a <= lim) && nbad++ == 0)
			worst = i;
		ek = fmax(ek, isnan(a) ? INFINITY : a);
	}
	cr_expect(nbad == 0, "dw N=%d IC=%d OC=%d accumulate %d (seed %llu): %zu outputs beyond "
		  "2 x naive %.3g + %.3g + 2^-12 sqrt(N) sum |p|; first %zu: gpu %.8g ref %.8g "
		  "sum |p| %.4g (max abs err %.3g)", N, IC, OC, accumulate, (unsigned long long)seed,
		  nbad, en, big / 65536, worst, (double)go[worst], ref[worst], sabs[worst], ek);
	free(sabs), free(na), free(nb);
	ng_matmul_free(&mm);
	ng_matmul_ctx_free(&ctx);
	void *bufs[] = { bd, bx, bo, bs, bws };
	for (int i = 0; i < 5; i++)
		if (bufs[i])
			cudaFree(bufs[i]);
	free(dq), free(xq), free(dd), free(xd), free(ref), free(init), free(nv), free(go);
}

Test(fp8, dw_e5m2_dout) { dw_case_(160, 784, 2 * 784, 0); }
Test(fp8, dw_accumulate_head_vp) { dw_case_(32, 768, 50304, 1); }
