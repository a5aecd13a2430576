/*
 * tests/kernel_testing.h — helpers shared by the kernel-family tests (test_encoder.c,
 * test_layernorm.c, test_elementwise.c, test_loss.c, test_optim.c, test_fp8.c, test_matmul.c):
 * bf16 <-> float, fresh seeds, random bf16 and fp32 fills, device upload/download (and device
 * ints), and the comparisons docs/CONTRIBUTING.md asks for.
 *
 * Header-only (static functions) on purpose: tests/meson.build builds each test from its one .c
 * file, and these helpers are test-only. Every comparison reports max abs err, max rel err and
 * the worst index, with the seed.
 *
 * Comparisons:
 *  - check_bf16_: bf16 outputs; the fp64 reference rounded to bf16, then |got - ref| <= ulps *
 *    ulp(ref) + atol per element.
 *  - check_fa_: reductions; max|kernel - fp64| <= 2 * max|naive fp32 - fp64| + atol (the
 *    FlashAttention rule).
 *  - check_nmse_: fp32 outputs; sum (got - ref)^2 / sum ref^2 <= 1e-7.
 */
#ifndef NG_TESTS_KERNEL_TESTING_H
#define NG_TESTS_KERNEL_TESTING_H

#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/check.h"
#include "kernels/types.h"
#include "util/rng.h"
#include "util/status.h"

static float kt_bf16_to_f32(ng_bf16 h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static ng_bf16 kt_f32_to_bf16(float f) /* round to nearest even; NaN stays NaN */
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (ng_bf16)((u >> 16) | 0x40u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (ng_bf16)(u >> 16);
}

static double kt_round_bf16(double x) { return kt_bf16_to_f32(kt_f32_to_bf16((float)x)); }

static uint64_t kt_seed(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return ((uint64_t)ts.tv_sec * 1000000007ull) ^ (uint64_t)ts.tv_nsec;
}

/* n bf16 values ~ N(mean, sd): bits in h, the same values in d (either may be NULL). */
static void kt_fill_bf16(struct ng_rng *r, ng_bf16 *h, double *d, size_t n, double mean,
			 double sd)
{
	for (size_t i = 0; i < n; i++) {
		ng_bf16 b = kt_f32_to_bf16((float)(mean + sd * ng_rng_normal(r)));
		if (h)
			h[i] = b;
		if (d)
			d[i] = kt_bf16_to_f32(b);
	}
}

static void *kt_xmalloc(size_t bytes)
{
	void *p = malloc(bytes ? bytes : 1);
	cr_assert(p, "out of host memory (%zu bytes)", bytes);
	return p;
}

static void kt_cuda(cudaError_t e, const char *what)
{
	cr_assert(e == cudaSuccess, "%s: %s", what, cudaGetErrorString(e));
}

static void kt_ok(enum ng_status st, const char *what)
{
	cr_assert(st == NG_OK, "%s failed: %s", what, ng_error_message());
}

/* Device copy of host bytes (bytes == 0 allowed). */
static void *kt_upload(const void *h, size_t bytes)
{
	void *d = NULL;
	kt_cuda(cudaMalloc(&d, bytes ? bytes : 16), "cudaMalloc");
	if (h && bytes)
		kt_cuda(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
	return d;
}

static void kt_download(void *h, const void *d, size_t bytes)
{
	kt_cuda(cudaDeviceSynchronize(), "kernel");
	kt_cuda(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}

/* n normal fp32 values N(mean, sd) in f, the same values in d. */
static void kt_fill_f32(struct ng_rng *r, float *f, double *d, size_t n, double mean, double sd)
{
	for (size_t i = 0; i < n; i++) {
		f[i] = (float)(mean + sd * ng_rng_normal(r));
		d[i] = f[i];
	}
}

/* A device int holding v, and the value of one. */
static int *kt_device_int(int v)
{
	return kt_upload(&v, sizeof(v));
}

static int kt_read_int(const int *d)
{
	int v;
	kt_download(&v, d, sizeof(v));
	return v;
}

/* max(1, max |ref|): the scale an fp32 atol is a fraction of. */
static double kt_ref_scale(const double *ref, size_t n)
{
	double m = 1.0;
	for (size_t i = 0; i < n; i++)
		m = fmax(m, fabs(ref[i]));
	return m;
}

/* Error summary of got vs ref. */
struct kt_err {
	double max_abs;  /* max |got - ref| */
	double max_rel;  /* max |got - ref| / max(|ref|, 1e-30) */
	size_t worst;    /* index of max_abs */
	double ref_max;  /* max |ref| */
};

static struct kt_err kt_errors(const double *got, const double *ref, size_t n)
{
	struct kt_err e = {0, 0, 0, 0};
	for (size_t i = 0; i < n; i++) {
		double d = fabs(got[i] - ref[i]);
		if (isnan(got[i]) != isnan(ref[i]))
			d = INFINITY;
		else if (isnan(ref[i]))
			d = 0.0;
		double rel = d / fmax(fabs(ref[i]), 1e-30);
		if (d > e.max_abs || (isinf(d) && !isinf(e.max_abs))) {
			e.max_abs = d;
			e.worst = i;
		}
		if (rel > e.max_rel)
			e.max_rel = rel;
		if (fabs(ref[i]) > e.ref_max)
			e.ref_max = fabs(ref[i]);
	}
	return e;
}

/* ulp of a bf16 value near x (8 significant bits). */
static double kt_bf16_ulp(double x)
{
	int ex;
	if (x == 0.0)
		return ldexp(1.0, -133);
	frexp(x, &ex); /* x = f * 2^ex, 0.5 <= |f| < 1 */
	return ldexp(1.0, ex - 8);
}

static void check_bf16_(const char *what, uint64_t seed, const ng_bf16 *got, const double *ref,
			size_t n, double ulps, double atol)
{
	size_t bad = n, worst = 0;
	double max_abs = 0, max_rel = 0;
	for (size_t i = 0; i < n; i++) {
		double r = kt_round_bf16(ref[i]), g = kt_bf16_to_f32(got[i]);
		double d = fabs(g - r);
		if (isnan(g))
			d = INFINITY;
		if (d > max_abs) {
			max_abs = d;
			worst = i;
		}
		if (d / fmax(fabs(r), 1e-30) > max_rel)
			max_rel = d / fmax(fabs(r), 1e-30);
		if (d > ulps * kt_bf16_ulp(r) + atol && bad == n)
			bad = i;
	}
	cr_expect(bad == n,
		  "%s: element %zu is %.8g, reference %.8g (> %.1f ulp + %.3g); max abs err %.3g, "
		  "max rel err %.3g at %zu; seed %llu",
		  what, bad, bad < n ? kt_bf16_to_f32(got[bad]) : 0.0, bad < n ? ref[bad] : 0.0,
		  ulps, atol, max_abs, max_rel, worst, (unsigned long long)seed);
}

static void check_fa_(const char *what, uint64_t seed, const double *got, const double *naive,
		      const double *ref, size_t n, double atol)
{
	struct kt_err ek = kt_errors(got, ref, n), en = kt_errors(naive, ref, n);
	cr_expect(ek.max_abs <= 2.0 * en.max_abs + atol,
		  "%s: max abs err %.4g (rel %.4g) at %zu (got %.9g, ref %.9g) > 2 x naive fp32 err "
		  "%.4g + atol %.3g; seed %llu",
		  what, ek.max_abs, ek.max_rel, ek.worst, got[ek.worst], ref[ek.worst], en.max_abs,
		  atol, (unsigned long long)seed);
}

static void check_nmse_(const char *what, uint64_t seed, const double *got, const double *ref,
			size_t n)
{
	double num = 0, den = 0;
	for (size_t i = 0; i < n; i++) {
		num += (got[i] - ref[i]) * (got[i] - ref[i]);
		den += ref[i] * ref[i];
	}
	struct kt_err e = kt_errors(got, ref, n);
	double nmse = den > 0 ? num / den : num;
	cr_expect(nmse <= 1e-7 && !isnan(nmse),
		  "%s: NMSE %.3g > 1e-7; max abs err %.4g, max rel err %.4g at %zu (got %.9g, ref "
		  "%.9g); seed %llu",
		  what, nmse, e.max_abs, e.max_rel, e.worst, got[e.worst], ref[e.worst],
		  (unsigned long long)seed);
}

/* float array -> double array (new allocation) */
static double *kt_f2d(const float *f, size_t n)
{
	double *d = (double *)kt_xmalloc(n * sizeof(double));
	for (size_t i = 0; i < n; i++)
		d[i] = f[i];
	return d;
}

static double *kt_b2d(const ng_bf16 *h, size_t n)
{
	double *d = (double *)kt_xmalloc(n * sizeof(double));
	for (size_t i = 0; i < n; i++)
		d[i] = kt_bf16_to_f32(h[i]);
	return d;
}

#endif
