/*
 * kernels/decode_spr.cu — the speedrun model's one-token decode kernels (see decode_spr.h):
 * embedding + RMSNorm + document start, one-row RMSNorm, the scalar mix, QK-norm + rotary +
 * value mixing at the device position, and the logits' soft cap. Each is one pass over a row of
 * at most a few thousand floats (the head's Vp for the soft cap), so one block a row (or a
 * head) with block reductions is enough; the decode step's time is the GEMVs' weight reads
 * (kernels/decode.cu).
 * References: Zhang & Sennrich 2019 (RMSNorm); Su et al. 2021 (RoFormer, rotary embeddings);
 * the rotary's fp32 frequencies and angles as kernels/rmsnorm.cu computes them for training.
 */
#include "kernels/common.cuh"
#include "kernels/decode_spr.h"

#define DECODE_SPR_THREADS 256 /* one-row kernels */
#define QK_THREADS 128         /* QK-norm + rotary: a block per head, D <= 256 */

static __device__ __forceinline__ float as_float(float x) { return x; }
static __device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

/* rsqrtf(mean(x^2) + eps) of a row of C values (fp32 or bf16), in every thread of the block. */
template <typename T>
static __device__ __forceinline__ float row_rstd(const T *x, int C, float eps, float *sh)
{
	float ss = 0.0f;
	for (int c = threadIdx.x; c < C; c += blockDim.x) {
		float v = as_float(x[c]);
		ss += v * v;
	}
	return rsqrtf(ng_block_reduce_(ss, sh, 0.0f, ng_op_sum_()) / C + eps);
}

static __global__ void spr_embed_rmsnorm(float *x, float *x0, int *doc_start,
					 const __nv_bfloat16 *wte, const int32_t *tokens,
					 const int *pos, int32_t bos, int C, float eps)
{
	__shared__ float sh[32];
	int p = *pos, tok = tokens[p];
	const __nv_bfloat16 *row = wte + (size_t)tok * C;
	float rs = row_rstd(row, C, eps, sh);
	for (int c = threadIdx.x; c < C; c += blockDim.x) {
		float v = __bfloat162float(row[c]) * rs;
		x[c] = v;
		x0[c] = v;
	}
	if (threadIdx.x == 0 && (p == 0 || tok == bos))
		*doc_start = p;
}

static __global__ void rmsnorm_one_row(float *out, const float *x, int C, float eps)
{
	__shared__ float sh[32];
	float rs = row_rstd(x, C, eps, sh);
	for (int c = threadIdx.x; c < C; c += blockDim.x)
		out[c] = x[c] * rs;
}

static __global__ void mix2_row(float *out, const float *a, const float *u, const float *b,
				const float *w, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= n)
		return;
	float fa = a ? *a : 1.0f, fb = b ? *b : 1.0f;
	out[i] = fa * u[i] + (w ? fb * w[i] : 0.0f);
}

/* One block per head h: q_h, then k_h, normed and rotated in place; then v_h mixed. Each thread
 * reads and writes only its own pairs, after the reduction over the head has read them all. */
static __global__ void qk_rotary_vmix(float *qkv, const __nv_bfloat16 *ve, const int32_t *tokens,
				      const int *pos, const float *a0, const float *a1, int H,
				      int D, float eps)
{
	__shared__ float sh[32];
	int h = blockIdx.x, C = H * D, half = D / 2, q = D / 4, p = *pos;
	for (int j = 0; j < 2; j++) {
		float *x = qkv + (size_t)j * C + (size_t)h * D;
		float rs = row_rstd(x, D, eps, sh);
		for (int i = threadIdx.x; i < half; i += blockDim.x) {
			float y1 = x[i] * rs, y2 = x[i + half] * rs;
			if (i < q) {
				float f = q == 1 ? 1.0f : (float)exp2(-10.0 * i / (q - 1));
				float sn, cn;
				sincosf(__fmul_rn((float)p, f), &sn, &cn);
				float r1 = y1 * cn + y2 * sn, r2 = -y1 * sn + y2 * cn;
				y1 = r1;
				y2 = r2;
			}
			x[i] = y1;
			x[i + half] = y2;
		}
	}
	float *v = qkv + 2 * (size_t)C + (size_t)h * D;
	const __nv_bfloat16 *e = ve ? ve + (size_t)tokens[p] * C + (size_t)h * D : NULL;
	float fa0 = *a0, fa1 = *a1;
	for (int d = threadIdx.x; d < D; d += blockDim.x)
		v[d] = fa0 * v[d] + (e ? fa1 * __bfloat162float(e[d]) : 0.0f);
}

static __global__ void softcap_row(float *z, int n, float cap, float div)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		z[i] = cap / (1.0f + expf(-z[i] / div));
}

extern "C" enum ng_status ng_decode_spr_embed(float *x, float *x0, int *doc_start,
					      const ng_bf16 *wte, const int32_t *tokens,
					      const int *pos, int32_t bos, int C, float eps,
					      cudaStream_t s)
{
	if (C <= 0 || C % 8 || !(eps > 0.0f))
		return ng_check_arg_fail("ng_decode_spr_embed", "C = %d (multiple of 8), eps %g",
					 C, (double)eps);
	spr_embed_rmsnorm<<<1, DECODE_SPR_THREADS, 0, s>>>(
		x, x0, doc_start, (const __nv_bfloat16 *)wte, tokens, pos, bos, C, eps);
	return NG_LAUNCH_CHECK("spr_embed_rmsnorm");
}

extern "C" enum ng_status ng_decode_rmsnorm(float *out, const float *x, int C, float eps,
					    cudaStream_t s)
{
	if (C <= 0 || !(eps > 0.0f) || out == x)
		return ng_check_arg_fail("ng_decode_rmsnorm", "C = %d, eps %g, out %p != x %p", C,
					 (double)eps, out, x);
	rmsnorm_one_row<<<1, DECODE_SPR_THREADS, 0, s>>>(out, x, C, eps);
	return NG_LAUNCH_CHECK("rmsnorm_one_row");
}

extern "C" enum ng_status ng_decode_mix2(float *out, const float *a, const float *u,
					 const float *b, const float *w, int n, cudaStream_t s)
{
	if (n <= 0)
		return ng_check_arg_fail("ng_decode_mix2", "n = %d", n);
	mix2_row<<<(n + DECODE_SPR_THREADS - 1) / DECODE_SPR_THREADS, DECODE_SPR_THREADS, 0, s>>>(
		out, a, u, b, w, n);
	return NG_LAUNCH_CHECK("mix2_row");
}

extern "C" enum ng_status ng_decode_spr_qk_rotary(float *qkv, const ng_bf16 *ve,
						  const int32_t *tokens, const int *pos,
						  const float *a0, const float *a1, int H, int D,
						  float eps, cudaStream_t s)
{
	if (H <= 0 || D < 8 || D > 256 || D % 8 || !a0 || !a1 || !(eps > 0.0f))
		return ng_check_arg_fail("ng_decode_spr_qk_rotary", "H = %d, D = %d (8..256, "
					 "multiple of 8), scalars %p %p, eps %g", H, D, a0, a1,
					 (double)eps);
	qk_rotary_vmix<<<H, QK_THREADS, 0, s>>>(qkv, (const __nv_bfloat16 *)ve, tokens, pos, a0,
						 a1, H, D, eps);
	return NG_LAUNCH_CHECK("qk_rotary_vmix");
}

extern "C" enum ng_status ng_decode_softcap(float *z, int n, float cap, float div,
					    cudaStream_t s)
{
	if (n <= 0 || !(cap > 0.0f) || !(div > 0.0f))
		return ng_check_arg_fail("ng_decode_softcap", "n = %d, cap %g, div %g (> 0)", n,
					 (double)cap, (double)div);
	softcap_row<<<(n + DECODE_SPR_THREADS - 1) / DECODE_SPR_THREADS, DECODE_SPR_THREADS, 0, s>>>(
		z, n, cap, div);
	return NG_LAUNCH_CHECK("softcap_row");
}
