/*
 * kernels/fp8.cu — absolute maximum, scale and E4M3 cast (see fp8.h).
 *
 * Memory-bound, one thread per 8 elements (16-byte bf16 loads, 8-byte E4M3 stores) and a scalar
 * tail. amax: a warp maximum, then one atomicMax per warp on the float's bits, which order like
 * the values for non-negative floats (and put NaN above every number), so no order is needed.
 * The conversion is cuda_fp8.h's __nv_cvt_float_to_fp8 (round to nearest even, __NV_SATFINITE).
 */
#include <cuda_fp8.h>

#include "kernels/common.cuh"

#include "kernels/fp8.h"

#define FP8_THREADS 256

static __device__ __forceinline__ void amax_update_(float *amax, float v)
{
#pragma unroll
	for (int o = NG_WARP / 2; o > 0; o /= 2)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	if ((threadIdx.x & (NG_WARP - 1)) == 0)
		atomicMax(reinterpret_cast<unsigned *>(amax), __float_as_uint(v));
}

static __global__ void fp8_amax_vec8(float *amax, const __nv_bfloat16 *in, size_t n)
{
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
	float m = 0.0f;
	bool nan = false; /* fmaxf drops NaN, so it is tracked on the side */
	if (i + 8 <= n) {
		float x[8];
		ng_unpack8_(x, ng_load8_stream_(in + i));
#pragma unroll
		for (int k = 0; k < 8; k++) {
			nan |= x[k] != x[k];
			m = fmaxf(m, fabsf(x[k]));
		}
	} else {
		for (; i < n; i++) {
			float x = __bfloat162float(in[i]);
			nan |= x != x;
			m = fmaxf(m, fabsf(x));
		}
	}
	if (nan)
		atomicMax(reinterpret_cast<unsigned *>(amax), 0x7fc00000u); /* above every number */
	amax_update_(amax, m);
}

static __global__ void fp8_scale_one_thread(float *scale, float *descale, const float *amax,
					    int margin)
{
	float a = *amax;
	float s = (a > 0.0f && isfinite(a)) ? NG_FP8_E4M3_MAX / ldexpf(a, margin) : 1.0f;
	*scale = s;
	*descale = 1.0f / s;
}

static __global__ void fp8_cast_e4m3_vec8(uint8_t *out, const __nv_bfloat16 *in,
					  const float *scale, size_t n)
{
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
	float sc = *scale;
	if (i + 8 <= n) {
		float x[8];
		ng_unpack8_(x, ng_load8_stream_(in + i));
		uint2 v;
		uint8_t *b = reinterpret_cast<uint8_t *>(&v);
#pragma unroll
		for (int k = 0; k < 8; k++)
			b[k] = __nv_cvt_float_to_fp8(x[k] * sc, __NV_SATFINITE, __NV_E4M3);
		*reinterpret_cast<uint2 *>(out + i) = v;
	} else {
		for (; i < n; i++)
			out[i] = __nv_cvt_float_to_fp8(__bfloat162float(in[i]) * sc, __NV_SATFINITE,
						       __NV_E4M3);
	}
}

static unsigned grid8_(size_t n)
{
	return (unsigned)(((n + 7) / 8 + FP8_THREADS - 1) / FP8_THREADS);
}

static enum ng_status check_(const char *who, size_t n, const void *in, const void *out,
			     size_t out_align)
{
	if (n == 0)
		return ng_check_arg_fail(who, "n must be > 0");
	if ((n + 7) / 8 > (size_t)FP8_THREADS * 0x7fffffffu)
		return ng_check_arg_fail(who, "n = %zu is too large", n);
	if (!ng_aligned16_(in) || ((uintptr_t)out % out_align))
		return ng_check_arg_fail(who, "in (%p) must be 16-byte and out (%p) %zu-byte aligned",
					 in, out, out_align);
	return NG_OK;
}

extern "C" enum ng_status ng_fp8_amax(float *amax, const ng_bf16 *in, size_t n, cudaStream_t s)
{
	enum ng_status st = check_("ng_fp8_amax", n, in, amax, 4);
	if (st)
		return st;
	fp8_amax_vec8<<<grid8_(n), FP8_THREADS, 0, s>>>(amax, (const __nv_bfloat16 *)in, n);
	return NG_LAUNCH_CHECK("fp8_amax_vec8");
}

extern "C" enum ng_status ng_fp8_scale_from_amax(float *scale, float *descale, const float *amax,
						  int margin, cudaStream_t s)
{
	if (!scale || !descale || !amax || margin < 0 || margin > 16)
		return ng_check_arg_fail("ng_fp8_scale_from_amax", "need device pointers and a margin "
					 "in 0..16, got %p %p %p margin %d", (void *)scale,
					 (void *)descale, (const void *)amax, margin);
	fp8_scale_one_thread<<<1, 1, 0, s>>>(scale, descale, amax, margin);
	return NG_LAUNCH_CHECK("fp8_scale_one_thread");
}

extern "C" enum ng_status ng_fp8_cast_e4m3(uint8_t *out, const ng_bf16 *in, const float *scale,
					   size_t n, cudaStream_t s)
{
	enum ng_status st = check_("ng_fp8_cast_e4m3", n, in, out, 8);
	if (st)
		return st;
	if (!scale)
		return ng_check_arg_fail("ng_fp8_cast_e4m3", "scale must be a device pointer");
	fp8_cast_e4m3_vec8<<<grid8_(n), FP8_THREADS, 0, s>>>(out, (const __nv_bfloat16 *)in, scale,
							     n);
	return NG_LAUNCH_CHECK("fp8_cast_e4m3_vec8");
}
