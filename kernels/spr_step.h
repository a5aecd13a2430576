/*
 * kernels/spr_step.h — two small kernels of the speedrun model's step (graph/step_spr.h):
 * the fp32 copy of the learned scalars the mixes read, and the attention windows of the step,
 * both computed on the device at the step's start, so the captured step needs no host value.
 */
#ifndef NG_KERNELS_SPR_STEP_H
#define NG_KERNELS_SPR_STEP_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] = the fp32 master (kernels/split.h) of hi[i], lo[i] for i < n, then out[n .. n + ones)
 * = 1.0 (the constant coefficient of the mixes that have none). */
enum ng_status ng_split_join_f32(float *out, const ng_bf16 *hi, const uint16_t *lo, size_t n,
				 int ones, cudaStream_t s);

/* The attention windows in tokens: W blocks of `block` tokens, W = *given when given is not
 * NULL (a device int32, read when the kernel runs), else the schedule's at the step the state is
 * at (st->step completed steps of `steps`): max(1, ceil(13.5 step / steps)); W < 1 counts as 1.
 * win[0] = W * block (the long-window blocks), win[1] = max(1, W / 2) * block (the others). */
enum ng_status ng_spr_windows(int32_t *win, const struct ng_step_state *st, int steps, int block,
			      const int32_t *given, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
