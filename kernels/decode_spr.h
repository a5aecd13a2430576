/*
 * kernels/decode_spr.h — the one-token decode kernels the speedrun model adds to kernels/decode.h
 * (graph/sampler_spr.c): the embedding with its RMSNorm and the document-start tracking, the
 * one-row weightless RMSNorm, the two-term scalar mix, QK-norm + rotary with the value mixing
 * at the device position, and the soft cap of the logits. Activations fp32, weights bf16, the
 * model's scalars fp32 device values; every per-token value (position, token, document start)
 * is read from device memory, so the launches can be captured once and replayed per token.
 * The semantics are graph/cpu_spr_decode.h's (the double-precision reference the tests compare
 * against). Shapes: C % 8 == 0, C = H * D, D % 8 == 0 and 8 <= D <= 256. The training kernels
 * of these ops (kernels/rmsnorm.h, kernels/mix.h) read and write bf16 rows and take positions
 * from the row index, so they do not fit the decode step's fp32 row at a device position.
 */
#ifndef NG_KERNELS_DECODE_SPR_H
#define NG_KERNELS_DECODE_SPR_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x = x0 = rmsnorm(wte[tokens[*pos]]) (fp32, eps), and the document start: *doc_start = *pos
 * when *pos == 0 or tokens[*pos] == bos, else unchanged. One block. */
enum ng_status ng_decode_spr_embed(float *x,              /* (C) fp32, = */
				   float *x0,             /* (C) fp32, = */
				   int *doc_start,        /* device scalar, = or unchanged */
				   const ng_bf16 *wte,    /* (Vp, C) bf16 */
				   const int32_t *tokens, /* (Tmax) int32, device */
				   const int *pos,        /* device scalar */
				   int32_t bos, int C, float eps, cudaStream_t s);

/* out = x / sqrt(mean(x^2) + eps), one row (one block). out must not alias x. */
enum ng_status ng_decode_rmsnorm(float *out,     /* (C) fp32, = */
				 const float *x, /* (C) fp32 */
				 int C, float eps, cudaStream_t s);

/* out = a * u + b * w (w NULL: a * u); a or b NULL means 1.0. out may equal u. */
enum ng_status ng_decode_mix2(float *out,     /* (n) fp32, = */
			      const float *a, /* device scalar fp32, or NULL */
			      const float *u, /* (n) fp32 */
			      const float *b, /* device scalar fp32, or NULL */
			      const float *w, /* (n) fp32, or NULL */
			      int n, cudaStream_t s);

/* In place on qkv ([q | k | v], head h at h*D of each): q and k of every head RMS-normed over
 * its D channels (x * rsqrtf(mean(x^2) + eps)), then pair i = (y[i], y[i + D/2]), i < D/4,
 * rotated by theta = *pos * freq[i] (freq as kernels/rmsnorm.h: (1/1024)^(i / (D/4 - 1)) in
 * double rounded to fp32, theta their fp32 product, the precise sincosf): (y1 c + y2 s,
 * -y1 s + y2 c); v = a0 v + a1 ve[tokens[*pos]] (ve NULL: a0 v). One block per head. */
enum ng_status ng_decode_spr_qk_rotary(float *qkv,            /* (3C) fp32, in place */
				       const ng_bf16 *ve,     /* (Vp, C) bf16, or NULL */
				       const int32_t *tokens, /* (Tmax) int32, device */
				       const int *pos,        /* device scalar */
				       const float *a0,       /* device scalar fp32 */
				       const float *a1,       /* device scalar fp32 */
				       int H, int D, float eps, cudaStream_t s);

/* z = cap * sigmoid(z / div) in place (cap / (1 + expf(-z / div))), n values. cap, div > 0. */
enum ng_status ng_decode_softcap(float *z, /* (n) fp32, in place */
				 int n, float cap, float div, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
