/*
 * tests/test_softcap.c — the soft-capped cross-entropy (kernels/softcap.h) against
 * ng_ref_softcap_crossentropy (graph/cpu_spr_ops.h, double).
 * Tolerances. Losses (fp32): NMSE <= 1e-7. dz (bf16, in place): away from the target the
 * kernel's fp32 value is within 2^-15 (relative) of the exact one (the exponent -cap q log2(e)
 * of each softmax term carries cap log2(e) 2^-22 ~ 2^-16.6 of absolute error from the approximate
 * ex2 and rcp, the row's sum ~2^-17 relative from its fp32 additions, ds/dz = s q / div a few
 * fp32 ulps, with no cancellation), far below half a bf16 ulp (2^-9), so its rounding is at most
 * one ulp from the rounded reference: 1 ulp, plus an atol of 2^-24 of the largest |dz| (fp32's
 * resolution: flushed tiny intermediates). At the target, softmax - 1 keeps the absolute error
 * of softmax only, <= 2^-15 dloss ds/dz: 1 ulp + 2^-14 dloss ds/dz (the bound, times 2).
 * The logits are N(mean, sd) with sd comparable to div, so that the cap bends them (at the
 * model's div = 7.5 sqrt(768) and the small model's 7.5 sqrt(64)); one case sits deep in the
 * saturated lower tail. The no-gradient variant must leave z untouched; a target outside
 * [0, Vp) gives a NaN loss and the gradient without the onehot term; two runs give the same
 * bytes.
 * Shapes: Vp = 50304 (the row in shared memory), 60000 (too long for it: two passes), 1024,
 * 130 and 1001 (Vp % 8 != 0: the scalar path), a z offset by 2 bytes (scalar path); N = 1, 3,
 * 5, 33.
 * The E5M2 form (g8 = E5M2(dz gscale), z untouched): each byte must decode to a value between
 * the E5M2 roundings (ng_ref_round_e5m2: nearest even, saturating) of (dz_ref -+ tol) gscale,
 * tol the bf16 check's tolerance above (which bounds the kernel's fp32 dz with room to spare).
 * Rounding to nearest is monotone, so any fp32 dz within tol passes, and the byte is pinned
 * exactly unless dz_ref gscale lies within tol gscale of a rounding midpoint. gscale = 448 (the
 * model's), 2^20, and 2^24 (the cast saturates at +-57344); g8 offset by 8 bytes (the 8-byte
 * stores) and by 4 (the scalar path); the descale written or not asked for.
 */
#include <criterion/criterion.h>

#include "graph/cpu_spr_ops.h"
#include "kernels/softcap.h"
#include "tests/kernel_testing.h"

#define CAP 30.0 /* the model's soft cap */

/* dz against the reference, the target columns (tg may be NULL: none) apart as the header
 * says; the others through check_bf16_ with the target entries replaced by the reference's. */
static void check_dz(const char *what, uint64_t seed, const ng_bf16 *got, const double *dref,
		     const double *z, const int32_t *tg, int N, int Vp, double div, double dloss)
{
	size_t n = (size_t)N * Vp;
	ng_bf16 *masked = kt_xmalloc(n * 2);
	memcpy(masked, got, n * 2);
	double dmax = 0;
	for (size_t i = 0; i < n; i++)
		dmax = fmax(dmax, fabs(dref[i]));
	for (int i = 0; tg && i < N; i++) {
		size_t j = (size_t)i * Vp + tg[i];
		double s = CAP / (1.0 + exp(-z[j] / div)), ds = s * (1.0 - s / CAP) / div;
		double ref = kt_round_bf16(dref[j]), g = kt_bf16_to_f32(got[j]);
		double tol = kt_bf16_ulp(ref) + ldexp(dloss * ds, -14);
		cr_expect(fabs(g - ref) <= tol,
			  "%s: row %d, target %d: dz %.8g, reference %.8g (> %.3g); seed %llu", what,
			  i, tg[i], g, dref[j], tol, (unsigned long long)seed);
		masked[j] = kt_f32_to_bf16((float)dref[j]);
	}
	check_bf16_(what, seed, masked, dref, n, 1.0, ldexp(dmax, -24));
	free(masked);
}

/* N targets in [0, Vp), row 0's Vp - 1 (the last column, padded in the model) when N > 1. */
static int32_t *draw_targets(struct ng_rng *r, int N, int Vp)
{
	int32_t *tg = kt_xmalloc((size_t)N * 4);
	for (int i = 0; i < N; i++)
		tg[i] = (int32_t)ng_rng_below(r, (uint64_t)Vp);
	if (N > 1)
		tg[0] = Vp - 1;
	return tg;
}

/* One call over N rows of Vp logits ~ N(mean, sd), soft cap CAP, divisor div; z placed `off`
 * bytes past a 256-byte boundary; grad 0: the forward only. Row 0's target is Vp - 1 (the last
 * column, padded in the model) when N > 1. */
static void sc_case(int N, int Vp, double div, double mean, double sd, int off, int grad)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = (size_t)N * Vp;
	ng_bf16 *z = kt_xmalloc(n * 2), *got[2] = {kt_xmalloc(n * 2), kt_xmalloc(n * 2)};
	double *z_d = kt_xmalloc(n * 8), *dref = kt_xmalloc(n * 8), *lref = kt_xmalloc(N * 8);
	kt_fill_bf16(&r, z, z_d, n, mean, sd);
	int32_t *tg = draw_targets(&r, N, Vp);
	double dloss = 1.0 / (N * 3.0);
	ng_ref_softcap_crossentropy(lref, dref, z_d, tg, N, Vp, CAP, div, dloss);

	char *d_base = kt_upload(NULL, n * 2 + (size_t)off);
	ng_bf16 *d_z = (ng_bf16 *)(d_base + off);
	void *d_tg = kt_upload(tg, N * 4);
	float *d_l = kt_upload(NULL, N * 4), *l[2] = {kt_xmalloc(N * 4), kt_xmalloc(N * 4)};
	for (int run = 0; run < 2; run++) {
		kt_cuda(cudaMemcpy(d_z, z, n * 2, cudaMemcpyHostToDevice), "H2D");
		if (grad)
			kt_ok(ng_softcap_crossentropy(d_l, d_z, d_tg, N, Vp, (float)CAP, (float)div,
						      (float)dloss, 0),
			      "ng_softcap_crossentropy");
		else
			kt_ok(ng_softcap_crossentropy_fwd(d_l, d_z, d_tg, N, Vp, (float)CAP,
							  (float)div, 0),
			      "ng_softcap_crossentropy_fwd");
		kt_download(l[run], d_l, N * 4);
		kt_download(got[run], d_z, n * 2);
	}
	char what[160];
	snprintf(what, sizeof(what),
		 "softcap_crossentropy%s losses N=%d Vp=%d div=%g mean=%g sd=%g off=%d",
		 grad ? "" : "_fwd", N, Vp, div, mean, sd, off);
	double *ld = kt_f2d(l[0], N);
	check_nmse_(what, seed, ld, lref, N);
	if (grad) {
		snprintf(what, sizeof(what),
			 "softcap_crossentropy dz N=%d Vp=%d div=%g mean=%g sd=%g off=%d", N, Vp,
			 div, mean, sd, off);
		check_dz(what, seed, got[0], dref, z_d, tg, N, Vp, div, dloss);
	} else {
		cr_expect(memcmp(got[0], z, n * 2) == 0, "softcap_crossentropy_fwd changed z; seed "
			  "%llu", (unsigned long long)seed);
	}
	cr_expect(memcmp(l[0], l[1], N * 4) == 0 && memcmp(got[0], got[1], n * 2) == 0,
		  "%s: two runs differ (not deterministic); seed %llu", what,
		  (unsigned long long)seed);
	cudaFree(d_base), cudaFree(d_tg), cudaFree(d_l);
	free(z), free(got[0]), free(got[1]), free(z_d), free(dref), free(lref), free(tg);
	free(l[0]), free(l[1]), free(ld);
}

/* the model's divisor, 7.5 sqrt(C), at C = 768 and at the small model's C = 64 */
#define DIV_768 (7.5 * 27.712812921102035)
#define DIV_64 60.0

/* A case of sc_case: rows, columns, divisor, the logits' mean and sd, z's offset (bytes). */
struct sc_shape {
	int N, Vp;
	double div, mean, sd;
	int off;
};

static const struct sc_shape sc_grad_shapes[] = {
	{5, 50304, DIV_768, 0.0, 150.0, 0},
	{1, 50304, DIV_768, 100.0, 200.0, 0},
	{3, 60000, DIV_768, 0.0, 150.0, 0},
	{33, 1024, DIV_64, -10.0, 40.0, 0},
	{33, 512, DIV_64, 0.0, 2.0, 16},
	{5, 1024, DIV_768, -3000.0, 800.0, 0}, /* the saturated lower tail: s ~ cap e^-14 */
	{7, 130, DIV_768, 0.0, 150.0, 0},      /* the scalar path from here on */
	{3, 1001, DIV_64, 5.0, 40.0, 0},
	{5, 1024, DIV_64, 0.0, 40.0, 2},
};

static const struct sc_shape sc_fwd_shapes[] = {
	{7, 50304, DIV_768, 0.0, 150.0, 0},
	{1, 130, DIV_64, 3.0, 40.0, 0},
	{3, 1024, DIV_64, 0.0, 40.0, 2},
};

static void sc_cases(const struct sc_shape *c, size_t n, int grad)
{
	for (size_t i = 0; i < n; i++)
		sc_case(c[i].N, c[i].Vp, c[i].div, c[i].mean, c[i].sd, c[i].off, grad);
}

Test(softcap, shapes)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	sc_cases(sc_grad_shapes, sizeof(sc_grad_shapes) / sizeof(sc_grad_shapes[0]), 1);
}

Test(softcap, fwd_only)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	sc_cases(sc_fwd_shapes, sizeof(sc_fwd_shapes) / sizeof(sc_fwd_shapes[0]), 0);
}

/* A target outside [0, Vp): the loss is NaN and dz has no onehot term, i.e. it is the
 * reference's dz for any valid target t plus dloss ds/dz(z_t) at t. */
static void bad_target_case(int Vp, int32_t bad, int off)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	ng_bf16 *z = kt_xmalloc(Vp * 2), *got = kt_xmalloc(Vp * 2);
	double *z_d = kt_xmalloc(Vp * 8), *dref = kt_xmalloc(Vp * 8), lref;
	kt_fill_bf16(&r, z, z_d, Vp, 0.0, 100.0);
	int32_t t = 0;
	double dloss = 0.5;
	ng_ref_softcap_crossentropy(&lref, dref, z_d, &t, 1, Vp, CAP, DIV_768, dloss);
	double s = CAP / (1.0 + exp(-z_d[0] / DIV_768));
	dref[0] += dloss * s * (1.0 - s / CAP) / DIV_768;
	char *d_base = kt_upload(NULL, (size_t)Vp * 2 + (size_t)off);
	ng_bf16 *d_z = (ng_bf16 *)(d_base + off);
	kt_cuda(cudaMemcpy(d_z, z, (size_t)Vp * 2, cudaMemcpyHostToDevice), "H2D");
	int32_t *d_t = kt_upload(&bad, 4);
	float *d_l = kt_upload(NULL, 4), l;
	kt_ok(ng_softcap_crossentropy(d_l, d_z, d_t, 1, Vp, (float)CAP, (float)DIV_768,
				      (float)dloss, 0),
	      "ng_softcap_crossentropy");
	kt_download(&l, d_l, 4);
	kt_download(got, d_z, (size_t)Vp * 2);
	cr_expect(isnan(l), "target %d of Vp=%d: loss %g, expected NaN; seed %llu", bad, Vp, l,
		  (unsigned long long)seed);
	char what[96];
	snprintf(what, sizeof(what), "softcap dz, target %d of Vp=%d off=%d", bad, Vp, off);
	check_dz(what, seed, got, dref, z_d, NULL, 1, Vp, DIV_768, dloss);
	cudaFree(d_base), cudaFree(d_t), cudaFree(d_l);
	free(z), free(got), free(z_d), free(dref);
}

Test(softcap, target_out_of_range)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	bad_target_case(50304, -1, 0);
	bad_target_case(50304, 50304, 2);
	bad_target_case(130, 130, 0);
}

/* The value of an E5M2 byte: 1 sign, 5 exponent bits (bias 15), 2 mantissa bits, the top byte
 * of an IEEE half; exponent 31 is Inf (mantissa 0) or NaN. */
static double e5m2_value(uint8_t b)
{
	int e = b >> 2 & 31, m = b & 3;
	double v = e == 31 ? (m ? NAN : INFINITY) : e ? ldexp(4 + m, e - 17) : ldexp(m, -16);
	return b & 0x80 ? -v : v;
}

/* g8 against the reference as the header says: the tolerance of dz is check_dz's (target
 * columns apart); a NaN byte (one the kernel did not write: the buffer is filled with 0x7f
 * first) fails. */
static void check_g8(const char *what, uint64_t seed, const uint8_t *g8, const double *dref,
		     const double *z, const int32_t *tg, int N, int Vp, double div, double dloss,
		     double gscale)
{
	size_t n = (size_t)N * Vp, nbad = 0, first = 0, sat = 0;
	double dmax = 0, lo1 = 0, hi1 = 0;
	for (size_t i = 0; i < n; i++)
		dmax = fmax(dmax, fabs(dref[i]));
	for (int r = 0; r < N; r++)
		for (int c = 0; c < Vp; c++) {
			size_t j = (size_t)r * Vp + c;
			double tol = kt_bf16_ulp(kt_round_bf16(dref[j]));
			if (c == tg[r]) {
				double s = CAP / (1.0 + exp(-z[j] / div));
				tol += ldexp(dloss * s * (1.0 - s / CAP) / div, -14);
			} else {
				tol += ldexp(dmax, -24);
			}
			double lo = ng_ref_round_e5m2((dref[j] - tol) * gscale);
			double hi = ng_ref_round_e5m2((dref[j] + tol) * gscale);
			double g = e5m2_value(g8[j]);
			sat += fabs(g) == 57344.0;
			if (!(g >= lo && g <= hi) && nbad++ == 0) {
				first = j;
				lo1 = lo;
				hi1 = hi;
			}
		}
	cr_expect(nbad == 0,
		  "%s: %zu of %zu bytes off; the first, row %zu column %zu: 0x%02x = %.6g, reference "
		  "dz %.8g x gscale %g = %.6g, allowed [%.6g, %.6g]; seed %llu", what, nbad, n,
		  first / Vp, first % Vp, g8[first], e5m2_value(g8[first]), dref[first], gscale,
		  dref[first] * gscale, lo1, hi1, (unsigned long long)seed);
	cr_log_info("%s: %zu of %zu bytes at +-57344", what, sat, n);
}

/* A case of the E5M2 form: logits as sc_case draws them, z and g8 placed off_z and off_g bytes
 * past 256-byte boundaries, the gradient times gscale; descale 0: no descale pointer. */
struct sc8_shape {
	int N, Vp;
	double div, mean, sd;
	int off_z, off_g;
	double gscale;
	int descale;
};

static void sc8_case(const struct sc8_shape *c)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const int N = c->N, Vp = c->Vp;
	size_t n = (size_t)N * Vp;
	ng_bf16 *z = kt_xmalloc(n * 2), *zback = kt_xmalloc(n * 2);
	uint8_t *g[2] = {kt_xmalloc(n), kt_xmalloc(n)};
	double *z_d = kt_xmalloc(n * 8), *dref = kt_xmalloc(n * 8), *lref = kt_xmalloc(N * 8);
	kt_fill_bf16(&r, z, z_d, n, c->mean, c->sd);
	int32_t *tg = draw_targets(&r, N, Vp);
	double dloss = 1.0 / (N * 3.0);
	ng_ref_softcap_crossentropy(lref, dref, z_d, tg, N, Vp, CAP, c->div, dloss);

	char *d_zb = kt_upload(NULL, n * 2 + (size_t)c->off_z);
	ng_bf16 *d_z = (ng_bf16 *)(d_zb + c->off_z);
	kt_cuda(cudaMemcpy(d_z, z, n * 2, cudaMemcpyHostToDevice), "H2D");
	uint8_t *d_gb = kt_upload(NULL, n + (size_t)c->off_g), *d_g = d_gb + c->off_g;
	float *d_ds = c->descale ? kt_upload(NULL, 4) : NULL, ds = 0.0f;
	void *d_tg = kt_upload(tg, N * 4);
	float *d_l = kt_upload(NULL, N * 4), *l[2] = {kt_xmalloc(N * 4), kt_xmalloc(N * 4)};
	for (int run = 0; run < 2; run++) {
		kt_cuda(cudaMemset(d_g, 0x7f, n), "memset"); /* NaN: a byte left unwritten fails */
		if (d_ds)
			kt_cuda(cudaMemset(d_ds, 0xff, 4), "memset");
		kt_ok(ng_softcap_crossentropy_e5m2(d_l, d_z, d_g, d_ds, d_tg, N, Vp, (float)CAP,
						   (float)c->div, (float)dloss, (float)c->gscale, 0),
		      "ng_softcap_crossentropy_e5m2");
		kt_download(l[run], d_l, N * 4);
		kt_download(g[run], d_g, n);
	}
	kt_download(zback, d_z, n * 2);
	if (d_ds)
		kt_download(&ds, d_ds, 4);
	char what[192];
	snprintf(what, sizeof(what),
		 "softcap_crossentropy_e5m2 N=%d Vp=%d div=%g mean=%g sd=%g off_z=%d off_g=%d "
		 "gscale=%g", N, Vp, c->div, c->mean, c->sd, c->off_z, c->off_g, c->gscale);
	double *ld = kt_f2d(l[0], N);
	check_nmse_(what, seed, ld, lref, N);
	check_g8(what, seed, g[0], dref, z_d, tg, N, Vp, c->div, dloss, c->gscale);
	cr_expect(memcmp(zback, z, n * 2) == 0, "%s changed z; seed %llu", what,
		  (unsigned long long)seed);
	cr_expect(!d_ds || ds == 1.0f / (float)c->gscale, "%s: descale %a, want %a", what,
		  (double)ds, (double)(1.0f / (float)c->gscale));
	cr_expect(memcmp(l[0], l[1], N * 4) == 0 && memcmp(g[0], g[1], n) == 0,
		  "%s: two runs differ (not deterministic); seed %llu", what,
		  (unsigned long long)seed);
	cudaFree(d_zb), cudaFree(d_gb), cudaFree(d_tg), cudaFree(d_l);
	if (d_ds)
		cudaFree(d_ds);
	free(z), free(zback), free(g[0]), free(g[1]), free(z_d), free(dref), free(lref), free(tg);
	free(l[0]), free(l[1]), free(ld);
}

static const struct sc8_shape sc8_shapes[] = {
	{5, 50304, DIV_768, 0.0, 150.0, 0, 0, 448.0, 1}, /* the row in shared memory */
	{1, 50304, DIV_768, 100.0, 200.0, 0, 8, 1048576.0, 1},
	{33, 1024, DIV_64, -10.0, 40.0, 0, 0, 1048576.0, 0},
	{5, 1024, DIV_768, -3000.0, 800.0, 0, 0, 1048576.0, 1}, /* the saturated lower tail */
	{2, 1024, DIV_64, 0.0, 40.0, 0, 0, 16777216.0, 1},      /* the cast saturates */
	{3, 60000, DIV_768, 0.0, 150.0, 0, 8, 448.0, 1},        /* two passes, 8-byte stores */
	{3, 1001, DIV_64, 5.0, 40.0, 0, 0, 448.0, 1},           /* the scalar path from here on */
	{3, 1001, DIV_64, 5.0, 40.0, 0, 0, 16777216.0, 1},
	{5, 1024, DIV_64, 0.0, 40.0, 2, 0, 448.0, 1}, /* z not 16-byte aligned */
	{5, 1024, DIV_64, 0.0, 40.0, 0, 4, 448.0, 1}, /* g8 not 8-byte aligned */
};

Test(softcap, e5m2_gradient)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (size_t i = 0; i < sizeof(sc8_shapes) / sizeof(sc8_shapes[0]); i++)
		sc8_case(&sc8_shapes[i]);
}

/* Refusals name the values; they happen before anything reaches the device, so this runs
 * without a GPU (the pointers are never dereferenced). */
Test(softcap, bad_arguments_are_input_errors)
{
	static ng_bf16 z[16] __attribute__((aligned(16)));
	static float l[2];
	static int32_t t[2];
	ng_clear_error();
	cr_expect(ng_softcap_crossentropy(l, z, t, 2, 8, 100.0f, 7.5f, 1.0f, 0) == NG_ERR_INPUT,
		  "cap 100 (> 64) must be refused");
	cr_expect(strstr(ng_error_message(), "cap=100") != NULL, "message: %s", ng_error_message());
	ng_clear_error();
	cr_expect(ng_softcap_crossentropy(l, z, t, 2, 8, 30.0f, 0.0f, 1.0f, 0) == NG_ERR_INPUT,
		  "div 0 must be refused");
	ng_clear_error();
	cr_expect(ng_softcap_crossentropy_fwd(l, z, t, 2, 0, 30.0f, 7.5f, 0) == NG_ERR_INPUT,
		  "Vp 0 must be refused");
	cr_expect(strstr(ng_error_message(), "Vp=0") != NULL, "message: %s", ng_error_message());
	ng_clear_error();
	cr_expect(ng_softcap_crossentropy_fwd(l, NULL, t, 2, 8, 30.0f, 7.5f, 0) == NG_ERR_INPUT,
		  "z NULL must be refused");
	ng_clear_error();
}

/* The E5M2 form's own refusals (g8, gscale), also before any device work. */
Test(softcap, e5m2_bad_arguments_are_input_errors)
{
	static ng_bf16 z[16] __attribute__((aligned(16)));
	static uint8_t g[16] __attribute__((aligned(16)));
	static float l[2], d;
	static int32_t t[2];
	const float bad[] = {0.0f, -448.0f, INFINITY, NAN, 1e-45f}; /* 1e-45: 1 / gscale is Inf */
	ng_clear_error();
	cr_expect(ng_softcap_crossentropy_e5m2(l, z, NULL, &d, t, 2, 8, 30.0f, 7.5f, 1.0f, 448.0f,
					       0) == NG_ERR_INPUT,
		  "g8 NULL must be refused");
	ng_clear_error();
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		cr_expect(ng_softcap_crossentropy_e5m2(l, z, g, &d, t, 2, 8, 30.0f, 7.5f, 1.0f,
						       bad[i], 0) == NG_ERR_INPUT,
			  "gscale %g must be refused", (double)bad[i]);
		cr_expect(strstr(ng_error_message(), "gscale=") != NULL, "message: %s",
			  ng_error_message());
		ng_clear_error();
	}
	cr_expect(ng_softcap_crossentropy_e5m2(l, z, g, &d, t, 2, 8, 100.0f, 7.5f, 1.0f, 448.0f,
					       0) == NG_ERR_INPUT,
		  "cap 100 (> 64) must be refused");
	cr_expect(strstr(ng_error_message(), "cap=100") != NULL, "message: %s", ng_error_message());
	ng_clear_error();
}
