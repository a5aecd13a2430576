/*
 * kernels/muon.cu — the elementwise and reduction kernels of Muon (see muon.h); the
 * Newton-Schulz GEMMs are cuBLASLt's (kernels/muon_ns.c).
 *
 * muon_schedule_one_thread: the step's scalars from st->step (no host value in the graph).
 * muon_momentum_vec4: one thread per 4 elements, float4 loads of grad and m: 10 bytes read and
 *   10 written an element, memory-bound.
 * muon_norm_partials_chunked / muon_norm_scale_chunked: a block per 16K-element chunk of every
 *   matrix sums its squares in double, then a block per chunk reads the matrix's partials in a
 *   fixed order (deterministic) and scales its chunk. One block per matrix left the GPU mostly
 *   idle: 1.79 ms for the twelve (3072, 768) fc matrices of d12, against ~0.06 ms now
 *   (tools/bench_muon, H200).
 * muon_apply_split / adam_speedrun_split: the split fp32 master (kernels/split.h) joined,
 *   updated in fp32, split again, as adamw_split_vec4 in optim.cu; 4 elements a thread in wide
 *   loads where the pointers allow (Adam of the speedrun's 193M embedding, head and scalar
 *   parameters: 28 bytes an element, memory-bound).
 */
#include "kernels/common.cuh"

#include "kernels/muon.h"
#include "kernels/optim.cuh"
#include "kernels/split.h"

#define MUON_THREADS 256
#define NORM_THREADS 256
#define NORM_CHUNK NG_MUON_NORM_CHUNK

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

/* Block (c, b): the double sum of squares of chunk c of matrix b into partials[b * chunks + c];
 * each thread sums at most NORM_CHUNK / NORM_THREADS elements in fp32 first. vec: numel and
 * stride multiples of 8 and x 16-byte aligned, so 8 bf16 a load. */
static __global__ void muon_norm_partials_chunked(const __nv_bfloat16 *x, double *partials,
						  size_t numel, size_t stride, int vec)
{
	__shared__ double sh[NG_WARP];
	const __nv_bfloat16 *p = x + (size_t)blockIdx.y * stride;
	size_t lo = (size_t)blockIdx.x * NORM_CHUNK, hi = lo + NORM_CHUNK;
	if (hi > numel)
		hi = numel;
	float f = 0.0f;
	if (vec) {
		for (size_t i = lo + threadIdx.x * 8; i < hi; i += NORM_THREADS * 8) {
			uint4 w = *reinterpret_cast<const uint4 *>(p + i);
			const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&w);
			for (int j = 0; j < 4; j++) {
				float2 v = __bfloat1622float2(h[j]);
				f += v.x * v.x + v.y * v.y;
			}
		}
	} else {
		for (size_t i = lo + threadIdx.x; i < hi; i += NORM_THREADS) {
			float v = __bfloat162float(p[i]);
			f += v * v;
		}
	}
	double acc = ng_block_sum_d_((double)f, sh);
	if (threadIdx.x == 0)
		partials[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = acc;
}

/* Block (c, b): the norm of matrix b from its partials (warp 0, a fixed order), then chunk c of
 * it divided by (norm + eps), in place. */
static __global__ void muon_norm_scale_chunked(__nv_bfloat16 *x, const double *partials,
					       size_t numel, size_t stride, int vec)
{
	__shared__ float den;
	if (threadIdx.x < NG_WARP) {
		const double *q = partials + (size_t)blockIdx.y * gridDim.x;
		double acc = 0.0;
		for (unsigned i = threadIdx.x; i < gridDim.x; i += NG_WARP)
			acc += q[i];
		for (int o = NG_WARP / 2; o > 0; o /= 2)
			acc += __shfl_xor_sync(0xffffffffu, acc, o);
		if (threadIdx.x == 0)
			den = (float)sqrt(acc) + (float)NG_MUON_NORM_EPS;
	}
	__syncthreads();
	float d = den;
	__nv_bfloat16 *p = x + (size_t)blockIdx.y * stride;
	size_t lo = (size_t)blockIdx.x * NORM_CHUNK, hi = lo + NORM_CHUNK;
	if (hi > numel)
		hi = numel;
	if (vec) {
		for (size_t i = lo + threadIdx.x * 8; i < hi; i += NORM_THREADS * 8) {
			uint4 w = *reinterpret_cast<uint4 *>(p + i);
			__nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&w);
			for (int j = 0; j < 4; j++) {
				float2 v = __bfloat1622float2(h[j]);
				h[j] = __floats2bfloat162_rn(v.x / d, v.y / d);
			}
			*reinterpret_cast<uint4 *>(p + i) = w;
		}
	} else {
		for (size_t i = lo + threadIdx.x; i < hi; i += NORM_THREADS)
			p[i] = __float2bfloat16_rn(__bfloat162float(p[i]) / d);
	}
}

static __device__ __forceinline__ float adam_speedrun_elem_(float w, float g, float *m,
							 float *v, float alpha, float b1, float b2,
							 float eps)
{
	float mk = b1 * *m + (1.0f - b1) * g;
	float vk = b2 * *v + (1.0f - b2) * g * g;
	*m = mk;
	*v = vk;
	return w - alpha * mk / (sqrtf(vk) + eps);
}

/* vec: every pointer aligned for 4 elements (8 bytes of hi / lo / x, 16 of m / v / grad), so
 * one thread takes 4 elements in wide loads; otherwise one element a thread. */
static __global__ void muon_apply_split(ng_bf16 *hi, uint16_t *lo, const __nv_bfloat16 *x,
					size_t n, float scale, const struct ng_muon_scalars *sc,
					const struct ng_step_state *st, int vec)
{
	if (st->skipped)
		return;
	size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t i = vec ? t * 4 : t, e = i + (vec ? 4 : 1);
	if (i >= n)
		return;
	float step = sc->lr * scale;
	if (vec && e <= n) {
		ushort4 h = *reinterpret_cast<ushort4 *>(hi + i);
		ushort4 l = *reinterpret_cast<ushort4 *>(lo + i);
		uint2 xr = __ldcs(reinterpret_cast<const uint2 *>(x + i));
		__nv_bfloat162 x01 = *reinterpret_cast<__nv_bfloat162 *>(&xr.x);
		__nv_bfloat162 x23 = *reinterpret_cast<__nv_bfloat162 *>(&xr.y);
		float xa[4] = { __low2float(x01), __high2float(x01), __low2float(x23),
				__high2float(x23) };
		ng_bf16 ha[4] = { h.x, h.y, h.z, h.w };
		uint16_t la[4] = { l.x, l.y, l.z, l.w };
#pragma unroll
		for (int k = 0; k < 4; k++)
			ng_split_encode(ng_split_decode(ha[k], la[k]) - step * xa[k], &ha[k], &la[k]);
		*reinterpret_cast<ushort4 *>(hi + i) = make_ushort4(ha[0], ha[1], ha[2], ha[3]);
		*reinterpret_cast<ushort4 *>(lo + i) = make_ushort4(la[0], la[1], la[2], la[3]);
		return;
	}
	if (e > n)
		e = n;
	for (; i < e; i++) {
		float w = ng_split_decode(hi[i], lo[i]);
		w -= step * __bfloat162float(x[i]);
		ng_split_encode(w, &hi[i], &lo[i]);
	}
}

static __global__ void adam_speedrun_split(ng_bf16 *hi, uint16_t *lo, float *m, float *v,
					   const float *grad, size_t n, int group, float b1,
					   float b2, float eps, const struct ng_muon_scalars *sc,
					   const struct ng_step_state *st, int vec)
{
	if (st->skipped)
		return;
	size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t i = vec ? t * 4 : t, e = i + (vec ? 4 : 1);
	if (i >= n)
		return;
	float alpha = sc->adam_alpha[group], gs = st->clip_scale;
	if (vec && e <= n) {
		struct ng_adam4 q;
		ng_adam4_load_(&q, hi + i, lo + i, grad + i, m + i, v + i);
#pragma unroll
		for (int k = 0; k < 4; k++) {
			float w = adam_speedrun_elem_(ng_split_decode(q.hi[k], q.lo[k]), q.g[k] * gs,
						      &q.m[k], &q.v[k], alpha, b1, b2, eps);
			ng_split_encode(w, &q.hi[k], &q.lo[k]);
		}
		ng_adam4_store_(&q, hi + i, lo + i, m + i, v + i);
		return;
	}
	if (e > n)
		e = n;
	for (; i < e; i++) {
		float w = adam_speedrun_elem_(ng_split_decode(hi[i], lo[i]), grad[i] * gs, &m[i],
					      &v[i], alpha, b1, b2, eps);
		ng_split_encode(w, &hi[i], &lo[i]);
	}
}

static int aligned8_(const void *p)
{
	return ((uintptr_t)p & 7u) == 0;
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

extern "C" size_t ng_muon_normalize_scratch_bytes(size_t numel, int batch)
{
	return (numel + NORM_CHUNK - 1) / NORM_CHUNK * (size_t)(batch > 0 ? batch : 0) *
	       sizeof(double);
}

extern "C" enum ng_status ng_muon_normalize(ng_bf16 *x, double *partials, size_t numel,
					    size_t stride, int batch, cudaStream_t s)
{
	if (batch <= 0 || numel == 0 || stride < numel || !partials)
		return ng_check_arg_fail("ng_muon_normalize", "batch %d of %zu elements, stride "
					 "%zu, partials %p", batch, numel, stride, (void *)partials);
	size_t chunks = (numel + NORM_CHUNK - 1) / NORM_CHUNK;
	if (chunks > 65535u * 1024u || batch > 65535)
		return ng_check_arg_fail("ng_muon_normalize", "%zu chunks x %d matrices", chunks,
					 batch);
	int vec = numel % 8 == 0 && stride % 8 == 0 && ng_aligned16_(x);
	dim3 grid((unsigned)chunks, (unsigned)batch);
	__nv_bfloat16 *xb = reinterpret_cast<__nv_bfloat16 *>(x);
	muon_norm_partials_chunked<<<grid, NORM_THREADS, 0, s>>>(xb, partials, numel, stride, vec);
	enum ng_status st = NG_LAUNCH_CHECK("muon_norm_partials_chunked");
	if (st)
		return st;
	muon_norm_scale_chunked<<<grid, NORM_THREADS, 0, s>>>(xb, partials, numel, stride, vec);
	return NG_LAUNCH_CHECK("muon_norm_scale_chunked");
}

extern "C" enum ng_status ng_muon_apply(ng_bf16 *param_hi, uint16_t *param_lo, const ng_bf16 *x,
					size_t n, float scale, const struct ng_muon_scalars *sc,
					const struct ng_step_state *st, cudaStream_t s)
{
	if (n == 0)
		return ng_check_arg_fail("ng_muon_apply", "n must be > 0");
	int vec = aligned8_(param_hi) && aligned8_(param_lo) && aligned8_(x);
	muon_apply_split<<<blocks_for(vec ? (n + 3) / 4 : n, MUON_THREADS), MUON_THREADS, 0, s>>>(
		param_hi, param_lo, reinterpret_cast<const __nv_bfloat16 *>(x), n, scale, sc, st,
		vec);
	return NG_LAUNCH_CHECK("muon_apply_split");
}

extern "C" enum ng_status ng_muon_adam(ng_bf16 *param_hi, uint16_t *param_lo, float *m, float *v,
				       const float *grad, size_t n, int group, float beta1,
				       float beta2, float eps, const struct ng_muon_scalars *sc,
				       const struct ng_step_state *st, cudaStream_t s)
{
	if (n == 0 || group < 0 || group >= NG_MUON_ADAM_GROUPS)
		return ng_check_arg_fail("ng_muon_adam", "n %zu, group %d", n, group);
	int vec = aligned8_(param_hi) && aligned8_(param_lo) && ng_aligned16_(m) &&
		  ng_aligned16_(v) && ng_aligned16_(grad);
	adam_speedrun_split<<<blocks_for(vec ? (n + 3) / 4 : n, MUON_THREADS), MUON_THREADS, 0,
			      s>>>(param_hi, param_lo, m, v, grad, n, group, beta1, beta2, eps, sc,
				   st, vec);
	return NG_LAUNCH_CHECK("adam_speedrun_split");
}
