/*
 * tests/test_sample.c — KV-cache generation (graph/sampler.h) on the GPU: the decode graph's
 * logits after a prompt equal the last-position logits of a full forward (the CPU reference in
 * double on the same bf16-rounded weights; the decode path keeps fp32 activations, so the
 * tolerance is fp32 accumulation over a few layers plus a bf16 ulp margin); graph replay gives
 * the same tokens and bit-identical logits as eager launches; greedy sampling picks the argmax;
 * the per-step logits trace ends with the final logits; generation stops at <|endoftext|>.
 * Fresh random models every run (seed printed on failure).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "graph/cpu_ref.h"
#include "graph/sampler.h"
#include "kernels/check.h"
#include "util/rng.h"

static float round_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
	memcpy(&f, &u, 4);
	return f;
}

/* A random model: GPT-2 init perturbed (LayerNorm weights and biases not trivial), rounded to
 * bf16 so the reference reads the same weights as the GPU. */
static float *random_model(struct ng_gpt_config *cfg, struct ng_gpt_layout *lay, struct ng_rng *r,
			   uint64_t seed)
{
	*cfg = (struct ng_gpt_config){ .L = 2 + (int)ng_rng_below(r, 2), .H = 4, .C = 128, .T = 64,
				       .V = 300 + (int)ng_rng_below(r, 300) };
	cr_assert_eq(ng_gpt_check(cfg), NG_OK);
	ng_gpt_layout(cfg, lay);
	float *p = malloc(lay->total * sizeof(float));
	ng_gpt_init(cfg, lay, seed, p);
	for (int id = 0; id < NG_P_COUNT; id++) {
		const struct ng_param_spec *s = &lay->p[id];
		bool vec = s->ndim - (s->per_layer ? 1 : 0) == 1;
		size_t n = id == NG_P_WTE ? (size_t)cfg->V * cfg->C : s->numel;
		for (size_t i = 0; i < n; i++) {
			float *x = &p[s->offset + i];
			if (vec) /* LN weights around 1, biases around 0 */
				*x += (float)(0.1 * ng_rng_normal(r));
			else
				*x *= 3.0f; /* livelier logits than the 0.02 init */
			*x = round_bf16(*x);
		}
	}
	return p;
}

static uint64_t seed_now(void)
{
	return (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
}

Test(sample, decode_logits_match_full_forward)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct ng_gpt_config cfg;
	struct ng_gpt_layout lay;
	float *p = random_model(&cfg, &lay, &r, seed);
	int P = 1 + (int)ng_rng_below(&r, cfg.T - 1);
	int32_t *prompt = malloc(sizeof(int32_t) * P);
	for (int i = 0; i < P; i++)
		prompt[i] = (int32_t)ng_rng_below(&r, (uint64_t)cfg.V);

	struct ng_cpu_model m;
	cr_assert_eq(ng_cpu_model_init(&m, &cfg, 1, P, 0), NG_OK, "%s", ng_error_message());
	ng_cpu_model_load_params(&m, p);
	double unused;
	cr_assert_eq(ng_cpu_forward(&m, prompt, NULL, &unused), NG_OK, "%s", ng_error_message());
	const double *ref = m.a.logits + (size_t)(P - 1) * cfg.Vp;

	struct ng_sampler s;
	struct ng_sampler_config sc = { cfg, 0, 0.0f, seed, false, false, 0 };
	cr_assert_eq(ng_sampler_init(&s, &sc, p), NG_OK, "%s", ng_error_message());
	int32_t next;
	cr_assert_eq(ng_sampler_generate(&s, prompt, P, 1, &next, NULL, NULL, NULL), NG_OK, "%s",
		     ng_error_message());
	float *got = malloc(sizeof(float) * cfg.Vp);
	cr_assert_eq(ng_sampler_logits(&s, got), NG_OK);
	double scale = 0;
	for (int i = 0; i < cfg.V; i++)
		scale = fmax(scale, fabs(ref[i]));
	double max_abs = 0, max_rel = 0;
	int worst = 0, best = 0;
	for (int i = 0; i < cfg.V; i++) {
		double e = fabs(got[i] - ref[i]);
		if (e > max_abs) {
			max_abs = e;
			worst = i;
		}
		max_rel = fmax(max_rel, e / fmax(fabs(ref[i]), 1e-6));
		if (ref[i] > ref[best])
			best = i;
	}
	/* fp32 activations vs double over L layers: ~1e-5 relative; a bf16 ulp (2^-8) of the
	 * largest logit is the ceiling the brief allows */
	double tol = scale * (1.0 / 256);
	cr_assert(max_abs <= tol, "seed %llu (L=%d V=%d P=%d): max abs err %.3g > %.3g (max rel "
		  "%.3g) at logit %d: %.6f vs %.6f", (unsigned long long)seed, cfg.L, cfg.V, P,
		  max_abs, tol, max_rel, worst, got[worst], ref[worst]);
	/* greedy: the argmax, when the reference's margin exceeds the error */
	double second = -INFINITY;
	for (int i = 0; i < cfg.V; i++)
		if (i != best)
			second = fmax(second, ref[i]);
	if (ref[best] - second > 2 * max_abs)
		cr_assert_eq(next, best, "seed %llu: greedy token %d, argmax %d",
			     (unsigned long long)seed, next, best);
	cr_log_info("decode vs full forward: max abs %.3g, max rel %.3g (logit scale %.3g)",
		    max_abs, max_rel, scale);
	ng_sampler_free(&s);
	ng_cpu_model_free(&m);
	free(got);
	free(prompt);
	free(p);
}

Test(sample, graph_replay_equals_eager)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct ng_gpt_config cfg;
	struct ng_gpt_layout lay;
	float *p = random_model(&cfg, &lay, &r, seed);
	int P = 1 + (int)ng_rng_below(&r, 8), n_new = cfg.T - P;
	int32_t prompt[8];
	for (int i = 0; i < P; i++)
		prompt[i] = (int32_t)ng_rng_below(&r, (uint64_t)cfg.V);
	int top_k[3] = { 0, 1 + (int)ng_rng_below(&r, 50), 0 };
	float temp[3] = { 1.0f, 0.8f, 0.0f };
	for (int c = 0; c < 3; c++) {
		int32_t out[2][64];
		float *lg[2];
		for (int eager = 0; eager < 2; eager++) {
			struct ng_sampler s;
			struct ng_sampler_config sc = { cfg, top_k[c], temp[c], seed, eager == 1, false,
							0 };
			cr_assert_eq(ng_sampler_init(&s, &sc, p), NG_OK, "%s", ng_error_message());
			double secs;
			cr_assert_eq(ng_sampler_generate(&s, prompt, P, n_new, out[eager], NULL, &secs, NULL),
				     NG_OK, "%s", ng_error_message());
			lg[eager] = malloc(sizeof(float) * cfg.Vp);
			cr_assert_eq(ng_sampler_logits(&s, lg[eager]), NG_OK);
			ng_sampler_free(&s);
		}
		for (int i = 0; i < n_new; i++) {
			cr_assert_eq(out[0][i], out[1][i], "seed %llu case %d: token %d: graph %d, eager "
				     "%d", (unsigned long long)seed, c, i, out[0][i], out[1][i]);
			cr_assert(out[0][i] >= 0 && out[0][i] < cfg.V, "token %d out of range",
				  out[0][i]);
		}
		cr_assert(memcmp(lg[0], lg[1], sizeof(float) * cfg.Vp) == 0,
			  "seed %llu case %d: final logits differ between graph and eager",
			  (unsigned long long)seed, c);
		free(lg[0]);
		free(lg[1]);
	}
	free(p);
}

Test(sample, context_overflow_refused)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_rng r;
	uint64_t seed = seed_now();
	ng_rng_seed(&r, seed);
	struct ng_gpt_config cfg;
	struct ng_gpt_layout lay;
	float *p = random_model(&cfg, &lay, &r, seed);
	struct ng_sampler s;
	struct ng_sampler_config sc = { cfg, 10, 1.0f, seed, false, false, 0 };
	cr_assert_eq(ng_sampler_init(&s, &sc, p), NG_OK, "%s", ng_error_message());
	int32_t prompt[2] = { 1, 2 }, out[64];
	ng_clear_error();
	cr_assert_eq(ng_sampler_generate(&s, prompt, 2, cfg.T - 1, out, NULL, NULL, NULL), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "exceed the context"), "%s", ng_error_message());
	ng_sampler_free(&s);
	free(p);
}

/* The per-step logits trace (sample --logits): its last row is the final step's logits, and a
 * run with the trace samples the same tokens as one without. */
Test(sample, logits_trace)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_rng r;
	uint64_t seed = seed_now();
	ng_rng_seed(&r, seed);
	struct ng_gpt_config cfg;
	struct ng_gpt_layout lay;
	float *p = random_model(&cfg, &lay, &r, seed);
	struct ng_sampler s;
	struct ng_sampler_config sc = { cfg, 0, 0.0f, seed, false, false, 0 };
	cr_assert_eq(ng_sampler_init(&s, &sc, p), NG_OK, "%s", ng_error_message());
	int32_t prompt[3] = { 5, 7, 11 }, a[8], b[8];
	int n = 0, steps = 3 + 8 - 1;
	float *rows = malloc(sizeof(float) * (size_t)steps * cfg.V);
	float *last = malloc(sizeof(float) * cfg.Vp);
	cr_assert_eq(ng_sampler_generate(&s, prompt, 3, 8, a, &n, NULL, rows), NG_OK, "%s",
		     ng_error_message());
	cr_assert_eq(n, 8);
	cr_assert_eq(ng_sampler_logits(&s, last), NG_OK);
	cr_assert_eq(memcmp(rows + (size_t)(steps - 1) * cfg.V, last, sizeof(float) * cfg.V), 0,
		     "last trace row != final logits (seed %llu)", (unsigned long long)seed);
	cr_assert_eq(ng_sampler_generate(&s, prompt, 3, 8, b, NULL, NULL, NULL), NG_OK);
	cr_assert_eq(memcmp(a, b, sizeof(a)), 0, "tokens differ with the trace (seed %llu)",
		     (unsigned long long)seed);
	/* greedy: every generated token is the argmax of the row before it */
	for (int i = 0; i < 8; i++) {
		const float *row = rows + (size_t)(3 - 1 + i) * cfg.V;
		int best = 0;
		for (int v = 1; v < cfg.V; v++)
			if (row[v] > row[best])
				best = v;
		cr_assert_eq(a[i], best, "token %d: %d, argmax %d (seed %llu)", i, a[i], best,
			     (unsigned long long)seed);
	}
	ng_sampler_free(&s);
	free(rows);
	free(last);
	free(p);
}

/* A GPT-2-sized vocabulary whose final LayerNorm makes <|endoftext|> the argmax everywhere:
 * with stop_at_eot the first sample ends generation (0 tokens); without, all are EOT. */
Test(sample, stops_at_end_of_text)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_gpt_config cfg = { .L = 1, .H = 2, .C = 64, .T = 64, .V = NG_SAMPLER_EOT + 1 };
	cr_assert_eq(ng_gpt_check(&cfg), NG_OK);
	struct ng_gpt_layout lay;
	ng_gpt_layout(&cfg, &lay);
	float *p = malloc(lay.total * sizeof(float));
	uint64_t seed = seed_now();
	ng_gpt_init(&cfg, &lay, seed, p);
	float *lnfw = p + lay.p[NG_P_LNFW].offset, *lnfb = p + lay.p[NG_P_LNFB].offset;
	float *eot = p + lay.p[NG_P_WTE].offset + (size_t)NG_SAMPLER_EOT * cfg.C;
	for (int c = 0; c < cfg.C; c++) { /* ln_f output = the bias; logit(EOT) = 64 * 0.5 */
		lnfw[c] = 0;
		lnfb[c] = 1;
		eot[c] = 0.5f;
	}
	for (int pass = 0; pass < 2; pass++) {
		struct ng_sampler s;
		struct ng_sampler_config sc = { cfg, 40, 1.0f, seed, false, pass == 0, 0 };
		cr_assert_eq(ng_sampler_init(&s, &sc, p), NG_OK, "%s", ng_error_message());
		int32_t prompt[2] = { 3, 4 }, out[40];
		int n = -1;
		cr_assert_eq(ng_sampler_generate(&s, prompt, 2, 40, out, &n, NULL, NULL), NG_OK, "%s",
			     ng_error_message());
		if (pass == 0) {
			cr_assert_eq(n, 0, "stop_at_eot: %d tokens before the end of text", n);
		} else {
			cr_assert_eq(n, 40);
			for (int i = 0; i < 40; i++)
				cr_assert_eq(out[i], NG_SAMPLER_EOT, "token %d = %d", i, out[i]);
		}
		ng_sampler_free(&s);
	}
	free(p);
}
