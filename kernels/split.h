/*
 * kernels/split.h — the fp32 master weight stored as two 16-bit halves ("split master"): the
 * bf16 copy that the forward and backward read (hi) and a low half (lo), which together hold the
 * fp32 master exactly. 4 bytes a parameter instead of 6 (fp32 master + bf16 copy), with no change
 * to the optimizer's arithmetic: AdamW joins (hi, lo) into the fp32 master, updates it as before
 * and splits it again.
 *
 * On the bit pattern `bits` of w:
 *   lo = bits & 0xFFFF
 *   hi = (bits >> 16) + (lo >= 0x8000)           the bf16 of w, rounded to nearest with ties
 *                                                away from zero (the +1 on the sign-magnitude
 *                                                pattern grows |w|, right for both signs)
 *   bits = ((hi - (lo >= 0x8000)) << 16) | lo    exact, in 16-bit wrap-around arithmetic
 * hi differs from round-to-nearest-even only on exact ties (lo == 0x8000). A finite w whose
 * magnitude rounds past the largest bf16 gets hi = infinity and still joins back exactly.
 * A NaN (not a value AdamW makes from finite inputs) is split as a quiet NaN in hi and lo = 0,
 * so the bf16 copy of a NaN master stays a NaN; its payload is not kept.
 *
 * Bodies in a header on purpose: the same few lines serve host C (uploads, checkpoints, tests)
 * and CUDA (kernels/optim.cu), so there is one definition of the encoding. Valid C11.
 */
#ifndef NG_KERNELS_SPLIT_H
#define NG_KERNELS_SPLIT_H

#include <stdint.h>
#include <string.h>

#include "kernels/types.h"

#ifdef __CUDACC__
#define NG_SPLIT_FN_ static inline __host__ __device__
#else
#define NG_SPLIT_FN_ static inline
#endif

/* The 32-bit pattern of w, and back (memcpy: defined in C and in CUDA device code, and
 * compiled to a register move). */
NG_SPLIT_FN_ uint32_t ng_split_bits_(float w)
{
	uint32_t u;
	memcpy(&u, &w, sizeof(u));
	return u;
}

NG_SPLIT_FN_ float ng_split_float_(uint32_t u)
{
	float w;
	memcpy(&w, &u, sizeof(w));
	return w;
}

/* w -> (hi = its bf16 copy, lo = its low 16 bits); see the top of the file. */
NG_SPLIT_FN_ void ng_split_encode(float w, ng_bf16 *hi, uint16_t *lo)
{
	uint32_t bits = ng_split_bits_(w);
	if ((bits & 0x7FFFFFFFu) > 0x7F800000u) { /* NaN: keep it a NaN in the bf16 copy */
		*hi = (ng_bf16)((bits >> 16) | 0x0040u);
		*lo = 0;
		return;
	}
	uint16_t l = (uint16_t)(bits & 0xFFFFu);
	*hi = (ng_bf16)((bits >> 16) + (l >= 0x8000u ? 1u : 0u));
	*lo = l;
}

/* (hi, lo) -> w, exactly the w that ng_split_encode split. */
NG_SPLIT_FN_ float ng_split_decode(ng_bf16 hi, uint16_t lo)
{
	uint16_t h = (uint16_t)(hi - (lo >= 0x8000u ? 1u : 0u));
	return ng_split_float_(((uint32_t)h << 16) | lo);
}

#undef NG_SPLIT_FN_

#endif
