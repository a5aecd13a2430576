/*
 * tests/test_muon.c — Muon (kernels/muon.h, kernels/muon_ns.h) against its double-precision
 * reference (graph/cpu_muon.h), and the reference itself.
 *
 * CPU: the Newton-Schulz iteration drives every singular value of a random matrix into the
 * quintic's band (X X^T's eigenvalues within [0.3, 1.6] for the wide form, X^T X for the
 * tall one: the speedrun's iteration is built to land near 0.7..1.2, not on 1); the bf16
 * emulation stays near the double iteration; the schedule's and the momentum's shapes.
 * GPU, shapes 64x64, 96x32 (tall), 32x96 (wide), 67x45 (tall, odd: 2-byte batch strides),
 * batch 3:
 *  - Newton-Schulz (1 and 5 steps) from the same normalised bf16 input: the FlashAttention
 *    rule, max|gpu - fp64| <= 2 max|bf16 emulation - fp64| + atol, the emulation rounding as the
 *    GPU does (bf16 operands, fp32 sums, one rounding a GEMM), atol = 2^-10 max|ref|; the same
 *    bytes over two runs.
 *  - The normalisation: the bf16 rule (2 ulps) against x / (||x|| + 1e-7) in double.
 *  - Momentum: m NMSE <= 1e-7, u within 1 bf16 ulp of the double value.
 *  - The update and the speedrun's Adam on the split master: NMSE <= 1e-7 against double.
 *  - The schedule kernel: lr, mu and Adam's step sizes against the host formulas (1e-6 rel).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_muon.h"
#include "kernels/muon.h"
#include "kernels/muon_ns.h"
#include "kernels/split.h"
#include "tests/kernel_testing.h"

/* The largest eigenvalue of the symmetric (n x n) g + shift I, by power iteration. */
static double top_eig(const double *g, int n, double shift)
{
	double *v = kt_xmalloc(n * 8), *w = kt_xmalloc(n * 8), lam = 0;
	for (int i = 0; i < n; i++)
		v[i] = 1.0 + 0.01 * i;
	for (int it = 0; it < 2000; it++) {
		double nn = 0;
		for (int i = 0; i < n; i++) {
			w[i] = shift * v[i];
			for (int j = 0; j < n; j++)
				w[i] += g[(size_t)i * n + j] * v[j];
			nn += w[i] * w[i];
		}
		nn = sqrt(nn);
		double dot = 0;
		for (int i = 0; i < n; i++) {
			dot += v[i] * w[i];
			v[i] = w[i] / nn;
		}
		lam = dot;
	}
	free(v), free(w);
	return lam;
}

/* The extreme eigenvalues of X X^T (wide) or X^T X (tall) of x (r x c): the squared
 * singular values the iteration produced. */
static void gram_band(const double *x, int r, int c, double *lo, double *hi)
{
	int tall = r > c, n = tall ? c : r, k = tall ? r : c;
	double *g = kt_xmalloc((size_t)n * n * 8);
	for (int i = 0; i < n; i++)
		for (int j = 0; j < n; j++) {
			double s = 0;
			for (int t = 0; t < k; t++)
				s += tall ? x[(size_t)t * c + i] * x[(size_t)t * c + j]
					  : x[(size_t)i * c + t] * x[(size_t)j * c + t];
			g[(size_t)i * n + j] = s;
		}
	*hi = top_eig(g, n, 0.0);
	for (size_t i = 0; i < (size_t)n * n; i++)
		g[i] = -g[i];
	*lo = -(top_eig(g, n, *hi) - *hi); /* top of hi I - G is hi - lo */
	free(g);
}

Test(muon_ref, newton_schulz_band)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	int shapes[][2] = { { 8, 64 }, { 64, 8 }, { 16, 96 } };
	for (int s = 0; s < 3; s++) {
		int rr = shapes[s][0], cc = shapes[s][1];
		size_t n = (size_t)rr * cc;
		double *u = kt_xmalloc(n * 8), *x = kt_xmalloc(n * 8), *xb = kt_xmalloc(n * 8);
		for (size_t i = 0; i < n; i++)
			u[i] = ng_rng_normal(&r);
		ng_ref_newton_schulz(x, u, rr, cc, NG_MUON_NS_STEPS, 0);
		double lo, hi;
		gram_band(x, rr, cc, &lo, &hi);
		cr_expect(lo > 0.3 && hi < 1.6, "%dx%d: Gram band [%.3f, %.3f]; seed %llu", rr, cc,
			  lo, hi, (unsigned long long)seed);
		ng_ref_newton_schulz(xb, u, rr, cc, NG_MUON_NS_STEPS, 1);
		double num = 0, den = 0;
		for (size_t i = 0; i < n; i++) {
			num += (xb[i] - x[i]) * (xb[i] - x[i]);
			den += x[i] * x[i];
		}
		cr_expect(sqrt(num / den) < 0.05, "%dx%d: bf16 emulation rel L2 %.3g; seed %llu", rr,
			  cc, sqrt(num / den), (unsigned long long)seed);
		free(u), free(x), free(xb);
	}
}

Test(muon_ref, schedule_and_momentum)
{
	cr_expect_float_eq(ng_muon_lr_factor(0, 100, 0.4, 0.1), 1.0, 1e-12);
	cr_expect_float_eq(ng_muon_lr_factor(59, 100, 0.4, 0.1), 1.0, 1e-12);
	cr_expect_float_eq(ng_muon_lr_factor(80, 100, 0.4, 0.1), 0.55, 1e-12);
	cr_expect_float_eq(ng_muon_lr_factor(100, 100, 0.4, 0.1), 0.1, 1e-12);
	cr_expect_float_eq(ng_muon_momentum(0, 0.85, 0.95, 300), 0.85, 1e-12);
	cr_expect_float_eq(ng_muon_momentum(150, 0.85, 0.95, 300), 0.90, 1e-12);
	cr_expect_float_eq(ng_muon_momentum(1000, 0.85, 0.95, 300), 0.95, 1e-12);
	struct ng_gpt_config cfg = { 2, 2, 64, 64, 500, 0, NG_ARCH_GPT2 };
	struct ng_muon_group g[NG_MUON_GROUPS];
	ng_muon_groups(&cfg, g);
	cr_expect(g[0].batch == 6 && g[2].rows == 256 && g[2].cols == 64 && g[2].scale == 2.0 &&
		  g[3].rows == 64 && g[3].cols == 256 && g[3].scale == 1.0);
}

/* ---- GPU ---- */

static const int shapes[][2] = { { 64, 64 }, { 96, 32 }, { 32, 96 }, { 67, 45 } };
enum { BATCH = 3 };

static cublasLtHandle_t lt_handle(void)
{
	static cublasLtHandle_t lt;
	if (!lt)
		cr_assert_eq(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
	return lt;
}

/* Random bf16 u of BATCH matrices (rows x cols) back to back; d gets the same values. */
static ng_bf16 *random_u(struct ng_rng *r, double *d, size_t n)
{
	ng_bf16 *h = kt_xmalloc(n * 2);
	kt_fill_bf16(r, h, d, n, 0.0, 1e-3);
	return h;
}

/* tune: each GEMM takes the fastest of cuBLASLt's offered algorithms first (--autotune) */
static void ns_case(int rows, int cols, int steps, int tune)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t numel = (size_t)rows * cols, n = numel * BATCH;
	int k = rows < cols ? rows : cols;
	double *u = kt_xmalloc(n * 8);
	ng_bf16 *h = random_u(&r, u, n);
	ng_bf16 *d_x0 = kt_upload(h, n * 2), *d_x1 = kt_upload(NULL, n * 2);
	ng_bf16 *d_a = kt_upload(NULL, (size_t)BATCH * k * k * 2);
	ng_bf16 *d_b = kt_upload(NULL, (size_t)BATCH * k * k * 2);
	size_t wsb = (size_t)32 << 20;
	void *d_ws = kt_upload(NULL, wsb);
	double *d_part = kt_upload(NULL, ng_muon_normalize_scratch_bytes(numel, BATCH));
	struct ng_muon_ns p;
	kt_ok(ng_muon_ns_plan(&p, lt_handle(), BATCH, rows, cols, numel, steps, wsb),
	      "ng_muon_ns_plan");
	float ms[3] = { -1, -1, -1 };
	if (tune) {
		kt_ok(ng_muon_ns_tune(&p, d_x0, d_x1, d_a, d_b, d_ws, 0, ms), "ng_muon_ns_tune");
		for (int g = 0; g < 3; g++)
			cr_expect(ms[g] > 0, "NS %dx%d: GEMM %d timed %.4f ms", rows, cols, g, ms[g]);
	}
	ng_bf16 *got[2];
	ng_bf16 *res;
	for (int run = 0; run < 2; run++) {
		kt_cuda(cudaMemcpy(d_x0, h, n * 2, cudaMemcpyHostToDevice), "upload");
		kt_ok(ng_muon_normalize(d_x0, d_part, numel, numel, BATCH, 0), "ng_muon_normalize");
		kt_ok(ng_muon_ns_run(&p, d_x0, d_x1, d_a, d_b, d_ws, &res, 0), "ng_muon_ns_run");
		got[run] = kt_xmalloc(n * 2);
		kt_download(got[run], res, n * 2);
	}
	cr_expect(res == (steps % 2 ? d_x1 : d_x0), "result buffer");
	cr_expect(memcmp(got[0], got[1], n * 2) == 0, "NS %dx%d: not deterministic", rows, cols);
	double *gd = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8), *naive = kt_xmalloc(n * 8);
	for (size_t i = 0; i < n; i++)
		gd[i] = kt_bf16_to_f32(got[0][i]);
	for (int b = 0; b < BATCH; b++) {
		ng_ref_newton_schulz(ref + b * numel, u + b * numel, rows, cols, steps, 0);
		ng_ref_newton_schulz(naive + b * numel, u + b * numel, rows, cols, steps, 1);
	}
	struct kt_err e = kt_errors(ref, ref, n);
	char what[96];
	snprintf(what, sizeof(what), "newton_schulz %dx%d x%d, %d step(s)%s", rows, cols, BATCH, steps,
		 tune ? ", tuned" : "");
	check_fa_(what, seed, gd, naive, ref, n, ldexp(e.ref_max, -10));
	ng_muon_ns_free(&p);
	cudaFree(d_x0), cudaFree(d_x1), cudaFree(d_a), cudaFree(d_b), cudaFree(d_ws), cudaFree(d_part);
	free(u), free(h), free(got[0]), free(got[1]), free(gd), free(ref), free(naive);
}

Test(muon, newton_schulz_batched)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (int s = 0; s < 4; s++) {
		ns_case(shapes[s][0], shapes[s][1], 1, 0);
		ns_case(shapes[s][0], shapes[s][1], NG_MUON_NS_STEPS, 0);
	}
}

/* The algorithms --autotune picks give the same iteration (within the same bound). */
Test(muon, newton_schulz_tuned)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	for (int s = 0; s < 4; s++)
		ns_case(shapes[s][0], shapes[s][1], NG_MUON_NS_STEPS, 1);
}

Test(muon, normalize)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	/* rows, cols, stride padding: the small shapes in one chunk with an odd stride (the scalar
	 * path), then several chunks (NG_MUON_NORM_CHUNK) with a partial last one, scalar and
	 * 8-wide (stride a multiple of 8) */
	static const int cases[][3] = { { 64, 64, 5 }, { 96, 32, 5 }, { 32, 96, 5 }, { 67, 45, 5 },
					{ 301, 200, 3 }, { 256, 776, 0 }, { 768, 192, 8 } };
	for (size_t s = 0; s < sizeof(cases) / sizeof(cases[0]); s++) {
		size_t numel = (size_t)cases[s][0] * cases[s][1], stride = numel + cases[s][2];
		size_t n = stride * BATCH;
		double *u = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8);
		ng_bf16 *h = random_u(&r, u, n), *got = kt_xmalloc(n * 2);
		ng_bf16 *d = kt_upload(h, n * 2);
		double *d_part = kt_upload(NULL, ng_muon_normalize_scratch_bytes(numel, BATCH));
		kt_ok(ng_muon_normalize(d, d_part, numel, stride, BATCH, 0), "ng_muon_normalize");
		kt_download(got, d, n * 2);
		cudaFree(d_part);
		for (int b = 0; b < BATCH; b++) {
			double ss = 0;
			for (size_t i = 0; i < numel; i++)
				ss += u[b * stride + i] * u[b * stride + i];
			for (size_t i = 0; i < stride; i++)
				ref[b * stride + i] = i < numel ? u[b * stride + i] / (sqrt(ss) + 1e-7)
								: u[b * stride + i];
		}
		check_bf16_("normalize", seed, got, ref, n, 2.0, 0.0);
		cudaFree(d);
		free(u), free(ref), free(h), free(got);
	}
}

/* Device scalars: a step state and the schedule's output for step `step`. */
static void scalars_at(int step, float clip_scale, struct ng_muon_config c,
		       struct ng_step_state **d_st, struct ng_muon_scalars **d_sc,
		       struct ng_muon_scalars *h_sc)
{
	struct ng_step_state st = { 0 };
	st.step = step;
	st.clip_scale = clip_scale;
	*d_st = kt_upload(&st, sizeof(st));
	*d_sc = kt_upload(NULL, sizeof(**d_sc));
	kt_ok(ng_muon_schedule(*d_sc, *d_st, c, 0), "ng_muon_schedule");
	kt_download(h_sc, *d_sc, sizeof(*h_sc));
}

Test(muon, schedule)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_muon_config c = ng_muon_config_default(500);
	int steps[] = { 0, 1, 150, 299, 300, 299 + 1, 350, 499 };
	for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
		struct ng_step_state *d_st;
		struct ng_muon_scalars *d_sc, h;
		scalars_at(steps[i], 1.0f, c, &d_st, &d_sc, &h);
		double lr = c.lr * ng_muon_lr_factor(steps[i], c.total, c.cooldown_frac, c.final_frac);
		double mu = ng_muon_momentum(steps[i], c.mu_start, c.mu_end, c.mu_warmup);
		cr_expect(fabs(h.lr - lr) <= 1e-6 * lr, "step %d: lr %g, want %g", steps[i], h.lr, lr);
		cr_expect(fabs(h.mu - mu) <= 1e-6, "step %d: mu %g, want %g", steps[i], h.mu, mu);
		for (int gi = 0; gi < NG_MUON_ADAM_GROUPS; gi++) {
			double a = ng_ref_muon_adam_alpha(&c, gi, steps[i]);
			cr_expect(fabs(h.adam_alpha[gi] - a) <= 1e-6 * a, "step %d group %d: alpha %g, "
				  "want %g", steps[i], gi, h.adam_alpha[gi], a);
		}
		cudaFree(d_st), cudaFree(d_sc);
	}
}

Test(muon, momentum_apply_adam)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = 67 * 45 * BATCH + 3; /* a tail past the float4s */
	struct ng_muon_config c = ng_muon_config_default(100);
	struct ng_step_state *d_st;
	struct ng_muon_scalars *d_sc, sc;
	scalars_at(7, 0.5f, c, &d_st, &d_sc, &sc);
	float *g = kt_xmalloc(n * 4), *m = kt_xmalloc(n * 4), *v = kt_xmalloc(n * 4);
	float *w = kt_xmalloc(n * 4);
	ng_bf16 *hi = kt_xmalloc(n * 2), *x = kt_xmalloc(n * 2);
	uint16_t *lo = kt_xmalloc(n * 2);
	double *gd = kt_xmalloc(n * 8), *md = kt_xmalloc(n * 8), *vd = kt_xmalloc(n * 8);
	double *wd = kt_xmalloc(n * 8), *xd = kt_xmalloc(n * 8), *got = kt_xmalloc(n * 8);
	for (size_t i = 0; i < n; i++) {
		g[i] = (float)(ng_rng_normal(&r) * 1e-3);
		m[i] = (float)(ng_rng_normal(&r) * 1e-3);
		v[i] = (float)fabs(ng_rng_normal(&r) * 1e-6);
		w[i] = (float)(ng_rng_normal(&r) * 0.02);
		ng_split_encode(w[i], &hi[i], &lo[i]);
		gd[i] = g[i], md[i] = m[i], vd[i] = v[i], wd[i] = w[i];
	}
	/* momentum */
	float *d_g = kt_upload(g, n * 4), *d_m = kt_upload(m, n * 4), *d_v = kt_upload(v, n * 4);
	ng_bf16 *d_u = kt_upload(NULL, n * 2);
	kt_ok(ng_muon_momentum_update(d_u, d_m, d_g, n, d_sc, d_st, 0), "momentum");
	float *mg = kt_xmalloc(n * 4);
	ng_bf16 *ug = kt_xmalloc(n * 2);
	kt_download(mg, d_m, n * 4);
	kt_download(ug, d_u, n * 2);
	double mu = sc.mu, *uref = kt_xmalloc(n * 8), *mref = kt_xmalloc(n * 8);
	for (size_t i = 0; i < n; i++) {
		double gi = gd[i] * 0.5;
		mref[i] = mu * md[i] + (1 - mu) * gi;
		uref[i] = (1 - mu) * gi + mu * mref[i];
		got[i] = mg[i];
	}
	check_nmse_("momentum m", seed, got, mref, n);
	check_bf16_("momentum u", seed, ug, uref, n, 1.0, 0.0);
	/* apply: w -= lr * 2 * x */
	for (size_t i = 0; i < n; i++) {
		x[i] = ug[i];
		xd[i] = kt_bf16_to_f32(ug[i]) * 100.0;
		x[i] = kt_f32_to_bf16((float)xd[i]);
		xd[i] = kt_bf16_to_f32(x[i]);
	}
	ng_bf16 *d_hi = kt_upload(hi, n * 2), *d_x = kt_upload(x, n * 2);
	uint16_t *d_lo = kt_upload(lo, n * 2);
	kt_ok(ng_muon_apply(d_hi, d_lo, d_x, n, 2.0f, d_sc, d_st, 0), "apply");
	ng_bf16 *hg = kt_xmalloc(n * 2);
	uint16_t *lg = kt_xmalloc(n * 2);
	kt_download(hg, d_hi, n * 2);
	kt_download(lg, d_lo, n * 2);
	/* the updates compared, not the weights (the change is small beside w) */
	double *wref = kt_xmalloc(n * 8), *dg = kt_xmalloc(n * 8);
	for (size_t i = 0; i < n; i++) {
		got[i] = ng_split_decode(hg[i], lg[i]);
		wref[i] = -(double)sc.lr * 2.0 * xd[i];
		dg[i] = got[i] - wd[i];
	}
	check_nmse_("muon apply", seed, dg, wref, n);
	/* Adam on the updated weights, the momentum-updated m as its first moment */
	kt_ok(ng_muon_adam(d_hi, d_lo, d_m, d_v, d_g, n, NG_MUON_ADAM_SCALAR, c.beta1, c.beta2,
			   c.eps, d_sc, d_st, 0), "adam");
	kt_download(hg, d_hi, n * 2);
	kt_download(lg, d_lo, n * 2);
	/* the reference from the GPU's apply output (the fp32 master before Adam) */
	double *p = kt_xmalloc(n * 8);
	for (size_t i = 0; i < n; i++) {
		md[i] = mg[i];
		p[i] = got[i];
	}
	ng_ref_adam_speedrun(p, md, vd, gd, n, sc.adam_alpha[NG_MUON_ADAM_SCALAR], c.beta1,
			     c.beta2, c.eps, 0.5);
	for (size_t i = 0; i < n; i++) {
		dg[i] = ng_split_decode(hg[i], lg[i]) - got[i];
		wref[i] = p[i] - got[i];
	}
	check_nmse_("adam speedrun", seed, dg, wref, n);
	cudaFree(d_g), cudaFree(d_m), cudaFree(d_v), cudaFree(d_u), cudaFree(d_hi), cudaFree(d_x);
	cudaFree(d_lo), cudaFree(d_st), cudaFree(d_sc);
	free(g), free(m), free(v), free(w), free(hi), free(x), free(lo), free(gd), free(md);
	free(vd), free(wd), free(xd), free(got), free(mg), free(ug), free(uref), free(mref);
	free(hg), free(lg), free(wref), free(dg), free(p);
}

/* The apply and Adam kernels take 4 elements a thread where the pointers allow it and one
 * otherwise: the same buffers one element off alignment must come out bit for bit the same. */
Test(muon, apply_adam_any_alignment)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = 1001;
	struct ng_muon_config c = ng_muon_config_default(100);
	struct ng_step_state *d_st;
	struct ng_muon_scalars *d_sc, sc;
	scalars_at(7, 0.5f, c, &d_st, &d_sc, &sc);
	float *f32[3]; /* g, m, v */
	ng_bf16 *hi = kt_xmalloc(n * 2), *x = kt_xmalloc(n * 2);
	uint16_t *lo = kt_xmalloc(n * 2);
	for (int k = 0; k < 3; k++)
		f32[k] = kt_xmalloc(n * 4);
	for (size_t i = 0; i < n; i++) {
		f32[0][i] = (float)(ng_rng_normal(&r) * 1e-3);
		f32[1][i] = (float)(ng_rng_normal(&r) * 1e-3);
		f32[2][i] = (float)fabs(ng_rng_normal(&r) * 1e-6);
		ng_split_encode((float)(ng_rng_normal(&r) * 0.02), &hi[i], &lo[i]);
		x[i] = kt_f32_to_bf16((float)ng_rng_normal(&r));
	}
	ng_bf16 *out_hi[2];
	uint16_t *out_lo[2];
	float *out_m[2], *out_v[2];
	for (int off = 0; off < 2; off++) { /* 0: aligned, 1: one element past */
		/* each buffer its own allocation (256-byte aligned), used from element off */
		ng_bf16 *b_hi = kt_upload(NULL, (n + 4) * 2), *b_x = kt_upload(NULL, (n + 4) * 2);
		uint16_t *b_lo = kt_upload(NULL, (n + 4) * 2);
		ng_bf16 *d_hi = b_hi + off, *d_x = b_x + off;
		uint16_t *d_lo = b_lo + off;
		float *b_f[3], *d_f[3];
		for (int k = 0; k < 3; k++) {
			b_f[k] = kt_upload(NULL, (n + 4) * 4);
			d_f[k] = b_f[k] + off;
			kt_cuda(cudaMemcpy(d_f[k], f32[k], n * 4, cudaMemcpyHostToDevice), "upload");
		}
		kt_cuda(cudaMemcpy(d_hi, hi, n * 2, cudaMemcpyHostToDevice), "upload");
		kt_cuda(cudaMemcpy(d_lo, lo, n * 2, cudaMemcpyHostToDevice), "upload");
		kt_cuda(cudaMemcpy(d_x, x, n * 2, cudaMemcpyHostToDevice), "upload");
		kt_ok(ng_muon_apply(d_hi, d_lo, d_x, n, 2.0f, d_sc, d_st, 0), "apply");
		kt_ok(ng_muon_adam(d_hi, d_lo, d_f[1], d_f[2], d_f[0], n, NG_MUON_ADAM_EMBED,
				   c.beta1, c.beta2, c.eps, d_sc, d_st, 0), "adam");
		out_hi[off] = kt_xmalloc(n * 2), out_lo[off] = kt_xmalloc(n * 2);
		out_m[off] = kt_xmalloc(n * 4), out_v[off] = kt_xmalloc(n * 4);
		kt_download(out_hi[off], d_hi, n * 2);
		kt_download(out_lo[off], d_lo, n * 2);
		kt_download(out_m[off], d_f[1], n * 4);
		kt_download(out_v[off], d_f[2], n * 4);
		cudaFree(b_hi), cudaFree(b_x), cudaFree(b_lo);
		for (int k = 0; k < 3; k++)
			cudaFree(b_f[k]);
	}
	cr_expect(memcmp(out_hi[0], out_hi[1], n * 2) == 0 && memcmp(out_lo[0], out_lo[1], n * 2) == 0,
		  "seed %llu: the weights differ between the wide and the one-element path",
		  (unsigned long long)seed);
	cr_expect(memcmp(out_m[0], out_m[1], n * 4) == 0 && memcmp(out_v[0], out_v[1], n * 4) == 0,
		  "seed %llu: the moments differ between the wide and the one-element path",
		  (unsigned long long)seed);
	size_t changed = 0;
	for (size_t i = 0; i < n; i++)
		changed += out_hi[0][i] != hi[i] || out_lo[0][i] != lo[i];
	cr_expect(changed > n / 2, "seed %llu: only %zu of %zu weights moved",
		  (unsigned long long)seed, changed, n);
	for (int off = 0; off < 2; off++)
		free(out_hi[off]), free(out_lo[off]), free(out_m[off]), free(out_v[off]);
	for (int k = 0; k < 3; k++)
		free(f32[k]);
	free(hi), free(x), free(lo);
	cudaFree(d_st), cudaFree(d_sc);
}
