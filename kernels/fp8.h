/*
 * kernels/fp8.h — inputs for cuBLASLt's FP8 matmuls (kernels/matmul.h, spec.fp8): the per-tensor
 * absolute maximum of a bf16 tensor, the scale that maps it onto E4M3's range, and the scaled,
 * saturating cast to E4M3. Scales and maxima live in device memory, so a replayed graph sees the
 * values of its own step (docs/DESIGN.md: no per-step host scalars).
 *
 * E4M3 (OCP FP8): 1 sign, 4 exponent (bias 7), 3 mantissa bits; largest finite 448, smallest
 * normal 2^-6, subnormal step 2^-9; no infinities (S.1111.111 is NaN). The cast multiplies in
 * fp32, then rounds to nearest even and saturates to +-448 (__NV_SATFINITE); NaN stays NaN.
 * bf16 pointers 16-byte aligned, any n (a scalar tail handles n % 8). Also the byte transpose
 * that gives an FP8 matmul the other layout of an FP8 operand. Valid C11.
 */
#ifndef NG_KERNELS_FP8_H
#define NG_KERNELS_FP8_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NG_FP8_E4M3_MAX 448.0f
#define NG_FP8_E5M2_MAX 57344.0f /* E5M2 (gradients): 1 sign, 5 exponent, 2 mantissa bits */
enum ng_fp8_format { NG_FP8_E4M3, NG_FP8_E5M2 };
/* Descales are what cuBLASLt reads (its A/B scale pointers), and it refuses one that is not
 * 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED, seen on the H200): the segmented forms write
 * slot k's descale at descale[NG_FP8_DESCALE_STRIDE * k]. */
#define NG_FP8_DESCALE_STRIDE 4
/* An activation's maximum is NG_FP8_AMAX_SUB floats NG_FP8_AMAX_STRIDE floats apart (each on
 * its own 128-byte line: atomics on one line serialise in its L2 slice, ~55 us for the 65536
 * rows of a d12 LayerNorm on the H200), max= by writers that spread their atomics over them (a
 * LayerNorm with an E4M3 output does one per row); its value is the largest of them
 * (ng_fp8_roll_scales). NG_FP8_AMAX_FLOATS floats in all. */
#define NG_FP8_AMAX_SUB 32
#define NG_FP8_AMAX_STRIDE 32
#define NG_FP8_AMAX_FLOATS (NG_FP8_AMAX_SUB * NG_FP8_AMAX_STRIDE)

/* *amax = max(*amax, max |in[i]|). The caller zeroes *amax first; max is order-independent, so
 * the result is deterministic. A NaN input makes *amax NaN. */
enum ng_status ng_fp8_amax(float *amax,         /* (1) fp32, max= */
			   const ng_bf16 *in,   /* (n) bf16 */
			   size_t n, cudaStream_t s);

/* scale = 448 / (amax * 2^margin) (1 when amax is 0, NaN or infinite), descale = 1 / scale:
 * the cast multiplies by scale, the matmul by the two descales. */
enum ng_status ng_fp8_scale_from_amax(float *scale,       /* (1) fp32, = */
				      float *descale,     /* (1) fp32, = */
				      const float *amax,  /* (1) fp32 */
				      int margin, cudaStream_t s);

/* out[i] = E4M3(in[i] * *scale). */
enum ng_status ng_fp8_cast_e4m3(uint8_t *out,        /* (n) E4M3 bytes, =, 8-byte aligned */
				const ng_bf16 *in,   /* (n) bf16 */
				const float *scale,  /* (1) fp32 */
				size_t n, cudaStream_t s);

/* Segmented forms: `nseg` consecutive segments of seg_n elements (seg_n a multiple of 8 when
 * nseg > 1), each with its own slot k of amax / scale / descale: the layers of one parameter
 * block, one scale per layer. nseg = 1 is the plain form above. */
enum ng_status ng_fp8_amax_seg(float *amax,       /* (nseg) fp32, max= */
			       const ng_bf16 *in, /* (nseg, seg_n) bf16 */
			       size_t seg_n, int nseg, cudaStream_t s);
enum ng_status ng_fp8_scale_seg(float *scale,      /* (nseg) fp32, = */
				float *descale,    /* (nseg x NG_FP8_DESCALE_STRIDE) fp32, = */
				const float *amax, /* (nseg) fp32 */
				int nseg, int margin, cudaStream_t s);
/* out = E4M3(in * scale[k]) per segment k; when amax is not NULL, also amax[k] = max(amax[k],
 * max |in| of segment k): the cast records the maximum for the next step's scale. */
enum ng_status ng_fp8_cast_e4m3_seg(uint8_t *out,        /* (nseg, seg_n) E4M3, = */
				    const ng_bf16 *in,   /* (nseg, seg_n) bf16 */
				    const float *scale,  /* (nseg) fp32 */
				    float *amax,         /* (nseg) fp32, max=, or NULL */
				    size_t seg_n, int nseg, cudaStream_t s);

/* The cast in either format (scale from the format's largest finite: NG_FP8_*_MAX). */
enum ng_status ng_fp8_cast_seg(enum ng_fp8_format fmt, uint8_t *out, const ng_bf16 *in,
			       const float *scale, float *amax, size_t seg_n, int nseg,
			       cudaStream_t s);
/* Transposing cast, for the E4M3 copy of W^T an fp8 dinp matmul reads: segment k of in is an
 * (R, Cc) bf16 row-major matrix, segment k of out the (Cc, R) row-major E4M3 of its transpose
 * times scale[k]. Any R, Cc. */
enum ng_status ng_fp8_cast_e4m3_t_seg(uint8_t *out, const ng_bf16 *in, const float *scale,
				      int R, int Cc, int nseg, cudaStream_t s);
/* Both in one read of in: out (nseg, R, Cc) as ng_fp8_cast_e4m3_seg would write it (NULL: not
 * written) and out_t as ng_fp8_cast_e4m3_t_seg (NULL: not written). in 16-byte aligned when
 * Cc % 8 == 0, out 8-byte aligned then, out_t 4-byte aligned when R % 4 == 0. */
enum ng_status ng_fp8_cast_e4m3_wt_seg(uint8_t *out, uint8_t *out_t, const ng_bf16 *in,
				       const float *scale, int R, int Cc, int nseg, cudaStream_t s);

/* The cast in front of an fp8 weight-gradient matmul (graph/step.h "FP8"), one read of in (R,
 * Cc) bf16, each output optional (NULL: not written):
 *   out (R, Cc) = FMT(in * *scale), the bytes ng_fp8_cast_seg writes (the dinp matmul's dout);
 *   out_t (Cc, R) = its transpose (the dW matmul's: FP8 GEMMs take the reduced dimension
 *     contiguous);
 *   amax: max= max |in|, spread over the NG_FP8_AMAX_SUB floats NG_FP8_AMAX_STRIDE apart of a
 *     slot, as ng_fp8_roll_scales reads it;
 *   part (ng_fp8_colsum_rows(R), Cc) fp32 = in's column sums over each band of 64 rows, in a
 *     fixed order; ng_bias_grad_reduce adds the bands in order (the bias gradient, the same
 *     every run).
 * Alignment as ng_fp8_cast_e4m3_wt_seg; part and amax 4-byte aligned; R at most 64 x 65535. */
enum ng_status ng_fp8_cast_wt(enum ng_fp8_format fmt, uint8_t *out, uint8_t *out_t, float *part,
			      float *amax, const ng_bf16 *in, const float *scale, int R, int Cc,
			      cudaStream_t s);
#define NG_FP8_COLSUM_BAND 64 /* rows a band of part sums (the cast's tile) */
static inline int ng_fp8_colsum_rows(int R)
{
	return (R + NG_FP8_COLSUM_BAND - 1) / NG_FP8_COLSUM_BAND;
}

/* Delayed scaling, once per step for each of nseg slots: push the slot's maximum (the largest
 * of amax[(k * sub + j) * stride], j < sub) into its history of the last H maxima (hist row k,
 * newest first), scale[k] / descale[k] from the largest of them as ng_fp8_scale_from_amax
 * does, and zero the slot's amax floats for the step to come. */
enum ng_status ng_fp8_roll_scales(float *hist,    /* (nseg, H) fp32, updated */
				  float *amax,    /* (nseg, sub, stride) fp32, read then zeroed */
				  int sub,        /* 1, or NG_FP8_AMAX_SUB */
				  int stride,     /* 1, or NG_FP8_AMAX_STRIDE */
				  float *scale,   /* (nseg) fp32, = */
				  float *descale, /* (nseg x NG_FP8_DESCALE_STRIDE) fp32, = */
				  int nseg, int H, int margin, cudaStream_t s);
/* Data parallelism: fold each slot's sub maxima (amax as for ng_fp8_roll_scales) into one
 * 32-bit word of bits (the float's bits: non-negative floats order like their bits, and a NaN
 * is 0x7fc00000, above them all, so an integer max over ranks keeps it), zeroing the slot;
 * unfold = 1 writes bits[k] back into the slot's first sub maximum. */
enum ng_status ng_fp8_amax_fold(float *amax, int sub, int stride, int nseg, unsigned *bits,
				int unfold, cudaStream_t s);
/* The same for a format's range (E5M2 for gradients: 57344 / (2^margin x the maximum)). */
enum ng_status ng_fp8_roll_scales_fmt(enum ng_fp8_format fmt, float *hist, float *amax, int sub,
				      int stride, float *scale, float *descale, int nseg, int H,
				      int margin, cudaStream_t s);

/* out = in^T for bytes (FP8 tensors of any format): in (rows, cols) row-major, out (cols, rows)
 * row-major, both dense; out must not overlap in. 16-byte loads and stores when rows and cols
 * are multiples of 16 and both pointers 16-byte aligned (the head's dz: N tokens x 50304), else
 * a byte path; rows <= 65535 x 64. */
enum ng_status ng_transpose_u8(uint8_t *out,      /* (cols, rows) bytes, = */
			       const uint8_t *in, /* (rows, cols) bytes */
			       int rows, int cols, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
