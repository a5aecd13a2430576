/*
 * tests/test_planner.c — the arena planner (alloc/planner.c): property tests over 10,000+
 * random lifetime sets (the placement passes the validator AND an independent O(n^2) overlap
 * check; the arena is at least the brute-force lower bound; offsets are aligned), the validator
 * catches planted overlaps, bad inputs are errors, and the targets on real steps:
 * arena <= 1.03 x lower bound for d12 B=64, d24 B=32, d48 B=16 at T=1024 with K=1 and K=8,
 * and planning d48 K=8 in under 1 s. Fresh random sets each run; the seed is in every message.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc/planner.h"
#include "graph/step.h"
#include "util/rng.h"

static uint64_t seed_;
static struct ng_rng rng_;

/* A fresh seed each run; NG_TEST_SEED=<a seed from a failure message> replays that run. */
static void setup_(void)
{
	const char *env = getenv("NG_TEST_SEED");
	seed_ = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
	ng_rng_seed(&rng_, seed_);
}

static size_t al(size_t x, size_t a)
{
	return (x + a - 1) / a * a;
}

/* Independent check: index of an interval overlapping another alive at the same time, or -1. */
static int brute_overlap(const struct ng_interval *iv, int n, size_t align, int *other)
{
	for (int i = 0; i < n; i++)
		for (int j = i + 1; j < n; j++) {
			if (!iv[i].size || !iv[j].size)
				continue;
			if (iv[i].first > iv[j].last || iv[j].first > iv[i].last)
				continue;
			size_t ei = iv[i].offset + al(iv[i].size, align);
			size_t ej = iv[j].offset + al(iv[j].size, align);
			if (iv[i].offset < ej && iv[j].offset < ei) {
				*other = j;
				return i;
			}
		}
	return -1;
}

static size_t brute_lower_bound(const struct ng_interval *iv, int n, size_t align, int n_ops)
{
	size_t best = 0;
	for (int t = 0; t < n_ops; t++) {
		size_t live = 0;
		for (int i = 0; i < n; i++)
			if (iv[i].first <= t && t <= iv[i].last)
				live += al(iv[i].size, align);
		if (live > best)
			best = live;
	}
	return best;
}

/* A random lifetime set: a mix of shapes the step produces (many short, some long, repeated
 * sizes, zero and unaligned sizes). */
static int random_set(struct ng_interval *iv, int max_n, int *n_ops)
{
	int n = 1 + (int)ng_rng_below(&rng_, (uint64_t)max_n);
	*n_ops = 1 + (int)ng_rng_below(&rng_, 120);
	static const size_t common[] = { 256, 1000, 4096, 65536, 12345, 1 << 20 };
	for (int i = 0; i < n; i++) {
		int a = (int)ng_rng_below(&rng_, (uint64_t)*n_ops);
		int len = ng_rng_uniform(&rng_) < 0.7 ? (int)ng_rng_below(&rng_, 4)
						       : (int)ng_rng_below(&rng_, (uint64_t)*n_ops);
		int b = a + len < *n_ops ? a + len : *n_ops - 1;
		size_t sz;
		double u = ng_rng_uniform(&rng_);
		if (u < 0.05)
			sz = 0;
		else if (u < 0.5)
			sz = common[ng_rng_below(&rng_, 6)];
		else
			sz = 1 + ng_rng_below(&rng_, 3u << 20);
		iv[i] = (struct ng_interval){ sz, a, b, (size_t)-1 };
	}
	return n;
}

Test(planner, random_lifetime_sets_are_valid_and_bounded, .init = setup_)
{
	enum { SETS = 12000, MAXN = 48 };
	static const size_t aligns[] = { 256, 1, 64, 4096, 0 };
	struct ng_interval iv[MAXN];
	double worst_ratio = 1.0;
	for (int s = 0; s < SETS; s++) {
		int n_ops, n = random_set(iv, MAXN, &n_ops);
		size_t align = aligns[s % 5], a = align ? align : NG_ARENA_ALIGN;
		size_t arena = 0;
		enum ng_status st = ng_arena_plan(iv, n, align, &arena);
		cr_assert_eq(st, NG_OK, "seed %llu set %d: plan failed: %s",
			     (unsigned long long)seed_, s, ng_error_message());
		int j, i = brute_overlap(iv, n, a, &j);
		cr_assert_eq(i, -1, "seed %llu set %d: intervals %d and %d overlap (offsets %zu, %zu)",
			     (unsigned long long)seed_, s, i, i >= 0 ? j : 0,
			     i >= 0 ? iv[i].offset : 0, i >= 0 ? iv[j].offset : 0);
		cr_assert_eq(ng_arena_validate(iv, n, align, arena), NG_OK,
			     "seed %llu set %d: validator rejects a correct plan: %s",
			     (unsigned long long)seed_, s, ng_error_message());
		size_t lb = ng_arena_lower_bound(iv, n, align);
		cr_assert_eq(lb, brute_lower_bound(iv, n, a, n_ops),
			     "seed %llu set %d: lower bound %zu differs from brute force",
			     (unsigned long long)seed_, s, lb);
		cr_assert_geq(arena, lb, "seed %llu set %d: arena %zu below the lower bound %zu",
			      (unsigned long long)seed_, s, arena, lb);
		cr_assert_eq(arena % a, 0, "seed %llu set %d: arena %zu not aligned",
			     (unsigned long long)seed_, s, arena);
		for (int k = 0; k < n; k++) {
			cr_assert_eq(iv[k].offset % a, 0, "seed %llu set %d: offset %zu of %d not "
				     "aligned to %zu", (unsigned long long)seed_, s, iv[k].offset, k,
				     a);
			cr_assert(!iv[k].size || iv[k].offset + al(iv[k].size, a) <= arena,
				  "seed %llu set %d: interval %d ends past the arena",
				  (unsigned long long)seed_, s, k);
		}
		if (lb && (double)arena / (double)lb > worst_ratio)
			worst_ratio = (double)arena / (double)lb;
	}
	/* not a target for adversarial sets, but a regression guard: greedy best fit stays
	 * within 2x of the bound on these */
	cr_expect_leq(worst_ratio, 2.0, "seed %llu: worst arena / lower bound %.3f",
		      (unsigned long long)seed_, worst_ratio);
}

Test(planner, validator_catches_planted_overlaps, .init = setup_)
{
	enum { SETS = 3000, MAXN = 32 };
	struct ng_interval iv[MAXN];
	int planted = 0;
	for (int s = 0; s < SETS; s++) {
		int n_ops, n = random_set(iv, MAXN, &n_ops);
		size_t arena;
		cr_assert_eq(ng_arena_plan(iv, n, 256, &arena), NG_OK);
		/* find a pair alive together, both non-empty, and move one onto the other */
		for (int i = 0; i < n; i++)
			for (int j = 0; j < n; j++) {
				if (i == j || !iv[i].size || !iv[j].size ||
				    iv[i].first > iv[j].last || iv[j].first > iv[i].last)
					continue;
				size_t keep = iv[j].offset;
				iv[j].offset = iv[i].offset;
				size_t big = arena + al(iv[j].size, 256) + al(iv[i].size, 256);
				ng_clear_error();
				cr_assert_eq(ng_arena_validate(iv, n, 256, big), NG_ERR_RUNTIME,
					     "seed %llu set %d: overlap of %d and %d not caught",
					     (unsigned long long)seed_, s, i, j);
				cr_assert(strstr(ng_error_message(), "overlap"),
					  "message: %s", ng_error_message());
				ng_clear_error();
				iv[j].offset = keep;
				planted++;
				goto next;
			}
next:;
	}
	cr_assert_gt(planted, 100, "seed %llu: only %d overlaps planted",
		     (unsigned long long)seed_, planted);
	/* misaligned offsets and intervals past the end are caught too */
	struct ng_interval one[1] = { { 1000, 0, 3, 128 } };
	ng_clear_error();
	cr_assert_eq(ng_arena_validate(one, 1, 256, 4096), NG_ERR_RUNTIME);
	ng_clear_error();
	one[0].offset = 3840;
	cr_assert_eq(ng_arena_validate(one, 1, 256, 4096), NG_ERR_RUNTIME);
	ng_clear_error();
}

Test(planner, bad_inputs_are_errors)
{
	struct ng_interval iv[2] = { { 100, 0, 1, 0 }, { 100, 3, 2, 0 } };
	size_t arena;
	ng_clear_error();
	cr_assert_eq(ng_arena_plan(iv, 2, 256, &arena), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "interval 1"), "message: %s", ng_error_message());
	ng_clear_error();
	iv[1].last = 4;
	cr_assert_eq(ng_arena_plan(iv, 2, 300, &arena), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "300"), "message: %s", ng_error_message());
	ng_clear_error();
	cr_assert_eq(ng_arena_plan(iv, 0, 256, &arena), NG_OK);
	cr_assert_eq(arena, 0);
	cr_assert_eq(ng_arena_lower_bound(iv, 0, 256), 0);
}

/* The targets on real steps: ratio and time. */
static void check_target(const char *model, int B, int K, int rc)
{
	struct ng_gpt_config cfg;
	cr_assert_eq(ng_gpt_preset(&cfg, model), NG_OK);
	cr_assert_eq(ng_gpt_check(&cfg), NG_OK);
	struct ng_step_options o;
	ng_step_default_options(&o);
	o.recompute_gelu = o.recompute_layernorm = rc;
	struct ng_graph g;
	enum ng_status st = ng_step_build_train(&g, &cfg, B, 1024, K, &o);
	cr_assert_eq(st, NG_OK, "%s B=%d K=%d: %s", model, B, K, ng_error_message());
	double ratio = (double)g.arena_bytes / (double)g.lower_bound_bytes;
	cr_expect_leq(ratio, 1.03, "%s B=%d K=%d recompute=%d: arena %zu / lower bound %zu = %.4f",
		      model, B, K, rc, g.arena_bytes, g.lower_bound_bytes, ratio);
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	st = ng_graph_plan(&g, 256);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	double sec = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
	cr_assert_eq(st, NG_OK);
	cr_assert_eq(ng_graph_validate(&g), NG_OK, "%s", ng_error_message());
	cr_expect_lt(sec, 1.0, "%s B=%d K=%d: planning took %.3f s (%d tensors, %d ops)", model,
		     B, K, sec, g.n_tensors, g.n_ops);
	ng_graph_free(&g);
}

Test(planner, targets_d12_b64, .timeout = 60)
{
	check_target("d12", 64, 1, 0);
	check_target("d12", 64, 8, 0);
	check_target("d12", 64, 8, 1);
}

Test(planner, targets_d24_b32, .timeout = 60)
{
	check_target("d24", 32, 1, 0);
	check_target("d24", 32, 8, 0);
	check_target("d24", 32, 1, 1);
}

Test(planner, targets_d48_b16, .timeout = 60)
{
	check_target("d48", 16, 1, 0);
	check_target("d48", 16, 8, 0);
	check_target("d48", 16, 8, 1);
}

/* Total bytes of the training step with GELU outputs recomputed in ng layers and LayerNorm
 * outputs in nl (the first ones), as --recompute auto builds it. */
/* total_bytes of the step with GELU outputs recomputed in ng layers and LayerNorm outputs in nl;
 * *lower_bound (when given) gets the graph's lower_bound_bytes. */
static size_t step_bytes_lb(const struct ng_gpt_config *c, int B, int T, int K,
			    const struct ng_step_options *base, int ng, int nl, size_t *lower_bound)
{
	struct ng_step_options o = *base;
	o.recompute_gelu = ng > 0;
	o.keep_gelu = c->L - ng;
	o.recompute_layernorm = nl > 0;
	o.keep_layernorm = c->L - nl;
	struct ng_graph g;
	cr_assert_eq(ng_step_build_train(&g, c, B, T, K, &o), NG_OK, "%s", ng_error_message());
	size_t b = g.total_bytes;
	if (lower_bound)
		*lower_bound = g.lower_bound_bytes;
	ng_graph_free(&g);
	return b;
}

static size_t step_bytes(const struct ng_gpt_config *c, int B, int T, int K,
			 const struct ng_step_options *base, int ng, int nl)
{
	return step_bytes_lb(c, B, T, K, base, ng, nl, NULL);
}

/* --recompute auto on random small models and random budgets: what it builds fits; one layer
 * fewer recomputed (the rung below) would not; below everything recomputed it is an input
 * error that names both sizes. The search bisects over the layer count: the lower bound of the
 * bytes falls (or stays) with each layer recomputed. The placement follows it as a heuristic
 * (over 22,000 random layer counts here the total rose twice, by at most 0.35%), so the total
 * is not asserted to fall. */
Test(planner, recompute_auto_takes_the_least_that_fits, .init = setup_, .timeout = 60)
{
	for (int rep = 0; rep < 40; rep++) {
		struct ng_gpt_config c;
		memset(&c, 0, sizeof(c));
		c.L = 1 + (int)ng_rng_below(&rng_, 6);
		c.H = 1 + (int)ng_rng_below(&rng_, 4);
		c.C = c.H * 16 * (1 + (int)ng_rng_below(&rng_, 4));
		c.T = 16 + (int)ng_rng_below(&rng_, 200);
		c.V = 2 + (int)ng_rng_below(&rng_, 3000);
		cr_assert_eq(ng_gpt_check(&c), NG_OK, "%s", ng_error_message());
		const int B = 1 + (int)ng_rng_below(&rng_, 8), T = 1 + (int)ng_rng_below(&rng_, c.T);
		const int K = 1 + (int)ng_rng_below(&rng_, 2);
		struct ng_step_options base;
		ng_step_default_options(&base);
		base.fuse_gelu = (int)ng_rng_below(&rng_, 4);
		base.head_chunk_rows = (int)ng_rng_below(&rng_, (uint64_t)B * T + 1);
		const int L = c.L;
		size_t prev_lb;
		size_t prev = step_bytes_lb(&c, B, T, K, &base, 0, 0, &prev_lb);
		const size_t none = prev;
		for (int n = 1; n <= 2 * L; n++) {
			size_t lb;
			size_t b = step_bytes_lb(&c, B, T, K, &base, n < L ? n : L, n > L ? n - L : 0,
						 &lb);
			cr_assert_leq(lb, prev_lb,
				      "seed %llu L=%d B=%d T=%d K=%d: %d layers, lower bound %zu > %zu",
				      (unsigned long long)seed_, L, B, T, K, n, lb, prev_lb);
			prev = b;
			prev_lb = lb;
		}
		const size_t all = prev;
		size_t budget = all + (size_t)ng_rng_below(&rng_, none - all + 2);
		struct ng_step_options o = base;
		o.recompute_auto = 1;
		struct ng_graph g;
		ng_graph_init(&g);
		cr_assert_eq(ng_step_fit_memory(&g, &c, B, T, K, &o, budget), NG_OK,
			     "seed %llu: %s", (unsigned long long)seed_, ng_error_message());
		cr_assert_leq(g.total_bytes, budget);
		cr_assert_eq(g.recompute_gelu, o.recompute_gelu);
		cr_assert_eq(g.keep_gelu, o.keep_gelu);
		const int ng = o.recompute_gelu ? L - o.keep_gelu : 0;
		const int nl = o.recompute_layernorm ? L - o.keep_layernorm : 0;
		cr_assert(nl == 0 || ng == L, "seed %llu: layernorm (%d) before all GELU (%d of %d)",
			  (unsigned long long)seed_, nl, ng, L);
		if (ng + nl > 0) /* the rung below does not fit */
			cr_assert_gt(step_bytes(&c, B, T, K, &base, nl ? L : ng - 1, nl ? nl - 1 : 0),
				     budget, "seed %llu: %d + %d layers chosen, fewer fit",
				     (unsigned long long)seed_, ng, nl);
		ng_graph_free(&g);
		if (all > 1) {
			o = base;
			o.recompute_auto = 1;
			ng_graph_init(&g);
			cr_assert_eq(ng_step_fit_memory(&g, &c, B, T, K, &o, all - 1), NG_ERR_INPUT);
			cr_assert(strstr(ng_error_message(), "with every recompute"), "%s",
				  ng_error_message());
			ng_clear_error();
			ng_graph_free(&g);
		}
	}
}

/* --recompute auto with --fp8: past every GELU and LayerNorm output, the E4M3 weight copies
 * (--recompute fp8) are the last rung, taken only when nothing else fits. */
Test(planner, recompute_auto_reaches_the_fp8_copies, .init = setup_)
{
	struct ng_gpt_config c = { .L = 4, .H = 4, .C = 256, .T = 128, .V = 1000 };
	cr_assert_eq(ng_gpt_check(&c), NG_OK, "%s", ng_error_message());
	struct ng_step_options base;
	ng_step_default_options(&base);
	base.fp8 = NG_FP8_EVERY;
	const int B = 2, T = 128, L = c.L;
	const size_t all_acts = step_bytes(&c, B, T, 1, &base, L, L);
	struct ng_step_options o = base;
	o.recompute_gelu = o.recompute_layernorm = o.recompute_fp8 = 1;
	struct ng_graph g;
	cr_assert_eq(ng_step_build_train(&g, &c, B, T, 1, &o), NG_OK, "%s", ng_error_message());
	const size_t floor = g.total_bytes;
	ng_graph_free(&g);
	cr_assert_lt(floor, all_acts, "the E4M3 copies save nothing (%zu, %zu)", floor, all_acts);
	o = base;
	o.recompute_auto = 1;
	ng_graph_init(&g);
	cr_assert_eq(ng_step_fit_memory(&g, &c, B, T, 1, &o, floor + (all_acts - floor) / 2), NG_OK,
		     "%s", ng_error_message());
	cr_expect(o.recompute_gelu && o.recompute_layernorm && o.recompute_fp8 && !o.keep_gelu &&
		  !o.keep_layernorm, "rungs: gelu %d/%d layernorm %d/%d fp8 %d", o.recompute_gelu,
		  o.keep_gelu, o.recompute_layernorm, o.keep_layernorm, o.recompute_fp8);
	cr_expect_eq(g.total_bytes, floor);
	ng_graph_free(&g);
	o = base;
	o.recompute_auto = 1;
	ng_graph_init(&g);
	cr_assert_eq(ng_step_fit_memory(&g, &c, B, T, 1, &o, all_acts), NG_OK, "%s",
		     ng_error_message());
	cr_expect_eq(o.recompute_fp8, 0, "the copies recast although the activations fit");
	ng_graph_free(&g);
}
