/*
 * tests/test_decode.c — the one-token generation kernels of `nanograph sample` (kernels/decode.h)
 * against the double-precision references of graph/cpu_ops.h (and cpu_spr_ops.h for the
 * speedrun mask), each kernel alone, on fresh seeded random inputs (the seed is printed with any
 * failure) and odd shapes.
 *
 * Tolerances (tests/kernel_testing.h): the outputs are fp32, so
 *  - the embedding, one fp32 rounding of the exact sum of two bf16 values: |got - ref| <=
 *    2^-24 |ref| (half an fp32 ulp);
 *  - LayerNorm, the GEMV (with bias, GELU or relu^2, the residual add) and attention (causal,
 *    and the speedrun model's document and window bound with its scale) are reductions: the
 *    FlashAttention rule, max |kernel - fp64| <= 2 max |naive fp32 - fp64| + atol, the naive
 *    being the plain fp32 loop over the same inputs in the same formula; atol 1e-5 of
 *    max(1, the largest |reference|), the fp32 atol of tests/test_attention.c (the device's
 *    rsqrtf, expf and tanhf are within 2 ulp, the host's within 1, and a scale of 1/sqrt(D)
 *    off by 2 ulp moves every score: errors the naive does not make);
 *  - the sampler picks integers: greedy and top_k = 1 the argmax (ties to the lower index);
 *    with a temperature, the token whose slice of the cumulative distribution (in the kernel's
 *    order, fp64 here) holds the uniform number the kernel hashes from (seed, position), within
 *    the worst-case error of the kernel's fp32 sums (2^-23 of the total a term summed in a
 *    row); only the top_k largest logits ever; a prompt position is never overwritten, and
 *    the position always advances.
 * The attention test also checks that the cache rows of the position are the k and v of qkv
 * bit for bit and that no other row changes.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_ops.h"
#include "graph/cpu_spr_ops.h"
#include "kernels/check.h"
#include "kernels/decode.h"
#include "tests/kernel_testing.h"

static void need_gpu(void)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
}

/* The atol of an fp32 output: 1e-5 of max(1, max |ref|). */
static double fp32_atol(const double *ref, size_t n)
{
	return 1e-5 * kt_ref_scale(ref, n);
}

/* ---- embedding ---- */

struct embed_case {
	int V, C, Tmax, pos;
};

static void embed_case(const struct embed_case *c)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const size_t C = (size_t)c->C;
	ng_bf16 *wte = kt_xmalloc((size_t)c->V * C * 2), *wpe = kt_xmalloc((size_t)c->Tmax * C * 2);
	double *wte_d = kt_xmalloc((size_t)c->V * C * 8), *wpe_d = kt_xmalloc((size_t)c->Tmax * C * 8);
	kt_fill_bf16(&r, wte, wte_d, (size_t)c->V * C, 0.0, 1.0);
	kt_fill_bf16(&r, wpe, wpe_d, (size_t)c->Tmax * C, 0.0, 0.3);
	int32_t *tok = kt_xmalloc((size_t)c->Tmax * 4);
	for (int t = 0; t < c->Tmax; t++)
		tok[t] = (int32_t)ng_rng_below(&r, (uint64_t)c->V);
	void *d_wte = kt_upload(wte, (size_t)c->V * C * 2), *d_wpe = kt_upload(wpe, (size_t)c->Tmax * C * 2);
	int32_t *d_tok = kt_upload(tok, (size_t)c->Tmax * 4);
	int *d_pos = kt_device_int(c->pos);
	float *d_x = kt_upload(NULL, C * 4), *x = kt_xmalloc(C * 4);
	kt_ok(ng_decode_embed(d_x, d_wte, d_wpe, d_tok, d_pos, c->C, 0), "ng_decode_embed");
	kt_download(x, d_x, C * 4);
	size_t bad = C;
	for (size_t i = 0; i < C && bad == C; i++) {
		double ref = wte_d[(size_t)tok[c->pos] * C + i] + wpe_d[(size_t)c->pos * C + i];
		if (fabs(x[i] - ref) > ldexp(fabs(ref), -24))
			bad = i;
	}
	cr_expect(bad == C, "decode_embed V=%d C=%d pos=%d: channel %zu is %.9g, reference %.9g; "
		  "seed %llu", c->V, c->C, c->pos, bad, bad < C ? x[bad] : 0.0,
		  bad < C ? wte_d[(size_t)tok[c->pos] * C + bad] + wpe_d[(size_t)c->pos * C + bad] : 0.0,
		  (unsigned long long)seed);
	cudaFree(d_wte), cudaFree(d_wpe), cudaFree(d_tok), cudaFree(d_pos), cudaFree(d_x);
	free(wte), free(wpe), free(wte_d), free(wpe_d), free(tok), free(x);
}

Test(decode, embed_matches_reference)
{
	need_gpu();
	static const struct embed_case cases[] = {
		{ .V = 50, .C = 77, .Tmax = 9, .pos = 0 },
		{ .V = 301, .C = 768, .Tmax = 64, .pos = 63 },
		{ .V = 7, .C = 1600, .Tmax = 5, .pos = 3 },
		{ .V = 3, .C = 1, .Tmax = 2, .pos = 1 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		embed_case(&cases[i]);
}

/* ---- LayerNorm of one row ---- */

struct ln_case {
	int C;
	double mean; /* of the row: large means test the centred variance */
};

static void ln_case(const struct ln_case *c)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const size_t C = (size_t)c->C;
	float *x = kt_xmalloc(C * 4), *out = kt_xmalloc(C * 4);
	double *x_d = kt_xmalloc(C * 8), *w_d = kt_xmalloc(C * 8), *b_d = kt_xmalloc(C * 8);
	double *ref = kt_xmalloc(C * 8), *naive = kt_xmalloc(C * 8), mref, rref;
	ng_bf16 *w = kt_xmalloc(C * 2), *b = kt_xmalloc(C * 2);
	kt_fill_f32(&r, x, x_d, C, c->mean, 2.0);
	kt_fill_bf16(&r, w, w_d, C, 1.0, 0.2);
	kt_fill_bf16(&r, b, b_d, C, 0.0, 0.2);
	ng_ref_layernorm_fwd(ref, &mref, &rref, x_d, w_d, b_d, 1, c->C);
	float s = 0, v = 0; /* naive fp32: the kernel's formula, one sequential loop */
	for (size_t i = 0; i < C; i++)
		s += x[i];
	float mean = s / (float)c->C;
	for (size_t i = 0; i < C; i++)
		v += (x[i] - mean) * (x[i] - mean);
	float rstd = 1.0f / sqrtf(v / (float)c->C + 1e-5f);
	for (size_t i = 0; i < C; i++)
		naive[i] = (x[i] - mean) * rstd * (float)w_d[i] + (float)b_d[i];
	float *d_x = kt_upload(x, C * 4), *d_out = kt_upload(NULL, C * 4);
	void *d_w = kt_upload(w, C * 2), *d_b = kt_upload(b, C * 2);
	kt_ok(ng_decode_layernorm(d_out, d_x, d_w, d_b, c->C, 0), "ng_decode_layernorm");
	kt_download(out, d_out, C * 4);
	double *got = kt_f2d(out, C);
	char what[96];
	snprintf(what, sizeof(what), "decode_layernorm C=%d mean=%g", c->C, c->mean);
	check_fa_(what, seed, got, naive, ref, C, fp32_atol(ref, C));
	cudaFree(d_x), cudaFree(d_out), cudaFree(d_w), cudaFree(d_b);
	free(x), free(out), free(x_d), free(w_d), free(b_d), free(ref), free(naive), free(w);
	free(b), free(got);
}

Test(decode, layernorm_matches_reference)
{
	need_gpu();
	static const struct ln_case cases[] = {
		{ .C = 1, .mean = 0.0 },     { .C = 77, .mean = 0.0 },   { .C = 255, .mean = 3.0 },
		{ .C = 768, .mean = 0.5 },   { .C = 1600, .mean = 100.0 }, { .C = 4099, .mean = 0.0 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		ln_case(&cases[i]);
}

/* ---- GEMV with bias, GELU and the residual add ---- */

struct gemv_case {
	int IC, OC;
	int bias, act, accumulate; /* act: enum ng_decode_act */
};

static double gelu_d(double x)
{
	return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

static float gelu_f(float x)
{
	return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

static void gemv_case(const struct gemv_case *c)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const size_t IC = (size_t)c->IC, OC = (size_t)c->OC;
	ng_bf16 *W = kt_xmalloc(OC * IC * 2), *bias = kt_xmalloc(OC * 2);
	double *W_d = kt_xmalloc(OC * IC * 8), *b_d = kt_xmalloc(OC * 8), *x_d = kt_xmalloc(IC * 8);
	double *o0_d = kt_xmalloc(OC * 8), *ref = kt_xmalloc(OC * 8), *naive = kt_xmalloc(OC * 8);
	float *x = kt_xmalloc(IC * 4), *o0 = kt_xmalloc(OC * 4), *out = kt_xmalloc(OC * 4);
	kt_fill_bf16(&r, W, W_d, OC * IC, 0.0, 1.0 / sqrt((double)IC));
	kt_fill_bf16(&r, bias, b_d, OC, 0.0, 0.5);
	kt_fill_f32(&r, x, x_d, IC, 0.0, 1.0);
	kt_fill_f32(&r, o0, o0_d, OC, 0.0, 1.0); /* what out holds before: the residual */
	for (size_t o = 0; o < OC; o++) {
		double y = c->bias ? b_d[o] : 0.0;
		float yf = 0.0f;
		for (size_t i = 0; i < IC; i++) {
			y += W_d[o * IC + i] * x_d[i];
			yf += (float)W_d[o * IC + i] * x[i];
		}
		if (c->bias)
			yf += (float)b_d[o];
		if (c->act == NG_DECODE_ACT_GELU) {
			y = gelu_d(y);
			yf = gelu_f(yf);
		} else if (c->act == NG_DECODE_ACT_RELU2) {
			y = y > 0 ? y * y : 0;
			yf = yf > 0 ? yf * yf : 0;
		}
		ref[o] = c->accumulate ? o0_d[o] + y : y;
		naive[o] = c->accumulate ? o0[o] + yf : yf;
	}
	void *d_W = kt_upload(W, OC * IC * 2), *d_b = kt_upload(bias, OC * 2);
	float *d_x = kt_upload(x, IC * 4), *d_out = kt_upload(o0, OC * 4);
	kt_ok(ng_decode_gemv(d_out, d_W, c->bias ? d_b : NULL, d_x, c->IC, c->OC, c->act,
			     c->accumulate, 0),
	      "ng_decode_gemv");
	kt_download(out, d_out, OC * 4);
	double *got = kt_f2d(out, OC);
	char what[128];
	snprintf(what, sizeof(what), "decode_gemv IC=%d OC=%d bias %d act %d accumulate %d", c->IC,
		 c->OC, c->bias, c->act, c->accumulate);
	check_fa_(what, seed, got, naive, ref, OC, fp32_atol(ref, OC));
	cudaFree(d_W), cudaFree(d_b), cudaFree(d_x), cudaFree(d_out);
	free(W), free(bias), free(W_d), free(b_d), free(x_d), free(o0_d), free(ref), free(naive);
	free(x), free(o0), free(out), free(got);
}

Test(decode, gemv_matches_reference)
{
	need_gpu();
	static const struct gemv_case cases[] = {
		{ .IC = 8, .OC = 1 },
		{ .IC = 776, .OC = 37, .bias = 1 },
		{ .IC = 200, .OC = 301, .bias = 1, .act = NG_DECODE_ACT_GELU },
		{ .IC = 3104, .OC = 776, .bias = 1, .accumulate = 1 },
		{ .IC = 768, .OC = 5003 },
		{ .IC = 264, .OC = 9, .act = NG_DECODE_ACT_GELU, .accumulate = 1 },
		{ .IC = 768, .OC = 3072, .act = NG_DECODE_ACT_RELU2 },
		{ .IC = 96, .OC = 45, .bias = 1, .act = NG_DECODE_ACT_RELU2, .accumulate = 1 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		gemv_case(&cases[i]);
}

Test(decode, gemv_rejects_bad_arguments)
{
	float *p = (float *)(uintptr_t)4096;
	ng_bf16 *w = (ng_bf16 *)(uintptr_t)8192;
	cr_expect_eq(ng_decode_gemv(p + 64, w, NULL, p, 12, 4, 0, 0, 0), NG_ERR_INPUT, "IC % 8");
	ng_clear_error();
	cr_expect_eq(ng_decode_gemv(p + 64, w + 1, NULL, p, 16, 4, 0, 0, 0), NG_ERR_INPUT,
		     "W misaligned");
	ng_clear_error();
	cr_expect_eq(ng_decode_gemv(p, w, NULL, p, 16, 4, 0, 0, 0), NG_ERR_INPUT, "out == x");
	ng_clear_error();
	cr_expect_eq(ng_decode_gemv(p + 64, w, NULL, p, 16, 4, 3, 0, 0), NG_ERR_INPUT, "act 3");
	ng_clear_error();
}

/* ---- attention over the KV cache ---- */

struct att_case {
	int H, D, Tmax, pos;
	int masked;    /* ng_decode_attention_masked with scale 0.12 (else the causal entry) */
	int doc_start; /* masked: the current document's start (<= pos) */
	int window;    /* masked: tokens, 0 = none */
	int block;     /* masked: the window's granularity (0 or 1: tokens) */
};

static void att_case(const struct att_case *c)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const int H = c->H, D = c->D, C = H * D, T = c->pos + 1;
	const size_t Cs = (size_t)C, cache = (size_t)c->Tmax * Cs;
	/* positions 0..pos: qkv rows in fp32; the caches hold k, v of 0..pos-1 (the earlier
	 * tokens' decode steps wrote them) and noise in the rows after */
	float *qkv = kt_xmalloc((size_t)T * 3 * Cs * 4), *kc = kt_xmalloc(cache * 4),
	      *vc = kt_xmalloc(cache * 4), *out = kt_xmalloc(Cs * 4);
	double *qkv_d = kt_xmalloc((size_t)T * 3 * Cs * 8), *ref_all = kt_xmalloc((size_t)T * Cs * 8);
	double *lse = kt_xmalloc((size_t)H * T * 8), *naive = kt_xmalloc(Cs * 8);
	kt_fill_f32(&r, qkv, qkv_d, (size_t)T * 3 * Cs, 0.0, 1.0);
	for (size_t i = 0; i < cache; i++) {
		kc[i] = (float)ng_rng_normal(&r);
		vc[i] = (float)ng_rng_normal(&r);
	}
	for (int t = 0; t < c->pos; t++)
		for (int i = 0; i < C; i++) {
			kc[(size_t)t * Cs + i] = qkv[((size_t)t * 3 + 1) * Cs + i];
			vc[(size_t)t * Cs + i] = qkv[((size_t)t * 3 + 2) * Cs + i];
		}
	/* the masked case: keys before doc_start are another document (id 0), the window is the
	 * reference's own; the query sees [lo, pos] */
	int32_t *doc = kt_xmalloc((size_t)T * 4);
	for (int t = 0; t < T; t++)
		doc[t] = c->masked && t >= c->doc_start;
	float scale = c->masked ? 0.12f : 1.0f / sqrtf((float)D);
	int blk = c->block > 1 ? c->block : 1;
	if (c->masked)
		ng_ref_attention_masked_fwd(ref_all, lse, qkv_d, doc, c->window, blk, 0.12, 1, T, H,
					    D);
	else
		ng_ref_attention_fwd(ref_all, lse, qkv_d, 1, T, H, D);
	int lo = c->masked ? c->doc_start : 0;
	/* the window's first key: the start of the block n - 1 blocks before pos's */
	int n = c->window / blk > 0 ? c->window / blk : 1;
	int first = blk == 1 ? c->pos - c->window + 1 : c->pos - c->pos % blk - (n - 1) * blk;
	if (c->masked && c->window > 0 && first > lo)
		lo = first;
	const double *ref = ref_all + (size_t)c->pos * Cs;
	const float *q = qkv + (size_t)c->pos * 3 * Cs;
	float *sc = kt_xmalloc((size_t)T * 4);
	for (int h = 0; h < H; h++) { /* naive fp32: scores, max, exp, weighted sum */
		float mx = -INFINITY, sum = 0;
		for (int t = lo; t < T; t++) {
			float s = 0;
			for (int d = 0; d < D; d++)
				s += q[h * D + d] * qkv[((size_t)t * 3 + 1) * Cs + h * D + d];
			sc[t] = s * scale;
			mx = fmaxf(mx, sc[t]);
		}
		for (int t = lo; t < T; t++) {
			sc[t] = expf(sc[t] - mx);
			sum += sc[t];
		}
		for (int d = 0; d < D; d++) {
			float acc = 0;
			for (int t = lo; t < T; t++)
				acc += sc[t] * qkv[((size_t)t * 3 + 2) * Cs + h * D + d];
			naive[h * D + d] = acc / sum;
		}
	}
	float *d_kc = kt_upload(kc, cache * 4), *d_vc = kt_upload(vc, cache * 4);
	float *d_qkv = kt_upload(q, 3 * Cs * 4), *d_out = kt_upload(NULL, Cs * 4);
	int *d_pos = kt_device_int(c->pos), *d_doc = kt_device_int(c->doc_start);
	if (c->masked)
		kt_ok(ng_decode_attention_masked(d_out, d_kc, d_vc, d_qkv, d_pos, d_doc, c->window,
						 blk, scale, H, D, c->Tmax, 0),
		      "ng_decode_attention_masked");
	else
		kt_ok(ng_decode_attention(d_out, d_kc, d_vc, d_qkv, d_pos, H, D, c->Tmax, 0),
		      "ng_decode_attention");
	float *kc2 = kt_xmalloc(cache * 4), *vc2 = kt_xmalloc(cache * 4);
	kt_download(out, d_out, Cs * 4);
	kt_download(kc2, d_kc, cache * 4);
	kt_download(vc2, d_vc, cache * 4);
	double *got = kt_f2d(out, Cs);
	char what[128];
	snprintf(what, sizeof(what), "decode_attention H=%d D=%d Tmax=%d pos=%d masked %d doc %d "
		 "window %d", H, D, c->Tmax, c->pos, c->masked, c->doc_start, c->window);
	check_fa_(what, seed, got, naive, ref, Cs, fp32_atol(ref, Cs));
	for (int i = 0; i < C; i++) { /* row pos: this token's k and v, bit for bit */
		kc[(size_t)c->pos * Cs + i] = q[Cs + i];
		vc[(size_t)c->pos * Cs + i] = q[2 * Cs + i];
	}
	cr_expect(memcmp(kc, kc2, cache * 4) == 0 && memcmp(vc, vc2, cache * 4) == 0,
		  "%s: the caches are not the old rows with row pos = this token's k, v; seed %llu",
		  what, (unsigned long long)seed);
	cudaFree(d_kc), cudaFree(d_vc), cudaFree(d_qkv), cudaFree(d_out), cudaFree(d_pos);
	cudaFree(d_doc);
	free(qkv), free(kc), free(vc), free(out), free(qkv_d), free(ref_all), free(lse);
	free(naive), free(sc), free(kc2), free(vc2), free(got), free(doc);
}

Test(decode, attention_matches_reference)
{
	need_gpu();
	static const struct att_case cases[] = {
		{ .H = 1, .D = 8, .Tmax = 1, .pos = 0 },
		{ .H = 3, .D = 40, .Tmax = 33, .pos = 5 },
		{ .H = 12, .D = 64, .Tmax = 1024, .pos = 1023 },
		{ .H = 2, .D = 256, .Tmax = 300, .pos = 129 },
		{ .H = 25, .D = 64, .Tmax = 130, .pos = 128 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		att_case(&cases[i]);
}

/* The speedrun model's bound: the window cuts (doc_start earlier), the document does (window
 * wider), neither does (a window beyond the cache, smaller than Tmax's shared memory would
 * need), the query alone (a document starting at pos), the real model's D = 128, and the
 * model's block-granular windows. */
Test(decode, attention_masked_matches_reference)
{
	need_gpu();
	static const struct att_case cases[] = {
		{ .H = 2, .D = 32, .Tmax = 400, .pos = 399, .masked = 1, .doc_start = 10,
		  .window = 128 },
		{ .H = 2, .D = 32, .Tmax = 400, .pos = 300, .masked = 1, .doc_start = 250,
		  .window = 128 },
		{ .H = 6, .D = 128, .Tmax = 2000, .pos = 1999, .masked = 1, .doc_start = 0,
		  .window = 1792 },
		{ .H = 3, .D = 40, .Tmax = 50, .pos = 20, .masked = 1, .doc_start = 20,
		  .window = 256 },
		{ .H = 1, .D = 8, .Tmax = 9, .pos = 8, .masked = 1, .doc_start = 0, .window = 0 },
		/* the model's block window: 2 blocks of 128 (pos 300 sees 128 .. 300), and 14 */
		{ .H = 2, .D = 32, .Tmax = 400, .pos = 300, .masked = 1, .doc_start = 10,
		  .window = 256, .block = 128 },
		{ .H = 6, .D = 128, .Tmax = 2000, .pos = 1999, .masked = 1, .doc_start = 0,
		  .window = 1792, .block = 128 },
		/* a window under one block still sees the query's whole block: 256 .. 300 */
		{ .H = 2, .D = 32, .Tmax = 400, .pos = 300, .masked = 1, .doc_start = 0,
		  .window = 64, .block = 128 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		att_case(&cases[i]);
}

Test(decode, attention_masked_rejects_bad_arguments)
{
	float *p = (float *)(uintptr_t)4096;
	int *i = (int *)(uintptr_t)8192;
	cr_expect_eq(ng_decode_attention_masked(p, p, p, p, i, i, 128, 1, 0.0f, 2, 32, 64, 0),
		     NG_ERR_INPUT, "scale 0");
	ng_clear_error();
	cr_expect_eq(ng_decode_attention_masked(p, p, p, p, i, i, 0, 1, 0.12f, 2, 32, 49152, 0),
		     NG_ERR_INPUT, "no window: 49152 scores do not fit");
	ng_clear_error();
	cr_expect_eq(ng_decode_attention_masked(p, p, p, p, i, i, 128, 0, 0.12f, 2, 32, 64, 0),
		     NG_ERR_INPUT, "block 0");
	ng_clear_error();
}

/* ---- sampling ---- */

/* The kernel's uniform number of position p: splitmix64 of (seed ^ splitmix64(p + 1)), its top
 * 24 bits. */
static uint64_t splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static double uniform_of(uint64_t seed, int p)
{
	uint64_t h = splitmix64(seed ^ splitmix64((uint64_t)p + 1));
	return (double)(h >> 40) / 16777216.0;
}

struct sample_case {
	int V, top_k;
	float temperature;
	int ties; /* logits drawn from few values, so that ties decide ranks */
};

static const float *sort_logits_;
static int by_rank(const void *a, const void *b) /* larger first, ties to the lower index */
{
	int i = *(const int *)a, j = *(const int *)b;
	if (sort_logits_[i] != sort_logits_[j])
		return sort_logits_[i] > sort_logits_[j] ? -1 : 1;
	return (i > j) - (i < j);
}

/* One draw at position p (n_prompt <= p + 1: it is written) and the checks of its token. */
static void sample_case(const struct sample_case *c, int round)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const int V = c->V, Tmax = 16, p = (int)ng_rng_below(&r, Tmax - 1);
	float *logits = kt_xmalloc((size_t)V * 4);
	for (int i = 0; i < V; i++)
		logits[i] = c->ties ? (float)ng_rng_below(&r, 5) : (float)(3.0 * ng_rng_normal(&r));
	int32_t tok[16];
	for (int t = 0; t < Tmax; t++)
		tok[t] = -7;
	float *d_l = kt_upload(logits, (size_t)V * 4);
	int32_t *d_tok = kt_upload(tok, sizeof(tok));
	int *d_pos = kt_device_int(p), *d_np = kt_device_int(round % 2 ? p + 1 : 0);
	kt_ok(ng_decode_sample(d_tok, d_pos, d_np, d_l, V, c->top_k, c->temperature, seed, 0),
	      "ng_decode_sample");
	kt_download(tok, d_tok, sizeof(tok));
	cr_expect_eq(kt_read_int(d_pos), p + 1, "the position advances");
	for (int t = 0; t < Tmax; t++)
		if (t != p + 1)
			cr_expect_eq(tok[t], -7, "token %d changed (only %d may)", t, p + 1);
	const int got = tok[p + 1];
	int *order = kt_xmalloc((size_t)V * sizeof(int));
	for (int i = 0; i < V; i++)
		order[i] = i;
	sort_logits_ = logits;
	qsort(order, (size_t)V, sizeof(int), by_rank);
	const int greedy = c->temperature <= 0.0f, k = greedy ? 1 : c->top_k > 0 ? c->top_k : 0;
	const int kk = k > V ? V : k;
	cr_assert(got >= 0 && got < V, "V=%d top_k=%d T=%g: token %d out of range; seed %llu", V,
		  c->top_k, c->temperature, got, (unsigned long long)seed);
	if (greedy || kk == 1) {
		cr_expect_eq(got, order[0], "V=%d top_k=%d T=%g: %d is not the argmax %d; seed %llu",
			     V, c->top_k, c->temperature, got, order[0], (unsigned long long)seed);
	} else {
		/* the kernel's order: the top-k ranks, or every index in order (top_k = 0) */
		const int n = kk ? kk : V;
		double total = 0, lo = -1, hi = -1, mx = logits[order[0]];
		for (int j = 0; j < n; j++)
			total += exp((logits[kk ? order[j] : j] - mx) / c->temperature);
		double acc = 0;
		for (int j = 0; j < n; j++) {
			int i = kk ? order[j] : j;
			double w = exp((logits[i] - mx) / c->temperature);
			if (i == got) {
				lo = acc;
				hi = acc + w;
			}
			acc += w;
		}
		/* the kernel's fp32 sums: at most `steps` roundings (and expf's) in a row */
		double steps = kk ? 2.0 * kk : (double)((V + 1023) / 1024 + 1024);
		double u = uniform_of(seed, p) * total, tol = steps * ldexp(1.0, -23) * total;
		cr_expect(lo >= 0, "V=%d top_k=%d T=%g: token %d (logit %g) is not among the top %d; "
			  "seed %llu", V, c->top_k, c->temperature, got, logits[got], n,
			  (unsigned long long)seed);
		cr_expect(lo < 0 || (lo <= u + tol && u - tol <= hi),
			  "V=%d top_k=%d T=%g: token %d holds [%.9g, %.9g) of %.9g, the draw is %.9g; "
			  "seed %llu", V, c->top_k, c->temperature, got, lo, hi, total, u,
			  (unsigned long long)seed);
	}
	/* a prompt position is not overwritten, and the position still advances */
	int np = p + 2;
	kt_cuda(cudaMemcpy(d_np, &np, sizeof(np), cudaMemcpyHostToDevice), "H2D");
	kt_cuda(cudaMemcpy(d_pos, &p, sizeof(p), cudaMemcpyHostToDevice), "H2D");
	tok[p + 1] = -7;
	kt_cuda(cudaMemcpy(d_tok, tok, sizeof(tok), cudaMemcpyHostToDevice), "H2D");
	kt_ok(ng_decode_sample(d_tok, d_pos, d_np, d_l, V, c->top_k, c->temperature, seed, 0),
	      "ng_decode_sample");
	kt_download(tok, d_tok, sizeof(tok));
	cr_expect_eq(tok[p + 1], -7, "the prompt's token at %d was overwritten", p + 1);
	cr_expect_eq(kt_read_int(d_pos), p + 1, "the position advances inside the prompt too");
	cudaFree(d_l), cudaFree(d_tok), cudaFree(d_pos), cudaFree(d_np);
	free(logits), free(order);
}

Test(decode, sample_draws_from_the_distribution)
{
	need_gpu();
	static const struct sample_case cases[] = {
		{ .V = 1, .top_k = 0, .temperature = 1.0f },
		{ .V = 997, .top_k = 0, .temperature = 0.0f },
		{ .V = 997, .top_k = 0, .temperature = 0.0f, .ties = 1 },
		{ .V = 3001, .top_k = 1, .temperature = 0.8f, .ties = 1 },
		{ .V = 3001, .top_k = 40, .temperature = 0.7f },
		{ .V = 3001, .top_k = 40, .temperature = 1.0f, .ties = 1 },
		{ .V = 50257, .top_k = NG_DECODE_MAX_TOP_K, .temperature = 1.5f },
		{ .V = 300, .top_k = 1000, .temperature = 1.0f },
		{ .V = 3001, .top_k = 0, .temperature = 1.0f },
		{ .V = 50257, .top_k = 0, .temperature = 0.9f },
		{ .V = 1025, .top_k = 0, .temperature = 2.0f, .ties = 1 },
	};
	for (int round = 0; round < 4; round++)
		for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
			sample_case(&cases[i], round);
}

Test(decode, sample_rejects_bad_arguments)
{
	int *p = (int *)(uintptr_t)4096;
	cr_expect_eq(ng_decode_sample((int32_t *)p, p, p, (const float *)p, 0, 0, 1.0f, 1, 0),
		     NG_ERR_INPUT, "V = 0");
	ng_clear_error();
	cr_expect_eq(ng_decode_sample((int32_t *)p, p, p, (const float *)p, 10,
				      NG_DECODE_MAX_TOP_K + 1, 1.0f, 1, 0),
		     NG_ERR_INPUT, "top_k too large");
	ng_clear_error();
	cr_expect_eq(ng_decode_attention((float *)p, (float *)p, (float *)p, (const float *)p, p, 2,
					 264, 8, 0),
		     NG_ERR_INPUT, "D > 256");
	ng_clear_error();
}
