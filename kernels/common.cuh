/*
 * kernels/common.cuh — CUDA-only helpers shared by the elementwise, layernorm, loss and
 * optimizer kernels: bf16 <-> float, 16-byte vectors of 8 bf16 / 4 float, warp and block sums.
 * Included by .cu files only (never by C).
 *
 * Why 16-byte vectors: every kernel here is memory-bound; one 128-bit load per thread per
 * iteration is what reaches copy bandwidth on the H100/H200 (CUDA C++ Best Practices Guide,
 * "coalesced access"). Launchers check the 16-byte alignment and the divisibility by 8 they
 * rely on, and fail with the values.
 */
#ifndef NG_KERNELS_COMMON_CUH
#define NG_KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/check.h"
#include "kernels/types.h"

#define NG_WARP 32

/* Eight bf16 in one 16-byte word. */
struct ng_bf16x8 {
	__nv_bfloat162 h[4]; /* elements 2i, 2i+1 in h[i] */
};

static __device__ __forceinline__ struct ng_bf16x8 ng_load8_(const __nv_bfloat16 *p)
{
	struct ng_bf16x8 r;
	*reinterpret_cast<int4 *>(&r) = *reinterpret_cast<const int4 *>(p);
	return r;
}

/* Streaming load (evict-first): for data read once. */
static __device__ __forceinline__ struct ng_bf16x8 ng_load8_stream_(const __nv_bfloat16 *p)
{
	struct ng_bf16x8 r;
	*reinterpret_cast<int4 *>(&r) = __ldcs(reinterpret_cast<const int4 *>(p));
	return r;
}

static __device__ __forceinline__ void ng_store8_(__nv_bfloat16 *p, struct ng_bf16x8 v)
{
	*reinterpret_cast<int4 *>(p) = *reinterpret_cast<const int4 *>(&v);
}

static __device__ __forceinline__ void ng_unpack8_(float f[8], struct ng_bf16x8 v)
{
#pragma unroll
	for (int i = 0; i < 4; i++) {
		float2 t = __bfloat1622float2(v.h[i]);
		f[2 * i] = t.x;
		f[2 * i + 1] = t.y;
	}
}

static __device__ __forceinline__ struct ng_bf16x8 ng_pack8_(const float f[8])
{
	struct ng_bf16x8 v;
#pragma unroll
	for (int i = 0; i < 4; i++)
		v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
	return v;
}

static __device__ __forceinline__ float ng_warp_sum_(float x)
{
#pragma unroll
	for (int o = NG_WARP / 2; o > 0; o >>= 1)
		x += __shfl_xor_sync(0xffffffffu, x, o);
	return x;
}

static __device__ __forceinline__ float ng_warp_max_(float x)
{
#pragma unroll
	for (int o = NG_WARP / 2; o > 0; o >>= 1)
		x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
	return x;
}

struct ng_op_sum_ { /* a + b, for ng_block_reduce_ */
	template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
/* Reduce over the block with `op` (blockDim.x a multiple of 32, at most 1024); the result is in
 * every thread. Fixed order, so deterministic. `sh` holds 32 values; every thread of the block
 * must reach the call. `id` is the identity of `op`. */
template <typename T, typename Op>
static __device__ __forceinline__ T ng_block_reduce_(T x, T *sh, T id, Op op)
{
	int lane = threadIdx.x % NG_WARP, warp = threadIdx.x / NG_WARP;
	int nw = blockDim.x / NG_WARP;
#pragma unroll
	for (int o = NG_WARP / 2; o > 0; o >>= 1)
		x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
	__syncthreads(); /* sh may still be read from a previous call */
	if (lane == 0)
		sh[warp] = x;
	__syncthreads();
	x = lane < nw ? sh[lane] : id;
#pragma unroll
	for (int o = NG_WARP / 2; o > 0; o >>= 1)
		x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
	return x;
}

static __device__ __forceinline__ double ng_block_sum_d_(double x, double *sh)
{
	return ng_block_reduce_(x, sh, 0.0, ng_op_sum_());
}

/* The double sum of p[0..n) by one block, in a fixed order (every thread gets it). */
template <typename T>
static __device__ __forceinline__ double ng_block_sum_array_d_(const T *p, int n, double *sh)
{
	double acc = 0.0;
	for (int i = threadIdx.x; i < n; i += blockDim.x)
		acc += p[i];
	return ng_block_sum_d_(acc, sh);
}

/* Dynamic shared memory above 48 KiB needs a per-kernel opt-in (a host call, not a stream
 * operation, so it is allowed while a stream is being captured). */
template <typename K>
static inline enum ng_status ng_ensure_smem_(K kernel, size_t bytes)
{
	if (bytes <= 48 * 1024)
		return NG_OK;
	return NG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
						  (int)bytes));
}

/* Is p aligned to 16 bytes? (host side, for the launchers' precondition checks) */
static inline int ng_aligned16_(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* GELU, the tanh approximation of GPT-2 (Hendrycks & Gimpel 2016), in fp32: used by the
 * elementwise kernels and by the epilogue of our GEMM, so both compute the same values. */
#define GELU_S 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_K 0.044715f

/* 0.5 (1 + tanh u) = sigmoid(2u) =: sp and 1 - tanh^2 u = 4 sp (1 - sp). Written with the
 * sigmoid, neither 1 + tanh nor 1 - tanh^2 cancels for negative x (the tanh form loses all the
 * bits of the gradient at x < -4); for large positive x, 1 - sp does cancel, but there the term
 * it scales is negligible next to sp ~ 1. */
static __device__ __forceinline__ float ng_gelu_f(float x)
{
	float u = GELU_S * (x + GELU_K * x * x * x);
	return __fdividef(x, 1.0f + __expf(-2.0f * u));
}

static __device__ __forceinline__ float ng_gelu_grad_f(float x)
{
	float u = GELU_S * (x + GELU_K * x * x * x);
	float sp = __frcp_rn(1.0f + __expf(-2.0f * u)); /* sigmoid(2u) */
	return sp + 2.0f * x * sp * (1.0f - sp) * GELU_S * (1.0f + 3.0f * GELU_K * x * x);
}

#endif
