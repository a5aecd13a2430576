/*
 * kernels/attention_naive.cu — causal attention in plain CUDA: the fallback when cuDNN has no
 * engine for a shape (or when asked), and a second witness in the tests. Correct for every
 * shape with D <= 256; simpler and slower than flash attention; deterministic (no atomics); no
 * allocation, so it can be recorded inside a CUDA graph.
 *
 * Algorithm: one warp per output row. The 32 lanes take 32 keys (or queries) at a time: each
 * lane computes a full D-long dot product for its key, the warp reduces max/sum with shuffles
 * (online softmax, as in FlashAttention), then each lane accumulates its own D/32 columns of the
 * output while the 32 probabilities are broadcast by shuffles. Accumulation in fp32.
 *   forward:  o_t = sum_{s<=t} softmax_s(scale q_t.k_s) v_s,  lse_t = log sum_s exp(scale q_t.k_s)
 *   backward: rowdot_t = dout_t . o_t;  p_ts = exp(scale q_t.k_s - lse_t)
 *             ds_ts = p_ts (dout_t . v_s - rowdot_t) scale
 *             dq_t = sum_{s<=t} ds_ts k_s   (warp per query row)
 *             dk_s = sum_{t>=s} ds_ts q_t,  dv_s = sum_{t>=s} p_ts dout_t   (warp per key row)
 * Shapes: qkv/dqkv (B,T,3,H,D), out/dout (B,T,H,D) bf16; lse/rowdot (B,H,T) fp32.
 *
 * Also here: ng_attention_fill_i32_, which writes the sequence lengths of the cuDNN padding-mask
 * workaround (attention_cudnn.c) into the workspace.
 * The entry points return the launch's cudaError_t; ng_attention_plan (attention_cudnn.c)
 * validates the shape and wraps them in NG_CUDA_CHECK. This file includes no project header that
 * pulls in util/status.h, whose C++ guard does not compile under nvcc today.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/types.h"

#define WARPS_PER_BLOCK 4
#define MAX_D 256
#define MAX_PER_LANE (MAX_D / 32)
#define FULL_MASK 0xffffffffu

typedef __nv_bfloat16 bf16;

/* The shape and strides every kernel needs. */
struct attn_shape {
	int B, H, T, D;
	float scale;    /* 1/sqrt(D) */
	int vec;        /* 1: rows are 16-byte aligned and D % 8 == 0, load 8 bf16 at a time */
};

static __device__ float warp_max(float x)
{
	for (int o = 16; o > 0; o >>= 1)
		x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, o));
	return x;
}

static __device__ float warp_sum(float x)
{
	for (int o = 16; o > 0; o >>= 1)
		x += __shfl_xor_sync(FULL_MASK, x, o);
	return x;
}

/* Row `sec` (0 q, 1 k, 2 v) of token (b, t), head h, in the fused qkv buffer. */
static __device__ const bf16 *qkv_row(const bf16 *qkv, const struct attn_shape &sh, int b, int t,
				      int sec, int h)
{
	return qkv + (((size_t)b * sh.T + t) * 3 * sh.H + (size_t)sec * sh.H + h) * sh.D;
}

/* Offset of row (b, t), head h, of an (B, T, H, D) tensor (out, dout). */
static __device__ size_t o_off(const struct attn_shape &sh, int b, int t, int h)
{
	return (((size_t)b * sh.T + t) * sh.H + h) * sh.D;
}

/* The row this warp owns (-1 past the end) and its (b, h); bh = b * H + h. */
static __device__ int warp_row(const struct attn_shape &sh, int *bh, int *b, int *h)
{
	int row_blocks = (sh.T + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
	int t = (blockIdx.x % row_blocks) * WARPS_PER_BLOCK + threadIdx.x / 32;
	*bh = blockIdx.x / row_blocks;
	*b = *bh / sh.H;
	*h = *bh % sh.H;
	return t < sh.T ? t : -1;
}

/* One lane: dot product of an fp32 row in shared memory with a bf16 row in global memory. */
static __device__ float dot_shared_global(const float *a, const bf16 *g,
					  const struct attn_shape &sh)
{
	float acc = 0.0f;
	if (sh.vec) {
		const uint4 *g4 = (const uint4 *)g;
		for (int i = 0; i < sh.D / 8; i++) {
			uint4 u = g4[i];
			const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&u;
#pragma unroll
			for (int j = 0; j < 4; j++) {
				float2 f = __bfloat1622float2(h2[j]);
				acc += a[8 * i + 2 * j] * f.x + a[8 * i + 2 * j + 1] * f.y;
			}
		}
	} else {
		for (int d = 0; d < sh.D; d++)
			acc += a[d] * __bfloat162float(g[d]);
	}
	return acc;
}

/* The warp copies a bf16 row into fp32 shared memory. */
static __device__ void load_row(float *dst, const bf16 *src, int D, int lane)
{
	for (int d = lane; d < D; d += 32)
		dst[d] = __bfloat162float(src[d]);
	__syncwarp();
}

/* grid: B*H*ceil(T/WARPS_PER_BLOCK) blocks of WARPS_PER_BLOCK warps; warp = query row t. */
static __global__ void attention_fwd_warp_per_row(bf16 *out, float *lse, const bf16 *qkv,
						  struct attn_shape sh)
{
	__shared__ float q_sh[WARPS_PER_BLOCK][MAX_D];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, bh, b, h;
	int t = warp_row(sh, &bh, &b, &h);
	if (t < 0)
		return;
	float *q = q_sh[warp];
	load_row(q, qkv_row(qkv, sh, b, t, 0, h), sh.D, lane);

	float m = -INFINITY, l = 0.0f, acc[MAX_PER_LANE];
#pragma unroll
	for (int i = 0; i < MAX_PER_LANE; i++)
		acc[i] = 0.0f;
	for (int base = 0; base <= t; base += 32) {
		int s = base + lane;
		float sc = -INFINITY;
		if (s <= t)
			sc = dot_shared_global(q, qkv_row(qkv, sh, b, s, 1, h), sh) * sh.scale;
		float mn = fmaxf(m, warp_max(sc)); /* finite: lane 0's key is always visible */
		float corr = expf(m - mn);
		float p = s <= t ? expf(sc - mn) : 0.0f;
		l = l * corr + warp_sum(p);
		m = mn;
		int nk = min(32, t - base + 1);
#pragma unroll
		for (int i = 0; i < MAX_PER_LANE; i++)
			acc[i] *= corr;
		for (int j = 0; j < nk; j++) {
			float pj = __shfl_sync(FULL_MASK, p, j);
			const bf16 *v = qkv_row(qkv, sh, b, base + j, 2, h);
#pragma unroll
			for (int i = 0; i < MAX_PER_LANE; i++) {
				int d = lane + 32 * i;
				if (d < sh.D)
					acc[i] += pj * __bfloat162float(v[d]);
			}
		}
	}
	bf16 *o = out + o_off(sh, b, t, h);
#pragma unroll
	for (int i = 0; i < MAX_PER_LANE; i++) {
		int d = lane + 32 * i;
		if (d < sh.D)
			o[d] = __float2bfloat16(acc[i] / l);
	}
	if (lane == 0)
		lse[(size_t)bh * sh.T + t] = m + logf(l);
}

/* rowdot (B,H,T) = sum_d dout * out; warp per row, same grid as the forward. */
static __global__ void attention_bwd_rowdot_warp_per_row(float *rowdot, const bf16 *dout,
							 const bf16 *out, struct attn_shape sh)
{
	int lane = threadIdx.x % 32, bh, b, h;
	int t = warp_row(sh, &bh, &b, &h);
	if (t < 0)
		return;
	size_t off = o_off(sh, b, t, h);
	float acc = 0.0f;
	for (int d = lane; d < sh.D; d += 32)
		acc += __bfloat162float(dout[off + d]) * __bfloat162float(out[off + d]);
	acc = warp_sum(acc);
	if (lane == 0)
		rowdot[(size_t)bh * sh.T + t] = acc;
}

/* dq rows of dqkv; warp per query row t, lanes over keys s <= t. */
static __global__ void attention_bwd_dq_warp_per_row(bf16 *dqkv, const float *rowdot,
						     const bf16 *dout, const bf16 *qkv,
						     const float *lse, struct attn_shape sh)
{
	__shared__ float q_sh[WARPS_PER_BLOCK][MAX_D];
	__shared__ float do_sh[WARPS_PER_BLOCK][MAX_D];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, bh, b, h;
	int t = warp_row(sh, &bh, &b, &h);
	if (t < 0)
		return;
	float *q = q_sh[warp], *dov = do_sh[warp];
	load_row(q, qkv_row(qkv, sh, b, t, 0, h), sh.D, lane);
	load_row(dov, dout + o_off(sh, b, t, h), sh.D, lane);
	float lse_t = lse[(size_t)bh * sh.T + t], rd_t = rowdot[(size_t)bh * sh.T + t];

	float acc[MAX_PER_LANE];
#pragma unroll
	for (int i = 0; i < MAX_PER_LANE; i++)
		acc[i] = 0.0f;
	for (int base = 0; base <= t; base += 32) {
		int s = base + lane;
		float ds = 0.0f;
		if (s <= t) {
			float p = expf(dot_shared_global(q, qkv_row(qkv, sh, b, s, 1, h), sh) * sh.scale -
				       lse_t);
			float dp = dot_shared_global(dov, qkv_row(qkv, sh, b, s, 2, h), sh);
			ds = p * (dp - rd_t) * sh.scale;
		}
		int nk = min(32, t - base + 1);
		for (int j = 0; j < nk; j++) {
			float dsj = __shfl_sync(FULL_MASK, ds, j);
			const bf16 *k = qkv_row(qkv, sh, b, base + j, 1, h);
#pragma unroll
			for (int i = 0; i < MAX_PER_LANE; i++) {
				int d = lane + 32 * i;
				if (d < sh.D)
					acc[i] += dsj * __bfloat162float(k[d]);
			}
		}
	}
	bf16 *dq = dqkv + (qkv_row(qkv, sh, b, t, 0, h) - qkv);
#pragma unroll
	for (int i = 0; i < MAX_PER_LANE; i++) {
		int d = lane + 32 * i;
		if (d < sh.D)
			dq[d] = __float2bfloat16(acc[i]);
	}
}

/* dk and dv rows of dqkv; warp per key row s, lanes over queries t >= s. */
static __global__ void attention_bwd_dkdv_warp_per_row(bf16 *dqkv, const float *rowdot,
						       const bf16 *dout, const bf16 *qkv,
						       const float *lse, struct attn_shape sh)
{
	__shared__ float k_sh[WARPS_PER_BLOCK][MAX_D];
	__shared__ float v_sh[WARPS_PER_BLOCK][MAX_D];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, bh, b, h;
	int s = warp_row(sh, &bh, &b, &h);
	if (s < 0)
		return;
	float *k = k_sh[warp], *v = v_sh[warp];
	load_row(k, qkv_row(qkv, sh, b, s, 1, h), sh.D, lane);
	load_row(v, qkv_row(qkv, sh, b, s, 2, h), sh.D, lane);
	const float *lse_bh = lse + (size_t)bh * sh.T, *rd_bh = rowdot + (size_t)bh * sh.T;

	float dk[MAX_PER_LANE], dv[MAX_PER_LANE];
#pragma unroll
	for (int i = 0; i < MAX_PER_LANE; i++)
		dk[i] = dv[i] = 0.0f;
	for (int base = s; base < sh.T; base += 32) {
		int t = base + lane;
		float ds = 0.0f, p = 0.0f;
		if (t < sh.T) {
			const bf16 *dot = dout + o_off(sh, b, t, h);
			p = expf(dot_shared_global(k, qkv_row(qkv, sh, b, t, 0, h), sh) * sh.scale -
				 lse_bh[t]);
			float dp = dot_shared_global(v, dot, sh);
			ds = p * (dp - rd_bh[t]) * sh.scale;
		}
		int nq = min(32, sh.T - base);
		for (int j = 0; j < nq; j++) {
			float dsj = __shfl_sync(FULL_MASK, ds, j);
			float pj = __shfl_sync(FULL_MASK, p, j);
			const bf16 *q = qkv_row(qkv, sh, b, base + j, 0, h);
			const bf16 *dot = dout + o_off(sh, b, base + j, h);
#pragma unroll
			for (int i = 0; i < MAX_PER_LANE; i++) {
				int d = lane + 32 * i;
				if (d < sh.D) {
					dk[i] += dsj * __bfloat162float(q[d]);
					dv[i] += pj * __bfloat162float(dot[d]);
				}
			}
		}
	}
	bf16 *dkr = dqkv + (qkv_row(qkv, sh, b, s, 1, h) - qkv);
	bf16 *dvr = dqkv + (qkv_row(qkv, sh, b, s, 2, h) - qkv);
#pragma unroll
	for (int i = 0; i < MAX_PER_LANE; i++) {
		int d = lane + 32 * i;
		if (d < sh.D) {
			dkr[d] = __float2bfloat16(dk[i]);
			dvr[d] = __float2bfloat16(dv[i]);
		}
	}
}

/* Fills `sh` and the grid size; the plan has validated the shape (1 <= D <= MAX_D). */
static unsigned naive_setup(struct attn_shape *sh, int B, int H, int T, int D,
			    const void *const *ptrs, int n_ptrs)
{
	int vec = D % 8 == 0;
	for (int i = 0; i < n_ptrs; i++)
		if ((uintptr_t)ptrs[i] % 16)
			vec = 0;
	sh->B = B;
	sh->H = H;
	sh->T = T;
	sh->D = D;
	sh->scale = 1.0f / sqrtf((float)D);
	sh->vec = vec;
	return (unsigned)((size_t)B * H * ((T + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK));
}

extern "C" cudaError_t ng_attention_naive_fwd_(ng_bf16 *out, float *lse, const ng_bf16 *qkv,
					       int B, int H, int T, int D, cudaStream_t s)
{
	struct attn_shape sh;
	const void *ptrs[] = {qkv};
	unsigned blocks = naive_setup(&sh, B, H, T, D, ptrs, 1);
	attention_fwd_warp_per_row<<<blocks, WARPS_PER_BLOCK * 32, 0, s>>>(
		(bf16 *)out, lse, (const bf16 *)qkv, sh);
	return cudaGetLastError();
}

extern "C" cudaError_t ng_attention_naive_bwd_(ng_bf16 *dqkv, float *rowdot, const ng_bf16 *dout,
					       const ng_bf16 *qkv, const ng_bf16 *out,
					       const float *lse, int B, int H, int T, int D,
					       cudaStream_t s)
{
	struct attn_shape sh;
	const void *ptrs[] = {qkv, dout};
	unsigned blocks = naive_setup(&sh, B, H, T, D, ptrs, 2);
	cudaError_t e;
	attention_bwd_rowdot_warp_per_row<<<blocks, WARPS_PER_BLOCK * 32, 0, s>>>(
		rowdot, (const bf16 *)dout, (const bf16 *)out, sh);
	if ((e = cudaGetLastError()) != cudaSuccess)
		return e;
	attention_bwd_dq_warp_per_row<<<blocks, WARPS_PER_BLOCK * 32, 0, s>>>(
		(bf16 *)dqkv, rowdot, (const bf16 *)dout, (const bf16 *)qkv, lse, sh);
	if ((e = cudaGetLastError()) != cudaSuccess)
		return e;
	attention_bwd_dkdv_warp_per_row<<<blocks, WARPS_PER_BLOCK * 32, 0, s>>>(
		(bf16 *)dqkv, rowdot, (const bf16 *)dout, (const bf16 *)qkv, lse, sh);
	return cudaGetLastError();
}

static __global__ void fill_i32(int *p, int n, int v)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		p[i] = v;
}

extern "C" cudaError_t ng_attention_fill_i32_(int *p, int n, int v, cudaStream_t s)
{
	fill_i32<<<(n + 255) / 256, 256, 0, s>>>(p, n, v);
	return cudaGetLastError();
}
