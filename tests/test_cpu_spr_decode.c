/*
 * tests/test_cpu_spr_decode.c — the speedrun model's one-token KV-cache decoding on the CPU
 * (graph/cpu_spr_decode.h) against the full forward of graph/cpu_spr.h, on speedrun-tiny (L = 6,
 * H = 2, C = 64, V = Vp = 512) with every zero-initialised tensor and scalar randomised
 * (ng_cpu_spr_randomize): the soft-capped logits at every position of a 400-token prompt agree
 * to 1e-12 of max(1, |logit|) (both are double precision and differ only in summation order,
 * ~1e-15), at the windows W = 1 (128 tokens in every block) and W = 2 (256 long, 128 short), so
 * the prompt is longer than every window; the prompt holds document starts (bos = V - 1) both
 * nearer than the window and farther, and starts either with bos or without one. A reset
 * decoder reproduces its logits. Bad input (token, full cache, family, window) is a status.
 * Fresh random values each run; the seed is in every message.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_spr.h"
#include "graph/cpu_spr_decode.h"
#include "graph/cpu_spr_ops.h"
#include "tests/ref_testing.h"

#define PROMPT 400

/* A randomised speedrun-tiny model for a B = 1, T = PROMPT forward. */
static void model_(struct ng_cpu_spr_model *m)
{
	struct ng_gpt_config c;
	cr_assert_eq(ng_gpt_preset(&c, "speedrun-tiny"), NG_OK);
	cr_assert_eq(ng_cpu_spr_init(m, &c, 1, PROMPT, ng_rng_u64(&rng_)), NG_OK, "%s",
		     ng_error_message());
	ng_cpu_spr_randomize(m, ng_rng_u64(&rng_));
}

/* PROMPT random tokens below bos, then document starts at a few places (and at 0 if asked). */
static void prompt_(int32_t *tok, int32_t bos, bool bos_first)
{
	for (int i = 0; i < PROMPT; i++)
		tok[i] = (int32_t)ng_rng_below(&rng_, (uint64_t)bos);
	int starts[] = { 70 + (int)ng_rng_below(&rng_, 40), 200 + (int)ng_rng_below(&rng_, 10),
			 330 + (int)ng_rng_below(&rng_, 30) };
	for (int k = 0; k < 3; k++)
		tok[starts[k]] = bos;
	if (bos_first)
		tok[0] = bos;
}

/* Decode the prompt and compare each position's logits with the full forward's. */
static void check_window_(struct ng_cpu_spr_model *m, const int32_t *tok, int W)
{
	int Vp = m->cfg.Vp;
	double div = NG_SPR_SOFTCAP_DIV * sqrt((double)m->cfg.C);
	cr_assert_eq(ng_cpu_spr_forward(m, tok, NULL, W, NULL), NG_OK, "%s", ng_error_message());
	double *ref = keep_((size_t)PROMPT * Vp * sizeof(double));
	ng_ref_softcap_fwd(ref, m->a.logits, (size_t)PROMPT * Vp, NG_SPR_SOFTCAP, div);
	struct ng_cpu_spr_decoder d;
	cr_assert_eq(ng_cpu_spr_decode_init(&d, &m->cfg, m->params, PROMPT, W), NG_OK, "%s",
		     ng_error_message());
	double worst = 0.0, spread = 0.0;
	for (int pass = 0; pass < 2; pass++) { /* the second after a reset */
		ng_cpu_spr_decode_reset(&d);
		for (int t = 0; t < PROMPT; t++) {
			cr_assert_eq(ng_cpu_spr_decode_step(&d, tok[t]), NG_OK, "%s",
				     ng_error_message());
			const double *r = ref + (size_t)t * Vp;
			for (int v = 0; v < Vp; v++) {
				double e = fabs(d.logits[v] - r[v]) / fmax(1.0, fabs(r[v]));
				worst = fmax(worst, e);
				spread = fmax(spread, fabs(r[v] - r[0]));
				cr_assert(e <= 1e-12, "seed %llu W %d pass %d: position %d logit %d: "
					  "decode %.17g, forward %.17g", (unsigned long long)seed_, W,
					  pass, t, v, d.logits[v], r[v]);
			}
		}
	}
	/* the check is only as good as the logits are varied */
	cr_assert(spread > 1.0, "seed %llu: logits barely vary (%g)", (unsigned long long)seed_,
		  spread);
	cr_log_info("W %d: max relative difference %.3g over %d positions", W, worst, PROMPT);
	ng_cpu_spr_decode_free(&d);
}

Test(cpu_spr_decode, matches_full_forward, .init = setup_, .fini = release_, .timeout = 300)
{
	struct ng_cpu_spr_model m;
	model_(&m);
	int32_t *tok = keep_(PROMPT * sizeof(int32_t));
	for (int bos_first = 0; bos_first < 2; bos_first++) {
		prompt_(tok, m.bos, bos_first);
		check_window_(&m, tok, 1);
		check_window_(&m, tok, 2);
	}
	ng_cpu_spr_free(&m);
}

/* The inference window (the end of training's schedule) covers all of speedrun-tiny's context,
 * so there only the documents cut the attention. */
Test(cpu_spr_decode, matches_full_forward_at_inference_window, .init = setup_, .fini = release_,
     .timeout = 300)
{
	struct ng_cpu_spr_model m;
	model_(&m);
	int32_t *tok = keep_(PROMPT * sizeof(int32_t));
	prompt_(tok, m.bos, false);
	check_window_(&m, tok, 14);
	ng_cpu_spr_free(&m);
}

Test(cpu_spr_decode, bad_input_is_a_status, .init = setup_, .fini = release_)
{
	struct ng_cpu_spr_model m;
	model_(&m);
	struct ng_cpu_spr_decoder d;
	ng_clear_error();
	cr_assert_eq(ng_cpu_spr_decode_init(&d, &m.cfg, m.params, 0, 1), NG_ERR_INPUT);
	ng_clear_error();
	cr_assert_eq(ng_cpu_spr_decode_init(&d, &m.cfg, m.params, 4, 0), NG_ERR_INPUT);
	struct ng_gpt_config g;
	cr_assert_eq(ng_gpt_preset(&g, "tiny"), NG_OK);
	ng_clear_error();
	cr_assert_eq(ng_cpu_spr_decode_init(&d, &g, m.params, 4, 1), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "not the speedrun model"), "%s", ng_error_message());

	cr_assert_eq(ng_cpu_spr_decode_init(&d, &m.cfg, m.params, 2, 1), NG_OK, "%s",
		     ng_error_message());
	ng_clear_error();
	cr_assert_eq(ng_cpu_spr_decode_step(&d, m.cfg.V), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "outside the vocabulary"), "%s", ng_error_message());
	cr_assert_eq(d.pos, 0);
	cr_assert_eq(ng_cpu_spr_decode_step(&d, 1), NG_OK);
	cr_assert_eq(ng_cpu_spr_decode_step(&d, 2), NG_OK);
	ng_clear_error();
	cr_assert_eq(ng_cpu_spr_decode_step(&d, 3), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "is full"), "%s", ng_error_message());
	cr_assert_eq(d.pos, 2);
	ng_cpu_spr_decode_free(&d);
	ng_cpu_spr_free(&m);
}
