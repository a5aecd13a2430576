/*
 * data/synth.h — the built-in synthetic corpus: a seeded random sparse Markov chain whose entropy
 * rate is known exactly, so `nanograph train` runs with no download and can print the loss floor
 * beside the validation loss.
 *
 * The chain lives on S = min(256, vocab) states; state s emits token id tok[s] (S distinct ids
 * spread over [0, vocab), so the model's whole embedding table is in play). Each state has k in
 * [4, 16] successors (at most S) with random probabilities; successor (s+1) mod S is always among
 * them (irreducible) and state 0 may follow itself (aperiodic), so the stationary distribution pi
 * is unique. Every window starts from a pi-distributed state, so each position's best possible
 * loss is the entropy rate  H = sum_s pi_s * H(P_s)  (nats), which ng_synth_entropy returns.
 * With ~256 states of 4..16 successors a tiny transformer learns the bigram table in a few hundred
 * steps and approaches H.
 */
#ifndef NG_DATA_SYNTH_H
#define NG_DATA_SYNTH_H

#include <stdint.h>

#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NG_SYNTH_MAX_STATES 256
#define NG_SYNTH_MAX_SUCC 16

struct ng_synth {
	int vocab;                                   /* token ids are < vocab */
	int states;                                  /* S = min(256, vocab) */
	uint64_t seed;                               /* the chain and every batch derive from it */
	double entropy;                              /* H in nats per token */
	uint16_t tok[NG_SYNTH_MAX_STATES];           /* (S,) token id of each state */
	int nsucc[NG_SYNTH_MAX_STATES];              /* (S,) successors of each state, k */
	uint16_t succ[NG_SYNTH_MAX_STATES][NG_SYNTH_MAX_SUCC]; /* (S, k) successor states */
	double prob[NG_SYNTH_MAX_STATES][NG_SYNTH_MAX_SUCC];   /* (S, k) transition probabilities */
	double cum[NG_SYNTH_MAX_STATES][NG_SYNTH_MAX_SUCC];    /* (S, k) running sums, last = 1 */
	double pi[NG_SYNTH_MAX_STATES];              /* (S,) stationary distribution */
	double pi_cum[NG_SYNTH_MAX_STATES];          /* (S,) running sums of pi, last = 1 */
};

/* Build the chain for `vocab` (2..65536) from `seed`. */
enum ng_status ng_synth_init(struct ng_synth *s, int vocab, uint64_t seed);
/* Nats per token: the loss floor. */
double ng_synth_entropy(const struct ng_synth *s);
/* Fill out with B windows of T+1 tokens, (B, T+1) row-major. `stream` picks a disjoint,
 * deterministic stream (train vs val, rank), `index` the batch number: batch (stream, index) is
 * always the same tokens, on any machine. */
void ng_synth_batch(const struct ng_synth *s, uint64_t stream, uint64_t index, int B, int T,
		    uint16_t *out);
/* Probability that token b follows token a (0 when b cannot follow a or a is not a state);
 * for tests and for reporting. */
double ng_synth_prob(const struct ng_synth *s, uint16_t a, uint16_t b);
void ng_synth_free(struct ng_synth *s);

#ifdef __cplusplus
}
#endif

#endif
