/*
 * kernels/fp8.cu — absolute maximum, scales, E4M3 / E5M2 casts, and W / W^T casts (see fp8.h).
 *
 * Memory-bound: 8 elements per thread per pass (16-byte bf16 loads, 8-byte E4M3 stores), a
 * scalar tail, and a capped grid striding over the tensor. amax: a block maximum, then one
 * atomicMax per block (max is order-independent, so the result is deterministic).
 * The conversion is cuda_fp8.h's __nv_cvt_float_to_fp8 (round to nearest even, __NV_SATFINITE).
 * The byte transpose (ng_transpose_u8) moves ~0.8-2.5 GB at the head's shapes (16384 to 49152
 * tokens x 50304), so it is shaped for bandwidth: 128 x 128 byte tiles in shared memory with
 * 16-byte global loads and stores and full 128-byte lines per warp on both sides; a byte path
 * takes the other shapes.
 */
#include <cuda_fp8.h>

#include "kernels/common.cuh"

#include "kernels/fp8.h"

#define FP8_THREADS 256

struct op_max_ { /* fmaxf, for ng_block_reduce_ */
	__device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/* One atomicMax per block (on the float's bits, which order like the values for non-negative
 * floats; NaN's bits lie above every number's): the same-address atomics of a per-warp update
 * serialize in L2 and cost more than the cast itself on a 200M-element tensor. fmaxf drops
 * NaN, so it is tracked on the side. Every thread of the block must reach the call. */
static __device__ __forceinline__ void amax_commit_(float *amax, float m, bool nan)
{
	__shared__ float sh[32];
	m = ng_block_reduce_(m, sh, 0.0f, op_max_());
	int any_nan = __syncthreads_or(nan);
	if (threadIdx.x == 0)
		atomicMax(reinterpret_cast<unsigned *>(amax), any_nan ? 0x7fc00000u : __float_as_uint(m));
}

static __device__ __forceinline__ void max8_(float &m, bool &nan, const float x[8])
{
#pragma unroll
	for (int k = 0; k < 8; k++) {
		nan |= x[k] != x[k];
		m = fmaxf(m, fabsf(x[k]));
	}
}

#define FP8_AMAX_ONLY -1 /* seg_pass_'s FMT for a pass that casts nothing */

/* One segment's elements [0, seg_n), 8 per thread per pass, the blocks of the segment striding
 * over it: |x|'s maximum goes to m and a NaN to nan; unless FMT is FP8_AMAX_ONLY, x * sc is also
 * cast to FMT (__NV_E4M3 or __NV_E5M2) in out. Shared by fp8_amax_seg and fp8_cast_seg; the
 * amax-only pass compiles to the same code as a loop without the cast. */
template <int FMT>
static __device__ __forceinline__ void seg_pass_(uint8_t *__restrict__ out,
						 const __nv_bfloat16 *__restrict__ in, float sc,
						 size_t seg_n, float &m, bool &nan)
{
	size_t stride = (size_t)gridDim.x * blockDim.x * 8;
#pragma unroll 4 /* restrict: the loads of 4 passes may be issued before their stores */
	for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < seg_n; i += stride) {
		if (i + 8 <= seg_n) {
			float x[8];
			ng_unpack8_(x, ng_load8_stream_(in + i));
			if constexpr (FMT != FP8_AMAX_ONLY) {
				uint2 v;
				uint8_t *b = reinterpret_cast<uint8_t *>(&v);
#pragma unroll
				for (int k = 0; k < 8; k++)
					b[k] = __nv_cvt_float_to_fp8(x[k] * sc, __NV_SATFINITE,
								     (__nv_fp8_interpretation_t)FMT);
				*reinterpret_cast<uint2 *>(out + i) = v;
			}
			max8_(m, nan, x);
		} else {
			for (size_t j = i; j < seg_n; j++) {
				float x = __bfloat162float(in[j]);
				if constexpr (FMT != FP8_AMAX_ONLY)
					out[j] = __nv_cvt_float_to_fp8(x * sc, __NV_SATFINITE,
								       (__nv_fp8_interpretation_t)FMT);
				nan |= x != x;
				m = fmaxf(m, fabsf(x));
			}
		}
	}
}

/* Segment blockIdx.y: elements [y * seg_n, (y + 1) * seg_n). */
static __global__ void fp8_amax_seg(float *__restrict__ amax, const __nv_bfloat16 *__restrict__ in,
				    size_t seg_n)
{
	float m = 0.0f;
	bool nan = false;
	seg_pass_<FP8_AMAX_ONLY>(nullptr, in + (size_t)blockIdx.y * seg_n, 1.0f, seg_n, m, nan);
	amax_commit_(amax + blockIdx.y, m, nan);
}

static __device__ __forceinline__ float scale_of_(float a, int margin,
						  float fmax = NG_FP8_E4M3_MAX)
{
	/* a maximum so small or large that the scale is not a finite positive number (below
	 * ~1e-36, or above ~1.7e38 with margin 1): scale 1, as for 0 or NaN */
	float s = (a > 0.0f && isfinite(a)) ? fmax / ldexpf(a, margin) : 1.0f;
	return (isfinite(s) && s > 0.0f) ? s : 1.0f;
}

static __global__ void fp8_scale_seg(float *scale, float *descale, const float *amax, int nseg,
				     int margin)
{
	int k = blockIdx.x * blockDim.x + threadIdx.x;
	if (k >= nseg)
		return;
	float s = scale_of_(amax[k], margin);
	scale[k] = s;
	descale[NG_FP8_DESCALE_STRIDE * k] = 1.0f / s;
}

static __global__ void fp8_roll_seg(float *hist, float *amax, int sub, int stride,
				    float *scale, float *descale, int nseg, int H, int margin,
				    float fmax)
{
	int k = blockIdx.x * blockDim.x + threadIdx.x;
	if (k >= nseg)
		return;
	float *h = hist + (size_t)k * H;
	float a = 0.0f, m = 0.0f;
	bool nan = false; /* a NaN in the window keeps scale 1 until it leaves */
	for (int j = 0; j < sub; j++) {
		size_t at = ((size_t)k * sub + j) * stride;
		float v = amax[at];
		nan |= v != v;
		a = fmaxf(a, v);
		amax[at] = 0.0f;
	}
	if (nan)
		a = __int_as_float(0x7fc00000);
	for (int j = H - 1; j > 0; j--) {
		h[j] = h[j - 1];
		nan |= h[j] != h[j];
		m = fmaxf(m, h[j]);
	}
	h[0] = a;
	m = fmaxf(m, a);
	float s = nan ? 1.0f : scale_of_(m, margin, fmax);
	scale[k] = s;
	descale[NG_FP8_DESCALE_STRIDE * k] = 1.0f / s;
}

template <int FMT> /* __NV_E4M3 or __NV_E5M2 */
static __global__ void fp8_cast_seg(uint8_t *__restrict__ out,
					 const __nv_bfloat16 *__restrict__ in,
					 const float *__restrict__ scale, float *__restrict__ amax,
					 size_t seg_n)
{
	size_t base = (size_t)blockIdx.y * seg_n;
	float m = 0.0f;
	bool nan = false;
	seg_pass_<FMT>(out + base, in + base, scale[blockIdx.y], seg_n, m, nan);
	if (amax) /* uniform over the grid: every thread reaches the block reduction or none */
		amax_commit_(amax + blockIdx.y, m, nan);
}

/* Blocks per segment: enough for one pass, capped so that the whole grid is ~8 waves of
 * 132-SM blocks at most (the rest strides), which also caps the atomics at ~1K per launch. */
static dim3 grid8_(size_t seg_n, int nseg)
{
	size_t need = ((seg_n + 7) / 8 + FP8_THREADS - 1) / FP8_THREADS;
	size_t cap = 1056 / (size_t)nseg;
	if (cap < 1)
		cap = 1;
	return dim3((unsigned)(need < cap ? need : cap), (unsigned)nseg);
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

extern "C" enum ng_status ng_fp8_roll_scales_fmt(enum ng_fp8_format fmt, float *hist,
						 float *amax, int sub, int stride, float *scale,
						 float *descale, int nseg, int H, int margin,
						 cudaStream_t s)
{
	if (!hist || !amax || !scale || !descale || nseg < 1 || H < 1 || H > 1024 || margin < 0 ||
	    margin > 16 || sub < 1 || sub > 1024 || stride < 1 || stride > 1024 ||
	    (fmt != NG_FP8_E4M3 && fmt != NG_FP8_E5M2))
		return ng_check_arg_fail("ng_fp8_roll_scales", "need device pointers, segments, a "
					 "history of 1..1024 and a margin in 0..16, got %d segments, "
					 "history %d, margin %d", nseg, H, margin);
	fp8_roll_seg<<<(nseg + 127) / 128, 128, 0, s>>>(
		hist, amax, sub, stride, scale, descale, nseg, H, margin,
		fmt == NG_FP8_E5M2 ? NG_FP8_E5M2_MAX : NG_FP8_E4M3_MAX);
	return NG_LAUNCH_CHECK("fp8_roll_seg");
}

/* fold: slot k's sub-maxima to one (its bits, so a NaN, 0x7fc00000, stays above every number)
 * in bits[k]; unfold: bits[k] back into the slot's first sub-maximum, the others 0. */
static __global__ void fp8_amax_fold(float *amax, int sub, int stride, int nseg, unsigned *bits,
				     int unfold)
{
	int k = blockIdx.x * blockDim.x + threadIdx.x;
	if (k >= nseg)
		return;
	float *a = amax + (size_t)k * sub * stride;
	if (unfold) {
		a[0] = __uint_as_float(bits[k]);
		return;
	}
	unsigned m = 0;
	for (int j = 0; j < sub; j++) {
		float v = a[(size_t)j * stride];
		m = max(m, v != v ? 0x7fc00000u : __float_as_uint(fabsf(v)));
		a[(size_t)j * stride] = 0.0f;
	}
	bits[k] = m;
}

extern "C" enum ng_status ng_fp8_amax_fold(float *amax, int sub, int stride, int nseg,
					   unsigned *bits, int unfold, cudaStream_t s)
{
	if (!amax || !bits || sub < 1 || stride < 1 || nseg < 1)
		return ng_check_arg_fail("ng_fp8_amax_fold", "need device pointers, sub %d, stride "
					 "%d and nseg %d >= 1", sub, stride, nseg);
	fp8_amax_fold<<<(nseg + 127) / 128, 128, 0, s>>>(amax, sub, stride, nseg, bits, unfold);
	return NG_LAUNCH_CHECK("fp8_amax_fold");
}

extern "C" enum ng_status ng_fp8_roll_scales(float *hist, float *amax, int sub, int stride,
					     float *scale, float *descale, int nseg, int H,
					     int margin, cudaStream_t s)
{
	return ng_fp8_roll_scales_fmt(NG_FP8_E4M3, hist, amax, sub, stride, scale, descale, nseg,
				      H, margin, s);
}

extern "C" enum ng_status ng_fp8_cast_seg(enum ng_fp8_format fmt, uint8_t *out,
					  const ng_bf16 *in, const float *scale, float *amax,
					  size_t seg_n, int nseg, cudaStream_t s)
{
	enum ng_status st = check_("ng_fp8_cast", seg_n, nseg, in, out, 8);
	if (st)
		return st;
	if (!scale || (fmt != NG_FP8_E4M3 && fmt != NG_FP8_E5M2))
		return ng_check_arg_fail("ng_fp8_cast", "scale must be a device pointer and the "
					 "format E4M3 or E5M2");
	if (fmt == NG_FP8_E5M2)
		fp8_cast_seg<__NV_E5M2><<<grid8_(seg_n, nseg), FP8_THREADS, 0, s>>>(
			out, (const __nv_bfloat16 *)in, scale, amax, seg_n);
	else
		fp8_cast_seg<__NV_E4M3><<<grid8_(seg_n, nseg), FP8_THREADS, 0, s>>>(
			out, (const __nv_bfloat16 *)in, scale, amax, seg_n);
	return NG_LAUNCH_CHECK("fp8_cast_seg");
}

extern "C" enum ng_status ng_fp8_cast_e4m3_seg(uint8_t *out, const ng_bf16 *in,
					       const float *scale, float *amax, size_t seg_n,
					       int nseg, cudaStream_t s)
{
	return ng_fp8_cast_seg(NG_FP8_E4M3, out, in, scale, amax, seg_n, nseg, s);
}

/* W and W^T in one read: 64 x 64 tiles of a segment, 256 threads. Each thread converts 2 x 8
 * elements (16-byte loads when the rows allow), writes their 8 bytes to out (when not NULL) and
 * keeps them in a shared tile; then 4 x 4 bytes of the transpose go to out_t (when not NULL): 3
 * bytes an element read once instead of twice. Tile rows are 65 bytes apart, so the column reads
 * of the transpose fall on distinct banks. The gradient form (one segment) also records |x|'s
 * maximum (amax, spread over its NG_FP8_AMAX_SUB lines by block) and the tile's column sums of
 * x (part, row blockIdx.y): the 8 columns of a thread are shared by the lanes 8 and 16 apart in
 * its warp (a shuffle sum), then by the 8 warps (a shared-memory sum in warp order), so the sums
 * are the same every run. */
#define WT_TILE NG_FP8_COLSUM_BAND
#define WT_THREADS 256
template <int FMT>
static __global__ void __launch_bounds__(WT_THREADS)
fp8_cast_wt(uint8_t *__restrict__ out, uint8_t *__restrict__ out_t, float *__restrict__ part,
	    float *__restrict__ amax, const __nv_bfloat16 *__restrict__ in,
	    const float *__restrict__ scale, int R, int Cc)
{
	__shared__ uint8_t tile[WT_TILE][WT_TILE + 1];
	__shared__ float colsum[WT_THREADS / 32][WT_TILE];
	size_t seg = (size_t)blockIdx.z * R * Cc;
	in += seg;
	const int r0 = blockIdx.y * WT_TILE, c0 = blockIdx.x * WT_TILE;
	const bool vec = Cc % 8 == 0; /* rows of whole 16-byte vectors: aligned loads */
	const float sc = scale[blockIdx.z];
	float cs[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f }, m = 0.0f;
	bool nan = false;
	/* a thread's vectors share their 8 columns: v % 8 == threadIdx.x % 8 */
	for (int v = threadIdx.x; v < WT_TILE * WT_TILE / 8; v += WT_THREADS) {
		int rr = v / (WT_TILE / 8), cc = v % (WT_TILE / 8) * 8, r = r0 + rr, c = c0 + cc;
		float x[8];
		bool full = r < R && c + 8 <= Cc;
		if (full && vec) {
			ng_unpack8_(x, ng_load8_stream_(in + (size_t)r * Cc + c));
		} else {
#pragma unroll
			for (int j = 0; j < 8; j++)
				x[j] = r < R && c + j < Cc ? __bfloat162float(in[(size_t)r * Cc + c + j])
							   : 0.0f;
		}
		uint8_t q[8];
#pragma unroll
		for (int j = 0; j < 8; j++) {
			q[j] = __nv_cvt_float_to_fp8(x[j] * sc, __NV_SATFINITE,
						     (__nv_fp8_interpretation_t)FMT);
			cs[j] += x[j];
		}
		max8_(m, nan, x);
		if (out && full && vec) {
			uint2 w;
			memcpy(&w, q, 8);
			*reinterpret_cast<uint2 *>(out + seg + (size_t)r * Cc + c) = w;
		} else if (out && r < R) {
			for (int j = 0; j < 8 && c + j < Cc; j++)
				out[seg + (size_t)r * Cc + c + j] = q[j];
		}
#pragma unroll
		for (int j = 0; j < 8; j++)
			tile[rr][cc + j] = q[j];
	}
	if (amax) /* uniform over the grid: every thread reaches the block reduction or none */
		amax_commit_(amax + (size_t)((blockIdx.y * gridDim.x + blockIdx.x) %
					     NG_FP8_AMAX_SUB) * NG_FP8_AMAX_STRIDE,
			     m, nan);
	if (part) {
		const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
		for (int j = 0; j < 8; j++) {
			cs[j] += __shfl_xor_sync(0xffffffffu, cs[j], 8);
			cs[j] += __shfl_xor_sync(0xffffffffu, cs[j], 16);
		}
		if (lane < 8)
#pragma unroll
			for (int j = 0; j < 8; j++)
				colsum[warp][lane * 8 + j] = cs[j];
	}
	if (!out_t && !part)
		return;
	__syncthreads();
	if (part && threadIdx.x < WT_TILE && c0 + (int)threadIdx.x < Cc) {
		float t = 0.0f;
#pragma unroll
		for (int w = 0; w < WT_THREADS / 32; w++)
			t += colsum[w][threadIdx.x];
		part[(size_t)blockIdx.y * Cc + c0 + threadIdx.x] = t;
	}
	if (!out_t)
		return;
	out_t += seg; /* (Cc, R): row c holds column c of the segment */
	const bool vec_t = R % 4 == 0;
	for (int w = threadIdx.x; w < WT_TILE * WT_TILE / 4; w += WT_THREADS) {
		int cc = w / (WT_TILE / 4), rr = w % (WT_TILE / 4) * 4, c = c0 + cc, r = r0 + rr;
		if (c >= Cc)
			continue;
		uint8_t b[4] = { tile[rr][cc], tile[rr + 1][cc], tile[rr + 2][cc], tile[rr + 3][cc] };
		if (vec_t && r + 4 <= R) {
			unsigned u;
			memcpy(&u, b, 4);
			*reinterpret_cast<unsigned *>(out_t + (size_t)c * R + r) = u;
		} else {
			for (int j = 0; j < 4 && r + j < R; j++)
				out_t[(size_t)c * R + r + j] = b[j];
		}
	}
}

/* Both casts' checks and launch; part and amax only with one segment. */
static enum ng_status cast_wt_(const char *who, enum ng_fp8_format fmt, uint8_t *out,
			       uint8_t *out_t, float *part, float *amax, const ng_bf16 *in,
			       const float *scale, int R, int Cc, int nseg, cudaStream_t s)
{
	if ((!out && !out_t && !part && !amax) || !in || !scale || R < 1 || Cc < 1 || nseg < 1 ||
	    nseg > 65535 || ((part || amax) && nseg != 1) ||
	    (fmt != NG_FP8_E4M3 && fmt != NG_FP8_E5M2) ||
	    (Cc % 8 == 0 && (uintptr_t)in % 16) || (out && Cc % 8 == 0 && (uintptr_t)out % 8) ||
	    (out_t && R % 4 == 0 && (uintptr_t)out_t % 4) || (part && (uintptr_t)part % 4) ||
	    (amax && (uintptr_t)amax % 4) || (R + WT_TILE - 1) / WT_TILE > 65535)
		return ng_check_arg_fail(who, "need device pointers (in 16-, out 8-, out_t 4-byte "
					 "aligned), an output, E4M3 or E5M2, R %d (at most 64 x "
					 "65535), C %d and 1..65535 segments (%d; 1 with part or amax)",
					 R, Cc, nseg);
	dim3 grid((unsigned)((Cc + WT_TILE - 1) / WT_TILE), (unsigned)((R + WT_TILE - 1) / WT_TILE),
		  (unsigned)nseg);
	if (fmt == NG_FP8_E5M2)
		fp8_cast_wt<__NV_E5M2><<<grid, WT_THREADS, 0, s>>>(
			out, out_t, part, amax, (const __nv_bfloat16 *)in, scale, R, Cc);
	else
		fp8_cast_wt<__NV_E4M3><<<grid, WT_THREADS, 0, s>>>(
			out, out_t, part, amax, (const __nv_bfloat16 *)in, scale, R, Cc);
	return NG_LAUNCH_CHECK(who);
}

extern "C" enum ng_status ng_fp8_cast_e4m3_wt_seg(uint8_t *out, uint8_t *out_t,
						  const ng_bf16 *in, const float *scale, int R,
						  int Cc, int nseg, cudaStream_t s)
{
	if (!out && !out_t)
		return ng_check_arg_fail("ng_fp8_cast_e4m3_wt", "need at least one output");
	return cast_wt_("ng_fp8_cast_e4m3_wt", NG_FP8_E4M3, out, out_t, NULL, NULL, in, scale, R,
			Cc, nseg, s);
}

extern "C" enum ng_status ng_fp8_cast_wt(enum ng_fp8_format fmt, uint8_t *out, uint8_t *out_t,
					 float *part, float *amax, const ng_bf16 *in,
					 const float *scale, int R, int Cc, cudaStream_t s)
{
	return cast_wt_("ng_fp8_cast_wt", fmt, out, out_t, part, amax, in, scale, R, Cc, 1, s);
}

extern "C" enum ng_status ng_fp8_cast_e4m3_t_seg(uint8_t *out, const ng_bf16 *in,
						 const float *scale, int R, int Cc, int nseg,
						 cudaStream_t s)
{
	return ng_fp8_cast_e4m3_wt_seg(NULL, out, in, scale, R, Cc, nseg, s);
}

extern "C" enum ng_status ng_fp8_cast_e4m3(uint8_t *out, const ng_bf16 *in, const float *scale,
					   size_t n, cudaStream_t s)
{
	return ng_fp8_cast_e4m3_seg(out, in, scale, NULL, n, 1, s);
}

/* Byte transpose, 128 x 128 tiles of in, 256 threads. Phase 1: each thread copies four 16-byte
 * pieces of tile rows into shared memory (eight threads a row: 128-byte lines). Phase 2: thread
 * (g, h) = (tid / 8, tid % 8) reads the 16 x 4 bytes of tile rows 16h..16h+15 and columns
 * 4g..4g+3 as 16 words, transposes them as four 4 x 4 byte blocks in registers, and stores one
 * 16-byte piece of each of output rows 4g..4g+3 (eight threads an output row: 128-byte lines).
 * Chunk q of tile row rr (16 bytes) is stored at chunk q ^ (rr / 16): a quarter warp's stores
 * (one row) and a warp's word reads (8 row groups h x the 4 words of chunk g / 4) both fall on
 * 32 distinct banks. rows and cols are multiples of 16, so a 16-byte piece is wholly inside the
 * matrix or wholly outside; pieces outside are neither read nor written (the shared words they
 * would fill feed only outputs that are skipped). */
#define TR_TILE 128
#define TR_THREADS 256
#define TR_CHUNKS (TR_TILE / 16) /* 16-byte chunks in a tile row */

/* o[j] = byte j of w[0], w[1], w[2], w[3] (as bytes 0..3): the transpose of a 4 x 4 byte block
 * whose row i is word w[i]. */
static __device__ __forceinline__ void transpose4x4_u8_(unsigned o[4], const unsigned w[4])
{
	unsigned a = __byte_perm(w[0], w[1], 0x5140), b = __byte_perm(w[2], w[3], 0x5140);
	unsigned c = __byte_perm(w[0], w[1], 0x7362), d = __byte_perm(w[2], w[3], 0x7362);
	o[0] = __byte_perm(a, b, 0x5410);
	o[1] = __byte_perm(a, b, 0x7632);
	o[2] = __byte_perm(c, d, 0x5410);
	o[3] = __byte_perm(c, d, 0x7632);
}

static __global__ void __launch_bounds__(TR_THREADS)
transpose_u8_tile16(uint8_t *__restrict__ out, const uint8_t *__restrict__ in, int rows, int cols)
{
	__shared__ uint4 tile[TR_TILE * TR_CHUNKS];
	const int r0 = blockIdx.y * TR_TILE, c0 = blockIdx.x * TR_TILE;
	const int nr = min(TR_TILE, rows - r0), nc = min(TR_TILE, cols - c0);
#pragma unroll
	for (int u = 0; u < TR_TILE * TR_CHUNKS / TR_THREADS; u++) {
		int k = threadIdx.x + u * TR_THREADS, rr = k / TR_CHUNKS, q = k % TR_CHUNKS;
		if (rr < nr && 16 * q < nc)
			tile[rr * TR_CHUNKS + (q ^ (rr / 16))] = __ldcs(
				reinterpret_cast<const uint4 *>(in + (size_t)(r0 + rr) * cols + c0 + 16 * q));
	}
	__syncthreads();
	const int g = threadIdx.x / 8, h = threadIdx.x % 8;
	if (16 * h >= nr || 4 * g >= nc) /* nc % 16 == 0: then columns 4g..4g+3 all lie inside */
		return;
	const unsigned *tw = reinterpret_cast<const unsigned *>(tile);
	unsigned o[4][4]; /* o[j][m]: output row 4g + j, bytes 16h + 4m .. 16h + 4m + 3 */
#pragma unroll
	for (int m = 0; m < 4; m++) {
		unsigned w[4], t[4];
#pragma unroll
		for (int i = 0; i < 4; i++) /* tile row 16h + 4m + i, whose rr / 16 is h */
			w[i] = tw[(16 * h + 4 * m + i) * TR_TILE / 4 + 4 * ((g / 4) ^ h) + g % 4];
		transpose4x4_u8_(t, w);
#pragma unroll
		for (int j = 0; j < 4; j++)
			o[j][m] = t[j];
	}
#pragma unroll
	for (int j = 0; j < 4; j++)
		*reinterpret_cast<uint4 *>(out + (size_t)(c0 + 4 * g + j) * rows + r0 + 16 * h) =
			make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
}

/* Any shape: 64 x 64 byte tiles, one byte a load and a store. Tile rows are 68 bytes (17 words)
 * apart, so the column reads of 32 consecutive rows fall on 32 distinct banks. */
#define TRB_TILE 64
static __global__ void __launch_bounds__(TR_THREADS)
transpose_u8_bytes(uint8_t *__restrict__ out, const uint8_t *__restrict__ in, int rows, int cols)
{
	__shared__ uint8_t tile[TRB_TILE][TRB_TILE + 4];
	const int r0 = blockIdx.y * TRB_TILE, c0 = blockIdx.x * TRB_TILE;
	for (int k = threadIdx.x; k < TRB_TILE * TRB_TILE; k += TR_THREADS) {
		int rr = k / TRB_TILE, cc = k % TRB_TILE;
		if (r0 + rr < rows && c0 + cc < cols)
			tile[rr][cc] = in[(size_t)(r0 + rr) * cols + c0 + cc];
	}
	__syncthreads();
	for (int k = threadIdx.x; k < TRB_TILE * TRB_TILE; k += TR_THREADS) {
		int cc = k / TRB_TILE, rr = k % TRB_TILE;
		if (r0 + rr < rows && c0 + cc < cols)
			out[(size_t)(c0 + cc) * rows + r0 + rr] = tile[rr][cc];
	}
}

extern "C" enum ng_status ng_transpose_u8(uint8_t *out, const uint8_t *in, int rows, int cols,
					  cudaStream_t s)
{
	if (!out || !in || rows < 1 || cols < 1 || (rows + TRB_TILE - 1) / TRB_TILE > 65535)
		return ng_check_arg_fail("ng_transpose_u8", "need device pointers and 1 <= rows <= "
					 "%d, cols >= 1, got out %p, in %p, rows %d, cols %d",
					 65535 * TRB_TILE, (void *)out, (const void *)in, rows, cols);
	size_t n = (size_t)rows * cols;
	if ((uintptr_t)out < (uintptr_t)in + n && (uintptr_t)in < (uintptr_t)out + n)
		return ng_check_arg_fail("ng_transpose_u8", "out (%p) overlaps in (%p), %zu bytes",
					 (void *)out, (const void *)in, n);
	if (rows % 16 == 0 && cols % 16 == 0 && ng_aligned16_(in) && ng_aligned16_(out)) {
		dim3 grid((unsigned)((cols + TR_TILE - 1) / TR_TILE),
			  (unsigned)((rows + TR_TILE - 1) / TR_TILE));
		transpose_u8_tile16<<<grid, TR_THREADS, 0, s>>>(out, in, rows, cols);
		return NG_LAUNCH_CHECK("transpose_u8_tile16");
	}
	dim3 grid((unsigned)((cols + TRB_TILE - 1) / TRB_TILE),
		  (unsigned)((rows + TRB_TILE - 1) / TRB_TILE));
	transpose_u8_bytes<<<grid, TR_THREADS, 0, s>>>(out, in, rows, cols);
	return NG_LAUNCH_CHECK("transpose_u8_bytes");
}
