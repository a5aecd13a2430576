/*
 * kernels/mix.h — the two-term mix of the speedrun model's learned scalars, forward and
 * backward: the x0 mixing (x = l0 x + l1 x0), the value mixing (v = a0 v + a1 ve, v inside the
 * fused qkv buffer) and the U-net skip (x = x + w_j skip). Reference: ng_ref_mix2_fwd/bwd
 * (graph/cpu_spr_ops.h).
 * Shapes: (N, C) matrices, each operand with its own leading dimension (elements, >= C), bf16;
 * the scalars are device fp32 pointers to one float each (the step changes them, so they are
 * data, never launch arguments). Math in fp32, each output rounded once.
 * 16-byte vector loads when C % 8 == 0 and every operand used is 16-byte aligned with ld % 8 ==
 * 0 (the model's (49152, 768) matrices, ld 768 or 2304); any other shape takes a scalar path.
 * Valid C11; launchers return NG_OK or a recorded error.
 */
#ifndef NG_KERNELS_MIX_H
#define NG_KERNELS_MIX_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[r, c] = a * u[r, c] + b * w[r, c] (w NULL: a * u[r, c]); a or b NULL means 1.0. Computed
 * in fp32, rounded once to bf16. out may equal u (same ld): in place. */
enum ng_status ng_mix2_fwd(ng_bf16 *out, int ld_out, /* (N, C) bf16, = */
			   const float *a,           /* device scalar fp32, or NULL (1.0) */
			   const ng_bf16 *u, int ld_u, /* (N, C) bf16 */
			   const float *b,           /* device scalar fp32, or NULL (1.0) */
			   const ng_bf16 *w, int ld_w, /* (N, C) bf16, or NULL */
			   int N, int C, cudaStream_t s);

/* The backward of ng_mix2_fwd (ng_ref_mix2_bwd), every output optional (NULL skips it):
 *   du = (du_acc ? du : 0) + a * dout, dw likewise with dw_acc and b (bf16, rounded once);
 *   *da += sum(dout * u), *db += sum(dout * w) (fp32): per-block fp32 partials over a grid that
 *   depends on (N, C) alone, in scratch (ng_mix2_bwd_scratch_bytes(N, C) bytes, 16-byte
 *   aligned; may be NULL when da and db are), then summed in double in block order: the same
 *   bits every run, no atomics.
 * u is read only for da, w only for db (either may be NULL when its scalar's gradient is). du may
 * equal dout (same ld) when du_acc is 0: in place. a or b NULL means 1.0. */
enum ng_status ng_mix2_bwd(ng_bf16 *du, int ld_du, int du_acc, /* (N, C) bf16, = or += */
			   ng_bf16 *dw, int ld_dw, int dw_acc, /* (N, C) bf16, = or += */
			   float *da,                          /* device scalar fp32, += */
			   float *db,                          /* device scalar fp32, += */
			   const ng_bf16 *dout, int ld_dout,   /* (N, C) bf16 */
			   const float *a,                     /* device scalar fp32, or NULL */
			   const ng_bf16 *u, int ld_u,         /* (N, C) bf16, the forward's u */
			   const float *b,                     /* device scalar fp32, or NULL */
			   const ng_bf16 *w, int ld_w,         /* (N, C) bf16, the forward's w */
			   int N, int C, void *scratch, cudaStream_t s);
size_t ng_mix2_bwd_scratch_bytes(int N, int C);

#ifdef __cplusplus
}
#endif

#endif
