/*
 * tests/ref_testing.h — helpers shared by the tests of the double-precision reference ops
 * (test_cpu_ops.c, test_cpu_spr_ops.c): a fresh seed per test, buffers freed after each test,
 * random fills, and the finite-difference check of an analytic gradient.
 *
 * Header-only as tests/kernel_testing.h, since tests/meson.build builds each test from its one .c
 * file; static inline, so a test that uses only some of them compiles without warnings. A test
 * uses `.init = setup_, .fini = release_`.
 *
 * The gradient checks use the scalar f = sum(out * R) for a fixed random R, so dout = R; "+="
 * outputs are pre-filled with random values that are subtracted afterwards (acc0), which checks
 * the accumulate contract too.
 */
#ifndef NG_TESTS_REF_TESTING_H
#define NG_TESTS_REF_TESTING_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/cpu_ops.h"
#include "util/rng.h"

#define FD_H 1e-3      /* step: truncation O(h^4) ~ 1e-13, rounding ~ 1e-16 |f| / h */
#define FD_FLOOR 1e-5  /* gradients below this are held to an absolute 1e-11 (FD noise level) */
#define FD_TOL 1e-6    /* relative error allowed per element */

static uint64_t seed_;
static struct ng_rng rng_;

static inline void setup_(void)
{
	seed_ = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
	ng_rng_seed(&rng_, seed_);
}

/* The buffers of one test, freed after it (.fini = release_): the tests allocate freely, and
 * the sanitizer build's leak check stays quiet. */
static void *kept_[64];
static int n_kept_;

static inline void *keep_(size_t bytes)
{
	cr_assert_lt(n_kept_, 64);
	void *p = malloc(bytes);
	cr_assert(p);
	return kept_[n_kept_++] = p;
}

static inline void release_(void)
{
	while (n_kept_)
		free(kept_[--n_kept_]);
}

static inline double *rnd_(size_t n, double mean, double std)
{
	double *x = keep_(n * sizeof(double));
	for (size_t i = 0; i < n; i++)
		x[i] = mean + std * ng_rng_normal(&rng_);
	return x;
}

static inline double *copy_(const double *x, size_t n)
{
	double *y = keep_(n * sizeof(double));
	memcpy(y, x, n * sizeof(double));
	return y;
}

static inline double dot_(const double *a, const double *b, size_t n)
{
	double s = 0.0;
	for (size_t i = 0; i < n; i++)
		s += a[i] * b[i];
	return s;
}

/* Run the FD comparison over all n elements of x and assert; gradients below `floor` are held
 * to the absolute FD_TOL * floor. `acc0` (may be NULL) is the pre-fill of the accumulated
 * analytic gradient, subtracted first. Ends with one more f(ctx), so the outputs are x's own. */
static inline void expect_grad_floor_(const char *what, double (*f)(void *), void *ctx,
				      double *x, double *analytic, const double *acc0, size_t n,
				      double floor)
{
	if (acc0)
		for (size_t i = 0; i < n; i++)
			analytic[i] -= acc0[i];
	struct ng_ref_fd_result r;
	ng_ref_fd_compare(&r, f, ctx, x, analytic, NULL, n, FD_H, floor);
	cr_log_info("%s: %zu elements, max rel err %.3g, max abs err %.3g (seed %llu)", what,
		    r.count, r.max_rel, r.max_abs, (unsigned long long)seed_);
	cr_expect(r.max_rel <= FD_TOL,
		  "%s: max rel err %.3g > %.1g, max abs err %.3g, worst index %zu (analytic %.12g, "
		  "numeric %.12g), seed %llu", what, r.max_rel, FD_TOL, r.max_abs, r.worst_index,
		  r.analytic, r.numeric, (unsigned long long)seed_);
	f(ctx); /* the last evaluation was at a perturbed x */
}

static inline void expect_grad_(const char *what, double (*f)(void *), void *ctx, double *x,
				double *analytic, const double *acc0, size_t n)
{
	expect_grad_floor_(what, f, ctx, x, analytic, acc0, n, FD_FLOOR);
}

#endif
