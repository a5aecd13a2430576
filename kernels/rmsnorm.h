/*
 * kernels/rmsnorm.h — the speedrun model's normalisations and its MLP activation: the weightless
 * RMSNorm of rows, QK-norm fused with the half-truncated rotary on q and k of the merged qkv,
 * and relu^2, each forward and backward. bf16 in and out, fp32 inside; the semantics are those
 * of graph/cpu_spr_ops.h (the double-precision reference the tests compare against).
 * Shapes: rows N >= 1 (any), channels C % 8 == 0 with C <= 4096; heads of D channels with
 * D % 8 == 0 and 8 <= D <= 256; every bf16 pointer 16-byte aligned. relu^2 takes any n >= 1.
 * Valid C11; launchers return NG_OK or a recorded error (util/status.h).
 */
#ifndef NG_KERNELS_RMSNORM_H
#define NG_KERNELS_RMSNORM_H

#include <cuda_runtime.h>
#include <stddef.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out = inp / sqrt(mean(inp^2) + eps) per row, in fp32 (inp * rsqrtf(...)), rounded once.
 * out may equal inp (in place). */
enum ng_status ng_rmsnorm_fwd(ng_bf16 *out,       /* (N, C) bf16, = */
			      float *rstd,        /* (N) fp32, = 1 / sqrt(mean + eps) (or NULL) */
			      const ng_bf16 *inp, /* (N, C) bf16 */
			      int N, int C, float eps, cudaStream_t s);

/* dinp (accumulate ? += : =) rstd * (dout - y * mean(dout * y)), y = inp * rstd: the gradient
 * through ng_rmsnorm_fwd, summed in fp32 (with the old dinp when accumulating) and rounded once.
 * dinp may equal dout only when accumulate is 0. */
enum ng_status ng_rmsnorm_bwd(ng_bf16 *dinp,       /* (N, C) bf16, = or += */
			      const ng_bf16 *dout, /* (N, C) bf16 */
			      const ng_bf16 *inp,  /* (N, C) bf16, the forward's input */
			      const float *rstd,   /* (N) fp32, from the forward */
			      int N, int C, int accumulate, cudaStream_t s);

/* QK-norm then the half-truncated rotary on q and k of qkv (graph/cpu_spr_ops.h
 * ng_ref_qk_norm_rotary_fwd): for each row and each head of q and of k, y = x * rsqrtf(mean(x^2)
 * over its D channels + eps), then pair i = (y[i], y[i + D/2]) rotates by theta = pos * freq[i]
 * with pos = row % T: (y1 c + y2 s, -y1 s + y2 c). freq[i] is ng_ref_rotary_freqs's value
 * rounded to fp32, theta their fp32 product, and (c, s) = sincosf(theta) (the precise sincosf,
 * 2 ulp of fp32 at most over the whole range, so long sequences keep exact angles); pairs i >=
 * D/4 are not rotated. y is not rounded between the norm and the rotation.
 * out may equal qkv (in place: q and k overwritten, v untouched); otherwise v is copied. */
enum ng_status ng_qk_norm_rotary_fwd(ng_bf16 *out,       /* (N, 3, H, D) bf16, = */
				     float *rstd,        /* (N, 2, H) fp32, = (or NULL) */
				     const ng_bf16 *qkv, /* (N, 3, H, D) bf16 */
				     int N, int T, int H, int D, float eps, cudaStream_t s);

/* The backward from the forward's output: on entry the q and k parts of dqkv hold the gradient
 * with respect to the forward's output q and k; they are replaced by the gradient with respect
 * to its input q and k. With R the rotation of the forward and o = qkv_out = R y, the gradient
 * is rstd * R^T (dout - o * mean(dout * o)) (R is orthogonal, so dout . o = (R^T dout) . y).
 * The v part of dqkv is left as it is. */
enum ng_status ng_qk_norm_rotary_bwd(ng_bf16 *dqkv,          /* (N, 3, H, D) bf16, q, k = */
				     const ng_bf16 *qkv_out, /* (N, 3, H, D) bf16, the fwd out */
				     const float *rstd,      /* (N, 2, H) fp32, from the fwd */
				     int N, int T, int H, int D, cudaStream_t s);

/* out = max(inp, 0)^2 (exact in fp32, rounded once). */
enum ng_status ng_relu2_fwd(ng_bf16 *out,       /* (n) bf16, = */
			    const ng_bf16 *inp, /* (n) bf16 */
			    size_t n, cudaStream_t s);
/* dinp = 2 max(inp, 0) dout (exact in fp32, rounded once); dinp may equal dout. */
enum ng_status ng_relu2_bwd(ng_bf16 *dinp,       /* (n) bf16, = */
			    const ng_bf16 *inp,  /* (n) bf16, the forward's input */
			    const ng_bf16 *dout, /* (n) bf16 */
			    size_t n, cudaStream_t s);
/* The same from the forward's output out = max(inp, 0)^2: dinp = 2 sqrt(out) dout (fp32,
 * rounded once; 2 sqrt(out) is 2 max(inp, 0) to out's rounding, 2^-9 relative), for a forward
 * that keeps only out (our GEMM's relu^2 epilogue); dinp may equal dout. */
enum ng_status ng_relu2_bwd_from_out(ng_bf16 *dinp,       /* (n) bf16, = */
				     const ng_bf16 *out,  /* (n) bf16, max(inp, 0)^2 */
				     const ng_bf16 *dout, /* (n) bf16 */
				     size_t n, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
