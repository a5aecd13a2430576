/*
 * kernels/encoder.h — token + position embedding, forward and backward (GPT-2 input layer), and
 * the plain embedding lookup without positions (the speedrun model's wte and value embeddings).
 * Shapes: tokens (B, T) int32 in [0, Vp); wte (Vp, C) bf16; wpe (>= T, C) bf16; out (B*T, C) bf16.
 * The backward is deterministic and needs no host work (a device radix sort of the tokens with
 * cub, then each token's positions summed in position order), so it can be captured in a graph.
 * Valid C11; launchers return NG_OK or a recorded error (util/status.h).
 */
#ifndef NG_KERNELS_ENCODER_H
#define NG_KERNELS_ENCODER_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:], rounded to bf16. C % 8 == 0, pointers 16-byte
 * aligned. */
enum ng_status ng_encoder_fwd(ng_bf16 *out,           /* (B*T, C) bf16, = */
			      const int32_t *tokens,  /* (B, T) int32 */
			      const ng_bf16 *wte,     /* (Vp, C) bf16 */
			      const ng_bf16 *wpe,     /* (>= T, C) bf16 */
			      int B, int T, int C, cudaStream_t s);

/* dwte[v,:] += sum over positions holding token v of dout; dwpe[t,:] += sum over b of dout[b,t]
 * (dwpe NULL: no position table, skipped). Deterministic (fixed summation order). scratch:
 * ng_encoder_bwd_scratch_bytes(B, T, C) bytes, 16-byte aligned. */
enum ng_status ng_encoder_bwd(float *dwte,            /* (Vp, C) fp32, += */
			      float *dwpe,            /* (>= T, C) fp32, +=; or NULL */
			      const ng_bf16 *dout,    /* (B*T, C) bf16 */
			      const int32_t *tokens,  /* (B, T) int32 */
			      int B, int T, int C, int Vp, void *scratch, size_t scratch_bytes,
			      cudaStream_t s);
size_t ng_encoder_bwd_scratch_bytes(int B, int T, int C);

/* The same in two parts, so that the sort (it depends on the tokens alone) can run early, beside
 * the forward, on another stream (the step does: graph/ir.h ENCODER_SORT):
 * ng_encoder_bwd_sort writes `sorted` (ng_encoder_bwd_sorted_bytes(B, T) bytes) from the tokens;
 * ng_encoder_bwd_sorted adds the gradients from it, with `work` (ng_encoder_bwd_work_bytes)
 * of its own (dwpe may be NULL, as there). Both pointers 16-byte aligned. The two give the bits
 * of ng_encoder_bwd. */
enum ng_status ng_encoder_bwd_sort(void *sorted, size_t sorted_bytes, const int32_t *tokens, int B,
				   int T, int Vp, cudaStream_t s);
enum ng_status ng_encoder_bwd_sorted(float *dwte, float *dwpe, const ng_bf16 *dout,
				     const void *sorted, int B, int T, int C, int Vp, void *work,
				     size_t work_bytes, cudaStream_t s);
size_t ng_encoder_bwd_sorted_bytes(int B, int T);
size_t ng_encoder_bwd_work_bytes(int B, int T, int C);

/* Embedding lookup without positions: out[r,:] = table[tok[r],:] (the bits of the table row).
 * C % 8 == 0, out and table 16-byte aligned; tok (N) in [0, rows). */
enum ng_status ng_embed_fwd(ng_bf16 *out,          /* (N, C) bf16, = */
			    const ng_bf16 *table,  /* (rows, C) bf16 */
			    const int32_t *tok,    /* (N) int32 */
			    int N, int C, cudaStream_t s);

/* dtable[v,:] += sum over the rows r with tok[r] == v of dout[r,:], in increasing r: the
 * encoder's backward with B = 1, T = N and no position table (deterministic, capturable).
 * scratch: ng_embed_bwd_scratch_bytes(N, C) bytes, 16-byte aligned. Tables that share the
 * tokens (the speedrun's wte and its value embeddings) can share one sort instead:
 * ng_encoder_bwd_sort(sorted, .., tok, 1, N, rows, s) once, then per table
 * ng_encoder_bwd_sorted(dtable, NULL, dout, sorted, 1, N, C, rows, work, .., s). */
enum ng_status ng_embed_bwd(float *dtable,         /* (rows, C) fp32, += */
			    const ng_bf16 *dout,   /* (N, C) bf16 */
			    const int32_t *tok,    /* (N) int32 */
			    int N, int C, int rows, void *scratch, size_t scratch_bytes,
			    cudaStream_t s);
size_t ng_embed_bwd_scratch_bytes(int N, int C);

#ifdef __cplusplus
}
#endif

#endif
