/*
 * kernels/layernorm.h — LayerNorm (eps 1e-5, biased variance, affine), forward (optionally with
 * an E4M3 copy of its output) and backward. Statistics are fp32, activations bf16.
 * Shapes: rows N (= B*T tokens), channels C with C % 8 == 0; every bf16 pointer 16-byte aligned.
 * Valid C11; launchers return NG_OK or a recorded error (util/status.h).
 */
#ifndef NG_KERNELS_LAYERNORM_H
#define NG_KERNELS_LAYERNORM_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out = (inp - mean) * rstd * w + b. mean and rstd may be NULL (inference). */
enum ng_status ng_layernorm_fwd(ng_bf16 *out,        /* (N, C) bf16, = */
				float *mean,         /* (N) fp32, = (or NULL) */
				float *rstd,         /* (N) fp32, = (or NULL) */
				const ng_bf16 *inp,  /* (N, C) bf16 */
				const ng_bf16 *w,    /* (C) bf16 */
				const ng_bf16 *b,    /* (C) bf16 */
				int N, int C, cudaStream_t s);

/* The forward with an E4M3 copy of `out` for an fp8 matmul (kernels/fp8.h): out8 =
 * E4M3(bf16 out * *scale8), byte for byte what ng_fp8_cast_e4m3 of `out` gives, and the
 * maximum |out| max= into amax8[(row % NG_FP8_AMAX_SUB) * NG_FP8_AMAX_STRIDE] (one atomic per
 * row, spread over those NG_FP8_AMAX_SUB lines: the slot's maximum is theirs; amax8 holds
 * NG_FP8_AMAX_FLOATS floats). out8 8-byte aligned; out8 NULL is
 * the plain forward. */
enum ng_status ng_layernorm_fwd_fp8(ng_bf16 *out, uint8_t *out8, const float *scale8,
				    float *amax8, float *mean, float *rstd, const ng_bf16 *inp,
				    const ng_bf16 *w, const ng_bf16 *b, int N, int C,
				    cudaStream_t s);

/* dinp += d(loss)/d(inp); dw += sum_rows dout * xhat; db += sum_rows dout. Deterministic:
 * fixed-order per-block partials in scratch (ng_layernorm_bwd_scratch_bytes(N, C) bytes,
 * 16-byte aligned), then a fixed-order reduce. */
enum ng_status ng_layernorm_bwd(ng_bf16 *dinp,       /* (N, C) bf16, += (residual gradient) */
				float *dw,           /* (C) fp32, += */
				float *db,           /* (C) fp32, += */
				const ng_bf16 *dout, /* (N, C) bf16 */
				const ng_bf16 *inp,  /* (N, C) bf16, the forward's input */
				const ng_bf16 *w,    /* (C) bf16 */
				const float *mean,   /* (N) fp32, from the forward */
				const float *rstd,   /* (N) fp32, from the forward */
				int N, int C, void *scratch, cudaStream_t s);
size_t ng_layernorm_bwd_scratch_bytes(int N, int C);

#ifdef __cplusplus
}
#endif

#endif
