/*
 * tests/test_train_stop.c — the training loop's multi-process stop (src/train.c), on the CPU with
 * a stand-in backend: a signal reaches one rank; the flag it raises is "reduced over ranks"
 * inside the step, so every rank's records carry it from the same step s; each rank must stop
 * after step s + 8 however late it collects its records, keep fewer than 8 steps in flight, and
 * only rank 0 writes the checkpoint, named for that step. A signal too close to the end of the
 * run still leaves the final checkpoint.
 *
 * The stand-in's "reduction" is a variable the ranks share: the first step submitted after a
 * request carries the flag (a real rank's queued steps may carry it earlier; any first step
 * works, as long as every rank sees the same one). Records of rank r become collectable `lag`
 * submissions late unless the loop waits.
 */
#define _XOPEN_SOURCE 700
#define _DEFAULT_SOURCE
#include <criterion/criterion.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graph/gpt.h"
#include "src/checkpoint.h"
#include "src/train.h"
#include "tests/test_tmpdir.h"

struct stand_in {
	long long submitted, collected;
	int lag;                   /* records collectable this many submissions late */
	long long raise_at;        /* raise(SIGTERM) while submitting this step (0: never) */
	long long *flagged_from;   /* shared "reduced" flag: first step carrying stop */
	long long max_in_flight;
	int requests;
	size_t total;              /* parameters of the model (for save_state) */
	uint16_t tokens[1 << 16];
};

static enum ng_status si_input(void *ctx, uint16_t **buf)
{
	*buf = ((struct stand_in *)ctx)->tokens;
	return NG_OK;
}

static enum ng_status si_submit(void *ctx)
{
	struct stand_in *m = ctx;
	m->submitted++;
	if (m->submitted - m->collected > m->max_in_flight)
		m->max_in_flight = m->submitted - m->collected;
	if (m->submitted == m->raise_at)
		raise(SIGTERM);
	return NG_OK;
}

static enum ng_status si_collect(void *ctx, struct ng_step_result *out, int max, bool wait, int *n)
{
	struct stand_in *m = ctx;
	long long ready = wait ? m->submitted : m->submitted - m->lag;
	*n = 0;
	while (m->collected < ready && *n < max) {
		long long s = ++m->collected;
		out[(*n)++] = (struct ng_step_result){ s, 1.0, 1.0, 1e-3, false,
						       s >= *m->flagged_from, 1.0 };
	}
	return NG_OK;
}

static void si_request_stop(void *ctx)
{
	struct stand_in *m = ctx;
	m->requests++;
	if (m->submitted + 1 < *m->flagged_from)
		*m->flagged_from = m->submitted + 1;
}

static enum ng_status si_evaluate(void *ctx, const uint16_t *t, int n, int window, double *loss)
{
	(void)ctx, (void)t, (void)n, (void)window;
	*loss = 1.0;
	return NG_OK;
}

static enum ng_status si_save(void *ctx, struct ng_train_state *s, float **p32)
{
	struct stand_in *m = ctx;
	*p32 = calloc(m->total, sizeof(float));
	enum ng_status st = ng_ckpt_state_alloc(s, 4, m->total);
	s->step = m->collected;
	return st;
}

static enum ng_status si_load(void *ctx, const struct ng_train_state *s)
{
	(void)ctx, (void)s;
	return NG_OK;
}

static void si_free(void *ctx) { (void)ctx; }

/* One rank's run; returns the step it stopped after (the stand-in's last submitted step). */
static long long run_rank_(int rank, int lag, long long raise_at, long long steps,
			   long long *flagged_from, struct stand_in **out)
{
	struct ng_train_opts o;
	memset(&o, 0, sizeof(o));
	o.shape.model = (struct ng_gpt_config){ 2, 2, 64, 32, 512, 0, NG_ARCH_GPT2 };
	cr_assert_eq(ng_gpt_check(&o.shape.model), NG_OK);
	o.shape.B = 2;
	o.shape.T = 32;
	o.shape.K = 1;
	o.steps = steps;
	o.lr = 1e-3;
	o.lr_final_frac = 0.1;
	o.schedule = "cosine";
	o.clip = 1;
	o.beta1 = 0.9, o.beta2 = 0.95, o.eps = 1e-8;
	o.val_batches = 1;
	o.out_dir = ng_test_dir;
	o.seed = 7;
	o.device = "cpu";
	o.log_every = 1;
	o.rank = rank;
	o.world = 2;
	struct ng_gpt_layout lay;
	ng_gpt_layout(&o.shape.model, &lay);
	struct stand_in *m = calloc(1, sizeof(*m));
	m->lag = lag;
	m->raise_at = raise_at;
	m->flagged_from = flagged_from;
	m->total = lay.total;
	struct ng_backend be = { .name = "stand-in", .ctx = m, .input_buffer = si_input,
				 .submit = si_submit, .collect = si_collect,
				 .evaluate = si_evaluate, .save_state = si_save,
				 .load_state = si_load, .free = si_free,
				 .request_stop = si_request_stop };
	cr_assert_eq(ng_train_run(&o, &be), NG_OK, "rank %d: %s", rank, ng_error_message());
	*out = m;
	return m->submitted;
}

static void setup_(void) { ng_test_dir_make("ng_stop_test_"); }

static bool checkpoint_at_(long long step)
{
	char p[320];
	snprintf(p, sizeof(p), "%s/state_%08lld.safetensors", ng_test_dir, step);
	return access(p, F_OK) == 0;
}

Test(train_stop, ranks_stop_after_the_same_step, .init = setup_)
{
	long long flagged = LLONG_MAX;
	struct stand_in *a, *b;
	/* rank 1 gets the signal at step 20 and collects promptly; rank 0 never gets it and
	 * collects 5 submissions late */
	long long sa = run_rank_(1, 0, 20, 200, &flagged, &a);
	cr_assert_eq(a->requests, 1);
	cr_assert_eq(flagged, 21, "the first flagged step: %lld", flagged);
	long long sb = run_rank_(0, 5, 0, 200, &flagged, &b);
	cr_expect_eq(sa, flagged + 8, "rank 1 stopped after %lld", sa);
	cr_expect_eq(sb, flagged + 8, "rank 0 stopped after %lld", sb);
	cr_expect(a->max_in_flight < 8 && b->max_in_flight < 8, "in flight: %lld, %lld",
		  a->max_in_flight, b->max_in_flight);
	cr_expect_eq(b->requests, 0);
	cr_expect(checkpoint_at_(flagged + 8), "rank 0 wrote no checkpoint at step %lld",
		  flagged + 8);
	free(a);
	free(b);
}

Test(train_stop, a_very_late_collector_is_held_back, .init = setup_)
{
	long long flagged = LLONG_MAX;
	struct stand_in *a, *b;
	long long sa = run_rank_(0, 1, 30, 200, &flagged, &a);
	long long sb = run_rank_(1, 50, 0, 200, &flagged, &b); /* would run 50 steps ahead */
	cr_expect_eq(sa, flagged + 8);
	cr_expect_eq(sb, flagged + 8, "the late rank stopped after %lld, not %lld", sb,
		     flagged + 8);
	cr_expect(b->max_in_flight < 8, "in flight %lld", b->max_in_flight);
	free(a);
	free(b);
}

Test(train_stop, signal_near_the_end_still_checkpoints, .init = setup_)
{
	long long flagged = LLONG_MAX;
	struct stand_in *a, *b;
	long long sa = run_rank_(1, 0, 45, 50, &flagged, &a);
	long long sb = run_rank_(0, 2, 0, 50, &flagged, &b);
	cr_expect_eq(sa, 50);
	cr_expect_eq(sb, 50);
	cr_expect(checkpoint_at_(50), "no final checkpoint after a late signal");
	free(a);
	free(b);
}
