/*
 * util/rng.c — xoshiro256** (Blackman & Vigna, 2018) with splitmix64 seeding. See rng.h.
 */
#include "util/rng.h"

#include <math.h>

uint64_t ng_rng_mix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void ng_rng_seed(struct ng_rng *r, uint64_t seed)
{
	/* splitmix64 as a generator: the state advances by the golden-ratio step */
	for (int i = 0; i < 4; i++, seed += 0x9e3779b97f4a7c15ull)
		r->s[i] = ng_rng_mix64(seed);
}

uint64_t ng_rng_u64(struct ng_rng *r)
{
	uint64_t *s = r->s;
	uint64_t result = rotl(s[1] * 5, 7) * 9;
	uint64_t t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return result;
}

uint64_t ng_rng_below(struct ng_rng *r, uint64_t n)
{
	uint64_t limit = UINT64_MAX - UINT64_MAX % n; /* reject the incomplete last block */
	uint64_t x;
	do
		x = ng_rng_u64(r);
	while (x >= limit);
	return x % n;
}

double ng_rng_uniform(struct ng_rng *r) { return (double)(ng_rng_u64(r) >> 11) * 0x1.0p-53; }

double ng_rng_normal(struct ng_rng *r)
{
	double u1 = 1.0 - ng_rng_uniform(r); /* (0, 1]: log is finite */
	double u2 = ng_rng_uniform(r);
	return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
