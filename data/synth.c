/*
 * data/synth.c — the seeded Markov-chain corpus of known entropy (see synth.h).
 */
#include "data/synth.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "util/rng.h"

/* Power iteration pi <- pi P until the L1 change is below 1e-15. */
static enum ng_status stationary(struct ng_synth *s)
{
	int S = s->states;
	double a[NG_SYNTH_MAX_STATES], b[NG_SYNTH_MAX_STATES];
	for (int i = 0; i < S; i++)
		a[i] = 1.0 / S;
	for (int it = 0; it < 200000; it++) {
		memset(b, 0, sizeof(b));
		for (int i = 0; i < S; i++)
			for (int j = 0; j < s->nsucc[i]; j++)
				b[s->succ[i][j]] += a[i] * s->prob[i][j];
		double sum = 0, diff = 0;
		for (int i = 0; i < S; i++)
			sum += b[i];
		for (int i = 0; i < S; i++) {
			b[i] /= sum;
			diff += fabs(b[i] - a[i]);
			a[i] = b[i];
		}
		if (diff < 1e-15)
			break;
	}
	double run = 0;
	for (int i = 0; i < S; i++) {
		s->pi[i] = a[i];
		run += a[i];
		s->pi_cum[i] = run;
	}
	s->pi_cum[S - 1] = 1.0;
	return NG_OK;
}

enum ng_status ng_synth_init(struct ng_synth *s, int vocab, uint64_t seed)
{
	memset(s, 0, sizeof(*s));
	if (vocab < 2 || vocab > 65536)
		return ng_fail(NG_ERR_INPUT, "synthetic corpus: vocabulary %d out of range (2..65536)",
			       vocab);
	int S = vocab < NG_SYNTH_MAX_STATES ? vocab : NG_SYNTH_MAX_STATES;
	s->vocab = vocab;
	s->states = S;
	s->seed = seed;
	struct ng_rng r;
	ng_rng_seed(&r, ng_rng_mix64(seed ^ 0x5157a7e5ull));

	/* S distinct token ids over [0, vocab) by rejection (S <= 256, so this is cheap). */
	for (int i = 0; i < S; i++) {
		for (;;) {
			uint16_t c = (uint16_t)ng_rng_below(&r, (uint64_t)vocab);
			bool dup = false;
			for (int q = 0; q < i; q++)
				dup = dup || s->tok[q] == c;
			if (!dup) {
				s->tok[i] = c;
				break;
			}
		}
	}

	for (int i = 0; i < S; i++) {
		int k = 4 + (int)ng_rng_below(&r, NG_SYNTH_MAX_SUCC - 4 + 1);
		if (k > S)
			k = S;
		int n = 0;
		s->succ[i][n++] = (uint16_t)((i + 1) % S); /* the cycle: irreducible */
		if (i == 0 && S > 1 && k > 1)
			s->succ[i][n++] = 0; /* one self-loop: aperiodic */
		while (n < k) {
			uint16_t c = (uint16_t)ng_rng_below(&r, (uint64_t)S);
			bool dup = false;
			for (int q = 0; q < n; q++)
				dup = dup || s->succ[i][q] == c;
			if (!dup)
				s->succ[i][n++] = c;
		}
		s->nsucc[i] = k;
		/* Skewed weights (u^3 spans ~3 orders of magnitude) give a lower, more learnable
		 * entropy than uniform ones. */
		double w[NG_SYNTH_MAX_SUCC], sum = 0;
		for (int j = 0; j < k; j++) {
			double u = 0.02 + ng_rng_uniform(&r);
			w[j] = u * u * u;
			sum += w[j];
		}
		double run = 0;
		for (int j = 0; j < k; j++) {
			s->prob[i][j] = w[j] / sum;
			run += s->prob[i][j];
			s->cum[i][j] = run;
		}
		s->cum[i][k - 1] = 1.0;
	}
	enum ng_status st = stationary(s);
	if (st)
		return st;
	double H = 0;
	for (int i = 0; i < S; i++) {
		double h = 0;
		for (int j = 0; j < s->nsucc[i]; j++)
			h -= s->prob[i][j] * log(s->prob[i][j]);
		H += s->pi[i] * h;
	}
	s->entropy = H;
	return NG_OK;
}

double ng_synth_entropy(const struct ng_synth *s) { return s->entropy; }

static int pick(const double *cum, int n, double u)
{
	for (int j = 0; j < n - 1; j++)
		if (u < cum[j])
			return j;
	return n - 1;
}

void ng_synth_batch(const struct ng_synth *s, uint64_t stream, uint64_t index, int B, int T,
		    uint16_t *out)
{
	for (int b = 0; b < B; b++) {
		struct ng_rng r;
		uint64_t key = ng_rng_mix64(ng_rng_mix64(ng_rng_mix64(s->seed) ^ stream) ^ index);
		ng_rng_seed(&r, ng_rng_mix64(key ^ (uint64_t)b));
		uint16_t *row = out + (size_t)b * (T + 1);
		int st = pick(s->pi_cum, s->states, ng_rng_uniform(&r));
		row[0] = s->tok[st];
		for (int t = 1; t <= T; t++) {
			st = s->succ[st][pick(s->cum[st], s->nsucc[st], ng_rng_uniform(&r))];
			row[t] = s->tok[st];
		}
	}
}

double ng_synth_prob(const struct ng_synth *s, uint16_t a, uint16_t b)
{
	int sa = -1;
	for (int i = 0; i < s->states; i++)
		if (s->tok[i] == a)
			sa = i;
	if (sa < 0)
		return 0;
	for (int j = 0; j < s->nsucc[sa]; j++)
		if (s->tok[s->succ[sa][j]] == b)
			return s->prob[sa][j];
	return 0;
}

void ng_synth_free(struct ng_synth *s) { memset(s, 0, sizeof(*s)); }
