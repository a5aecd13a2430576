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

/* Four consecutive elements of a split master (kernels/split.h) and its Adam state, read and
 * written in wide accesses: hi and lo 8-byte aligned, grad, m and v 16-byte aligned. */
struct ng_adam4 {
	ng_bf16 hi[4];
	uint16_t lo[4];
	float g[4], m[4], v[4];
};

static __device__ __forceinline__ void ng_adam4_load_(struct ng_adam4 *e, const ng_bf16 *hi,
						      const uint16_t *lo, const float *grad,
						      const float *m, const float *v)
{
	ushort4 h = *reinterpret_cast<const ushort4 *>(hi);
	ushort4 l = *reinterpret_cast<const ushort4 *>(lo);
	float4 g = __ldcs(reinterpret_cast<const float4 *>(grad));
	float4 mm = *reinterpret_cast<const float4 *>(m);
	float4 vv = *reinterpret_cast<const float4 *>(v);
	*e = (struct ng_adam4){ { h.x, h.y, h.z, h.w }, { l.x, l.y, l.z, l.w },
				{ g.x, g.y, g.z, g.w }, { mm.x, mm.y, mm.z, mm.w },
				{ vv.x, vv.y, vv.z, vv.w } };
}

static __device__ __forceinline__ void ng_adam4_store_(const struct ng_adam4 *e, ng_bf16 *hi,
						       uint16_t *lo, float *m, float *v)
{
	*reinterpret_cast<float4 *>(m) = make_float4(e->m[0], e->m[1], e->m[2], e->m[3]);
	*reinterpret_cast<float4 *>(v) = make_float4(e->v[0], e->v[1], e->v[2], e->v[3]);
	*reinterpret_cast<ushort4 *>(hi) = make_ushort4(e->hi[0], e->hi[1], e->hi[2], e->hi[3]);
	*reinterpret_cast<ushort4 *>(lo) = make_ushort4(e->lo[0], e->lo[1], e->lo[2], e->lo[3]);
}

#endif
