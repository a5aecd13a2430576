/*
 * kernels/elementwise.h — the small memory-bound kernels of the step: GELU (tanh approximation)
 * forward and backward, the bias gradient, fp32 <-> bf16 casts, a bf16 transpose, and splitting
 * token windows into inputs and targets.
 * Vector kernels use 16-byte loads: bf16 pointers must be 16-byte aligned; any n is accepted
 * (a scalar tail handles n % 8). Valid C11; launchers return NG_OK or a recorded error.
 */
#ifndef NG_KERNELS_ELEMENTWISE_H
#define NG_KERNELS_ELEMENTWISE_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
enum ng_status ng_gelu_fwd(ng_bf16 *out,       /* (n) bf16, = */
			   const ng_bf16 *inp, /* (n) bf16 */
			   size_t n, cudaStream_t s);

/* dinp = gelu'(inp) * dout; dinp may alias dout. */
enum ng_status ng_gelu_bwd(ng_bf16 *dinp,       /* (n) bf16, = */
			   const ng_bf16 *inp,  /* (n) bf16 */
			   const ng_bf16 *dout, /* (n) bf16 */
			   size_t n, cudaStream_t s);

/* The GELU backward with what the step does around it, in one pass over the rows (the FC layer
 * of the step when the DGELU epilogue is not fused):
 *   dinp (N, OC) bf16 = gelu'(inp) * dout, as ng_gelu_bwd; dinp may alias dout;
 *   gelu_out (N, OC) bf16 = gelu(inp), as ng_gelu_fwd, unless gelu_out is NULL (--recompute
 *     gelu: the activation the FC-proj weight gradient reads, recomputed from the same inp);
 *   dbias (OC) fp32 = (accumulate: dbias +) the column sums of dinp as stored (bf16), summed in
 *     fp32 over fixed row chunks in scratch and then in chunk order (deterministic, no
 *     atomics); ng_bias_grad_scratch_bytes(N, OC) bytes, 16-byte aligned.
 * OC % 8 == 0; bf16 pointers 16-byte aligned. */
enum ng_status ng_gelu_bwd_bias(ng_bf16 *dinp,       /* (N, OC) bf16, = */
				ng_bf16 *gelu_out,   /* (N, OC) bf16, =; or NULL */
				float *dbias,        /* (OC) fp32, = or += */
				int accumulate,
				const ng_bf16 *inp,  /* (N, OC) bf16, the pre-activation */
				const ng_bf16 *dout, /* (N, OC) bf16 */
				int N, int OC, void *scratch, cudaStream_t s);

/* dbias += sum over rows of dout. Deterministic (fixed-order partials in scratch, 16-byte
 * aligned, ng_bias_grad_scratch_bytes(N, OC) bytes). OC % 8 == 0. */
enum ng_status ng_bias_grad(float *dbias,        /* (OC) fp32, += */
			    const ng_bf16 *dout, /* (N, OC) bf16 */
			    int N, int OC, void *scratch, cudaStream_t s);
size_t ng_bias_grad_scratch_bytes(int N, int OC);

/* dbias (OC) fp32 = (accumulate: dbias +) the sum of part's rows, in row order (deterministic):
 * the reduce of per-chunk column sums that a producer wrote (ng_gemm_sm90_dgelu's part). part
 * 16-byte aligned, (rows, OC) fp32. */
enum ng_status ng_bias_grad_reduce(float *dbias, const float *part, int rows, int OC,
				   int accumulate, cudaStream_t s);

/* out[i] (C, R) = the transpose of in[i] (R, C) for i < count, both row-major bf16, the count
 * matrices back to back (exact: a copy). Any R, C >= 1, count 1..65535; out must not overlap
 * in. */
enum ng_status ng_transpose_bf16(ng_bf16 *out,       /* (count, C, R) bf16, = */
				 const ng_bf16 *in,  /* (count, R, C) bf16 */
				 int R, int C, int count, cudaStream_t s);

/* out = round-to-nearest-even bf16 of in. */
enum ng_status ng_cast_f32_to_bf16(ng_bf16 *out,     /* (n) bf16, = */
				   const float *in,  /* (n) fp32, 16-byte aligned */
				   size_t n, cudaStream_t s);
enum ng_status ng_cast_bf16_to_f32(float *out,         /* (n) fp32, =, 16-byte aligned */
				   const ng_bf16 *in,  /* (n) bf16 */
				   size_t n, cudaStream_t s);

/* inputs[b,t] = windows[b,t]; targets[b,t] = windows[b,t+1] (token windows of T+1). */
enum ng_status ng_tokens_split(int32_t *inputs,          /* (B, T) int32, = */
			       int32_t *targets,         /* (B, T) int32, = */
			       const uint16_t *windows,  /* (B, T+1) uint16 */
			       int B, int T, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
