/*
 * kernels/muon.cu — the elementwise and reduction kernels of Muon (see muon.h); the
 * Newton-Schulz GEMMs are cuBLASLt's (kernels/muon_ns.c).
 *
 * muon_schedule_one_thread: the step's scalars from st->step (no host value in the graph).
 * muon_momentum_vec4: one thread per 4 elements, float4 loads of grad and m: 10 bytes read and
 *   10 written an element, memory-bound.
 * muon_normalize_block_per_matrix: one block per matrix sums the squares in double (fixed
 *   order: deterministic), then scales the matrix in place. A d12 group is 12-36 matrices, so
 *   the grid is smaller than the GPU; it reads each matrix twice (1.2 MB of a (768, 768) one).
 * muon_apply_split / adam_speedrun_split: the split fp32 master (kernels/split.h) joined,
 *   updated in fp32, split again, as adamw_split_vec4 in optim.cu.
 */
#include "kernels/common.cuh"

#include "kernels/muon.h"
#include "kernels/split.h"

#define MUON_THREADS 256
#define NORM_THREADS 1024

static __global__ void muon_schedule_one_thread(struct ng_muon_scalars *out,
						struct ng_step_state *st, struct ng_muon_config c)
{
	int step = st->step;
	double f = ng_muon_lr_factor(step, c.total, c.cooldown_frac, c.final_frac);
	double t = step + 1.0;
	double bc = sqrt(1.0 - pow((double)c.beta2, t)) / (1.0 - pow((double)c.beta1, t));
	out->lr = (float)(c.lr * f);
	out->mu = (float)ng_muon_momentum(step, c.mu_start, c.mu_end, c.mu_warmup);
	for (int k = 0; k < NG_MUON_ADAM_GROUPS; k++)
		out->adam_alpha[k] = (float)((double)c.adam_lr * c.adam_mult[k] * f * bc);
	st->lr = out->lr;
}

static __device__ __forceinline__ float muon_mom_elem_(float g, float *m, float mu)
{
	float mk = mu * *m + (1.0f - mu) * g;
	*m = mk;
	return (1.0f - mu) * g + mu * mk;
}

static __global__ void muon_momentum_vec4(__nv_bfloat16 *u, float *m, const float *grad,
					  size_t n, const struct ng_muon_scalars *sc,
					  const struct ng_step_state *st)
{
	if (st->skipped)
		return;
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
	if (i >= n)
		return;
	float mu = sc->mu, gs = st->clip_scale;
	if (i + 4 <= n) {
		float4 g = __ldcs(reinterpret_cast<const float4 *>(grad + i));
		float4 mm = *reinterpret_cast<float4 *>(m + i);
		float r0 = muon_mom_elem_(g.x * gs, &mm.x, mu), r1 = muon_mom_elem_(g.y * gs, &mm.y, mu);
		float r2 = muon_mom_elem_(g.z * gs, &mm.z, mu), r3 = muon_mom_elem_(g.w * gs, &mm.w, mu);
		*reinterpret_cast<float4 *>(m + i) = mm;
		__nv_bfloat162 a = __floats2bfloat162_rn(r0, r1), b = __floats2bfloat162_rn(r2, r3);
		reinterpret_cast<__nv_bfloat162 *>(u + i)[0] = a;
		reinterpret_cast<__nv_bfloat162 *>(u + i)[1] = b;
	} else {
		for (; i < n; i++)
			u[i] = __float2bfloat16_rn(muon_mom_elem_(grad[i] * gs, &m[i], mu));
	}
}

static __global__ void muon_normalize_block_per_matrix(__nv_bfloat16 *x, size_t numel,
						       size_t stride)
{
	__shared__ double sh[NG_WARP];
	__nv_bfloat16 *p = x + (size_t)blockIdx.x * stride;
	double acc = 0.0;
	float f = 0.0f;
	int k = 0;
	for (size_t i = threadIdx.x; i < numel; i += blockDim.x) {
		float v = __bfloat162float(p[i]);
		f += v * v;
		if (++k == 64) { /* bound the fp32 run length */
			acc += f;
			f = 0.0f;
			k = 0;
		}
	}
	acc += f;
	acc = ng_block_sum_d_(acc, sh);
	float den = (float)sqrt(acc) + (float)NG_MUON_NORM_EPS;
	for (size_t i = threadIdx.x; i < numel; i += blockDim.x)
		p[i] = __float2bfloat16_rn(__bfloat162float(p[i]) / den);
}

static __global__ void muon_apply_split(ng_bf16 *hi, uint16_t *lo, const __nv_bfloat16 *x,
					size_t n, float scale, const struct ng_muon_scalars *sc,
					const struct ng_step_state *st)
{
	if (st->skipped)
		return;
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= n)
		return;
	float step = sc->lr * scale;
	float w = ng_split_decode(hi[i], lo[i]);
	w -= step * __bfloat162float(x[i]);
	ng_split_encode(w, &hi[i], &lo[i]);
}

static __global__ void adam_speedrun_split(ng_bf16 *hi, uint16_t *lo, float *m, float *v,
					   const float *grad, size_t n, int group, float b1,
					   float b2, float eps, const struct ng_muon_scalars *sc,
					   const struct ng_step_state *st)
{
	if (st->skipped)
		return;
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= n)
		return;
	float alpha = sc->adam_alpha[group];
	float g = grad[i] * st->clip_scale;
	float mk = b1 * m[i] + (1.0f - b1) * g;
	float vk = b2 * v[i] + (1.0f - b2) * g * g;
	m[i] = mk;
	v[i] = vk;
	float w = ng_split_decode(hi[i], lo[i]);
	w -= alpha * mk / (sqrtf(vk) + eps);
	ng_split_encode(w, &hi[i], &lo[i]);
}

static unsigned blocks_for(size_t n, unsigned threads)
{
	return (unsigned)((n + threads - 1) / threads);
}

extern "C" enum ng_status ng_muon_schedule(struct ng_muon_scalars *out, struct ng_step_state *st,
					   struct ng_muon_config cfg, cudaStream_t s)
{
	if (cfg.total <= 0 || !(cfg.lr >= 0.0f) || cfg.mu_warmup < 0 ||
	    !(cfg.cooldown_frac >= 0.0f && cfg.cooldown_frac <= 1.0f))
		return ng_check_arg_fail("ng_muon_schedule", "bad config: total=%d lr=%g "
					 "mu_warmup=%d cooldown_frac=%g", cfg.total, (double)cfg.lr,
					 cfg.mu_warmup, (double)cfg.cooldown_frac);
	muon_schedule_one_thread<<<1, 1, 0, s>>>(out, st, cfg);
	return NG_LAUNCH_CHECK("muon_schedule_one_thread");
}

extern "C" enum ng_status ng_muon_momentum_update(ng_bf16 *u, float *m, const float *grad,
						  size_t n, const struct ng_muon_scalars *sc,
						  const struct ng_step_state *st, cudaStream_t s)
{
	if (n == 0)
		return ng_check_arg_fail("ng_muon_momentum_update", "n must be > 0");
	if (!ng_aligned16_(grad) || !ng_aligned16_(m) || ((uintptr_t)u & 7u))
		return ng_check_arg_fail("ng_muon_momentum_update", "grad (%p) and m (%p) must be "
					 "16-byte, u (%p) 8-byte aligned", (const void *)grad,
					 (void *)m, (void *)u);
	muon_momentum_vec4<<<blocks_for((n + 3) / 4, MUON_THREADS), MUON_THREADS, 0, s>>>(
		reinterpret_cast<__nv_bfloat16 *>(u), m, grad, n, sc, st);
	return NG_LAUNCH_CHECK("muon_momentum_vec4");
}

extern "C" enum ng_status ng_muon_normalize(ng_bf16 *x, size_t numel, size_t stride, int batch,
					    cudaStream_t s)
{
	if (batch <= 0 || numel == 0 || stride < numel)
		return ng_check_arg_fail("ng_muon_normalize", "batch %d of %zu elements, stride "
					 "%zu", batch, numel, stride);
	muon_normalize_block_per_matrix<<<(unsigned)batch, NORM_THREADS, 0, s>>>(
		reinterpret_cast<__nv_bfloat16 *>(x), numel, stride);
	return NG_LAUNCH_CHECK("muon_normalize_block_per_matrix");
}

extern "C" enum ng_status ng_muon_apply(ng_bf16 *param_hi, uint16_t *param_lo, const ng_bf16 *x,
					size_t n, float scale, const struct ng_muon_scalars *sc,
					const struct ng_step_state *st, cudaStream_t s)
{
	if (n == 0)
		return ng_check_arg_fail("ng_muon_apply", "n must be > 0");
	muon_apply_split<<<blocks_for(n, MUON_THREADS), MUON_THREADS, 0, s>>>(
		param_hi, param_lo, reinterpret_cast<const __nv_bfloat16 *>(x), n, scale, sc, st);
	return NG_LAUNCH_CHECK("muon_apply_split");
}

extern "C" enum ng_status ng_muon_adam(ng_bf16 *param_hi, uint16_t *param_lo, float *m, float *v,
				       const float *grad, size_t n, int group, float beta1,
				       float beta2, float eps, const struct ng_muon_scalars *sc,
				       const struct ng_step_state *st, cudaStream_t s)
{
	if (n == 0 || group < 0 || group >= NG_MUON_ADAM_GROUPS)
		return ng_check_arg_fail("ng_muon_adam", "n %zu, group %d", n, group);
	adam_speedrun_split<<<blocks_for(n, MUON_THREADS), MUON_THREADS, 0, s>>>(
		param_hi, param_lo, m, v, grad, n, group, beta1, beta2, eps, sc, st);
	return NG_LAUNCH_CHECK("adam_speedrun_split");
}
