/*
 * util/rng.h — the one random number generator of the project (xoshiro256**, seeded through
 * splitmix64). Parameter init, the synthetic corpus, data shuffling and sampling all draw from
 * it, so a seed means the same thing on the CPU path, the GPU path and in tests, on any libc.
 */
#ifndef NG_UTIL_RNG_H
#define NG_UTIL_RNG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ng_rng {
	uint64_t s[4]; /* xoshiro256** state; never all zero */
};

void ng_rng_seed(struct ng_rng *r, uint64_t seed);
/* splitmix64 of x: a stateless 64-bit mix, for deriving independent seeds and for hashing
 * (mix(seed ^ stream) seeds a stream; shuffles and hash tables use it too). */
uint64_t ng_rng_mix64(uint64_t x);
uint64_t ng_rng_u64(struct ng_rng *r);
/* Uniform in [0, n), unbiased (rejection). n > 0. */
uint64_t ng_rng_below(struct ng_rng *r, uint64_t n);
/* Uniform double in [0, 1) with 53 random bits. */
double ng_rng_uniform(struct ng_rng *r);
/* Standard normal (Box-Muller on two uniforms; no cached second value, so the stream is simple). */
double ng_rng_normal(struct ng_rng *r);

#ifdef __cplusplus
}
#endif

#endif
