/*
 * kernels/spr_step.cu — the speedrun step's scalars and windows (see spr_step.h). Both are a
 * few hundred threads at most, launched once a step.
 */
#include "kernels/common.cuh"

#include "kernels/check.h"
#include "kernels/spr_step.h"
#include "kernels/split.h"

static __global__ void split_join_f32(float *out, const ng_bf16 *hi, const uint16_t *lo, size_t n,
				      int ones)
{
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		out[i] = ng_split_decode(hi[i], lo[i]);
	else if (i < n + (size_t)ones)
		out[i] = 1.0f;
}

enum ng_status ng_split_join_f32(float *out, const ng_bf16 *hi, const uint16_t *lo, size_t n,
				 int ones, cudaStream_t s)
{
	size_t total = n + (size_t)(ones > 0 ? ones : 0);
	if (total == 0)
		return NG_OK;
	unsigned blocks = (unsigned)((total + 255) / 256);
	split_join_f32<<<blocks, 256, 0, s>>>(out, hi, lo, n, ones > 0 ? ones : 0);
	return NG_LAUNCH_CHECK("split_join_f32");
}

static __global__ void spr_windows(int32_t *win, const struct ng_step_state *st, int steps,
				   int block, const int32_t *given)
{
	long long step = st->step, num = 27LL * step, den = 2LL * (steps > 0 ? steps : 1);
	int w = given ? *given : (int)((num + den - 1) / den); /* ceil(13.5 step / steps) */
	if (w < 1)
		w = 1;
	int h = w / 2 < 1 ? 1 : w / 2;
	win[0] = w * block;
	win[1] = h * block;
}

enum ng_status ng_spr_windows(int32_t *win, const struct ng_step_state *st, int steps, int block,
			      const int32_t *given, cudaStream_t s)
{
	spr_windows<<<1, 1, 0, s>>>(win, st, steps, block, given);
	return NG_LAUNCH_CHECK("spr_windows");
}
