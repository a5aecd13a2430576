/*
 * kernels/attention_naive.cu — masked causal attention in plain CUDA: the fallback when cuDNN
 * has no engine for a shape or mask (or when asked), and the oracle of the cuDNN backend on the
 * GPU. Correct for every shape with D <= 256; simpler and slower than flash attention;
 * deterministic (no atomics); no allocation, so it can be recorded inside a CUDA graph.
 *
 * The mask (kernels/attention.h): query t sees keys first(t) .. t, first(t) = max(0,
 * t - window + 1, min(lo[b, t], t)) (lo clamped to t: a query always sees itself, so no row is
 * empty). The loops start at first(t) instead of masking from 0, so a window of w tokens costs
 * ~T w rather than T^2; the key-row kernel walks the queries t >= s upwards and stops at the
 * first chunk of 32 that cannot see s (lo is non-decreasing in t, so none after it can).
 *
 * Algorithm: one warp per output row. The 32 lanes take 32 keys (or queries) at a time: each
 * lane computes a full D-long dot product for its key, the warp reduces max/sum with shuffles
 * (online softmax, as in FlashAttention), then each lane accumulates its own D/32 columns of the
 * output while the 32 probabilities are broadcast by shuffles. Accumulation in fp32.
 *   forward:  o_t = sum_{s visible} softmax_s(scale q_t.k_s) v_s,  lse_t = log sum_s exp(...)
 *   backward: rowdot_t = dout_t . o_t;  p_ts = exp(scale q_t.k_s - lse_t)
 *             ds_ts = p_ts (dout_t . v_s - rowdot_t) scale
 *             dq_t = sum_{s visible to t} ds_ts k_s   (warp per query row)
 *             dk_s = sum_{t seeing s} ds_ts q_t,  dv_s = sum_{t seeing s} p_ts dout_t
 *             (warp per key row)
 * Shapes: qkv/dqkv (B,T,3,H,D), out/dout (B,T,H,D) bf16; lse/rowdot (B,H,T) fp32.
 *
 * Also here: ng_attention_fill_i32_, which writes the sequence lengths of the cuDNN padding-mask
 * workaround (attention_cudnn.c) into the workspace.
 * The entry points return the launch's cudaError_t; ng_attention_plan (attention_cudnn.c)
 * validates the shape and wraps them in NG_CUDA_CHECK.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/attention.h"
#include "kernels/types.h"

#define WARPS_PER_BLOCK 4
#define MAX_D 256
#define MAX_PER_LANE (MAX_D / 32)
#define FULL_MASK 0xffffffffu

typedef __nv_bfloat16 bf16;

/* The shape, mask and scale every kernel needs. */
struct attn_shape {
	int B, H, T, D;
	float scale;       /* softmax scale */
	int vec;           /* 1: rows are 16-byte aligned and D % 8 == 0, load 8 bf16 at a time */
	int window;        /* the band (tokens), 0: none */
	const int32_t *wdev; /* device band width, capped at window (NULL: window alone) */
	const int32_t *lo; /* (B, T) int32 first keys, or NULL */
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

/* The band's width this launch uses (0: none); read once per warp. */
static __device__ int band_width(const struct attn_shape &sh)
{
	int w = sh.window;
	if (sh.wdev) {
		int d = *sh.wdev;
		if (d > 0 && d < w)
			w = d;
	}
	return w;
}

/* The first key query t of sequence b sees (kernels/attention.h's mask), band width w. */
static __device__ int first_key(const struct attn_shape &sh, int w, int b, int t)
{
	int s0 = w > 0 ? max(0, t - w + 1) : 0;
	if (sh.lo)
		s0 = max(s0, min(sh.lo[(size_t)b * sh.T + t], t));
	return s0;
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
	for (int base = first_key(sh, band_width(sh), b, t); base <= t; base += 32) {
		int s = base + lane;
		float sc = -INFINITY;
		if (s <= t)
			sc = dot_shared_global(q, qkv_row(qkv, sh, b, s, 1, h), sh) * sh.scale;
		float mn = fmaxf(m, warp_max(sc)); /* finite: lane 0's key (s = base <= t) is visible */
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
	for (int base = first_key(sh, band_width(sh), b, t); base <= t; base += 32) {
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

/* dk and dv rows of dqkv; warp per key row s, lanes over the queries t >= s that see s: those
 * below s + window whose first key is at most s, a prefix of them since first_key is
 * non-decreasing in t. */
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
	int w = band_width(sh);
	int end = w > 0 ? min(sh.T, s + w) : sh.T; /* queries s .. end-1 */
	for (int base = s; base < end; base += 32) {
		int t = base + lane;
		bool sees = t < end && first_key(sh, w, b, t) <= s;
		if (!__any_sync(FULL_MASK, sees))
			break; /* this chunk sees nothing: neither does any later one */
		float ds = 0.0f, p = 0.0f;
		if (sees) {
			const bf16 *dot = dout + o_off(sh, b, t, h);
			p = expf(dot_shared_global(k, qkv_row(qkv, sh, b, t, 0, h), sh) * sh.scale -
				 lse_bh[t]);
			float dp = dot_shared_global(v, dot, sh);
			ds = p * (dp - rd_bh[t]) * sh.scale;
		}
		int nq = min(32, end - base); /* lanes past the prefix carry ds = p = 0 */
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
			    const struct ng_attention_naive_mask_ &m, const void *const *ptrs,
			    int n_ptrs)
{
	int vec = D % 8 == 0;
	for (int i = 0; i < n_ptrs; i++)
		if ((uintptr_t)ptrs[i] % 16)
			vec = 0;
	sh->B = B;
	sh->H = H;
	sh->T = T;
	sh->D = D;
	sh->scale = m.scale;
	sh->vec = vec;
	sh->window = m.window > 0 ? m.window : 0;
	sh->wdev = sh->window ? m.window_dev : NULL;
	sh->lo = m.lo;
	return (unsigned)((size_t)B * H * ((T + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK));
}

extern "C" cudaError_t ng_attention_naive_fwd_(ng_bf16 *out, float *lse, const ng_bf16 *qkv,
					       int B, int H, int T, int D,
					       struct ng_attention_naive_mask_ m, cudaStream_t s)
{
	struct attn_shape sh;
	const void *ptrs[] = {qkv};
	unsigned blocks = naive_setup(&sh, B, H, T, D, m, ptrs, 1);
	attention_fwd_warp_per_row<<<blocks, WARPS_PER_BLOCK * 32, 0, s>>>(
		(bf16 *)out, lse, (const bf16 *)qkv, sh);
	return cudaGetLastError();
}

extern "C" cudaError_t ng_attention_naive_bwd_(ng_bf16 *dqkv, float *rowdot, const ng_bf16 *dout,
					       const ng_bf16 *qkv, const ng_bf16 *out,
					       const float *lse, int B, int H, int T, int D,
					       struct ng_attention_naive_mask_ m, cudaStream_t s)
{
	struct attn_shape sh;
	const void *ptrs[] = {qkv, dout};
	unsigned blocks = naive_setup(&sh, B, H, T, D, m, ptrs, 2);
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
