/*
 * kernels/optim.h — the optimizer end of the step, all on the device: global gradient norm,
 * learning-rate schedule and clip scale, AdamW (fp32 master weights kept split as the bf16 copy
 * plus a low half, kernels/split.h), and the step finish that publishes metrics to a host-mapped
 * ring.
 * Every per-step scalar lives in struct ng_step_state in device memory (kernels/types.h), so a
 * replayed CUDA graph sees this step's values. Valid C11; launchers return NG_OK or an error.
 *
 * Step counting (a choice): st->step counts attempted optimizer steps and advances on every
 * ng_step_finish, skipped or not, so the schedule moves on and each step gets its own ring slot.
 * A skipped step applies no update; AdamW's bias correction (step + 1) still counts it.
 */
#ifndef NG_KERNELS_OPTIM_H
#define NG_KERNELS_OPTIM_H

#include <cuda_runtime.h>
#include <stddef.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* *out = sum of g[i]^2, in a fixed two-pass order (deterministic). scratch:
 * ng_grad_norm_scratch_bytes(n) bytes. g 16-byte aligned. */
enum ng_status ng_grad_norm_squared(float *out,      /* device scalar fp32, = */
				    const float *g,  /* (n) fp32 */
				    size_t n, void *scratch, cudaStream_t s);
size_t ng_grad_norm_scratch_bytes(size_t n);

/* One thread: st->lr = lr(st->step) (warmup, then cosine or linear decay to final_frac, the
 * formula of ng_ref_lr), st->grad_norm = sqrt(*norm_squared), st->clip_scale =
 * min(1, clip / (norm + 1e-6)) (1 when clip == 0), st->skipped = !isfinite(norm) ||
 * !isfinite(st->loss_sum). */
enum ng_status ng_schedule_update(struct ng_step_state *st,   /* device, read and written */
				  const float *norm_squared,  /* device scalar fp32 */
				  struct ng_schedule sched, float clip, cudaStream_t s);

/* AdamW on one tensor, decoupled weight decay (wd = 0 for tensors without decay), on the fp32
 * master w = ng_split_decode(param_hi, param_lo) (kernels/split.h):
 * g = grad * clip_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 * w -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd w), t = st->step + 1;
 * (param_hi, param_lo) = ng_split_encode(w): param_hi is the bf16 copy the matmuls read (w
 * rounded to nearest, ties away from zero). Nothing changes when st->skipped.
 * grad, m, v 16-byte aligned; param_hi, param_lo 8-byte aligned. */
enum ng_status ng_adamw(ng_bf16 *param_hi,              /* (n) bf16 copy = high half, updated */
			uint16_t *param_lo,             /* (n) low half of the master, updated */
			const float *grad,              /* (n) fp32 */
			float *m,                       /* (n) fp32, updated */
			float *v,                       /* (n) fp32, updated */
			size_t n, float wd, float beta1, float beta2, float eps,
			const struct ng_step_state *st, /* device: lr, clip_scale, skipped, step */
			cudaStream_t s);

/* One thread: ring[st->step % ring_len] = {step + 1, skipped, loss_sum, grad_norm, lr} (the
 * step field written last, after a system fence, so a host reader that sees it sees the rest);
 * then step += 1, n_skipped += skipped, loss_sum = 0. ring: host-mapped pinned memory (its
 * device pointer), ring_len records. */
enum ng_status ng_step_finish(struct ng_step_state *st, struct ng_metrics_record *ring,
			      int ring_len, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
