/*
 * kernels/softcap.h — the speedrun model's soft-capped cross-entropy over the head's raw logits:
 * s = cap * sigmoid(z / div) (fp32), softmax cross-entropy of s over all Vp columns (the padded
 * vocabulary included, as the reference model does), and its gradient written over z in place
 * (bf16) or, for an FP8 backward, scaled and cast to E5M2 bytes in a separate buffer.
 * Reference: ng_ref_softcap_crossentropy (graph/cpu_spr_ops.h).
 * Shapes: z (N, Vp) bf16, any Vp (16-byte vector loads when Vp % 8 == 0 and z is 16-byte
 * aligned, else a scalar path); g8 (N, Vp) E5M2 bytes (8-byte stores on the vector paths when
 * it is 8-byte aligned); targets (N) int32 in [0, Vp); losses (N) fp32. N is any number
 * of rows, so the head can be run over token chunks. 0 < cap <= 64 (softcap.cu says why), div
 * > 0 (the model: cap 30, div 7.5 sqrt(C)).
 * Valid C11; launchers return NG_OK or a recorded error.
 */
#ifndef NG_KERNELS_SOFTCAP_H
#define NG_KERNELS_SOFTCAP_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* losses[n] = logsumexp(s[n, :]) - s[n, target]; z is overwritten in place by
 * dz = dloss * (softmax(s) - onehot(target)) * s (1 - s / cap) / div (bf16). dloss is a host
 * float, a constant of the plan as in ng_crossentropy (the graph captures it). A target outside
 * [0, Vp) gives loss NaN (so the step is skipped) and no onehot term. */
enum ng_status ng_softcap_crossentropy(float *losses,          /* (N) fp32, = */
				       ng_bf16 *z,             /* (N, Vp) bf16: z in, dz out */
				       const int32_t *targets, /* (N) int32 */
				       int N, int Vp, float cap, float div, float dloss,
				       cudaStream_t s);

/* For an FP8 backward of the head: the losses as ng_softcap_crossentropy writes them, and its
 * fp32 dz (the value it rounds to bf16), times gscale, cast to E5M2 (round to nearest even,
 * saturating to +-57344) into g8 instead of over z, which is left untouched:
 * g8[n, c] = E5M2(dz[n, c] * gscale), rows Vp bytes apart. Block 0 also writes 1 / gscale to
 * *descale (when not NULL), the descale of g8 the FP8 matmul reads. gscale is a host float,
 * finite and > 0 with a finite reciprocal. The vector paths also need g8 8-byte aligned (8-byte
 * stores); otherwise the scalar path runs. */
enum ng_status ng_softcap_crossentropy_e5m2(float *losses,          /* (N) fp32, = */
					    const ng_bf16 *z,       /* (N, Vp) bf16 */
					    uint8_t *g8,            /* (N, Vp) E5M2, = */
					    float *descale,         /* (1) fp32, =, or NULL */
					    const int32_t *targets, /* (N) int32 */
					    int N, int Vp, float cap, float div, float dloss,
					    float gscale, cudaStream_t s);

/* Evaluation: the losses only; z is left untouched. */
enum ng_status ng_softcap_crossentropy_fwd(float *losses,          /* (N) fp32, = */
					   const ng_bf16 *z,       /* (N, Vp) bf16 */
					   const int32_t *targets, /* (N) int32 */
					   int N, int Vp, float cap, float div, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
