/*
 * kernels/decode.h — the kernels of one-token generation with a KV cache (graph/sampler.c):
 * one row of activations in fp32, weights in bf16 (the copy the training forward reads).
 * Every per-token value — the position, the token, the RNG counter — lives in device memory,
 * so the launches can be captured once as a CUDA Graph and replayed per token.
 *
 * Position protocol: *pos is the position being processed; tokens[*pos] its input token. The
 * sampler kernel writes tokens[*pos + 1] (unless that position belongs to the prompt) and then
 * advances *pos. Shapes: C = H * D, D % 8 == 0 and D <= 256, Tmax the context length.
 */
#ifndef NG_KERNELS_DECODE_H
#define NG_KERNELS_DECODE_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x = wte[tokens[*pos]] + wpe[*pos]. */
enum ng_status ng_decode_embed(float *x,              /* (C) fp32, = */
			       const ng_bf16 *wte,    /* (Vp, C) bf16 */
			       const ng_bf16 *wpe,    /* (Tmax, C) bf16 */
			       const int32_t *tokens, /* (Tmax) int32, device */
			       const int *pos,        /* device scalar */
			       int C, cudaStream_t s);

/* out = (x - mean) / sqrt(var + 1e-5) * w + b, one row (one block). */
enum ng_status ng_decode_layernorm(float *out,          /* (C) fp32, = */
				   const float *x,      /* (C) fp32 */
				   const ng_bf16 *w,    /* (C) bf16 */
				   const ng_bf16 *b,    /* (C) bf16 */
				   int C, cudaStream_t s);

/* The epilogue activation of ng_decode_gemv. */
enum ng_decode_act {
	NG_DECODE_ACT_NONE = 0,  /* y */
	NG_DECODE_ACT_GELU = 1,  /* GELU (tanh form): GPT-2's MLP */
	NG_DECODE_ACT_RELU2 = 2, /* max(y, 0)^2: the speedrun model's MLP */
};

/* y = W x + bias, then the activation act (enum ng_decode_act); out = y, or out += y when
 * accumulate (the residual add). A warp per output row. IC % 8 == 0; W 16-byte aligned; out
 * must not alias x. */
enum ng_status ng_decode_gemv(float *out,          /* (OC) fp32, = or += */
			      const ng_bf16 *W,    /* (OC, IC) bf16, row-major (torch Linear) */
			      const ng_bf16 *bias, /* (OC) bf16, or NULL */
			      const float *x,      /* (IC) fp32, 16-byte aligned */
			      int IC, int OC, int act, int accumulate, cudaStream_t s);

/* Causal attention of position *pos: k and v of qkv go into row *pos of the caches, then
 * out[h] = softmax(q_h . K_h[0..pos] / sqrt(D)) V_h[0..pos]. One block per head. */
enum ng_status ng_decode_attention(float *out,         /* (C) fp32, = */
				   float *kcache,      /* (Tmax, C) fp32, row *pos written */
				   float *vcache,      /* (Tmax, C) fp32, row *pos written */
				   const float *qkv,   /* (3C) fp32: [q | k | v], head h at h*D */
				   const int *pos,     /* device scalar */
				   int H, int D, int Tmax, cudaStream_t s);

/* ng_decode_attention with the speedrun model's mask and scale: the query at p = *pos sees the
 * cache rows [lo, p], lo = max(*doc_start, ng_attention_window_first(p, window, block))
 * (kernels/window.h; doc_start NULL: 0; window <= 0: no window; block >= 1 the window's
 * granularity: 1, the last `window` tokens; the speedrun's 128, its reference's block window),
 * with scores scale * q_h . K_h. The cache rows of p get k and v of qkv as there.
 * Shared memory: D + min(the window in whole blocks, at least one, Tmax) floats (window <= 0:
 * D + Tmax), at most 48 KiB. */
enum ng_status ng_decode_attention_masked(float *out,           /* (C) fp32, = */
					  float *kcache,        /* (Tmax, C) fp32, row *pos = */
					  float *vcache,        /* (Tmax, C) fp32, row *pos = */
					  const float *qkv,     /* (3C) fp32: [q | k | v] */
					  const int *pos,       /* device scalar */
					  const int *doc_start, /* device scalar, or NULL */
					  int window, int block, float scale, int H, int D,
					  int Tmax, cudaStream_t s);

/* Next token: when *pos + 1 >= *n_prompt, tokens[*pos + 1] = a draw from softmax(logits[0..V)
 * / temperature) restricted to the top_k largest (top_k 0: all V; temperature <= 0: argmax),
 * with uniform numbers hashed from (seed, *pos) — a counter-based RNG, so replays need no host
 * state. Then *pos += 1. Ties in the top-k order go to the lower index. One block. */
enum ng_status ng_decode_sample(int32_t *tokens,       /* (Tmax) int32, device */
				int *pos,              /* device scalar, += 1 */
				const int *n_prompt,   /* device scalar */
				const float *logits,   /* (>= V) fp32 */
				int V, int top_k, float temperature, uint64_t seed,
				cudaStream_t s);
#define NG_DECODE_MAX_TOP_K 1024

#ifdef __cplusplus
}
#endif

#endif
