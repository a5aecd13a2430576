/*
 * kernels/mix.cu — the two-term scalar mix of the speedrun model (kernels/mix.h), forward and
 * backward.
 *
 * A unit is W elements of one row: W = 8, one 16-byte vector of each operand (C % 8 == 0, every
 * operand used 16-byte aligned with ld % 8 == 0: all the model's shapes), or W = 1, the scalar
 * path for anything else. Unit i is row i / cpr, columns W (i % cpr) .. with cpr = C / W units a
 * row, so rows with ld > C (v inside the fused qkv buffer, ld 3C) cost nothing extra.
 * mix2_fwd_units: one unit a thread; each operand is read once and out written once (6 bytes an
 * element, 4 without w): the traffic floor of an elementwise op.
 * mix2_bwd_units: the elementwise part likewise (every load of a unit issued before its
 * stores, so du may overwrite dout in place), and each thread's fp32 sums of dout * u and
 * dout * w over its grid-stride units; the block reduces them in a fixed tree
 * (ng_block_reduce_) and writes one partial per scalar. The grid is mix_bwd_grid(N, C), a
 * function of the shape alone (not of the device or of the path), so the partials hold the same
 * bits every run; mix2_bwd_finish sums them in double in block order and adds the total to *da
 * / *db. At (49152, 768): 528 blocks of 256 threads, 35 vectors a thread, a single wave on the
 * H200 with up to five 16-byte loads in flight per thread.
 */
#include "kernels/common.cuh"

#include <limits.h>

#include "kernels/mix.h"

#define MIX_THREADS 256     /* threads of a block of either elementwise kernel */
#define MIX_BWD_BLOCKS 528  /* the backward's grid at most (2 x this many fp32 partials): 4
			    * blocks of 256 threads at 64 registers fit an SM, 4 x 132 SMs of the
			    * H200 are one wave (fewer registers spill: 48 spilled 64 bytes) */
#define MIX_FIN_THREADS 256 /* threads of a finishing block */

/* out = a u + b w (w NULL: a u) for unit blockIdx.x * MIX_THREADS + threadIdx.x; a, b NULL: 1. */
template <int W>
static __global__ void __launch_bounds__(MIX_THREADS)
mix2_fwd_units(__nv_bfloat16 *out, int ld_out, const float *a, const __nv_bfloat16 *u, int ld_u,
	       const float *b, const __nv_bfloat16 *w, int ld_w, int cpr, int units)
{
	int i = blockIdx.x * MIX_THREADS + threadIdx.x;
	if (i >= units)
		return;
	int r = i / cpr, c = (i - r * cpr) * W;
	float x[W], y[W];
	ng_loadw_<W>(x, u + (size_t)r * ld_u + c);
	if (w)
		ng_loadw_<W>(y, w + (size_t)r * ld_w + c);
	float av = a ? *a : 1.0f;
	if (w) {
		float bv = b ? *b : 1.0f;
#pragma unroll
		for (int k = 0; k < W; k++)
			x[k] = fmaf(bv, y[k], av * x[k]);
	} else {
#pragma unroll
		for (int k = 0; k < W; k++)
			x[k] *= av;
	}
	ng_storew_<W>(out + (size_t)r * ld_out + c, x);
}

/* du = [du +] a dout, dw = [dw +] b dout over the grid-stride units of this thread (either
 * NULL: skipped); with part, the block's sums of dout * u (want_a) and dout * w (want_b) go to
 * part[blockIdx.x] and part[gridDim.x + blockIdx.x]. */
template <int W>
static __global__ void __launch_bounds__(MIX_THREADS)
mix2_bwd_units(__nv_bfloat16 *du, int ld_du, int du_acc, __nv_bfloat16 *dw, int ld_dw, int dw_acc,
	       float *part, int want_a, int want_b, const __nv_bfloat16 *dout, int ld_dout,
	       const float *a, const __nv_bfloat16 *u, int ld_u, const float *b,
	       const __nv_bfloat16 *w, int ld_w, int cpr, int units)
{
	__shared__ float sh[NG_WARP];
	float av = a ? *a : 1.0f, bv = b ? *b : 1.0f;
	float sa = 0.0f, sb = 0.0f;
	for (int i = blockIdx.x * MIX_THREADS + threadIdx.x; i < units;
	     i += gridDim.x * MIX_THREADS) {
		int r = i / cpr, c = (i - r * cpr) * W;
		float g[W], x[W], y[W], pu[W], pw[W];
		ng_loadw_<W>(g, dout + (size_t)r * ld_dout + c);
		if (want_a)
			ng_loadw_<W>(x, u + (size_t)r * ld_u + c);
		if (want_b)
			ng_loadw_<W>(y, w + (size_t)r * ld_w + c);
		if (du && du_acc)
			ng_loadw_<W>(pu, du + (size_t)r * ld_du + c);
		if (dw && dw_acc)
			ng_loadw_<W>(pw, dw + (size_t)r * ld_dw + c);
		if (want_a)
#pragma unroll
			for (int k = 0; k < W; k++)
				sa = fmaf(g[k], x[k], sa);
		if (want_b)
#pragma unroll
			for (int k = 0; k < W; k++)
				sb = fmaf(g[k], y[k], sb);
		if (dw) {
#pragma unroll
			for (int k = 0; k < W; k++)
				pw[k] = dw_acc ? fmaf(bv, g[k], pw[k]) : bv * g[k];
			ng_storew_<W>(dw + (size_t)r * ld_dw + c, pw);
		}
		if (du) {
#pragma unroll
			for (int k = 0; k < W; k++)
				pu[k] = du_acc ? fmaf(av, g[k], pu[k]) : av * g[k];
			ng_storew_<W>(du + (size_t)r * ld_du + c, pu);
		}
	}
	if (want_a) {
		float t = ng_block_reduce_(sa, sh, 0.0f, ng_op_sum_());
		if (threadIdx.x == 0)
			part[blockIdx.x] = t;
	}
	if (want_b) {
		float t = ng_block_reduce_(sb, sh, 0.0f, ng_op_sum_());
		if (threadIdx.x == 0)
			part[gridDim.x + blockIdx.x] = t;
	}
}

/* Block 0: *da += the double sum of part[0 .. nblk) in a fixed order; block 1: *db from
 * part[nblk .. 2 nblk). A NULL target's block does nothing. One rounding to fp32. */
static __global__ void __launch_bounds__(MIX_FIN_THREADS)
mix2_bwd_finish(float *da, float *db, const float *part, int nblk)
{
	__shared__ double sh[NG_WARP];
	float *dst = blockIdx.x == 0 ? da : db;
	if (dst == nullptr)
		return;
	double acc = ng_block_sum_array_d_(part + (size_t)blockIdx.x * nblk, nblk, sh);
	if (threadIdx.x == 0)
		*dst = (float)((double)*dst + acc);
}

/* The backward's grid: one 8-element unit a thread up to MIX_BWD_BLOCKS blocks. It depends on
 * (N, C) alone, so the scratch size and the summation order do too. */
static int mix_bwd_grid(int N, int C)
{
	size_t units = (size_t)N * (size_t)((C + 7) / 8);
	size_t g = (units + MIX_THREADS - 1) / MIX_THREADS;
	return g > MIX_BWD_BLOCKS ? MIX_BWD_BLOCKS : (int)(g ? g : 1);
}

extern "C" size_t ng_mix2_bwd_scratch_bytes(int N, int C)
{
	if (N <= 0 || C <= 0)
		return 0;
	return ((size_t)2 * mix_bwd_grid(N, C) * sizeof(float) + 15) & ~(size_t)15;
}

/* An operand of a launch: its name (for messages), pointer (NULL: not used) and ld. */
struct mix_operand {
	const char *name; /* as the header calls it */
	const void *p;    /* device pointer, or NULL */
	int ld;           /* leading dimension, elements */
};

/* The checks both launchers share: the shape, and ld >= C for every operand there. Sets *vec
 * when the vector path is open: C % 8 == 0 and every operand there 16-byte aligned with ld %
 * 8 == 0. */
static enum ng_status mix_check(const char *who, const struct mix_operand *op, int nop, int N,
				int C, bool *vec)
{
	if (N <= 0 || C <= 0 || (size_t)N * (size_t)C > (size_t)INT_MAX)
		return ng_check_arg_fail(who, "need N, C > 0 and N*C <= INT_MAX, got N=%d C=%d", N,
					 C);
	*vec = C % 8 == 0;
	for (int i = 0; i < nop; i++) {
		if (!op[i].p)
			continue;
		if (op[i].ld < C)
			return ng_check_arg_fail(who, "%s: ld %d is below C=%d", op[i].name,
						 op[i].ld, C);
		*vec = *vec && ng_aligned16_(op[i].p) && op[i].ld % 8 == 0;
	}
	return NG_OK;
}

static unsigned mix_blocks(int units)
{
	return (unsigned)((units + MIX_THREADS - 1) / MIX_THREADS);
}

extern "C" enum ng_status ng_mix2_fwd(ng_bf16 *out, int ld_out, const float *a, const ng_bf16 *u,
				      int ld_u, const float *b, const ng_bf16 *w, int ld_w, int N,
				      int C, cudaStream_t s)
{
	const char *who = "ng_mix2_fwd";
	const struct mix_operand op[] = {{"out", out, ld_out}, {"u", u, ld_u}, {"w", w, ld_w}};
	bool vec = false;
	enum ng_status st = mix_check(who, op, 3, N, C, &vec);
	if (st)
		return st;
	if (!out || !u)
		return ng_check_arg_fail(who, "out (%p) and u (%p) are required", (void *)out,
					 (const void *)u);
	if ((const void *)out == (const void *)u && ld_out != ld_u)
		return ng_check_arg_fail(who, "out == u in place needs ld_out == ld_u, got %d, %d",
					 ld_out, ld_u);
	__nv_bfloat16 *o = (__nv_bfloat16 *)out;
	const __nv_bfloat16 *pu = (const __nv_bfloat16 *)u, *pw = (const __nv_bfloat16 *)w;
	if (vec) {
		int units = N * (C / 8);
		mix2_fwd_units<8><<<mix_blocks(units), MIX_THREADS, 0, s>>>(
			o, ld_out, a, pu, ld_u, b, pw, ld_w, C / 8, units);
		return NG_LAUNCH_CHECK("mix2_fwd_units<8>");
	}
	mix2_fwd_units<1><<<mix_blocks(N * C), MIX_THREADS, 0, s>>>(o, ld_out, a, pu, ld_u, b, pw,
								    ld_w, C, N * C);
	return NG_LAUNCH_CHECK("mix2_fwd_units<1>");
}

extern "C" enum ng_status ng_mix2_bwd(ng_bf16 *du, int ld_du, int du_acc, ng_bf16 *dw, int ld_dw,
				      int dw_acc, float *da, float *db, const ng_bf16 *dout,
				      int ld_dout, const float *a, const ng_bf16 *u, int ld_u,
				      const float *b, const ng_bf16 *w, int ld_w, int N, int C,
				      void *scratch, cudaStream_t s)
{
	const char *who = "ng_mix2_bwd";
	/* u and w are only read for their scalar's gradient */
	const ng_bf16 *ru = da ? u : NULL, *rw = db ? w : NULL;
	const struct mix_operand op[] = {{"du", du, ld_du}, {"dw", dw, ld_dw},
					 {"dout", dout, ld_dout}, {"u", ru, ld_u}, {"w", rw, ld_w}};
	bool vec = false;
	enum ng_status st = mix_check(who, op, 5, N, C, &vec);
	if (st)
		return st;
	if (!du && !dw && !da && !db)
		return NG_OK;
	if (!dout)
		return ng_check_arg_fail(who, "dout is required");
	if ((da && !u) || (db && !w))
		return ng_check_arg_fail(who, "da needs u and db needs w (u %p, w %p)",
					 (const void *)u, (const void *)w);
	if ((da || db) && (!scratch || !ng_aligned16_(scratch)))
		return ng_check_arg_fail(who, "da/db need a 16-byte aligned scratch, got %p",
					 scratch);
	if ((const void *)du == (const void *)dout && (du_acc || ld_du != ld_dout))
		return ng_check_arg_fail(who, "du == dout in place needs du_acc 0 and ld_du == "
					 "ld_dout, got du_acc %d, ld %d and %d",
					 du_acc, ld_du, ld_dout);
	if (dw && ((const void *)dw == (const void *)dout || (const void *)dw == (const void *)du))
		return ng_check_arg_fail(who, "dw may not alias dout or du");
	int grid = mix_bwd_grid(N, C), W = vec ? 8 : 1;
	float *part = (da || db) ? (float *)scratch : nullptr;
	__nv_bfloat16 *pdu = (__nv_bfloat16 *)du, *pdw = (__nv_bfloat16 *)dw;
	const __nv_bfloat16 *pg = (const __nv_bfloat16 *)dout, *pu = (const __nv_bfloat16 *)ru;
	const __nv_bfloat16 *pw = (const __nv_bfloat16 *)rw;
	auto kernel = vec ? mix2_bwd_units<8> : mix2_bwd_units<1>;
	kernel<<<grid, MIX_THREADS, 0, s>>>(pdu, ld_du, du_acc, pdw, ld_dw, dw_acc, part,
					    da != NULL, db != NULL, pg, ld_dout, a, pu, ld_u, b, pw,
					    ld_w, C / W, N * (C / W));
	if ((st = NG_LAUNCH_CHECK(vec ? "mix2_bwd_units<8>" : "mix2_bwd_units<1>")) || !part)
		return st;
	mix2_bwd_finish<<<2, MIX_FIN_THREADS, 0, s>>>(da, db, part, grid);
	return NG_LAUNCH_CHECK("mix2_bwd_finish");
}
