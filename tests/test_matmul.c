/*
 * tests/test_matmul.c — the cuBLASLt matmul plans (kernels/matmul.h) against the double
 * reference of graph/cpu_ops.h (ng_ref_matmul_fwd/bwd, ng_ref_gelu_fwd/bwd).
 *
 * Tolerance (docs/CONTRIBUTING.md, the FlashAttention rule): err(GPU vs fp64) <= 2 * err(naive vs
 * fp64) + atol, where "naive" is the plain CPU loop over the same bf16-rounded inputs in fp32
 * (and its result rounded to bf16 where the GPU output is bf16), and the fp64 reference uses the
 * same bf16-rounded inputs. atol: 2^-10 of the largest |reference| for bf16 outputs (a quarter of
 * a bf16 ulp there), 1e-6 of it for fp32 outputs.
 *
 * Shapes: N = 1 (B = T = 1), C = 776 = 8 x 97 (odd multiple of 8), the MLP width 4C = 3104,
 * the padded vocabulary Vp = 50304 (tied head), large-mean inputs, pointers offset by 16 bytes,
 * DW accumulated over two calls (beta = 1) onto a random nonzero gradient, GELU / DGELU, bias
 * and BGRADB epilogues, autotune. Inputs are fresh each run (seed from the clock, printed on
 * failure). The DW-with-bias and FWD-with-GELU results are checked to be bit-identical over two
 * runs (the determinism the step relies on).
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
#include "kernels/gemm_sm90.h"
#include "kernels/matmul.h"
#include "kernels/types.h"
#include "tests/kernel_testing.h"
#include "util/rng.h"

/* One test case. */
struct mm_case {
	enum ng_matmul_kind kind;
	int N, IC, OC;   /* shape (matmul.h) */
	int gelu, bias;  /* epilogues */
	int accumulate;  /* DW "+=" */
	int autotune;    /* plan by timing candidates */
	int calls;       /* runs in a row (DW accumulate: 2) */
	int offset;      /* bytes added to every device pointer (0 or 16) */
	double mean;     /* mean of the activation inputs (large-mean case) */
	int determinism; /* run the whole case twice, compare the output bytes */
	int colsum;      /* DW bias: 1 the column-sum matmul, 0 the BGRADB epilogue */
	int own;         /* FWD: force our own GEMM's candidate (kernels/gemm_sm90.h); DINP with
	                  * gelu: spec.own */
};

static float round_bf16_(float f) { return kt_bf16_to_f32(kt_f32_to_bf16(f)); }

/* n bf16 values N(mean, sd): bits in h, the same values exactly in f (fp32) and d (fp64). */
static void fill_(struct ng_rng *r, ng_bf16 *h, float *f, double *d, size_t n, double mean,
		  double sd)
{
	for (size_t i = 0; i < n; i++) {
		h[i] = kt_f32_to_bf16((float)(mean + sd * ng_rng_normal(r)));
		f[i] = kt_bf16_to_f32(h[i]);
		d[i] = f[i];
	}
}

static float gelu_f_(float x)
{
	return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

static float dgelu_f_(float x)
{
	float u = 0.7978845608f * (x + 0.044715f * x * x * x), th = tanhf(u);
	float du = 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
	return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

/* Max abs error of gpu and naive against ref; expect the FlashAttention rule to hold. */
static void expect_close_(const char *what, const double *ref, const float *naive,
			  const float *gpu, size_t n, int out_bf16, uint64_t seed,
			  const struct mm_case *c)
{
	double ek = 0, en = 0, rel = 0, big = 0;
	size_t worst = 0;
	for (size_t i = 0; i < n; i++) {
		double a = fabs(gpu[i] - ref[i]), b = fabs(naive[i] - ref[i]);
		if (!(a <= ek)) { /* also catches NaN */
			ek = isnan(a) ? INFINITY : a;
			worst = i;
		}
		if (b > en)
			en = b;
		if (fabs(ref[i]) > big)
			big = fabs(ref[i]);
		double r = a / fmax(fabs(ref[i]), 1e-3);
		if (r > rel)
			rel = r;
	}
	double atol = big * (out_bf16 ? 1.0 / 1024 : 1e-6);
	cr_expect(ek <= 2 * en + atol,
		  "%s kind %d N=%d IC=%d OC=%d gelu %d bias %d acc %d tune %d off %d (seed %llu): "
		  "max abs err %.3g > 2 x naive %.3g + atol %.3g; max rel err %.3g; worst index %zu "
		  "(gpu %.6g, ref %.6g)", what, (int)c->kind, c->N, c->IC, c->OC, c->gelu, c->bias,
		  c->accumulate, c->autotune, c->offset, (unsigned long long)seed, ek, en, atol,
		  rel, worst, (double)gpu[worst], ref[worst]);
}

/* A device buffer of n elements of es bytes at `offset` past a 256-aligned allocation. */
static void *dev_(void **base, size_t bytes, int offset)
{
	cr_assert(!NG_CUDA_CHECK(cudaMalloc(base, bytes + 256)), "%s", ng_error_message());
	return (char *)*base + offset;
}

static void up_(void *dst, const void *src, size_t bytes)
{
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice)), "%s",
		  ng_error_message());
}

static void down_(void *dst, const void *src, size_t bytes)
{
	cr_assert(!NG_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost)), "%s",
		  ng_error_message());
}

/* Everything one case needs on the host. */
struct host_ {
	ng_bf16 *ah, *bh, *biash, *auxh;   /* bf16 bits of a, b, bias, aux (DINP input) */
	float *af, *bf, *biasf, *auxf;     /* the same values in fp32 */
	double *ad, *bd, *biasd, *auxd;    /* and in fp64 */
	float *out0;                       /* initial content of the output (DW: fp32 values) */
	double *ref, *ref_aux, *ref_db;    /* fp64 results */
	float *nv, *nv_aux, *nv_db;        /* naive fp32 results */
	float *gpu, *gpu_aux, *gpu_db;     /* GPU results, as float */
};

/* One call's reference and naive results for FWD / DINP ("=") or DW ("+="). */
static void reference_(struct host_ *h, const struct mm_case *c)
{
	size_t N = (size_t)c->N, IC = (size_t)c->IC, OC = (size_t)c->OC;
	if (c->kind == NG_MATMUL_FWD) {
		ng_ref_matmul_fwd(h->ref_aux, h->ad, h->bd, c->bias ? h->biasd : NULL, c->N, c->IC,
				  c->OC);
		if (c->gelu)
			ng_ref_gelu_fwd(h->ref, h->ref_aux, N * OC);
		else
			memcpy(h->ref, h->ref_aux, N * OC * sizeof(double));
		if (c->accumulate) /* the residual add: out = residual (out0, bf16) + product */
			for (size_t i = 0; i < N * OC; i++)
				h->ref[i] += h->out0[i];
		for (size_t n = 0; n < N; n++)
			for (size_t o = 0; o < OC; o++) {
				float s = c->bias ? h->biasf[o] : 0.0f;
				for (size_t i = 0; i < IC; i++)
					s += h->af[n * IC + i] * h->bf[o * IC + i];
				h->nv_aux[n * OC + o] = round_bf16_(s);
				if (c->accumulate)
					s += h->out0[n * OC + o];
				h->nv[n * OC + o] = round_bf16_(c->gelu ? gelu_f_(s) : s);
			}
	} else if (c->kind == NG_MATMUL_DINP) {
		memset(h->ref, 0, N * IC * sizeof(double));
		ng_ref_matmul_bwd(h->ref, NULL, NULL, h->ad, NULL, h->bd, c->N, c->IC, c->OC);
		memcpy(h->ref_aux, h->ref, N * IC * sizeof(double)); /* dout @ W, for gelu_form_ */
		if (c->gelu)
			ng_ref_gelu_bwd(h->ref, h->auxd, h->ref, N * IC);
		float *acc = calloc(IC, sizeof(float));
		for (size_t n = 0; n < N; n++) {
			memset(acc, 0, IC * sizeof(float));
			for (size_t o = 0; o < OC; o++)
				for (size_t i = 0; i < IC; i++)
					acc[i] += h->af[n * OC + o] * h->bf[o * IC + i];
			for (size_t i = 0; i < IC; i++)
				h->nv[n * IC + i] = round_bf16_(
					c->gelu ? acc[i] * dgelu_f_(h->auxf[n * IC + i]) : acc[i]);
		}
		free(acc);
	} else { /* DW: a = dout (N, OC), b = inp (N, IC) */
		if (!c->accumulate) {
			memset(h->ref, 0, OC * IC * sizeof(double));
			memset(h->ref_db, 0, OC * sizeof(double));
			memset(h->nv, 0, OC * IC * sizeof(float));
			memset(h->nv_db, 0, OC * sizeof(float));
		}
		ng_ref_matmul_bwd(NULL, h->ref, c->bias ? h->ref_db : NULL, h->ad, h->bd, NULL, c->N,
				  c->IC, c->OC);
		float *acc = calloc(IC, sizeof(float));
		for (size_t o = 0; o < OC; o++) {
			float sb = 0.0f;
			memset(acc, 0, IC * sizeof(float));
			for (size_t n = 0; n < N; n++) {
				float g = h->af[n * OC + o];
				sb += g;
				for (size_t i = 0; i < IC; i++)
					acc[i] += g * h->bf[n * IC + i];
			}
			for (size_t i = 0; i < IC; i++)
				h->nv[o * IC + i] += acc[i];
			h->nv_db[o] += sb;
		}
		free(acc);
	}
}

/* Which GELU did cuBLASLt apply? With e = erf-form minus tanh-form reference, the projection
 * t = sum((gpu - tanh_ref) * e) / sum(e^2) is ~0 for the tanh form and ~1 for the erf form
 * (bf16 rounding noise averages out over the elements). pre: pre-activations (FWD) or aux
 * (DINP); g: NULL (FWD) or dout @ W (DINP). */
static void gelu_form_(const double *pre, const double *g, const double *ref, const float *gpu,
		       size_t n, uint64_t seed)
{
	double num = 0, den = 0;
	for (size_t i = 0; i < n; i++) {
		double x = pre[i], phi = 0.5 * (1.0 + erf(x / sqrt(2.0)));
		double e = g ? g[i] * (phi + x * exp(-0.5 * x * x) / sqrt(2.0 * M_PI)) - ref[i]
			     : x * phi - ref[i];
		num += ((double)gpu[i] - ref[i]) * e;
		den += e * e;
	}
	double t = num / den;
	cr_log_info("%s: GELU form projection t = %.3f (0: tanh form, 1: erf form)",
		    g ? "DGELU" : "GELU", t);
	cr_expect(t < 0.5, "%s looks like the erf GELU, not the tanh form: t = %.3f (seed %llu)",
		  g ? "DGELU" : "GELU", t, (unsigned long long)seed);
}

/* One run: FWD with accumulate adds the residual `res` (bf16, the output's shape). */
static enum ng_status run_(const struct mm_case *c, const struct ng_matmul *mm, void *out,
			   const void *a, const void *b, const void *bias, void *aux, void *dbias,
			   const void *res, void *ws)
{
	if (c->kind == NG_MATMUL_FWD && c->accumulate)
		return ng_matmul_run_residual(mm, out, a, b, bias, res, NULL, NULL, ws, 0);
	if (mm->spec.own) { /* our own GEMM's DGELU from W^T (no post here: test_gemm_sm90) */
		void *wt = NULL;
		size_t bytes = (size_t)mm->spec.IC * mm->spec.OC * 2;
		kt_cuda(cudaMalloc(&wt, bytes), "cudaMalloc");
		enum ng_status st = ng_transpose_bf16(wt, b, mm->spec.OC, mm->spec.IC, 1, 0);
		if (!st)
			st = ng_matmul_run_dgelu(mm, out, a, wt, aux, NULL, NULL, 0, ws, 0);
		kt_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
		cudaFree(wt);
		return st;
	}
	return ng_matmul_run(mm, out, a, b, bias, aux, dbias, ws, 0);
}

static void run_case_(const struct mm_case *c)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng rng;
	ng_rng_seed(&rng, seed);
	const int fwd = c->kind == NG_MATMUL_FWD, dw = c->kind == NG_MATMUL_DW;
	size_t N = (size_t)c->N, IC = (size_t)c->IC, OC = (size_t)c->OC;
	size_t a_n = N * (fwd ? IC : OC), b_n = dw ? N * IC : OC * IC;
	size_t out_n = fwd ? N * OC : dw ? OC * IC : N * IC, out_es = dw ? 4 : 2;
	size_t aux_n = c->gelu ? (fwd ? N * OC : N * IC) : 0;
	struct host_ h;
	memset(&h, 0, sizeof(h));
	h.ah = malloc(a_n * 2); h.af = malloc(a_n * 4); h.ad = malloc(a_n * 8);
	h.bh = malloc(b_n * 2); h.bf = malloc(b_n * 4); h.bd = malloc(b_n * 8);
	h.biash = malloc(OC * 2); h.biasf = malloc(OC * 4); h.biasd = malloc(OC * 8);
	h.auxh = malloc(aux_n * 2 + 2); h.auxf = malloc(aux_n * 4 + 4); h.auxd = malloc(aux_n * 8 + 8);
	h.out0 = malloc(out_n * 4); h.ref = calloc(out_n, 8); h.nv = calloc(out_n, 4);
	h.gpu = malloc(out_n * 4);
	h.ref_aux = calloc(out_n, 8); h.nv_aux = calloc(out_n, 4); h.gpu_aux = calloc(out_n, 4);
	h.ref_db = calloc(OC, 8); h.nv_db = calloc(OC, 4); h.gpu_db = calloc(OC, 4);
	float *db0 = malloc(OC * 4);

	/* The output's prior content: random nonzero (DW accumulates onto it; others overwrite). */
	for (size_t i = 0; i < out_n; i++) {
		h.out0[i] = dw ? (float)ng_rng_normal(&rng) : round_bf16_((float)ng_rng_normal(&rng));
		if (dw) {
			h.ref[i] = h.out0[i];
			h.nv[i] = h.out0[i];
		}
	}
	for (size_t i = 0; i < OC; i++) {
		db0[i] = (float)ng_rng_normal(&rng);
		h.ref_db[i] = db0[i];
		h.nv_db[i] = db0[i];
	}

	struct ng_matmul_ctx ctx;
	struct ng_matmul mm;
	struct ng_matmul_spec sp = {c->kind, c->N, c->IC, c->OC, c->gelu, c->bias, c->accumulate,
				    c->autotune, 0, 0, 0};
	cr_assert(!ng_matmul_ctx_init(&ctx, (size_t)32 << 20), "%s", ng_error_message());
	ctx.dbias_colsum = c->colsum;
	if (c->own && c->kind == NG_MATMUL_DINP) { /* spec.own: W^T in the workspace, then ours */
		if (!ng_gemm_sm90_available())
			cr_skip_test("not an sm_90 GPU (or no sm_90a build): no own GEMM to test");
		sp.own = 1;
	} else if (c->own) {
		if (!ng_gemm_sm90_available())
			cr_skip_test("not an sm_90 GPU (or no sm_90a build): no own GEMM to test");
		ctx.own_gemm = 1;
		ctx.force_candidate = 1000; /* past cuBLASLt's: ours */
		sp.autotune = 1;
	}
	cr_assert(!ng_matmul_plan(&mm, &ctx, &sp), "%s", ng_error_message());
	if (c->own)
		cr_assert(mm.own != 0, "the plan did not take our own GEMM (%d candidates)",
			  mm.n_candidates);
	if (dw && c->bias)
		cr_log_info("DW N=%d IC=%d OC=%d acc %d: bias gradient by %s", c->N, c->IC, c->OC,
			    c->accumulate, mm.colsum ? "column-sum matmul" : "BGRADB");

	void *ba, *bb, *bout, *bbias, *baux, *bdb, *bws;
	void *da = dev_(&ba, a_n * 2, c->offset), *db = dev_(&bb, b_n * 2, c->offset);
	void *dout = dev_(&bout, out_n * out_es, c->offset);
	void *dbias = dev_(&bbias, OC * 2, c->offset), *daux = dev_(&baux, aux_n * 2 + 16, c->offset);
	/* the workspace stays 256-aligned: it comes from the arena (NG_MATMUL_WORKSPACE_ALIGN) */
	void *ddb = dev_(&bdb, OC * 4, c->offset), *dws = dev_(&bws, mm.workspace_need, 0);
	void *bres = NULL, *dres = NULL; /* FWD + accumulate: the residual, the out0 values */
	if (fwd && c->accumulate)
		dres = dev_(&bres, out_n * 2, c->offset);
	ng_bf16 *tmp = malloc(out_n * 2), *auxo = malloc(aux_n * 2 + 2);
	void *prev = malloc(out_n * out_es), *again = malloc(out_n * out_es);
	float *prev_db = malloc(OC * 4), *again_db = malloc(OC * 4);
	ng_bf16 *again_aux = malloc(aux_n * 2 + 2);

	for (int call = 0; call < c->calls; call++) {
		/* fresh inputs per call; FWD: a = inp, b = W; DINP: a = dout, b = W; DW: a = dout,
		 * b = inp. Weights N(0, 1/fan-in) keep the outputs O(1). */
		double a_mean = fwd ? c->mean : 0.0, b_mean = dw ? c->mean : 0.0;
		double b_sd = dw ? 1.0 : 1.0 / sqrt((double)(fwd ? IC : OC));
		fill_(&rng, h.ah, h.af, h.ad, a_n, a_mean, 1.0);
		fill_(&rng, h.bh, h.bf, h.bd, b_n, b_mean, b_sd);
		fill_(&rng, h.biash, h.biasf, h.biasd, OC, 0.0, 0.5);
		if (c->gelu)
			fill_(&rng, h.auxh, h.auxf, h.auxd, aux_n, 0.0, 1.5);
		reference_(&h, c);
		up_(da, h.ah, a_n * 2);
		up_(db, h.bh, b_n * 2);
		up_(dbias, h.biash, OC * 2);
		if (c->gelu)
			up_(daux, h.auxh, aux_n * 2); /* DINP: input; FWD: overwritten */
		if (call == 0 && dw) {
			up_(dout, h.out0, out_n * 4);
			up_(ddb, db0, OC * 4);
		} else if (call == 0) {
			for (size_t i = 0; i < out_n; i++)
				tmp[i] = kt_f32_to_bf16(h.out0[i]);
			up_(dout, tmp, out_n * 2);
			if (dres)
				up_(dres, tmp, out_n * 2);
		}
		down_(prev, dout, out_n * out_es); /* the state before this call */
		down_(prev_db, ddb, OC * 4);
		cr_assert(!run_(c, &mm, dout, da, db, dbias, daux, ddb, dres, dws), "%s",
			  ng_error_message());
		cr_assert(!NG_CUDA_CHECK(cudaDeviceSynchronize()), "%s", ng_error_message());
		if (dw) {
			down_(h.gpu, dout, out_n * 4);
			down_(h.gpu_db, ddb, OC * 4);
		} else {
			down_(tmp, dout, out_n * 2);
			if (fwd && c->gelu)
				down_(auxo, daux, aux_n * 2);
		}
		if (!c->determinism)
			continue;
		/* the same call again from the same state: the bytes must not change */
		up_(dout, prev, out_n * out_es);
		up_(ddb, prev_db, OC * 4);
		cr_assert(!run_(c, &mm, dout, da, db, dbias, daux, ddb, dres, dws), "%s",
			  ng_error_message());
		cr_assert(!NG_CUDA_CHECK(cudaDeviceSynchronize()), "%s", ng_error_message());
		down_(again, dout, out_n * out_es);
		cr_expect(!memcmp(again, dw ? (void *)h.gpu : (void *)tmp, out_n * out_es),
			  "output differs between two identical runs (seed %llu)",
			  (unsigned long long)seed);
		if (dw && c->bias) {
			down_(again_db, ddb, OC * 4);
			cr_expect(!memcmp(again_db, h.gpu_db, OC * 4),
				  "dbias differs between two identical runs (seed %llu)",
				  (unsigned long long)seed);
		}
		if (fwd && c->gelu) {
			down_(again_aux, daux, aux_n * 2);
			cr_expect(!memcmp(again_aux, auxo, aux_n * 2),
				  "aux differs between two identical runs (seed %llu)",
				  (unsigned long long)seed);
		}
	}
	if (!dw) {
		for (size_t i = 0; i < out_n; i++)
			h.gpu[i] = kt_bf16_to_f32(tmp[i]);
		expect_close_("out", h.ref, h.nv, h.gpu, out_n, 1, seed, c);
		if (fwd && c->gelu) {
			for (size_t i = 0; i < aux_n; i++)
				h.gpu_aux[i] = kt_bf16_to_f32(auxo[i]);
			expect_close_("aux", h.ref_aux, h.nv_aux, h.gpu_aux, aux_n, 1, seed, c);
			gelu_form_(h.ref_aux, NULL, h.ref, h.gpu, out_n, seed);
		}
		if (c->kind == NG_MATMUL_DINP && c->gelu)
			gelu_form_(h.auxd, h.ref_aux, h.ref, h.gpu, out_n, seed);
	} else {
		expect_close_("dW", h.ref, h.nv, h.gpu, out_n, 0, seed, c);
		if (c->bias)
			expect_close_("dbias", h.ref_db, h.nv_db, h.gpu_db, OC, 0, seed, c);
	}

	void *bases[8] = {ba, bb, bout, bbias, baux, bdb, bws, bres};
	for (int i = 0; i < 8; i++)
		cudaFree(bases[i]);
	ng_matmul_free(&mm);
	ng_matmul_ctx_free(&ctx);
	void *hp[] = {h.ah, h.af, h.ad, h.bh, h.bf, h.bd, h.biash, h.biasf, h.biasd, h.auxh,
		      h.auxf, h.auxd, h.out0, h.ref, h.nv, h.gpu, h.ref_aux, h.nv_aux, h.gpu_aux,
		      h.ref_db, h.nv_db, h.gpu_db, db0, tmp, auxo, prev, again, prev_db, again_db,
		      again_aux};
	for (size_t i = 0; i < sizeof(hp) / sizeof(hp[0]); i++)
		free(hp[i]);
}

#define C776 776
#define VP 50304
#define MM_TEST(name, ...) \
	Test(matmul, name) { run_case_(&(struct mm_case){ __VA_ARGS__ }); }
MM_TEST(fwd_bias_n1, .kind = NG_MATMUL_FWD, .N = 1, .IC = C776, .OC = 3 * C776, .bias = 1,
	.calls = 1)
MM_TEST(fwd_gelu_bias_large_mean, .kind = NG_MATMUL_FWD, .N = 111, .IC = C776, .OC = 4 * C776,
	.gelu = 1, .bias = 1, .calls = 1, .mean = 3.0, .determinism = 1)
MM_TEST(fwd_gelu_bias_offset16, .kind = NG_MATMUL_FWD, .N = 37, .IC = C776, .OC = 4 * C776,
	.gelu = 1, .bias = 1, .calls = 1, .offset = 16)
/* our own GEMM through the plan, the same checks (FWD only) */
MM_TEST(fwd_gelu_bias_large_mean_own, .kind = NG_MATMUL_FWD, .N = 111, .IC = C776, .OC = 4 * C776,
	.gelu = 1, .bias = 1, .autotune = 1, .calls = 1, .mean = 3.0, .determinism = 1, .own = 1)
MM_TEST(fwd_gelu_bias_offset16_own, .kind = NG_MATMUL_FWD, .N = 37, .IC = C776, .OC = 4 * C776,
	.gelu = 1, .bias = 1, .autotune = 1, .calls = 1, .offset = 16, .own = 1)
MM_TEST(fwd_bias_n1_own, .kind = NG_MATMUL_FWD, .N = 1, .IC = C776, .OC = 3 * C776, .bias = 1,
	.autotune = 1, .calls = 1, .own = 1)
MM_TEST(fwd_head_vp_own, .kind = NG_MATMUL_FWD, .N = 24, .IC = C776, .OC = VP, .autotune = 1,
	.calls = 1, .determinism = 1, .own = 1)
MM_TEST(fwd_bias_residual, .kind = NG_MATMUL_FWD, .N = 111, .IC = C776, .OC = C776, .bias = 1,
	.accumulate = 1, .calls = 1, .determinism = 1)
MM_TEST(fwd_bias_residual_autotune_offset16, .kind = NG_MATMUL_FWD, .N = 96, .IC = 4 * C776,
	.OC = C776, .bias = 1, .accumulate = 1, .autotune = 1, .calls = 1, .offset = 16,
	.mean = 1.0)
MM_TEST(fwd_head_vp, .kind = NG_MATMUL_FWD, .N = 24, .IC = C776, .OC = VP, .calls = 1)
MM_TEST(fwd_gelu_autotune, .kind = NG_MATMUL_FWD, .N = 64, .IC = 256, .OC = 1024, .gelu = 1,
	.autotune = 1, .calls = 1)
MM_TEST(dinp_plain, .kind = NG_MATMUL_DINP, .N = 111, .IC = C776, .OC = 3 * C776, .calls = 1)
MM_TEST(dinp_dgelu, .kind = NG_MATMUL_DINP, .N = 111, .IC = 4 * C776, .OC = C776, .gelu = 1,
	.calls = 1, .determinism = 1)
MM_TEST(dinp_dgelu_n1, .kind = NG_MATMUL_DINP, .N = 1, .IC = 4 * C776, .OC = C776, .gelu = 1,
	.calls = 1)
MM_TEST(dinp_dgelu_own, .kind = NG_MATMUL_DINP, .N = 111, .IC = 4 * C776, .OC = C776, .gelu = 1,
	.calls = 1, .determinism = 1, .own = 1)
MM_TEST(dinp_dgelu_own_offset16_n1, .kind = NG_MATMUL_DINP, .N = 1, .IC = 4 * C776, .OC = C776,
	.gelu = 1, .calls = 1, .offset = 16, .own = 1)
MM_TEST(dinp_head_vp, .kind = NG_MATMUL_DINP, .N = 24, .IC = C776, .OC = VP, .calls = 1)
MM_TEST(dw_bias_accumulate, .kind = NG_MATMUL_DW, .N = 111, .IC = C776, .OC = 3 * C776, .bias = 1,
	.accumulate = 1, .calls = 2, .determinism = 1)
MM_TEST(dw_bias_accumulate_n1, .kind = NG_MATMUL_DW, .N = 1, .IC = C776, .OC = 4 * C776, .bias = 1,
	.accumulate = 1, .calls = 2)
MM_TEST(dw_bias_accumulate_offset16_autotune, .kind = NG_MATMUL_DW, .N = 96, .IC = 4 * C776,
	.OC = C776, .bias = 1, .accumulate = 1, .autotune = 1, .calls = 2, .offset = 16,
	.mean = 1.0)
MM_TEST(dw_head_accumulate_vp, .kind = NG_MATMUL_DW, .N = 24, .IC = C776, .OC = VP, .accumulate = 1,
	.calls = 2)
MM_TEST(dw_colsum_accumulate_autotune, .kind = NG_MATMUL_DW, .N = 111, .IC = C776, .OC = 3 * C776,
	.bias = 1, .accumulate = 1, .autotune = 1, .calls = 2, .determinism = 1, .colsum = 1)
MM_TEST(dw_colsum_overwrite_n1, .kind = NG_MATMUL_DW, .N = 1, .IC = 4 * C776, .OC = C776, .bias = 1,
	.calls = 2, .offset = 16, .colsum = 1)
MM_TEST(dw_bias_overwrite, .kind = NG_MATMUL_DW, .N = 111, .IC = 4 * C776, .OC = C776, .bias = 1,
	.calls = 2)

Test(matmul, bad_inputs_fail_cleanly)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_matmul_ctx ctx;
	struct ng_matmul mm;
	cr_assert(!ng_matmul_ctx_init(&ctx, (size_t)32 << 20), "%s", ng_error_message());
	struct ng_matmul_spec bad = {NG_MATMUL_FWD, 4, 770, 768, 0, 1, 0, 0, 0, 0, 0};
	cr_expect_eq(ng_matmul_plan(&mm, &ctx, &bad), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "IC=770") != NULL, "message: %s", ng_error_message());
	ng_clear_error();
	struct ng_matmul_spec dwgelu = {NG_MATMUL_DW, 4, 768, 768, 1, 0, 0, 0, 0, 0, 0};
	cr_expect_eq(ng_matmul_plan(&mm, &ctx, &dwgelu), NG_ERR_INPUT);
	ng_clear_error();
	struct ng_matmul_spec ok = {NG_MATMUL_FWD, 4, 768, 768, 0, 1, 0, 0, 0, 0, 0};
	cr_assert(!ng_matmul_plan(&mm, &ctx, &ok), "%s", ng_error_message());
	void *p;
	cr_assert(!NG_CUDA_CHECK(cudaMalloc(&p, (size_t)1 << 20)));
	char *q = (char *)p + 8; /* misaligned by 8 bytes */
	cr_expect_eq(ng_matmul_run(&mm, p, q, p, p, NULL, NULL, p, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "misaligned") != NULL, "message: %s",
		  ng_error_message());
	ng_clear_error();
	cr_expect_eq(ng_matmul_run(&mm, p, p, p, NULL, NULL, NULL, p, 0), NG_ERR_INPUT); /* bias */
	ng_clear_error();
	ng_matmul_free(&mm);
	struct ng_matmul_spec own_fwd = {NG_MATMUL_FWD, 4, 768, 768, 1, 0, 0, 0, 0, 1, 0};
	cr_expect_eq(ng_matmul_plan(&mm, &ctx, &own_fwd), NG_ERR_INPUT); /* own: DINP + gelu only */
	cr_expect(strstr(ng_error_message(), "own is for") != NULL, "%s", ng_error_message());
	ng_clear_error();
	struct ng_matmul_spec dwb = {NG_MATMUL_DW, 4, 768, 768, 0, 1, 1, 0, 0, 0, 0};
	cr_assert(!ng_matmul_plan(&mm, &ctx, &dwb), "%s", ng_error_message());
	cr_assert(mm.workspace_need > 0); /* colsum's 3.0 vector lives there */
	cr_expect_eq(ng_matmul_run(&mm, p, p, p, NULL, NULL, p, (char *)p + 16, 0), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "workspace") != NULL, "message: %s",
		  ng_error_message());
	ng_clear_error();
	cudaFree(p);
	ng_matmul_free(&mm);
	ng_matmul_ctx_free(&ctx);
}
