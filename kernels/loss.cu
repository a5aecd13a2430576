/*
 * kernels/loss.cu — fused softmax cross-entropy (one block per row) and loss accumulation.
 *
 * ng_crossentropy -> crossentropy_row_in_smem when the row fits in shared memory (Vp * 2 <=
 * CE_SMEM_MAX: the GPT-2 row of 50304 columns is 100.6 KB, two rows per SM): the block copies
 * its row into shared memory with 16-byte cp.async (no registers held, every load in flight at
 * once); each thread takes the max, then the sum of exp, over the vectors it copied itself; the
 * block merges the (max, sum) pairs in a fixed order; dlogits are written from shared memory.
 * HBM traffic is the floor, one read and one write of the row: the two-pass kernel read it
 * twice (measured, d12: 4.82 ms -> 3.33 ms).
 * ng_crossentropy_fwd and longer rows -> crossentropy_block_per_row: pass 1 reads the row with
 * 16-byte loads (CE_UNROLL in flight per thread), keeping a running (max, sum of exp) per thread
 * over columns < V (online softmax, Milakov & Gimelshein 2018), merged across the block; with
 * GRAD, pass 2 re-reads the row and writes dlogits in place.
 * Both use exp(x - m) = 2^(x*log2e - m*log2e) (one FFMA + one ex2.approx per element) and a
 * packed-bf16 max; per-column bounds checks only in the last, partial vector. At these sizes
 * the kernels were instruction-bound as much as memory-bound (eval, d12: 2.63 ms -> 1.53 ms from
 * the arithmetic alone). Padded columns are excluded from the statistics and written as 0.
 * loss_accumulate_one_block: a fixed-order double sum of the per-token losses.
 */
#include "kernels/common.cuh"

#include "kernels/loss.h"

#define CE_THREADS 512 /* two-pass kernel; measured: 1024 threads per row was slower */
#define CE_UNROLL 4 /* 16-byte loads in flight per thread (two-pass kernel) */
#define CE_SMEM_THREADS 512 /* shared-memory kernel; measured at d12: 512 threads 3.33 ms,
			     * 1024 threads 3.49 ms (two blocks per SM either way) */
#define CE_SMEM_MAX (112 * 1024) /* largest row (bytes) the shared-memory kernel takes */
#define CE_LOG2E 1.4426950408889634f

struct ce_stat {
	float m; /* running max */
	float s; /* sum of exp(x - m) */
};

static __device__ __forceinline__ struct ce_stat ce_merge(struct ce_stat a, struct ce_stat b)
{
	float m = fmaxf(a.m, b.m);
	if (m == -INFINITY)
		return a;
	struct ce_stat r = {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
	return r;
}

/* 2^x by the hardware approximation (ex2.approx: ~2 ulp), denormals flushed: with exp(x - m)
 * written exp2(x*log2e - m*log2e) each element costs one FFMA and one MUFU. */
static __device__ __forceinline__ float ce_exp2(float x)
{
	float y;
	asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
	return y;
}

/* The max of the first `lim` (1..8) elements of v; lim == 8 is done in packed bf16 (exact). */
static __device__ __forceinline__ float ce_vmax(struct ng_bf16x8 v, int lim)
{
	if (lim >= 8) {
		__nv_bfloat162 a = __hmax2(v.h[0], v.h[1]), b = __hmax2(v.h[2], v.h[3]);
		a = __hmax2(a, b);
		return fmaxf(__low2float(a), __high2float(a));
	}
	float x[8], m = -INFINITY;
	ng_unpack8_(x, v);
#pragma unroll
	for (int k = 0; k < 8; k++)
		if (k < lim)
			m = fmaxf(m, x[k]);
	return m;
}

/* sum of exp(x_k - m) over the first lim elements, given mL = m * log2e */
static __device__ __forceinline__ float ce_vsumexp(struct ng_bf16x8 v, int lim, float mL)
{
	float x[8], s = 0.0f;
	ng_unpack8_(x, v);
	if (lim >= 8) {
#pragma unroll
		for (int k = 0; k < 8; k++)
			s += ce_exp2(fmaf(x[k], CE_LOG2E, -mL));
		return s;
	}
#pragma unroll
	for (int k = 0; k < 8; k++)
		if (k < lim)
			s += ce_exp2(fmaf(x[k], CE_LOG2E, -mL));
	return s;
}

/* dlogits of the 8 columns c..c+7: dloss * (softmax - onehot) below V, 0 from V on. */
static __device__ __forceinline__ struct ng_bf16x8 ce_vgrad(struct ng_bf16x8 v, int c, int V,
							    int tg, float lseL, float dloss)
{
	float x[8];
	ng_unpack8_(x, v);
	if (c + 8 <= V) {
#pragma unroll
		for (int k = 0; k < 8; k++)
			x[k] = dloss * ce_exp2(fmaf(x[k], CE_LOG2E, -lseL));
	} else {
#pragma unroll
		for (int k = 0; k < 8; k++)
			x[k] = c + k < V ? dloss * ce_exp2(fmaf(x[k], CE_LOG2E, -lseL)) : 0.0f;
	}
	if (tg >= c && tg < c + 8) {
#pragma unroll
		for (int k = 0; k < 8; k++)
			if (c + k == tg)
				x[k] -= dloss;
	}
	return ng_pack8_(x);
}

/* Merges every thread's (max, sum) into thread 0's, in a fixed order. */
template <int THREADS>
static __device__ __forceinline__ struct ce_stat ce_block_merge(struct ce_stat st)
{
	__shared__ struct ce_stat sh[THREADS / NG_WARP];
#pragma unroll
	for (int o = NG_WARP / 2; o > 0; o >>= 1) {
		struct ce_stat other = {__shfl_xor_sync(0xffffffffu, st.m, o),
					__shfl_xor_sync(0xffffffffu, st.s, o)};
		st = ce_merge(st, other);
	}
	int lane = threadIdx.x % NG_WARP, warp = threadIdx.x / NG_WARP;
	if (lane == 0)
		sh[warp] = st;
	__syncthreads();
	if (threadIdx.x == 0)
		for (int w = 1; w < THREADS / NG_WARP; w++)
			st = ce_merge(st, sh[w]);
	return st;
}

/* Two passes over the row in global memory (rows too long for shared memory). */
template <bool GRAD>
static __global__ void __launch_bounds__(CE_THREADS, 3)
crossentropy_block_per_row(float *losses, __nv_bfloat16 *logits, const int32_t *targets, int V,
			   int Vp, float dloss)
{
	__shared__ float sh_lse;
	int row = blockIdx.x;
	__nv_bfloat16 *z = logits + (size_t)row * Vp;
	struct ce_stat st = {-INFINITY, 0.0f};
	float mL = -INFINITY;
	int step = CE_THREADS * 8; /* columns one pass of the block covers */
	for (int c0 = threadIdx.x * 8; c0 < V; c0 += CE_UNROLL * step) {
		struct ng_bf16x8 r[CE_UNROLL];
#pragma unroll
		for (int u = 0; u < CE_UNROLL; u++) /* all loads first: memory-level parallelism */
			if (c0 + u * step < V)
				r[u] = ng_load8_(z + c0 + u * step);
#pragma unroll
		for (int u = 0; u < CE_UNROLL; u++) {
			int c = c0 + u * step;
			if (c >= V)
				break;
			int lim = V - c < 8 ? V - c : 8;
			float vm = ce_vmax(r[u], lim);
			if (vm > st.m) { /* rescale the running sum to the new max */
				float nL = vm * CE_LOG2E;
				st.s *= ce_exp2(mL - nL);
				st.m = vm;
				mL = nL;
			}
			if (st.m != -INFINITY)
				st.s += ce_vsumexp(r[u], lim, mL);
		}
	}
	st = ce_block_merge<CE_THREADS>(st);
	int tg = targets[row];
	if (threadIdx.x == 0) {
		float lse = st.m + logf(st.s);
		losses[row] = (tg >= 0 && tg < V) ? lse - __bfloat162float(z[tg]) : NAN;
		sh_lse = lse;
	}
	if (!GRAD)
		return;
	__syncthreads();
	float lseL = sh_lse * CE_LOG2E;
	for (int c0 = threadIdx.x * 8; c0 < Vp; c0 += CE_UNROLL * step) {
		struct ng_bf16x8 r[CE_UNROLL];
#pragma unroll
		for (int u = 0; u < CE_UNROLL; u++)
			if (c0 + u * step < Vp)
				r[u] = ng_load8_(z + c0 + u * step);
#pragma unroll
		for (int u = 0; u < CE_UNROLL; u++) {
			int c = c0 + u * step;
			if (c >= Vp)
				break;
			ng_store8_(z + c, ce_vgrad(r[u], c, V, tg, lseL, dloss));
		}
	}
}

/* One block per row; the row (Vp bf16) lives in dynamic shared memory. Every thread reads back
 * only the vectors it copied, so the only block barriers are the statistics merge. */
template <bool GRAD>
static __global__ void __launch_bounds__(CE_SMEM_THREADS)
crossentropy_row_in_smem(float *losses, __nv_bfloat16 *logits, const int32_t *targets, int V,
			 int Vp, float dloss)
{
	extern __shared__ int4 ce_row_sh[];
	__shared__ float sh_lse;
	__nv_bfloat16 *row = (__nv_bfloat16 *)ce_row_sh;
	int r = blockIdx.x;
	__nv_bfloat16 *z = logits + (size_t)r * Vp;
	int nv = (V + 7) / 8; /* vectors holding real columns */
	for (int i = threadIdx.x; i < nv; i += CE_SMEM_THREADS)
		ng_copy16_async_(row + 8 * i, z + 8 * i);
	ng_copy_wait_all_();
	float m = -INFINITY;
	for (int i = threadIdx.x; i < nv; i += CE_SMEM_THREADS)
		m = fmaxf(m, ce_vmax(ng_load8_(row + 8 * i), V - 8 * i));
	float sum = 0.0f, mL = m * CE_LOG2E;
	if (m != -INFINITY)
		for (int i = threadIdx.x; i < nv; i += CE_SMEM_THREADS)
			sum += ce_vsumexp(ng_load8_(row + 8 * i), V - 8 * i, mL);
	struct ce_stat st = {m, sum};
	st = ce_block_merge<CE_SMEM_THREADS>(st);
	int tg = targets[r];
	if (threadIdx.x == 0) {
		float lse = st.m + logf(st.s);
		/* the target's logit, copied by another thread: visible after its wait_all and
		 * the barrier in ce_block_merge */
		float zt = (tg >= 0 && tg < V) ? __bfloat162float(row[tg]) : 0.0f;
		losses[r] = (tg >= 0 && tg < V) ? lse - zt : NAN;
		sh_lse = lse;
	}
	if (!GRAD)
		return;
	__syncthreads();
	float lseL = sh_lse * CE_LOG2E;
	int nvp = Vp / 8;
	for (int i = threadIdx.x; i < nvp; i += CE_SMEM_THREADS) {
		int c = 8 * i;
		struct ng_bf16x8 v = {};
		if (c < V)
			v = ng_load8_(row + c);
		v = ce_vgrad(v, c, V, tg, lseL, dloss);
		__stcs(reinterpret_cast<int4 *>(z + c), *reinterpret_cast<const int4 *>(&v));
	}
}

static __global__ void loss_accumulate_one_block(float *loss_sum, const float *losses, int N,
						 float scale)
{
	__shared__ double sh[NG_WARP];
	double acc = ng_block_sum_array_d_(losses, N, sh);
	if (threadIdx.x == 0)
		*loss_sum += (float)(acc * scale);
}

static enum ng_status check_ce(const char *who, const void *logits, int N, int V, int Vp)
{
	if (N <= 0 || V <= 0 || Vp < V || Vp % 8 != 0)
		return ng_check_arg_fail(who, "need N > 0, 0 < V <= Vp, Vp %% 8 == 0; got N=%d V=%d Vp=%d",
					 N, V, Vp);
	if (!ng_aligned16_(logits))
		return ng_check_arg_fail(who, "logits (%p) must be 16-byte aligned", logits);
	return NG_OK;
}

extern "C" enum ng_status ng_crossentropy(float *losses, ng_bf16 *logits, const int32_t *targets,
					  int N, int V, int Vp, float dloss, cudaStream_t s)
{
	enum ng_status st = check_ce("ng_crossentropy", logits, N, V, Vp);
	if (st)
		return st;
	size_t smem = (size_t)Vp * 2;
	if (smem <= CE_SMEM_MAX) {
		if ((st = ng_ensure_smem_(crossentropy_row_in_smem<true>, smem)))
			return st;
		crossentropy_row_in_smem<true><<<N, CE_SMEM_THREADS, smem, s>>>(
			losses, (__nv_bfloat16 *)logits, targets, V, Vp, dloss);
		return NG_LAUNCH_CHECK("crossentropy_row_in_smem<grad>");
	}
	crossentropy_block_per_row<true><<<N, CE_THREADS, 0, s>>>(
		losses, (__nv_bfloat16 *)logits, targets, V, Vp, dloss);
	return NG_LAUNCH_CHECK("crossentropy_block_per_row<grad>");
}

extern "C" enum ng_status ng_crossentropy_fwd(float *losses, const ng_bf16 *logits,
					      const int32_t *targets, int N, int V, int Vp,
					      cudaStream_t s)
{
	enum ng_status st = check_ce("ng_crossentropy_fwd", logits, N, V, Vp);
	if (st)
		return st;
	/* one read of the row is all it needs, so the two-pass kernel (its first pass only) is the
	 * floor here; measured at d12: 1.53 ms, the shared-memory kernel 1.76 ms. It never writes
	 * through the pointer. */
	crossentropy_block_per_row<false><<<N, CE_THREADS, 0, s>>>(
		losses, (__nv_bfloat16 *)logits, targets, V, Vp, 0.0f);
	return NG_LAUNCH_CHECK("crossentropy_block_per_row<no grad>");
}

extern "C" enum ng_status ng_loss_accumulate(float *loss_sum, const float *losses, int N,
					     float scale, void *scratch, cudaStream_t s)
{
	(void)scratch;
	if (N <= 0)
		return ng_check_arg_fail("ng_loss_accumulate", "N must be > 0, got %d", N);
	loss_accumulate_one_block<<<1, 1024, 0, s>>>(loss_sum, losses, N, scale);
	return NG_LAUNCH_CHECK("loss_accumulate_one_block");
}
