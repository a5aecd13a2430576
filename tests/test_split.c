/*
 * tests/test_split.c — the split fp32 master (kernels/split.h) on the host: (hi, lo) joins back
 * to the exact bits of every finite fp32 (all 2^32 patterns, run in parallel), and hi is w
 * rounded to bf16 to nearest with ties away from zero, checked against a reference computed in
 * double (not the integer trick) on 10^6 random finite patterns and on the classes where
 * rounding goes wrong: exact ties (lo == 0x8000), +-0, denormals, values next to powers of two,
 * the largest floats (which round to infinity and still join back). Also: hi equals
 * round-to-nearest-even except on ties; infinities split exactly; a NaN stays a NaN.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "kernels/split.h"
#include "util/rng.h"

static uint64_t seed_(void)
{
	return (uint64_t)time(NULL) * 2654435761u;
}

/* hi by the definition, in double: |w| truncated to bf16 (t), one bf16 ulp at w's exponent;
 * round the magnitude up when |w| - t >= ulp / 2 (exact in double). */
static ng_bf16 ref_hi(uint32_t bits)
{
	uint32_t up = bits >> 16;
	double a = fabs((double)ng_split_float_(bits));
	double t = fabs((double)ng_split_float_(up << 16));
	int e = (int)((bits >> 23) & 0xFFu);
	double ulp = ldexp(1.0, (e ? e : 1) - 127 - 7);
	return (ng_bf16)(up + (a - t >= ulp / 2 ? 1u : 0u));
}

/* Round to nearest even, the classic integer form (finite inputs). */
static ng_bf16 rne_hi(uint32_t bits)
{
	return (ng_bf16)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static int is_finite_bits(uint32_t bits) { return (bits & 0x7F800000u) != 0x7F800000u; }

/* Checks one finite pattern; returns 0 and describes it in why[] when it fails. */
static int check_one(uint32_t bits, char *why, size_t n)
{
	ng_bf16 hi;
	uint16_t lo;
	ng_split_encode(ng_split_float_(bits), &hi, &lo);
	uint32_t back = ng_split_bits_(ng_split_decode(hi, lo));
	ng_bf16 want = ref_hi(bits);
	ng_bf16 rne = rne_hi(bits);
	if (back != bits || hi != want || lo != (bits & 0xFFFFu) ||
	    ((bits & 0xFFFFu) != 0x8000u && hi != rne)) {
		snprintf(why, n, "bits %#010x (%.9g): hi %#06x (want %#06x, RNE %#06x) lo %#06x, "
			 "joins to %#010x", bits, (double)ng_split_float_(bits), hi, want, rne, lo,
			 back);
		return 0;
	}
	return 1;
}

Test(split, random_finite_patterns)
{
	uint64_t seed = seed_();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	char why[200];
	int done = 0;
	while (done < 1000000) {
		uint32_t bits = (uint32_t)ng_rng_u64(&r);
		if (!is_finite_bits(bits))
			continue;
		cr_assert(check_one(bits, why, sizeof(why)), "%s; seed %llu", why,
			  (unsigned long long)seed);
		done++;
	}
}

Test(split, rounding_classes)
{
	uint64_t seed = seed_();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	char why[200];
	/* every exponent and sign, with the low mantissas around a tie and the carries into the
	 * next power of two; exponent 0: zeros and denormals; 0xFE: the largest floats, whose
	 * round-up is infinity */
	static const uint32_t mant[] = { 0x000000, 0x000001, 0x007FFF, 0x008000, 0x008001,
					 0x00FFFF, 0x010000, 0x018000, 0x7F0000, 0x7F7FFF,
					 0x7F8000, 0x7F8001, 0x7FFFFF, 0x3FFFFF, 0x400000 };
	for (uint32_t s = 0; s < 2; s++)
		for (uint32_t e = 0; e < 255; e++)
			for (size_t k = 0; k < sizeof(mant) / sizeof(mant[0]); k++) {
				uint32_t bits = (s << 31) | (e << 23) | mant[k];
				cr_assert(check_one(bits, why, sizeof(why)), "%s", why);
			}
	/* exact ties with random high halves, denormals with random mantissas */
	for (int i = 0; i < 100000; i++) {
		uint32_t u = (uint32_t)ng_rng_u64(&r);
		uint32_t tie = (u & 0xFFFF0000u) | 0x8000u;
		uint32_t den = (u & 0x807FFFFFu);
		if (is_finite_bits(tie))
			cr_assert(check_one(tie, why, sizeof(why)), "%s; seed %llu", why,
				  (unsigned long long)seed);
		cr_assert(check_one(den, why, sizeof(why)), "%s; seed %llu", why,
			  (unsigned long long)seed);
	}
	/* the signs of zero, and a tie's round-up goes away from zero for both signs */
	ng_bf16 hi;
	uint16_t lo;
	ng_split_encode(-0.0f, &hi, &lo);
	cr_expect(hi == 0x8000u && lo == 0 && signbit(ng_split_decode(hi, lo)), "-0: %#x %#x", hi,
		  lo);
	ng_split_encode(ng_split_float_(0x3F808000u), &hi, &lo); /* 1 + 2^-8: a tie */
	cr_expect(hi == 0x3F81u, "tie above 1 rounds up in magnitude: %#x", hi);
	ng_split_encode(ng_split_float_(0xBF808000u), &hi, &lo);
	cr_expect(hi == 0xBF81u, "tie below -1 rounds down (away from zero): %#x", hi);
	ng_split_encode(ng_split_float_(0x7F7FFFFFu), &hi, &lo); /* FLT_MAX */
	cr_expect(hi == 0x7F80u && ng_split_bits_(ng_split_decode(hi, lo)) == 0x7F7FFFFFu,
		  "FLT_MAX: the bf16 copy is infinity and the master joins back: %#x", hi);
}

Test(split, infinities_and_nan)
{
	ng_bf16 hi;
	uint16_t lo;
	for (int s = 0; s < 2; s++) {
		float inf = s ? -INFINITY : INFINITY;
		ng_split_encode(inf, &hi, &lo);
		cr_expect(ng_split_decode(hi, lo) == inf && lo == 0, "inf splits exactly");
	}
	static const uint32_t nans[] = { 0x7FC00000u, 0x7F800001u, 0x7F808000u, 0x7FFFFFFFu,
					 0xFFFFFFFFu, 0xFF80FFFFu };
	for (size_t i = 0; i < sizeof(nans) / sizeof(nans[0]); i++) {
		ng_split_encode(ng_split_float_(nans[i]), &hi, &lo);
		cr_expect((hi & 0x7F80u) == 0x7F80u && (hi & 0x7Fu) != 0,
			  "NaN %#010x: the bf16 copy %#06x must be a NaN", nans[i], hi);
		cr_expect(isnan(ng_split_decode(hi, lo)), "NaN %#010x must join to a NaN", nans[i]);
	}
}

/* Every finite pattern joins back exactly, and hi is the integer rule (RNE off ties, the
 * round-up on ties); the double reference runs on the samples above. */
Test(split, every_finite_pattern_round_trips, .timeout = 300)
{
	uint64_t bad = 0, first = UINT64_MAX;
#pragma omp parallel for schedule(static) reduction(+ : bad) reduction(min : first)
	for (int64_t i = 0; i < (int64_t)1 << 32; i++) {
		uint32_t bits = (uint32_t)i;
		if (!is_finite_bits(bits))
			continue;
		ng_bf16 hi;
		uint16_t lo;
		ng_split_encode(ng_split_float_(bits), &hi, &lo);
		ng_bf16 want = (bits & 0xFFFFu) == 0x8000u ? (ng_bf16)((bits >> 16) + 1u)
							    : rne_hi(bits);
		if (ng_split_bits_(ng_split_decode(hi, lo)) != bits || hi != want) {
			bad++;
			first = (uint64_t)bits < first ? (uint64_t)bits : first;
		}
	}
	cr_assert(bad == 0, "%llu finite patterns fail, the first %#010llx",
		  (unsigned long long)bad, (unsigned long long)first);
}
