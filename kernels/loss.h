/*
 * kernels/loss.h — fused softmax cross-entropy over the padded vocabulary, and the deterministic
 * accumulation of per-token losses into the step's loss scalar.
 * Shapes: logits (N, Vp) bf16 with Vp % 8 == 0, 16-byte aligned; only the first V columns are
 * real (padded columns never win and get gradient 0); targets (N) int32 in [0, V). N is any
 * number of rows, so the head can be run over token chunks. Statistics are fp32.
 * Valid C11; launchers return NG_OK or a recorded error.
 */
#ifndef NG_KERNELS_LOSS_H
#define NG_KERNELS_LOSS_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* losses[n] = logsumexp(logits[n, :V]) - logits[n, target]; logits are overwritten in place by
 * dlogits = dloss * (softmax - onehot(target)) for columns < V and 0 for columns V..Vp-1.
 * A target outside [0, V) gives loss NaN (so the step is skipped) and no onehot term. */
enum ng_status ng_crossentropy(float *losses,          /* (N) fp32, = */
			       ng_bf16 *logits,        /* (N, Vp) bf16: logits in, dlogits out */
			       const int32_t *targets, /* (N) int32 */
			       int N, int V, int Vp, float dloss, cudaStream_t s);

/* Evaluation: the losses only; logits are left untouched. */
enum ng_status ng_crossentropy_fwd(float *losses,          /* (N) fp32, = */
				   const ng_bf16 *logits,  /* (N, Vp) bf16 */
				   const int32_t *targets, /* (N) int32 */
				   int N, int V, int Vp, cudaStream_t s);

/* *loss_sum += scale * sum(losses), summed in double in a fixed order (deterministic). One block;
 * scratch is unused (may be NULL) and kept for a later multi-block version. */
enum ng_status ng_loss_accumulate(float *loss_sum,       /* device scalar fp32, += */
				  const float *losses,   /* (N) fp32 */
				  int N, float scale, void *scratch, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
