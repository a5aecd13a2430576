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

/* The row of a warp-per-row kernel: lane `lane` owns the 8 channels at lane*8 + 256 j, j < NCH;
 * those below C are loaded (streaming: the row is read once), all before any is used. */
template <int NCH>
static __device__ __forceinline__ void ng_load_row8_(struct ng_bf16x8 r[NCH],
						     const __nv_bfloat16 *row, int C, int lane)
{
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		int c = lane * 8 + j * 32 * 8;
		if (c < C)
			r[j] = ng_load8_stream_(row + c);
	}
}

/* The bodies of the elementwise kernels, one thread per 8 elements (16-byte loads) and a scalar
 * tail for n % 8, in fp32: out[i] = f(a[i]) (map1) or f(a[i], b[i]) (map2), rounded once. */
template <typename F>
static __device__ __forceinline__ void ng_map1_vec8_(__nv_bfloat16 *out, const __nv_bfloat16 *a,
						     size_t n, F f)
{
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
	if (i + 8 <= n) {
		float x[8];
		ng_unpack8_(x, ng_load8_stream_(a + i));
#pragma unroll
		for (int k = 0; k < 8; k++)
			x[k] = f(x[k]);
		ng_store8_(out + i, ng_pack8_(x));
	} else {
		for (; i < n; i++)
			out[i] = __float2bfloat16_rn(f(__bfloat162float(a[i])));
	}
}

template <typename F>
static __device__ __forceinline__ void ng_map2_vec8_(__nv_bfloat16 *out, const __nv_bfloat16 *a,
						     const __nv_bfloat16 *b, size_t n, F f)
{
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
	if (i + 8 <= n) {
		float x[8], y[8];
		ng_unpack8_(x, ng_load8_stream_(a + i));
		ng_unpack8_(y, ng_load8_stream_(b + i));
#pragma unroll
		for (int k = 0; k < 8; k++)
			x[k] = f(x[k], y[k]);
		ng_store8_(out + i, ng_pack8_(x));
	} else {
		for (; i < n; i++)
			out[i] = __float2bfloat16_rn(f(__bfloat162float(a[i]), __bfloat162float(b[i])));
	}
}

/* W (8 or 1) consecutive bf16 at p as float: for kernels with a 16-byte vector path and a scalar
 * path for other shapes (W == 8: one 16-byte load, p 16-byte aligned). */
template <int W>
static __device__ __forceinline__ void ng_loadw_(float x[W], const __nv_bfloat16 *p)
{
	if constexpr (W == 8)
		ng_unpack8_(x, ng_load8_(p));
	else
		x[0] = __bfloat162float(*p);
}

/* x rounded to bf16 and stored at p, W as ng_loadw_. */
template <int W>
static __device__ __forceinline__ void ng_storew_(__nv_bfloat16 *p, const float x[W])
{
	if constexpr (W == 8)
		ng_store8_(p, ng_pack8_(x));
	else
		*p = __float2bfloat16_rn(x[0]);
}

/* Copies 16 bytes global -> shared without a register round trip (cp.async, sm_80+); both
 * addresses 16-byte aligned. ng_copy_wait_all_ waits for this thread's copies; other threads
 * see them after a barrier that follows the wait. */
static __device__ __forceinline__ void ng_copy16_async_(void *dst_shared, const void *src)
{
	unsigned d = (unsigned)__cvta_generic_to_shared(dst_shared);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

static __device__ __forceinline__ void ng_copy_wait_all_(void)
{
	asm volatile("cp.async.wait_all;\n" ::: "memory");
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

/* A block's shared memory above 48 KiB in all needs a per-kernel opt-in for its dynamic part
 * (host calls, not stream operations, so they are allowed while a stream is being captured).
 * The kernel's static arrays count towards the 48 KiB: the staged LayerNorm backward at
 * C = 2048 has exactly 48 KiB of stages plus 256 bytes of static block sums, and without the
 * opt-in its launch fails with "invalid argument". */
template <typename K>
static inline enum ng_status ng_ensure_smem_(K kernel, size_t bytes)
{
	if (bytes == 0)
		return NG_OK;
	cudaFuncAttributes fa;
	if (NG_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel)))
		return NG_ERR_RUNTIME;
	if (bytes + fa.sharedSizeBytes <= 48 * 1024)
		return NG_OK;
	return NG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
						  (int)bytes));
}

/* Is p aligned to 16 bytes? (host side, for the launchers' precondition checks) */
static inline int ng_aligned16_(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* The grid of an elementwise kernel with one thread per 8 elements (and a scalar tail). */
static inline unsigned ng_vec8_grid_(size_t n, int threads)
{
	return (unsigned)(((n + 7) / 8 + threads - 1) / threads);
}

/* The precondition of those kernels: n > 0, a grid that fits, three 16-byte aligned pointers
 * (repeat one where the kernel has fewer). */
static inline enum ng_status ng_check_vec8_(const char *who, size_t n, int threads, const void *a,
					    const void *b, const void *c)
{
	if (n == 0)
		return ng_check_arg_fail(who, "n must be > 0");
	if ((n + 7) / 8 > (size_t)threads * 0x7fffffffu)
		return ng_check_arg_fail(who, "n = %zu is too large", n);
	if (!ng_aligned16_(a) || !ng_aligned16_(b) || !ng_aligned16_(c))
		return ng_check_arg_fail(who, "pointers must be 16-byte aligned (%p %p %p)", a, b, c);
	return NG_OK;
}

/* The register classes of the warp-per-row kernels (kernels/layernorm.cu, kernels/rmsnorm.cu):
 * a lane holds NCH chunks of 8 channels of its row, NCH in 1..8, 12 or 16 (C <= 4096, one
 * instantiation each). Returns f.template run<NCH>() for the smallest class >= nch. */
template <typename F> static inline enum ng_status ng_nch_dispatch_(int nch, const F &f)
{
	switch (nch) {
	case 1: return f.template run<1>();
	case 2: return f.template run<2>();
	case 3: return f.template run<3>();
	case 4: return f.template run<4>();
	case 5: return f.template run<5>();
	case 6: return f.template run<6>();
	case 7: return f.template run<7>();
	case 8: return f.template run<8>();
	default: break;
	}
	if (nch <= 12)
		return f.template run<12>();
	return f.template run<16>();
}

/* GELU, the tanh approximation of GPT-2 (Hendrycks & Gimpel 2016), in fp32: used by the
 * elementwise kernels and by the epilogue of our GEMM, so both compute the same values. */

/* 0.5 (1 + tanh u) = sigmoid(2u) =: sp and 1 - tanh^2 u = 4 sp (1 - sp). Written with the
 * sigmoid, neither 1 + tanh nor 1 - tanh^2 cancels for negative x (the tanh form loses all the
 * bits of the gradient at x < -4); for large positive x, 1 - sp does cancel, but there the term
 * it scales is negligible next to sp ~ 1.
 *
 * The constants are folded so that an element costs few FP32 operations besides its two MUFU
 * ones (ex2 and the approximate reciprocal): 2u log2(e) = x (GELU_E1 + GELU_E2 x^2), so
 * sp = 1 / (1 + 2^(-x (GELU_E1 + GELU_E2 x^2))), and d(2u)/dx = GELU_D1 + GELU_D2 x^2. The
 * epilogue of our GEMM measured 6% faster with them at d24's fc shape (BENCHMARKS.md); the
 * approximate ex2 and reciprocal are within 2 ulp in fp32, far below bf16's rounding. */
#define GELU_E1 2.302208198144325f   /* 2 sqrt(2/pi) log2(e) */
#define GELU_E2 0.1029432395800235f  /* GELU_E1 0.044715 */
#define GELU_D1 1.5957691216057308f  /* 2 sqrt(2/pi) */
#define GELU_D2 0.21406444881780076f /* 6 sqrt(2/pi) 0.044715 */

/* 2^(-x (GELU_E1 + GELU_E2 x^2)) = exp(-2u), given x2 = x * x */
static __device__ __forceinline__ float ng_gelu_exp_(float x, float x2)
{
	float e;
	asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-x * fmaf(GELU_E2, x2, GELU_E1)));
	return e;
}

static __device__ __forceinline__ float ng_gelu_f(float x)
{
	return __fdividef(x, 1.0f + ng_gelu_exp_(x, x * x));
}

/* GELU'(x), and GELU(x) in *value, from one sigmoid */
static __device__ __forceinline__ float ng_gelu_grad_value_f(float x, float *value)
{
	const float x2 = x * x;
	const float sp = __fdividef(1.0f, 1.0f + ng_gelu_exp_(x, x2)); /* sigmoid(2u) */
	*value = x * sp;
	/* sp + x sp (1 - sp) (D1 + D2 x^2) = sp (1 + x (1 - sp) (D1 + D2 x^2)) */
	return sp * fmaf(fmaf(-x, sp, x), fmaf(GELU_D2, x2, GELU_D1), 1.0f);
}

static __device__ __forceinline__ float ng_gelu_grad_f(float x)
{
	float v;
	return ng_gelu_grad_value_f(x, &v);
}

#endif
