/*
 * kernels/optim.cu — gradient norm, schedule, AdamW, step finish (see optim.h).
 *
 * grad_norm_partials_fixed_grid: a fixed grid (GN_BLOCKS blocks, independent of the device)
 * strides over g with float4 loads; each block writes one double partial; grad_norm_final sums
 * the partials in order. Same bytes every run.
 * adamw_split_vec4: one thread per 4 elements; float4 loads/stores of grad, m, v and 8-byte
 * loads/stores of the two halves of the master (kernels/split.h): 28 bytes per element,
 * memory-bound. Per-step scalars are read from the device.
 * References: Loshchilov & Hutter 2019 (AdamW); llm.c adamw_kernel3 (fp32 master + bf16 copy,
 * here the master is the bf16 copy plus a low half).
 */
#include "kernels/common.cuh"

#include "kernels/optim.cuh"
#include "kernels/optim.h"
#include "kernels/split.h"

#define GN_BLOCKS 1024
#define GN_THREADS 512
#define ADAM_THREADS 256
#define PI_D 3.14159265358979323846

static __global__ void grad_norm_partials_fixed_grid(double *part, const float *g, size_t n)
{
	__shared__ double sh[NG_WARP];
	size_t n4 = n / 4;
	size_t stride = (size_t)gridDim.x * blockDim.x;
	float acc = 0.0f;
	double accd = 0.0;
	int k = 0;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
		float4 x = __ldcs(reinterpret_cast<const float4 *>(g) + i);
		acc += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
		if (++k == 64) { /* bound the fp32 run length */
			accd += acc;
			acc = 0.0f;
			k = 0;
		}
	}
	if (blockIdx.x == 0)
		for (size_t i = n4 * 4 + threadIdx.x; i < n; i += blockDim.x)
			acc += g[i] * g[i];
	accd += acc;
	accd = ng_block_sum_d_(accd, sh);
	if (threadIdx.x == 0)
		part[blockIdx.x] = accd;
}

static __global__ void grad_norm_final(float *out, const double *part, int np)
{
	__shared__ double sh[NG_WARP];
	double acc = ng_block_sum_array_d_(part, np, sh);
	if (threadIdx.x == 0)
		*out = (float)acc;
}

static __device__ double schedule_lr(int step, struct ng_schedule sc)
{
	double lr_max = sc.lr_max;
	if (step < sc.warmup)
		return lr_max * (double)(step + 1) / (double)sc.warmup;
	double lr_min = lr_max * sc.final_frac;
	int span = sc.total - 1 - sc.warmup;
	if (span <= 0)
		return lr_max;
	double frac = (double)(step - sc.warmup) / (double)span;
	if (frac > 1.0)
		frac = 1.0;
	if (sc.cosine)
		return lr_min + 0.5 * (lr_max - lr_min) * (1.0 + cos(PI_D * frac));
	return lr_max - (lr_max - lr_min) * frac;
}

static __global__ void schedule_update_one_thread(struct ng_step_state *st,
						  const float *norm_squared,
						  struct ng_schedule sc, float clip)
{
	float norm = sqrtf(*norm_squared);
	st->lr = (float)schedule_lr(st->step, sc);
	st->grad_norm = norm;
	float scale = 1.0f;
	if (clip > 0.0f && isfinite(norm))
		scale = fminf(1.0f, clip / (norm + 1e-6f));
	st->clip_scale = scale;
	st->skipped = !isfinite(norm) || !isfinite(st->loss_sum);
}

/* hi, lo: the split fp32 master (kernels/split.h), joined before and split after the update
 * (ng_adamw_elem_, kernels/optim.cuh: the arithmetic of an fp32 master, unchanged). */
static __global__ void adamw_split_vec4(ng_bf16 *hi, uint16_t *lo, const float *grad, float *m,
					float *v, size_t n, float wd, float b1, float b2, float eps,
					const struct ng_step_state *st)
{
	if (st->skipped)
		return;
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
	if (i >= n)
		return;
	struct ng_adamw_scalars a = ng_adamw_scalars_(st, b1, b2);
	if (i + 4 <= n) {
		struct ng_adam4 e;
		ng_adam4_load_(&e, hi + i, lo + i, grad + i, m + i, v + i);
#pragma unroll
		for (int k = 0; k < 4; k++) {
			float p = ng_split_decode(e.hi[k], e.lo[k]);
			p = ng_adamw_elem_(p, e.g[k], &e.m[k], &e.v[k], a, wd, b1, b2, eps);
			ng_split_encode(p, &e.hi[k], &e.lo[k]);
		}
		ng_adam4_store_(&e, hi + i, lo + i, m + i, v + i);
	} else {
		for (; i < n; i++) {
			float p = ng_split_decode(hi[i], lo[i]);
			p = ng_adamw_elem_(p, grad[i], &m[i], &v[i], a, wd, b1, b2, eps);
			ng_split_encode(p, &hi[i], &lo[i]);
		}
	}
}

static __global__ void step_finish_one_thread(struct ng_step_state *st,
					      struct ng_metrics_record *ring, int ring_len)
{
	struct ng_metrics_record *r = ring + (st->step % ring_len);
	r->skipped = st->skipped;
	r->loss = st->loss_sum;
	r->grad_norm = st->grad_norm;
	r->lr = st->lr;
	r->stop = st->stop;
	__threadfence_system();
	*(volatile int *)&r->step = st->step + 1;
	st->n_skipped += st->skipped;
	st->step += 1;
	st->loss_sum = 0.0f;
}

extern "C" size_t ng_grad_norm_scratch_bytes(size_t n)
{
	(void)n;
	return GN_BLOCKS * sizeof(double);
}

extern "C" enum ng_status ng_grad_norm_squared(float *out, const float *g, size_t n,
					       void *scratch, cudaStream_t s)
{
	if (n == 0)
		return ng_check_arg_fail("ng_grad_norm_squared", "n must be > 0");
	if (!ng_aligned16_(g) || ((uintptr_t)scratch & 7u))
		return ng_check_arg_fail("ng_grad_norm_squared",
					 "g (%p) must be 16-byte and scratch (%p) 8-byte aligned",
					 (const void *)g, scratch);
	grad_norm_partials_fixed_grid<<<GN_BLOCKS, GN_THREADS, 0, s>>>((double *)scratch, g, n);
	enum ng_status st = NG_LAUNCH_CHECK("grad_norm_partials_fixed_grid");
	if (st)
		return st;
	grad_norm_final<<<1, GN_THREADS, 0, s>>>(out, (const double *)scratch, GN_BLOCKS);
	return NG_LAUNCH_CHECK("grad_norm_final");
}

extern "C" enum ng_status ng_schedule_update(struct ng_step_state *st, const float *norm_squared,
					     struct ng_schedule sched, float clip, cudaStream_t s)
{
	if (sched.warmup < 0 || sched.total <= 0 || !(sched.lr_max >= 0.0f) || clip < 0.0f)
		return ng_check_arg_fail("ng_schedule_update",
					 "bad schedule: warmup=%d total=%d lr_max=%g clip=%g",
					 sched.warmup, sched.total, (double)sched.lr_max,
					 (double)clip);
	schedule_update_one_thread<<<1, 1, 0, s>>>(st, norm_squared, sched, clip);
	return NG_LAUNCH_CHECK("schedule_update_one_thread");
}

extern "C" enum ng_status ng_adamw(ng_bf16 *param_hi, uint16_t *param_lo, const float *grad,
				   float *m, float *v, size_t n, float wd, float beta1,
				   float beta2, float eps, const struct ng_step_state *st,
				   cudaStream_t s)
{
	const char *who = "ng_adamw";
	if (n == 0)
		return ng_check_arg_fail(who, "n must be > 0");
	if (!ng_aligned16_(grad) || !ng_aligned16_(m) || !ng_aligned16_(v) ||
	    ((uintptr_t)param_hi & 7u) || ((uintptr_t)param_lo & 7u))
		return ng_check_arg_fail(who, "grad/m/v must be 16-byte aligned and "
					 "param_hi/param_lo 8-byte aligned (%p %p %p %p %p)", (const void *)grad,
					 (void *)m, (void *)v, (void *)param_hi, (void *)param_lo);
	size_t nt = (n + 3) / 4;
	adamw_split_vec4<<<(unsigned)((nt + ADAM_THREADS - 1) / ADAM_THREADS), ADAM_THREADS, 0, s>>>(
		param_hi, param_lo, grad, m, v, n, wd, beta1, beta2, eps, st);
	return NG_LAUNCH_CHECK("adamw_split_vec4");
}

extern "C" enum ng_status ng_step_finish(struct ng_step_state *st, struct ng_metrics_record *ring,
					 int ring_len, cudaStream_t s)
{
	if (ring_len <= 0 || !ring)
		return ng_check_arg_fail("ng_step_finish", "need a ring, got %p with %d records",
					 (void *)ring, ring_len);
	step_finish_one_thread<<<1, 1, 0, s>>>(st, ring, ring_len);
	return NG_LAUNCH_CHECK("step_finish_one_thread");
}
