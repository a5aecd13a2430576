/*
 * tests/test_sample_spr.c — KV-cache generation for the speedrun model (graph/sampler.h,
 * graph/sampler_spr.c) on the GPU, against the double-precision references: the full forward of
 * graph/cpu_spr.h and the one-token decoder of graph/cpu_spr_decode.h.
 *
 * Models: speedrun-tiny (L = 6, H = 2, D = 32, V = Vp = 512, T = 512) and the same with heads of
 * the real model's D = 128 (C = 256), every tensor random (ng_cpu_spr_randomize: the projections
 * and the head non-zero, the scalars off their init). The weight matrices are rounded to bf16
 * (as the sampler's upload rounds them, kernels/split.h) and the scalars kept in fp32 (the
 * sampler reads them in fp32), and the reference reads the very same values: what remains
 * between the two is the decode path's fp32 arithmetic against double.
 *
 * Tolerance: the logits are an fp32 output, so CONTRIBUTING.md's fp32 rule applies to each
 * position's row of V soft-capped logits, taken about the row's mean (the soft cap puts every
 * logit near 15 +- 15, and that common offset, which sampling ignores, would dilute the error):
 * NMSE = sum (got - ref)^2 / sum ref^2 <= 1e-7 on the centred rows. The largest fp32 effect
 * the reference does not share is the rotary angle: theta = pos * freq is formed in fp32
 * (kernels/decode_spr.h, as the training kernel), off by up to 2^-23 theta, i.e. 5e-5 radians
 * for the fastest pair at position 400 and ~2.4e-4 summed over the pairs (the frequencies fall
 * geometrically); with unit-size normed entries a score moves by at most 0.12 x 2 x 2 x 2.4e-4
 * ~ 1e-4, a relative 1e-4 of the attention at worst and ~3e-5 typically (random signs): NMSE
 * ~1e-9, a hundredfold inside the rule.
 *
 * Checks:
 *  - the logits after every position of a 400-token prompt with document starts (bos = V - 1)
 *    match the full forward's at windows W = 1 (128 tokens in every block), W = 2 (256 long,
 *    128 short) and the inference default (the widest, W = 14: all of T);
 *  - greedy generation past the window (W = 1) picks, at every step where the reference
 *    decoder's top-2 margin exceeds twice the step's largest logit difference, the reference's
 *    argmax; the reference is fed the GPU's tokens, so every step is checked; most steps must
 *    have a clear margin;
 *  - graph replay equals eager launches: the same tokens and bit-identical final logits, with
 *    top-k sampling, the whole vocabulary and greedy.
 * Fresh random models every run (the seed is in every message).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "graph/cpu_spr.h"
#include "graph/cpu_spr_decode.h"
#include "graph/cpu_spr_ops.h"
#include "graph/sampler.h"
#include "kernels/check.h"
#include "kernels/split.h"
#include "util/rng.h"

#define PROMPT 400

static uint64_t seed_now(void)
{
	return (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
}

/* fp32 w rounded as the sampler's upload rounds it (the bf16 half of the split master). */
static float as_uploaded(float w)
{
	ng_bf16 hi;
	uint16_t lo;
	ng_split_encode(w, &hi, &lo);
	uint32_t u = (uint32_t)hi << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* A random speedrun model (C = 64 or 256) in m (B = 1 sequence of T tokens) and the float
 * parameters both sides read: matrices at their bf16 values, scalars in fp32. */
static float *random_model(struct ng_cpu_spr_model *m, int C, int T, uint64_t seed)
{
	struct ng_gpt_config cfg;
	cr_assert_eq(ng_gpt_preset(&cfg, "speedrun-tiny"), NG_OK);
	cfg.C = C;
	cr_assert_eq(ng_cpu_spr_init(m, &cfg, 1, T, seed), NG_OK, "%s", ng_error_message());
	ng_cpu_spr_randomize(m, seed + 1);
	const struct ng_param_spec *p = m->lay.p;
	size_t s0 = p[NG_P_XLAMBDA].offset, s1 = p[NG_P_SKIPW].offset + p[NG_P_SKIPW].numel;
	float *f = malloc(m->lay.total * sizeof(float));
	cr_assert(f);
	for (size_t i = 0; i < m->lay.total; i++)
		f[i] = i >= s0 && i < s1 ? (float)m->params[i] : as_uploaded((float)m->params[i]);
	ng_cpu_spr_load_params(m, f);
	return f;
}

/* n random tokens below bos with document starts at a few places (never at 0). */
static void random_prompt(struct ng_rng *r, int32_t *tok, int n, int32_t bos)
{
	for (int i = 0; i < n; i++)
		tok[i] = (int32_t)ng_rng_below(r, (uint64_t)bos);
	for (int k = 1; k < 4; k++)
		tok[k * n / 4 + (int)ng_rng_below(r, (uint64_t)(n / 8))] = bos;
}

/* NMSE of got against ref over a row of n logits, each about its own mean (softmax and sampling
 * see only the differences, and the soft cap's common offset of ~15 would hide errors in
 * them); the largest |got - ref| in *max_abs. */
static double nmse(const float *got, const double *ref, int n, double *max_abs)
{
	double mg = 0, mr = 0, num = 0, den = 0;
	for (int i = 0; i < n; i++) {
		mg += got[i];
		mr += ref[i];
	}
	mg /= n;
	mr /= n;
	*max_abs = 0;
	for (int i = 0; i < n; i++) {
		double e = (got[i] - mg) - (ref[i] - mr);
		num += e * e;
		den += (ref[i] - mr) * (ref[i] - mr);
		*max_abs = fmax(*max_abs, fabs(got[i] - ref[i]));
	}
	return num / fmax(den, 1e-300);
}

static struct ng_sampler_config sampler_cfg(const struct ng_gpt_config *model, int top_k,
					    float temperature, uint64_t seed, bool eager, int W)
{
	return (struct ng_sampler_config){ .model = *model, .top_k = top_k,
					   .temperature = temperature, .seed = seed,
					   .no_graph = eager, .stop_at_eot = false, .window = W };
}

/* The logits after every prompt position, GPU against the full forward, at window W (0: the
 * sampler's default, which the reference takes as ng_spr_window_blocks(1, 1) = 14). */
static void logits_case(int C, int W)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct ng_cpu_spr_model m;
	float *p = random_model(&m, C, PROMPT, seed);
	int V = m.cfg.V, Vp = m.cfg.Vp;
	int32_t *prompt = malloc(sizeof(int32_t) * PROMPT);
	random_prompt(&r, prompt, PROMPT, m.bos);
	int Wref = W > 0 ? W : 14;
	cr_assert_eq(ng_cpu_spr_forward(&m, prompt, NULL, Wref, NULL), NG_OK, "%s",
		     ng_error_message());
	double *ref = malloc(sizeof(double) * PROMPT * Vp);
	ng_ref_softcap_fwd(ref, m.a.logits, (size_t)PROMPT * Vp, NG_SPR_SOFTCAP,
			   NG_SPR_SOFTCAP_DIV * sqrt((double)C));

	struct ng_sampler s;
	struct ng_sampler_config sc = sampler_cfg(&m.cfg, 0, 0.0f, seed, false, W);
	cr_assert_eq(ng_sampler_init(&s, &sc, p), NG_OK, "%s", ng_error_message());
	float *rows = malloc(sizeof(float) * PROMPT * V);
	int32_t next;
	cr_assert_eq(ng_sampler_generate(&s, prompt, PROMPT, 1, &next, NULL, NULL, rows), NG_OK,
		     "%s", ng_error_message());
	double worst = 0, worst_abs = 0;
	for (int t = 0; t < PROMPT; t++) {
		double ma, e = nmse(rows + (size_t)t * V, ref + (size_t)t * Vp, V, &ma);
		worst = fmax(worst, e);
		worst_abs = fmax(worst_abs, ma);
		cr_assert(e <= 1e-7, "seed %llu C %d W %d: position %d: logits NMSE %.3g > 1e-7 "
			  "(max abs %.3g)", (unsigned long long)seed, C, W, t, e, ma);
	}
	cr_log_info("C %d W %d: worst row NMSE %.3g, max abs %.3g over %d positions", C, W, worst,
		    worst_abs, PROMPT);
	ng_sampler_free(&s);
	ng_cpu_spr_free(&m);
	free(rows);
	free(ref);
	free(prompt);
	free(p);
}

Test(sample_spr, decode_logits_match_full_forward, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	logits_case(64, 1);
	logits_case(64, 2);
	logits_case(64, 0);
}

Test(sample_spr, decode_logits_match_full_forward_d128, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	logits_case(256, 1);
	logits_case(256, 0);
}

Test(sample_spr, greedy_matches_reference_decode, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct ng_cpu_spr_model m;
	float *p = random_model(&m, 64, 1, seed);
	const int P = 40, n_new = 320, W = 1, steps = P + n_new - 1;
	int V = m.cfg.V;
	int32_t prompt[40], out[320];
	random_prompt(&r, prompt, P, m.bos);
	struct ng_sampler s;
	struct ng_sampler_config sc = sampler_cfg(&m.cfg, 0, 0.0f, seed, false, W);
	cr_assert_eq(ng_sampler_init(&s, &sc, p), NG_OK, "%s", ng_error_message());
	float *rows = malloc(sizeof(float) * (size_t)steps * V);
	int n = 0;
	cr_assert_eq(ng_sampler_generate(&s, prompt, P, n_new, out, &n, NULL, rows), NG_OK, "%s",
		     ng_error_message());
	cr_assert_eq(n, n_new);

	struct ng_cpu_spr_decoder d;
	cr_assert_eq(ng_cpu_spr_decode_init(&d, &m.cfg, m.params, P + n_new, W), NG_OK, "%s",
		     ng_error_message());
	int clear = 0;
	for (int i = 0; i < steps; i++) {
		int32_t tok = i < P ? prompt[i] : out[i - P];
		cr_assert_eq(ng_cpu_spr_decode_step(&d, tok), NG_OK, "%s", ng_error_message());
		double ma, e = nmse(rows + (size_t)i * V, d.logits, V, &ma);
		cr_assert(e <= 1e-7, "seed %llu: step %d: logits NMSE %.3g > 1e-7",
			  (unsigned long long)seed, i, e);
		if (i < P - 1)
			continue;
		int best = 0;
		for (int v = 1; v < V; v++)
			if (d.logits[v] > d.logits[best])
				best = v;
		double second = -INFINITY;
		for (int v = 0; v < V; v++)
			if (v != best)
				second = fmax(second, d.logits[v]);
		if (d.logits[best] - second <= 2 * ma)
			continue;
		clear++;
		cr_assert_eq(out[i - (P - 1)], best, "seed %llu: generated token %d = %d, the "
			     "reference's argmax %d (margin %.3g, logit error %.3g)",
			     (unsigned long long)seed, i - (P - 1), out[i - (P - 1)], best,
			     d.logits[best] - second, ma);
	}
	cr_assert(clear >= n_new * 9 / 10, "seed %llu: only %d of %d steps had a clear top-2 "
		  "margin", (unsigned long long)seed, clear, n_new);
	cr_log_info("greedy: %d of %d steps checked against the reference argmax", clear, n_new);
	ng_cpu_spr_decode_free(&d);
	ng_sampler_free(&s);
	ng_cpu_spr_free(&m);
	free(rows);
	free(p);
}

Test(sample_spr, graph_replay_equals_eager, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct ng_cpu_spr_model m;
	float *p = random_model(&m, 64, 1, seed);
	const int P = 30, n_new = 300;
	int32_t prompt[30];
	random_prompt(&r, prompt, P, m.bos);
	int top_k[3] = { 1 + (int)ng_rng_below(&r, 50), 0, 0 };
	float temp[3] = { 0.8f, 1.0f, 0.0f };
	int window[3] = { 1, 2, 0 };
	for (int c = 0; c < 3; c++) {
		int32_t out[2][300];
		float *lg[2];
		for (int eager = 0; eager < 2; eager++) {
			struct ng_sampler s;
			struct ng_sampler_config sc = sampler_cfg(&m.cfg, top_k[c], temp[c], seed,
								  eager == 1, window[c]);
			cr_assert_eq(ng_sampler_init(&s, &sc, p), NG_OK, "%s", ng_error_message());
			cr_assert_eq(ng_sampler_generate(&s, prompt, P, n_new, out[eager], NULL, NULL,
							 NULL),
				     NG_OK, "%s", ng_error_message());
			lg[eager] = malloc(sizeof(float) * m.cfg.Vp);
			cr_assert_eq(ng_sampler_logits(&s, lg[eager]), NG_OK);
			ng_sampler_free(&s);
		}
		for (int i = 0; i < n_new; i++) {
			cr_assert_eq(out[0][i], out[1][i], "seed %llu case %d: token %d: graph %d, "
				     "eager %d", (unsigned long long)seed, c, i, out[0][i],
				     out[1][i]);
			cr_assert(out[0][i] >= 0 && out[0][i] < m.cfg.V, "token %d out of range",
				  out[0][i]);
		}
		cr_assert(memcmp(lg[0], lg[1], sizeof(float) * m.cfg.Vp) == 0,
			  "seed %llu case %d: final logits differ between graph and eager",
			  (unsigned long long)seed, c);
		free(lg[0]);
		free(lg[1]);
	}
	ng_cpu_spr_free(&m);
	free(p);
}

/* A bad window is an input error before anything is allocated on the device. */
Test(sample_spr, bad_window_is_a_status)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_gpt_config cfg;
	cr_assert_eq(ng_gpt_preset(&cfg, "speedrun-tiny"), NG_OK);
	struct ng_sampler s;
	struct ng_sampler_config sc = sampler_cfg(&cfg, 0, 0.0f, 1, false, -1);
	ng_clear_error();
	cr_assert_eq(ng_sampler_init(&s, &sc, NULL), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "window"), "%s", ng_error_message());
	ng_sampler_free(&s);
}
