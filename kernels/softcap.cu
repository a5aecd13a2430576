/*
 * kernels/softcap.cu — the soft-capped cross-entropy of the speedrun head (kernels/softcap.h),
 * one block per row, in the manner of kernels/loss.cu.
 *
 * No max pass: s = cap sigmoid(z / div) lies in [0, cap], so logsumexp(s) = cap + log(sum of
 * exp(s - cap)), and every term exp(s - cap) >= exp(-cap) >= e^-64 ~ 1.6e-28 stays a normal
 * fp32 number even through ex2.approx.ftz (which flushes below 2^-126): the sum cannot
 * underflow, and cannot overflow (at most Vp). Hence the launchers' cap <= 64. One pass gives
 * the statistics; a second writes the gradient.
 * Per element, with e = exp(-z / div) = 2^(z kz), kz = -log2(e) / div: sigmoid = 1 / (1 + e),
 * s = cap / (1 + e), q = 1 - sigmoid = e / (1 + e), and cap - s = cap q, computed without the
 * cancellation of cap - s; exp(s - cap) = 2^(-cap q log2 e); ds/dz = s (1 - s / cap) / div =
 * s q / div. Three MUFU operations (ex2, rcp, ex2) an element in each pass. The exponent z kz is
 * clamped to SC_EXP_MAX so that e, s and s q stay finite normal numbers (it binds for z below
 * about -69 div, where s < cap e^-69 ~ 3e-29 anyway); a NaN passes the clamp and makes the loss
 * NaN.
 * ng_softcap_crossentropy -> softcap_ce_row_in_smem when the row fits in shared memory (Vp % 8
 * == 0, Vp * 2 <= SC_SMEM_MAX: the model's 50304 columns are 100.6 KB, two rows per SM): the
 * block copies its row in with 16-byte cp.async, takes the sum over the vectors each thread
 * copied, merges it in a fixed tree, and writes dz from shared memory, so HBM sees one read and
 * one write of the row (kernels/loss.cu measured this 1.45x faster than re-reading the row).
 * ng_softcap_crossentropy_fwd, longer rows and other Vp -> softcap_ce_block_per_row: pass 1
 * reads the row (W = 8: 16-byte loads, W = 1: one element a load, for Vp % 8 != 0 or an
 * unaligned z), with a gradient pass 2 re-reads it and writes dz. The target's logit is read
 * before pass 1 (pass 2 of other threads may overwrite it). Sums are fp32 in a fixed order: the
 * same bits every run.
 * Both kernels are templates on what becomes of the gradient (enum sc_out): nothing (the
 * forward), bf16 over z, or, for ng_softcap_crossentropy_e5m2, the E5M2 bytes of dz * gscale in
 * a separate buffer g8 (z read only) for an FP8 backward matmul of the head: the same fp32 dz,
 * multiplied in fp32 and cast with cuda_fp8.h's round-to-nearest-even, saturating conversion;
 * 8 bytes a store on the vector paths (g8 8-byte aligned), one on the scalar path.
 */
#include <cuda_fp8.h>

#include "kernels/common.cuh"

#include "kernels/softcap.h"

#define SC_THREADS 512          /* threads of a row's block (kernels/loss.cu measured 512 best) */
#define SC_SMEM_MAX (112 * 1024) /* largest row (bytes) the shared-memory kernel takes */
#define SC_CAP_MAX 64.0f        /* largest cap without a max pass (see above) */
#define SC_EXP_MAX 100.0f       /* clamp of the exponent of e = exp(-z / div), base 2 */
#define SC_LOG2E 1.4426950408889634f

static __device__ __forceinline__ float sc_exp2(float x)
{
	float y;
	asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
	return y;
}

/* The soft cap of z: *s = cap sigmoid(z / div), *q = 1 - sigmoid(z / div). */
static __device__ __forceinline__ void sc_cap(float z, float kz, float cap, float *s, float *q)
{
	float t = z * kz;
	t = t > SC_EXP_MAX ? SC_EXP_MAX : t; /* a comparison, so NaN stays NaN */
	float e = sc_exp2(t);
	float inv = __fdividef(1.0f, 1.0f + e);
	*s = cap * inv;
	*q = e * inv;
}

/* exp(s - cap) of logit z */
static __device__ __forceinline__ float sc_term(float z, float kz, float cap)
{
	float s, q;
	sc_cap(z, kz, cap, &s, &q);
	return sc_exp2(-cap * q * SC_LOG2E);
}

/* dz of logit z: dloss (softmax - onehot) ds/dz, with softmax = exp(s - cap - lsum) =
 * 2^(-(cap q log2e + lsumL)), lsumL = log2(sum of exp(s - cap)). */
static __device__ __forceinline__ float sc_grad(float z, bool is_tg, float kz, float cap,
						float inv_div, float lsumL, float dloss)
{
	float s, q;
	sc_cap(z, kz, cap, &s, &q);
	float p = sc_exp2(-fmaf(cap * q, SC_LOG2E, lsumL));
	return dloss * (is_tg ? p - 1.0f : p) * (s * q * inv_div);
}

/* Thread 0 writes the row's loss, lsum = log(sum of exp(s - cap)), zt the target's logit:
 * logsumexp(s) - s_t = lsum + (cap - s_t) = lsum + cap q_t. */
static __device__ __forceinline__ void sc_write_loss(float *losses, int row, bool tg_ok, float zt,
						     float lsum, float kz, float cap)
{
	if (threadIdx.x != 0)
		return;
	float s, q;
	sc_cap(zt, kz, cap, &s, &q);
	losses[row] = tg_ok ? fmaf(cap, q, lsum) : NAN;
}

/* What a kernel makes of the gradient: nothing (the forward), bf16 dz written over z, or the
 * E5M2 bytes of dz * gscale written to g8. */
enum sc_out { SC_NONE, SC_BF16, SC_E5M2 };

/* The E5M2 output (read by SC_E5M2 kernels only). */
struct sc_g8 {
	uint8_t *g8;    /* (N, Vp) E5M2 bytes, row stride Vp, = */
	float gscale;   /* the factor of dz before the cast */
	float *descale; /* (1) fp32, = 1 / gscale by block 0, or NULL */
	float inv;      /* 1 / gscale, divided on the host */
};

/* E5M2 of x * gscale: round to nearest even, saturating to +-57344 (NaN stays NaN). */
static __device__ __forceinline__ uint8_t sc_e5m2(float x, float gscale)
{
	return __nv_cvt_float_to_fp8(x * gscale, __NV_SATFINITE, __NV_E5M2);
}

/* The same for 8 columns, byte k = column k: one conversion instruction per pair on sm_89+
 * (the pair form's low byte is .x), the same bytes as sc_e5m2. */
static __device__ __forceinline__ uint2 sc_e5m2x8(const float x[8], float gscale)
{
	unsigned w[4];
#pragma unroll
	for (int k = 0; k < 4; k++)
		w[k] = __nv_cvt_float2_to_fp8x2(make_float2(x[2 * k] * gscale,
							    x[2 * k + 1] * gscale),
						__NV_SATFINITE, __NV_E5M2);
	return make_uint2(w[0] | w[1] << 16, w[2] | w[3] << 16);
}

/* Block 0's thread 0 writes the descale that the FP8 matmul reading g8 takes. */
static __device__ __forceinline__ void sc_write_descale(const struct sc_g8 &o)
{
	if (o.descale && blockIdx.x == 0 && threadIdx.x == 0)
		*o.descale = o.inv;
}

/* Two passes over row blockIdx.x in global memory, W columns a load; OUT: enum sc_out. */
template <int OUT, int W>
static __global__ void __launch_bounds__(SC_THREADS)
softcap_ce_block_per_row(float *losses, __nv_bfloat16 *z, struct sc_g8 o, const int32_t *targets,
			 int Vp, float cap, float kz, float inv_div, float dloss)
{
	__shared__ float sh[NG_WARP];
	int row = blockIdx.x;
	__nv_bfloat16 *zr = z + (size_t)row * Vp;
	int tg = targets[row];
	bool tg_ok = tg >= 0 && tg < Vp;
	float zt = (threadIdx.x == 0 && tg_ok) ? __bfloat162float(zr[tg]) : 0.0f;
	float sum = 0.0f;
#pragma unroll 4
	for (int c = threadIdx.x * W; c < Vp; c += SC_THREADS * W) {
		float x[W];
		ng_loadw_<W>(x, zr + c);
#pragma unroll
		for (int k = 0; k < W; k++)
			sum += sc_term(x[k], kz, cap);
	}
	sum = ng_block_reduce_(sum, sh, 0.0f, ng_op_sum_());
	float lsum = logf(sum);
	sc_write_loss(losses, row, tg_ok, zt, lsum, kz, cap);
	if constexpr (OUT == SC_NONE)
		return;
	if constexpr (OUT == SC_E5M2)
		sc_write_descale(o);
	float lsumL = lsum * SC_LOG2E;
	for (int c = threadIdx.x * W; c < Vp; c += SC_THREADS * W) {
		float x[W];
		ng_loadw_<W>(x, zr + c);
#pragma unroll
		for (int k = 0; k < W; k++)
			x[k] = sc_grad(x[k], c + k == tg, kz, cap, inv_div, lsumL, dloss);
		if constexpr (OUT == SC_BF16) {
			ng_storew_<W>(zr + c, x);
		} else if constexpr (OUT == SC_E5M2) {
			uint8_t *g = o.g8 + (size_t)row * Vp + c;
			if constexpr (W == 8)
				*reinterpret_cast<uint2 *>(g) = sc_e5m2x8(x, o.gscale);
			else
				*g = sc_e5m2(x[0], o.gscale);
		}
	}
}

/* One block per row; the row (Vp bf16, Vp % 8 == 0) lives in dynamic shared memory. Every
 * thread reads back only the vectors it copied, so the only barriers are the sum's. OUT:
 * SC_BF16 or SC_E5M2. */
template <int OUT>
static __global__ void __launch_bounds__(SC_THREADS)
softcap_ce_row_in_smem(float *losses, __nv_bfloat16 *z, struct sc_g8 o, const int32_t *targets,
		       int Vp, float cap, float kz, float inv_div, float dloss)
{
	extern __shared__ int4 sc_row_sh[];
	__shared__ float sh[NG_WARP];
	__nv_bfloat16 *row = (__nv_bfloat16 *)sc_row_sh;
	int r = blockIdx.x, nv = Vp / 8;
	__nv_bfloat16 *zr = z + (size_t)r * Vp;
	int tg = targets[r];
	bool tg_ok = tg >= 0 && tg < Vp;
	for (int i = threadIdx.x; i < nv; i += SC_THREADS)
		ng_copy16_async_(row + 8 * i, zr + 8 * i);
	ng_copy_wait_all_();
	float sum = 0.0f;
	for (int i = threadIdx.x; i < nv; i += SC_THREADS) {
		float x[8];
		ng_unpack8_(x, ng_load8_(row + 8 * i));
#pragma unroll
		for (int k = 0; k < 8; k++)
			sum += sc_term(x[k], kz, cap);
	}
	sum = ng_block_reduce_(sum, sh, 0.0f, ng_op_sum_());
	/* the target's logit, copied by another thread: visible after that thread's wait_all and
	 * the barriers of the reduce; the row in shared memory is never overwritten */
	float zt = (threadIdx.x == 0 && tg_ok) ? __bfloat162float(row[tg]) : 0.0f;
	float lsum = logf(sum);
	sc_write_loss(losses, r, tg_ok, zt, lsum, kz, cap);
	if constexpr (OUT == SC_E5M2)
		sc_write_descale(o);
	float lsumL = lsum * SC_LOG2E;
	for (int i = threadIdx.x; i < nv; i += SC_THREADS) {
		int c = 8 * i;
		float x[8];
		ng_unpack8_(x, ng_load8_(row + c));
#pragma unroll
		for (int k = 0; k < 8; k++)
			x[k] = sc_grad(x[k], c + k == tg, kz, cap, inv_div, lsumL, dloss);
		if constexpr (OUT == SC_BF16) {
			struct ng_bf16x8 v = ng_pack8_(x);
			__stcs(reinterpret_cast<int4 *>(zr + c), *reinterpret_cast<const int4 *>(&v));
		} else {
			__stcs(reinterpret_cast<uint2 *>(o.g8 + (size_t)r * Vp + c),
			       sc_e5m2x8(x, o.gscale));
		}
	}
}

static enum ng_status check_sc(const char *who, const float *losses, const void *z,
			       const int32_t *targets, int N, int Vp, float cap, float div)
{
	if (N <= 0 || Vp <= 0)
		return ng_check_arg_fail(who, "need N, Vp > 0, got N=%d Vp=%d", N, Vp);
	if (!(cap > 0.0f && cap <= SC_CAP_MAX) || !(div > 0.0f && div < INFINITY))
		return ng_check_arg_fail(who, "need 0 < cap <= %g and a finite div > 0, got cap=%g "
					 "div=%g", (double)SC_CAP_MAX, (double)cap, (double)div);
	if (!losses || !z || !targets)
		return ng_check_arg_fail(who, "losses (%p), z (%p) and targets (%p) are required",
					 (const void *)losses, z, (const void *)targets);
	return NG_OK;
}

/* Is the vector path open: Vp % 8 == 0 and z 16-byte aligned (then every row is)? */
static bool sc_vec(const void *z, int Vp) { return Vp % 8 == 0 && ng_aligned16_(z); }

/* The launch names of a gradient form: the row in shared memory, two passes W = 8, W = 1. */
struct sc_names {
	const char *smem, *vec, *scalar;
};

/* A gradient form (OUT = SC_BF16 or SC_E5M2) over checked arguments: the row in shared memory
 * when it fits and vec (the vector path is open for every pointer), else the two passes. */
template <int OUT>
static enum ng_status sc_launch_grad(const struct sc_names &nm, float *losses,
				     __nv_bfloat16 *z, struct sc_g8 o, const int32_t *targets,
				     int N, int Vp, float cap, float div, float dloss, bool vec,
				     cudaStream_t s)
{
	float kz = -SC_LOG2E / div, inv_div = 1.0f / div;
	size_t smem = (size_t)Vp * 2;
	enum ng_status st;
	if (vec && smem <= SC_SMEM_MAX) {
		if ((st = ng_ensure_smem_(softcap_ce_row_in_smem<OUT>, smem)))
			return st;
		softcap_ce_row_in_smem<OUT><<<N, SC_THREADS, smem, s>>>(losses, z, o, targets, Vp,
									cap, kz, inv_div, dloss);
		return NG_LAUNCH_CHECK(nm.smem);
	}
	if (vec) {
		softcap_ce_block_per_row<OUT, 8><<<N, SC_THREADS, 0, s>>>(losses, z, o, targets, Vp,
									   cap, kz, inv_div, dloss);
		return NG_LAUNCH_CHECK(nm.vec);
	}
	softcap_ce_block_per_row<OUT, 1><<<N, SC_THREADS, 0, s>>>(losses, z, o, targets, Vp, cap,
								   kz, inv_div, dloss);
	return NG_LAUNCH_CHECK(nm.scalar);
}

extern "C" enum ng_status ng_softcap_crossentropy(float *losses, ng_bf16 *z,
						  const int32_t *targets, int N, int Vp, float cap,
						  float div, float dloss, cudaStream_t s)
{
	enum ng_status st = check_sc("ng_softcap_crossentropy", losses, z, targets, N, Vp, cap,
				     div);
	if (st)
		return st;
	static const struct sc_names nm = {"softcap_ce_row_in_smem<bf16>",
					   "softcap_ce_block_per_row<bf16, 8>",
					   "softcap_ce_block_per_row<bf16, 1>"};
	struct sc_g8 none = {NULL, 0.0f, NULL, 0.0f};
	return sc_launch_grad<SC_BF16>(nm, losses, (__nv_bfloat16 *)z, none, targets, N, Vp, cap,
				       div, dloss, sc_vec(z, Vp), s);
}

extern "C" enum ng_status ng_softcap_crossentropy_e5m2(float *losses, const ng_bf16 *z,
						       uint8_t *g8, float *descale,
						       const int32_t *targets, int N, int Vp,
						       float cap, float div, float dloss,
						       float gscale, cudaStream_t s)
{
	const char *who = "ng_softcap_crossentropy_e5m2";
	enum ng_status st = check_sc(who, losses, z, targets, N, Vp, cap, div);
	if (st)
		return st;
	/* gscale's reciprocal must be finite too: it is the descale the matmul multiplies by */
	if (!g8 || !(gscale > 0.0f && gscale < INFINITY && 1.0f / gscale < INFINITY))
		return ng_check_arg_fail(who, "need g8 (%p) and a finite gscale > 0 with a finite "
					 "1 / gscale, got gscale=%g", (void *)g8, (double)gscale);
	static const struct sc_names nm = {"softcap_ce_row_in_smem<e5m2>",
					   "softcap_ce_block_per_row<e5m2, 8>",
					   "softcap_ce_block_per_row<e5m2, 1>"};
	struct sc_g8 o = {g8, gscale, descale, 1.0f / gscale};
	/* the kernels only read z; 8-byte stores into g8 need every row 8-byte aligned, which
	 * Vp % 8 == 0 and an 8-byte aligned g8 give */
	bool vec = sc_vec(z, Vp) && (uintptr_t)g8 % 8 == 0;
	return sc_launch_grad<SC_E5M2>(nm, losses, (__nv_bfloat16 *)z, o, targets, N, Vp, cap, div,
				       dloss, vec, s);
}

extern "C" enum ng_status ng_softcap_crossentropy_fwd(float *losses, const ng_bf16 *z,
						      const int32_t *targets, int N, int Vp,
						      float cap, float div, cudaStream_t s)
{
	enum ng_status st = check_sc("ng_softcap_crossentropy_fwd", losses, z, targets, N, Vp, cap,
				     div);
	if (st)
		return st;
	float kz = -SC_LOG2E / div;
	/* one read of the row is all it needs: pass 1 of the two-pass kernel, which never writes
	 * through the pointer */
	__nv_bfloat16 *zb = (__nv_bfloat16 *)z;
	struct sc_g8 none = {NULL, 0.0f, NULL, 0.0f};
	if (sc_vec(z, Vp)) {
		softcap_ce_block_per_row<SC_NONE, 8><<<N, SC_THREADS, 0, s>>>(
			losses, zb, none, targets, Vp, cap, kz, 0.0f, 0.0f);
		return NG_LAUNCH_CHECK("softcap_ce_block_per_row<no grad, 8>");
	}
	softcap_ce_block_per_row<SC_NONE, 1><<<N, SC_THREADS, 0, s>>>(losses, zb, none, targets,
								       Vp, cap, kz, 0.0f, 0.0f);
	return NG_LAUNCH_CHECK("softcap_ce_block_per_row<no grad, 1>");
}
