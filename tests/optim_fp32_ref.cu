/*
 * tests/optim_fp32_ref.cu — AdamW on a plain fp32 master, for tests/test_optim.c only: the
 * arithmetic of kernels/optim.cu before the master was split into the bf16 copy and a low half
 * (kernels/split.h), one thread per element, through the same per-element helper
 * (kernels/optim.cuh). ng_adamw on the split master must give the same fp32 bits.
 */
#include <cuda_runtime.h>

#include "kernels/optim.cuh"
#include "kernels/types.h"

static __global__ void adamw_fp32_master(float *p, const float *g, float *m, float *v, size_t n,
					 float wd, float b1, float b2, float eps,
					 const struct ng_step_state *st)
{
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	if (st->skipped || i >= n)
		return;
	struct ng_adamw_scalars a = ng_adamw_scalars_(st, b1, b2);
	p[i] = ng_adamw_elem_(p[i], g[i], &m[i], &v[i], a, wd, b1, b2, eps);
}

/* p (n) fp32 master, updated; g (n) fp32; m, v (n) fp32, updated; st on the device. */
extern "C" cudaError_t kt_adamw_fp32_master(float *p, const float *g, float *m, float *v,
					    size_t n, float wd, float b1, float b2, float eps,
					    const struct ng_step_state *st)
{
	adamw_fp32_master<<<(unsigned)((n + 255) / 256), 256>>>(p, g, m, v, n, wd, b1, b2, eps, st);
	return cudaGetLastError();
}
