/*
 * tests/test_decode_spr.c — the speedrun model's one-token decode kernels (kernels/decode_spr.h)
 * against the double-precision references of graph/cpu_spr_ops.h, each kernel alone, on fresh
 * seeded random inputs (the seed is printed with any failure) and odd shapes.
 *
 * Tolerances (tests/kernel_testing.h), the outputs being fp32:
 *  - the RMSNorms (of the bf16 embedding row, of an fp32 row) and QK-norm + rotary are
 *    reductions: the FlashAttention rule, max |kernel - fp64| <= 2 max |naive fp32 - fp64| +
 *    atol, the naive being the plain fp32 loop of the kernel's formula on the same inputs (for
 *    the rotary: the fp32 frequencies and the fp32 angle pos * freq the kernel documents, so
 *    the angle's rounding, up to 2^-23 theta at large positions, is in both); atol 1e-5 of
 *    max(1, the largest |reference|) as tests/test_decode.c (rsqrtf and sincosf are within
 *    2 ulp on the device, the host's within 1);
 *  - the mix and the soft cap are elementwise: the same rule with atol 2^-21 of the largest
 *    |reference| (a few fp32 ulps: two products and a sum, or expf and a division).
 * The embedding also checks that x and x0 hold the same bits and the document start rule; the
 * rotary that the value mixing with and without a value embedding is applied to v.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_spr_ops.h"
#include "graph/gpt.h"
#include "kernels/check.h"
#include "kernels/decode_spr.h"
#include "tests/kernel_testing.h"

#define EPS ((float)NG_SPR_RMS_EPS)

static void need_gpu(void)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
}

/* naive fp32 RMSNorm of a row: one sequential sum, 1 / sqrtf */
static void naive_rmsnorm(double *out, const float *x, int C)
{
	float ss = 0;
	for (int c = 0; c < C; c++)
		ss += x[c] * x[c];
	float rs = 1.0f / sqrtf(ss / (float)C + EPS);
	for (int c = 0; c < C; c++)
		out[c] = x[c] * rs;
}

/* ---- embedding + RMSNorm + document start ---- */

struct embed_case {
	int V, C, pos;
	int at_bos;    /* tokens[pos] is bos = V - 1 */
	int doc_start; /* the value *doc_start holds before */
};

static void embed_case(const struct embed_case *c)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const size_t C = (size_t)c->C;
	const int Tmax = c->pos + 1;
	ng_bf16 *wte = kt_xmalloc((size_t)c->V * C * 2);
	double *wte_d = kt_xmalloc((size_t)c->V * C * 8), *ref = kt_xmalloc(C * 8);
	double *naive = kt_xmalloc(C * 8);
	kt_fill_bf16(&r, wte, wte_d, (size_t)c->V * C, 0.0, 1.0);
	int32_t *tok = kt_xmalloc((size_t)Tmax * 4);
	for (int t = 0; t < Tmax; t++)
		tok[t] = (int32_t)ng_rng_below(&r, (uint64_t)c->V - 1);
	if (c->at_bos)
		tok[c->pos] = c->V - 1;
	const int32_t row = tok[c->pos];
	ng_ref_rmsnorm_fwd(ref, NULL, wte_d + (size_t)row * C, 1, c->C, NG_SPR_RMS_EPS);
	float *xr = kt_xmalloc(C * 4);
	for (size_t i = 0; i < C; i++)
		xr[i] = (float)wte_d[(size_t)row * C + i];
	naive_rmsnorm(naive, xr, c->C);
	void *d_wte = kt_upload(wte, (size_t)c->V * C * 2);
	int32_t *d_tok = kt_upload(tok, (size_t)Tmax * 4);
	int *d_pos = kt_device_int(c->pos), *d_doc = kt_device_int(c->doc_start);
	float *d_x = kt_upload(NULL, C * 4), *d_x0 = kt_upload(NULL, C * 4);
	float *x = kt_xmalloc(C * 4), *x0 = kt_xmalloc(C * 4);
	kt_ok(ng_decode_spr_embed(d_x, d_x0, d_doc, d_wte, d_tok, d_pos, c->V - 1, c->C, EPS, 0),
	      "ng_decode_spr_embed");
	kt_download(x, d_x, C * 4);
	kt_download(x0, d_x0, C * 4);
	double *got = kt_f2d(x, C);
	char what[128];
	snprintf(what, sizeof(what), "decode_spr_embed V=%d C=%d pos=%d bos %d", c->V, c->C,
		 c->pos, c->at_bos);
	check_fa_(what, seed, got, naive, ref, C, 1e-5 * kt_ref_scale(ref, C));
	cr_expect(memcmp(x, x0, C * 4) == 0, "%s: x and x0 differ; seed %llu", what,
		  (unsigned long long)seed);
	int want = c->pos == 0 || c->at_bos ? c->pos : c->doc_start;
	cr_expect_eq(kt_read_int(d_doc), want, "%s: document start %d, expected %d", what,
		     kt_read_int(d_doc), want);
	cr_expect_eq(kt_read_int(d_pos), c->pos, "%s: the position must not change", what);
	cudaFree(d_wte), cudaFree(d_tok), cudaFree(d_pos), cudaFree(d_doc), cudaFree(d_x);
	cudaFree(d_x0);
	free(wte), free(wte_d), free(ref), free(naive), free(tok), free(xr), free(x), free(x0);
	free(got);
}

Test(decode_spr, embed_matches_reference)
{
	need_gpu();
	static const struct embed_case cases[] = {
		{ .V = 50, .C = 8, .pos = 0, .at_bos = 0, .doc_start = 7 },
		{ .V = 512, .C = 64, .pos = 300, .at_bos = 1, .doc_start = 12 },
		{ .V = 512, .C = 64, .pos = 301, .at_bos = 0, .doc_start = 300 },
		{ .V = 50257, .C = 64, .pos = 77, .at_bos = 1, .doc_start = 3 },
		{ .V = 300, .C = 768, .pos = 77, .at_bos = 0, .doc_start = 3 },
		{ .V = 9, .C = 1000, .pos = 4, .at_bos = 1, .doc_start = 0 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		embed_case(&cases[i]);
}

/* ---- RMSNorm of one row ---- */

Test(decode_spr, rmsnorm_matches_reference)
{
	need_gpu();
	static const int Cs[] = { 1, 77, 768, 4099 };
	static const double means[] = { 0.0, 3.0, 0.5, 100.0 };
	for (int k = 0; k < 4; k++) {
		uint64_t seed = kt_seed();
		struct ng_rng r;
		ng_rng_seed(&r, seed);
		const size_t C = (size_t)Cs[k];
		float *x = kt_xmalloc(C * 4), *out = kt_xmalloc(C * 4);
		double *x_d = kt_xmalloc(C * 8), *ref = kt_xmalloc(C * 8), *naive = kt_xmalloc(C * 8);
		kt_fill_f32(&r, x, x_d, C, means[k], 2.0);
		ng_ref_rmsnorm_fwd(ref, NULL, x_d, 1, Cs[k], NG_SPR_RMS_EPS);
		naive_rmsnorm(naive, x, Cs[k]);
		float *d_x = kt_upload(x, C * 4), *d_out = kt_upload(NULL, C * 4);
		kt_ok(ng_decode_rmsnorm(d_out, d_x, Cs[k], EPS, 0), "ng_decode_rmsnorm");
		kt_download(out, d_out, C * 4);
		double *got = kt_f2d(out, C);
		char what[64];
		snprintf(what, sizeof(what), "decode_rmsnorm C=%d mean=%g", Cs[k], means[k]);
		check_fa_(what, seed, got, naive, ref, C, 1e-5 * kt_ref_scale(ref, C));
		cudaFree(d_x), cudaFree(d_out);
		free(x), free(out), free(x_d), free(ref), free(naive), free(got);
	}
}

/* ---- the scalar mix ---- */

struct mix_case {
	int n;
	int a, b, w;  /* a, b device scalars (else 1.0); w present */
	int in_place; /* out = u */
};

static void mix_case(const struct mix_case *c)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const size_t n = (size_t)c->n;
	float *u = kt_xmalloc(n * 4), *w = kt_xmalloc(n * 4), *out = kt_xmalloc(n * 4);
	double *u_d = kt_xmalloc(n * 8), *w_d = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8);
	double *naive = kt_xmalloc(n * 8);
	kt_fill_f32(&r, u, u_d, n, 0.0, 1.0);
	kt_fill_f32(&r, w, w_d, n, 0.5, 2.0);
	float a = c->a ? (float)(1.0 + 0.3 * ng_rng_normal(&r)) : 1.0f;
	float b = c->b ? (float)(0.5 * ng_rng_normal(&r)) : 1.0f;
	ng_ref_mix2_fwd(ref, a, u_d, b, c->w ? w_d : NULL, n);
	for (size_t i = 0; i < n; i++)
		naive[i] = a * u[i] + (c->w ? b * w[i] : 0.0f);
	float *d_u = kt_upload(u, n * 4), *d_w = kt_upload(w, n * 4);
	float *d_out = c->in_place ? d_u : kt_upload(NULL, n * 4);
	float *d_a = kt_upload(&a, 4), *d_b = kt_upload(&b, 4);
	kt_ok(ng_decode_mix2(d_out, c->a ? d_a : NULL, d_u, c->b ? d_b : NULL, c->w ? d_w : NULL,
			     c->n, 0),
	      "ng_decode_mix2");
	kt_download(out, d_out, n * 4);
	double *got = kt_f2d(out, n);
	char what[96];
	snprintf(what, sizeof(what), "decode_mix2 n=%d a %d b %d w %d in place %d", c->n, c->a,
		 c->b, c->w, c->in_place);
	check_fa_(what, seed, got, naive, ref, n, ldexp(kt_ref_scale(ref, n), -21));
	cudaFree(d_u), cudaFree(d_w), cudaFree(d_a), cudaFree(d_b);
	if (!c->in_place)
		cudaFree(d_out);
	free(u), free(w), free(out), free(u_d), free(w_d), free(ref), free(naive), free(got);
}

Test(decode_spr, mix2_matches_reference)
{
	need_gpu();
	static const struct mix_case cases[] = {
		{ .n = 1, .a = 1, .b = 1, .w = 1 },
		{ .n = 768, .a = 1, .b = 1, .w = 1, .in_place = 1 },
		{ .n = 777, .b = 1, .w = 1, .in_place = 1 }, /* the U-net add */
		{ .n = 64 },                                 /* a copy */
		{ .n = 300, .a = 1 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		mix_case(&cases[i]);
}

/* ---- QK-norm + rotary + value mixing ---- */

struct qk_case {
	int H, D, pos;
	int ve; /* with a value embedding */
};

static void qk_case(const struct qk_case *c)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const int H = c->H, D = c->D, C = H * D, V = 37, half = D / 2, q4 = D / 4;
	const size_t C3 = 3 * (size_t)C;
	float *qkv = kt_xmalloc(C3 * 4), *out = kt_xmalloc(C3 * 4);
	double *qkv_d = kt_xmalloc(C3 * 8), *ref = kt_xmalloc(C3 * 8), *naive = kt_xmalloc(C3 * 8);
	ng_bf16 *ve = kt_xmalloc((size_t)V * C * 2);
	double *ve_d = kt_xmalloc((size_t)V * C * 8);
	kt_fill_f32(&r, qkv, qkv_d, C3, 0.3, 1.5);
	kt_fill_bf16(&r, ve, ve_d, (size_t)V * C, 0.0, 1.0);
	const int32_t tok = (int32_t)ng_rng_below(&r, V);
	float a0 = (float)(0.5 + 0.3 * ng_rng_normal(&r)), a1 = (float)(0.5 + 0.3 * ng_rng_normal(&r));
	const double *e = c->ve ? ve_d + (size_t)tok * C : NULL;
	ng_ref_qk_norm_rotary_at(ref, qkv_d, c->pos, H, D, NG_SPR_RMS_EPS);
	ng_ref_mix2_fwd(ref + 2 * C, a0, qkv_d + 2 * C, a1, e, (size_t)C);
	for (int j = 0; j < 2 * H; j++) { /* naive fp32 with the kernel's fp32 angles */
		const float *x = qkv + (size_t)j * D;
		float ss = 0;
		for (int d = 0; d < D; d++)
			ss += x[d] * x[d];
		float rs = 1.0f / sqrtf(ss / (float)D + EPS);
		for (int i = 0; i < half; i++) {
			float y1 = x[i] * rs, y2 = x[i + half] * rs;
			if (i < q4) {
				float f = q4 == 1 ? 1.0f : (float)exp2(-10.0 * i / (q4 - 1));
				float th = (float)c->pos * f;
				float cn = cosf(th), sn = sinf(th);
				float r1 = y1 * cn + y2 * sn, r2 = -y1 * sn + y2 * cn;
				y1 = r1;
				y2 = r2;
			}
			naive[(size_t)j * D + i] = y1;
			naive[(size_t)j * D + i + half] = y2;
		}
	}
	for (int d = 0; d < C; d++)
		naive[2 * C + d] = a0 * qkv[2 * C + d] + (e ? a1 * (float)e[d] : 0.0f);
	float *d_qkv = kt_upload(qkv, C3 * 4), *d_a0 = kt_upload(&a0, 4), *d_a1 = kt_upload(&a1, 4);
	void *d_ve = kt_upload(ve, (size_t)V * C * 2);
	int32_t *tokens = kt_xmalloc(((size_t)c->pos + 1) * 4); /* the kernel reads tokens[pos] */
	for (int t = 0; t <= c->pos; t++)
		tokens[t] = t == c->pos ? tok : -1;
	int32_t *d_tok = kt_upload(tokens, ((size_t)c->pos + 1) * 4);
	int *d_pos = kt_device_int(c->pos);
	kt_ok(ng_decode_spr_qk_rotary(d_qkv, c->ve ? d_ve : NULL, d_tok, d_pos, d_a0, d_a1, H, D,
				      EPS, 0),
	      "ng_decode_spr_qk_rotary");
	kt_download(out, d_qkv, C3 * 4);
	double *got = kt_f2d(out, C3);
	char what[96];
	snprintf(what, sizeof(what), "decode_spr_qk_rotary H=%d D=%d pos=%d ve %d", H, D, c->pos,
		 c->ve);
	check_fa_(what, seed, got, naive, ref, 2 * (size_t)C, 1e-5 * kt_ref_scale(ref, 2 * (size_t)C));
	char whatv[112];
	snprintf(whatv, sizeof(whatv), "%s (v)", what);
	check_fa_(whatv, seed, got + 2 * C, naive + 2 * C, ref + 2 * C, (size_t)C,
		  ldexp(kt_ref_scale(ref + 2 * C, (size_t)C), -21));
	cudaFree(d_qkv), cudaFree(d_a0), cudaFree(d_a1), cudaFree(d_ve), cudaFree(d_tok);
	cudaFree(d_pos);
	free(qkv), free(out), free(qkv_d), free(ref), free(naive), free(ve), free(ve_d);
	free(tokens), free(got);
}

Test(decode_spr, qk_rotary_matches_reference)
{
	need_gpu();
	static const struct qk_case cases[] = {
		{ .H = 1, .D = 8, .pos = 0, .ve = 1 },       /* D/4 = 2 */
		{ .H = 2, .D = 32, .pos = 399, .ve = 1 },    /* speedrun-tiny */
		{ .H = 3, .D = 40, .pos = 17, .ve = 0 },     /* D/4 = 10, D/2 not a power of 2 */
		{ .H = 6, .D = 128, .pos = 49151, .ve = 1 }, /* the model's last position */
		{ .H = 2, .D = 256, .pos = 1000, .ve = 0 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		qk_case(&cases[i]);
}

/* ---- the soft cap ---- */

Test(decode_spr, softcap_matches_reference)
{
	need_gpu();
	static const int ns[] = { 1, 512, 50304 };
	for (int k = 0; k < 3; k++) {
		uint64_t seed = kt_seed();
		struct ng_rng r;
		ng_rng_seed(&r, seed);
		const size_t n = (size_t)ns[k];
		const double cap = NG_SPR_SOFTCAP, div = NG_SPR_SOFTCAP_DIV * sqrt(768.0);
		float *z = kt_xmalloc(n * 4), *out = kt_xmalloc(n * 4);
		double *z_d = kt_xmalloc(n * 8), *ref = kt_xmalloc(n * 8), *naive = kt_xmalloc(n * 8);
		kt_fill_f32(&r, z, z_d, n, 0.0, 3.0 * div); /* across the sigmoid's whole range */
		ng_ref_softcap_fwd(ref, z_d, n, cap, div);
		for (size_t i = 0; i < n; i++)
			naive[i] = (float)cap / (1.0f + expf(-z[i] / (float)div));
		float *d_z = kt_upload(z, n * 4);
		kt_ok(ng_decode_softcap(d_z, ns[k], (float)cap, (float)div, 0), "ng_decode_softcap");
		kt_download(out, d_z, n * 4);
		double *got = kt_f2d(out, n);
		char what[48];
		snprintf(what, sizeof(what), "decode_softcap n=%d", ns[k]);
		check_fa_(what, seed, got, naive, ref, n, ldexp(kt_ref_scale(ref, n), -21));
		cudaFree(d_z);
		free(z), free(out), free(z_d), free(ref), free(naive), free(got);
	}
}

/* Bad shapes and scalars fail before any launch (no GPU needed). */
Test(decode_spr, bad_arguments_are_input_errors)
{
	float *p = (float *)(uintptr_t)4096;
	int *i = (int *)(uintptr_t)8192;
	int32_t *t = (int32_t *)(uintptr_t)8192;
	ng_bf16 *w = (ng_bf16 *)(uintptr_t)8192;
	cr_expect_eq(ng_decode_spr_embed(p, p, i, w, t, i, 1, 12, EPS, 0), NG_ERR_INPUT, "C % 8");
	ng_clear_error();
	cr_expect_eq(ng_decode_rmsnorm(p, p, 64, EPS, 0), NG_ERR_INPUT, "out == x");
	ng_clear_error();
	cr_expect_eq(ng_decode_mix2(p, NULL, p, NULL, NULL, 0, 0), NG_ERR_INPUT, "n 0");
	ng_clear_error();
	cr_expect_eq(ng_decode_spr_qk_rotary(p, NULL, t, i, p, p, 2, 12, EPS, 0), NG_ERR_INPUT,
		     "D 12");
	ng_clear_error();
	cr_expect_eq(ng_decode_spr_qk_rotary(p, NULL, t, i, NULL, p, 2, 32, EPS, 0), NG_ERR_INPUT,
		     "a0 NULL");
	ng_clear_error();
	cr_expect_eq(ng_decode_softcap(p, 10, 0.0f, 1.0f, 0), NG_ERR_INPUT, "cap 0");
	ng_clear_error();
}
