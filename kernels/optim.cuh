/*
 * kernels/optim.cuh — the AdamW update of one fp32 element and its per-step scalars, shared by
 * kernels/optim.cu and the fp32-master reference kernel of tests/optim_fp32_ref.cu (which checks
 * that keeping the master split, kernels/split.h, changes nothing in the arithmetic). Included
 * by .cu files only (never by C).
 */
#ifndef NG_KERNELS_OPTIM_CUH
#define NG_KERNELS_OPTIM_CUH

#include <math.h>

#include "kernels/types.h"

/* The per-step scalars of AdamW, read from the device step state. */
struct ng_adamw_scalars {
	float lr;  /* learning rate */
	float gs;  /* gradient (clip) scale */
	float bc1; /* 1 - b1^t, t = step + 1 */
	float bc2; /* 1 - b2^t */
};

static __device__ __forceinline__ struct ng_adamw_scalars ng_adamw_scalars_(
	const struct ng_step_state *st, float b1, float b2)
{
	float t = (float)(st->step + 1);
	struct ng_adamw_scalars a = { st->lr, st->clip_scale, 1.0f - powf(b1, t),
				      1.0f - powf(b2, t) };
	return a;
}

/* g = grad * gs; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2 (both written back); returns
 * p - lr (m / bc1 / (sqrt(v / bc2) + eps) + wd p). */
static __device__ __forceinline__ float ng_adamw_elem_(float p, float grad, float *m, float *v,
						       struct ng_adamw_scalars a, float wd,
						       float b1, float b2, float eps)
{
	float gk = grad * a.gs;
	float mk = b1 * *m + (1.0f - b1) * gk;
	float vk = b2 * *v + (1.0f - b2) * gk * gk;
	*m = mk;
	*v = vk;
	return p - a.lr * ((mk / a.bc1) / (sqrtf(vk / a.bc2) + eps) + wd * p);
}

#endif
