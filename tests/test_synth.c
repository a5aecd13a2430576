/*
 * tests/test_synth.c — the synthetic corpus: its entropy rate H = sum pi_i H(P_i) agrees with
 * the empirical mean of -log p(x_t | x_{t-1}) over a long sample; batches are deterministic per
 * (stream, index) and differ across streams; tokens stay below the vocabulary; the floor is in a
 * range a tiny model can approach.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "data/synth.h"

static uint64_t fresh_seed(void) { return (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 24); }

Test(synth, entropy_matches_sample)
{
	uint64_t seed = fresh_seed();
	int vocabs[] = { 512, 50257, 100, 2 };
	for (int v = 0; v < 4; v++) {
		struct ng_synth s;
		cr_assert_eq(ng_synth_init(&s, vocabs[v], seed), NG_OK);
		double H = ng_synth_entropy(&s);
		const int B = 64, T = 4096;
		uint16_t *buf = malloc((size_t)B * (T + 1) * sizeof(uint16_t));
		double sum = 0, sum2 = 0;
		long n = 0;
		for (uint64_t idx = 0; idx < 4; idx++) {
			ng_synth_batch(&s, 1, idx, B, T, buf);
			for (int b = 0; b < B; b++)
				for (int t = 0; t < T; t++) {
					uint16_t a = buf[b * (T + 1) + t], c = buf[b * (T + 1) + t + 1];
					cr_assert_lt(c, vocabs[v]);
					double p = ng_synth_prob(&s, a, c);
					cr_assert_gt(p, 0, "seed %llu: impossible transition %u -> %u",
						     (unsigned long long)seed, a, c);
					sum += -log(p);
					sum2 += log(p) * log(p);
					n++;
				}
		}
		double mean = sum / n, sd = sqrt(sum2 / n - mean * mean);
		/* ~1M samples, correlated over a few steps: 6 standard errors x a mixing margin */
		double tol = 6 * 3 * sd / sqrt((double)n) + 1e-9;
		cr_assert_leq(fabs(mean - H), tol, "seed %llu V=%d: H=%.6f, sample %.6f (tol %.2e)",
			      (unsigned long long)seed, vocabs[v], H, mean, tol);
		if (vocabs[v] >= 256)
			cr_assert(H > 0.5 && H < 2.8, "seed %llu: floor %.3f nats outside the "
				  "learnable range", (unsigned long long)seed, H);
		free(buf);
		ng_synth_free(&s);
	}
}

Test(synth, deterministic_streams)
{
	uint64_t seed = fresh_seed();
	struct ng_synth s, s2;
	cr_assert_eq(ng_synth_init(&s, 50257, seed), NG_OK);
	cr_assert_eq(ng_synth_init(&s2, 50257, seed), NG_OK);
	cr_assert_eq(ng_synth_entropy(&s), ng_synth_entropy(&s2));
	const int B = 4, T = 64;
	size_t n = (size_t)B * (T + 1);
	uint16_t a[n], b[n], c[n], d[n];
	ng_synth_batch(&s, 0, 7, B, T, a);
	ng_synth_batch(&s2, 0, 7, B, T, b);
	ng_synth_batch(&s, 1, 7, B, T, c);
	ng_synth_batch(&s, 0, 8, B, T, d);
	cr_assert_eq(memcmp(a, b, sizeof(a)), 0, "seed %llu: same batch differs",
		     (unsigned long long)seed);
	cr_assert_neq(memcmp(a, c, sizeof(a)), 0, "streams 0 and 1 agree");
	cr_assert_neq(memcmp(a, d, sizeof(a)), 0, "batches 7 and 8 agree");
	struct ng_synth o;
	cr_assert_eq(ng_synth_init(&o, 50257, seed + 1), NG_OK);
	cr_assert_neq(ng_synth_entropy(&o), ng_synth_entropy(&s));
	cr_assert_eq(ng_synth_init(&o, 1, seed), NG_ERR_INPUT);
}
