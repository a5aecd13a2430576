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

static __device__ __forceinline__ void amax_update_(float *amax, float v, bool nan)
{
#pragma unroll
	for (int o = NG_WARP / 2; o > 0; o /= 2)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	if (nan) /* fmaxf drops NaN, so it is tracked on the side: above every number */
		atomicMax(reinterpret_cast<unsigned *>(amax), 0x7fc00000u);
	if ((threadIdx.x & (NG_WARP - 1)) == 0)
		atomicMax(reinterpret_cast<unsigned *>(amax), __float_as_uint(v));
}

/* Segment blockIdx.y: elements [y * seg_n, (y + 1) * seg_n); 8 per thread. */
static __global__ void fp8_amax_seg(float *amax, const __nv_bfloat16 *in, size_t seg_n)
{
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
	in += (size_t)blockIdx.y * seg_n;
	float m = 0.0f;
	bool nan = false;
	if (i + 8 <= seg_n) {
		float x[8];
		ng_unpack8_(x, ng_load8_stream_(in + i));
#pragma unroll
		for (int k = 0; k < 8; k++) {
			nan |= x[k] != x[k];
			m = fmaxf(m, fabsf(x[k]));
		}
	} else {
		for (; i < seg_n; i++) {
			float x = __bfloat162float(in[i]);
			nan |= x != x;
			m = fmaxf(m, fabsf(x));
		}
	}
	amax_update_(amax + blockIdx.y, m, nan);
}

static __device__ __forceinline__ float scale_of_(float a, int margin)
{
	return (a > 0.0f && isfinite(a)) ? NG_FP8_E4M3_MAX / ldexpf(a, margin) : 1.0f;
}

static __global__ void fp8_scale_seg(float *scale, float *descale, const float *amax, int nseg,
				     int margin)
{
	int k = blockIdx.x * blockDim.x + threadIdx.x;
	if (k >= nseg)
		return;
	float s = scale_of_(amax[k], margin);
	scale[k] = s;
	descale[k] = 1.0f / s;
}

static __global__ void fp8_roll_seg(float *hist, float *amax, float *scale, float *descale,
				    int nseg, int H, int margin)
{
	int k = blockIdx.x * blockDim.x + threadIdx.x;
	if (k >= nseg)
		return;
	float *h = hist + (size_t)k * H;
	float a = amax[k], m = 0.0f;
	bool nan = a != a; /* a NaN in the window keeps scale 1 until it leaves */
	for (int j = H - 1; j > 0; j--) {
		h[j] = h[j - 1];
		nan |= h[j] != h[j];
		m = fmaxf(m, h[j]);
	}
	h[0] = a;
	m = fmaxf(m, a);
	float s = nan ? 1.0f : scale_of_(m, margin);
	scale[k] = s;
	descale[k] = 1.0f / s;
	amax[k] = 0.0f;
}

static __global__ void fp8_cast_e4m3_seg(uint8_t *out, const __nv_bfloat16 *in,
					 const float *scale, float *amax, size_t seg_n)
{
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
	size_t base = (size_t)blockIdx.y * seg_n;
	in += base;
	out += base;
	float sc = scale[blockIdx.y];
	float m = 0.0f;
	bool nan = false;
	if (i + 8 <= seg_n) {
		float x[8];
		ng_unpack8_(x, ng_load8_stream_(in + i));
		uint2 v;
		uint8_t *b = reinterpret_cast<uint8_t *>(&v);
#pragma unroll
		for (int k = 0; k < 8; k++) {
			b[k] = __nv_cvt_float_to_fp8(x[k] * sc, __NV_SATFINITE, __NV_E4M3);
			nan |= x[k] != x[k];
			m = fmaxf(m, fabsf(x[k]));
		}
		*reinterpret_cast<uint2 *>(out + i) = v;
	} else {
		for (; i < seg_n; i++) {
			float x = __bfloat162float(in[i]);
			out[i] = __nv_cvt_float_to_fp8(x * sc, __NV_SATFINITE, __NV_E4M3);
			nan |= x != x;
			m = fmaxf(m, fabsf(x));
		}
	}
	if (amax)
		amax_update_(amax + blockIdx.y, m, nan);
}

static dim3 grid8_(size_t seg_n, int nseg)
{
	return dim3((unsigned)(((seg_n + 7) / 8 + FP8_THREADS - 1) / FP8_THREADS), (unsigned)nseg);
}

static enum ng_status check_(const char *who, size_t seg_n, int nseg, const void *in,
			     const void *out, size_t out_align)
{
	if (seg_n == 0 || nseg < 1 || nseg > 65535)
		return ng_check_arg_fail(who, "need n > 0 and 1..65535 segments, got n %zu, %d "
					 "segments", seg_n, nseg);
	if ((seg_n + 7) / 8 > (size_t)FP8_THREADS * 0x7fffffffu)
		return ng_check_arg_fail(who, "n = %zu is too large", seg_n);
	if (nseg > 1 && seg_n % 8)
		return ng_check_arg_fail(who, "segments of %zu elements: more than one segment needs "
					 "a multiple of 8", seg_n);
	if (!ng_aligned16_(in) || ((uintptr_t)out % out_align))
		return ng_check_arg_fail(who, "in (%p) must be 16-byte and out (%p) %zu-byte aligned",
					 in, out, out_align);
	return NG_OK;
}

extern "C" enum ng_status ng_fp8_amax_seg(float *amax, const ng_bf16 *in, size_t seg_n,
					  int nseg, cudaStream_t s)
{
	enum ng_status st = check_("ng_fp8_amax", seg_n, nseg, in, amax, 4);
	if (st)
		return st;
	fp8_amax_seg<<<grid8_(seg_n, nseg), FP8_THREADS, 0, s>>>(amax, (const __nv_bfloat16 *)in,
								  seg_n);
	return NG_LAUNCH_CHECK("fp8_amax_seg");
}

extern "C" enum ng_status ng_fp8_amax(float *amax, const ng_bf16 *in, size_t n, cudaStream_t s)
{
	return ng_fp8_amax_seg(amax, in, n, 1, s);
}

extern "C" enum ng_status ng_fp8_scale_seg(float *scale, float *descale, const float *amax,
					   int nseg, int margin, cudaStream_t s)
{
	if (!scale || !descale || !amax || nseg < 1 || margin < 0 || margin > 16)
		return ng_check_arg_fail("ng_fp8_scale_from_amax", "need device pointers, segments "
					 "and a margin in 0..16, got %p %p %p, %d segments, margin %d",
					 (void *)scale, (void *)descale, (const void *)amax, nseg,
					 margin);
	fp8_scale_seg<<<(nseg + 127) / 128, 128, 0, s>>>(scale, descale, amax, nseg, margin);
	return NG_LAUNCH_CHECK("fp8_scale_seg");
}

extern "C" enum ng_status ng_fp8_scale_from_amax(float *scale, float *descale, const float *amax,
						  int margin, cudaStream_t s)
{
	return ng_fp8_scale_seg(scale, descale, amax, 1, margin, s);
}

extern "C" enum ng_status ng_fp8_roll_scales(float *hist, float *amax, float *scale,
					     float *descale, int nseg, int H, int margin,
					     cudaStream_t s)
{
	if (!hist || !amax || !scale || !descale || nseg < 1 || H < 1 || H > 1024 || margin < 0 ||
	    margin > 16)
		return ng_check_arg_fail("ng_fp8_roll_scales", "need device pointers, segments, a "
					 "history of 1..1024 and a margin in 0..16, got %d segments, "
					 "history %d, margin %d", nseg, H, margin);
	fp8_roll_seg<<<(nseg + 127) / 128, 128, 0, s>>>(hist, amax, scale, descale, nseg, H,
							  margin);
	return NG_LAUNCH_CHECK("fp8_roll_seg");
}

extern "C" enum ng_status ng_fp8_cast_e4m3_seg(uint8_t *out, const ng_bf16 *in,
					       const float *scale, float *amax, size_t seg_n,
					       int nseg, cudaStream_t s)
{
	enum ng_status st = check_("ng_fp8_cast_e4m3", seg_n, nseg, in, out, 8);
	if (st)
		return st;
	if (!scale)
		return ng_check_arg_fail("ng_fp8_cast_e4m3", "scale must be a device pointer");
	fp8_cast_e4m3_seg<<<grid8_(seg_n, nseg), FP8_THREADS, 0, s>>>(
		out, (const __nv_bfloat16 *)in, scale, amax, seg_n);
	return NG_LAUNCH_CHECK("fp8_cast_e4m3_seg");
}

extern "C" enum ng_status ng_fp8_cast_e4m3(uint8_t *out, const ng_bf16 *in, const float *scale,
					   size_t n, cudaStream_t s)
{
	return ng_fp8_cast_e4m3_seg(out, in, scale, NULL, n, 1, s);
}
