/*
 * kernels/layernorm.cu — LayerNorm forward (optionally fused with the residual add) and backward.
 *
 * Forward, layernorm_fwd_warp_per_row<NCH>: one warp per row; lane l owns channels l*8 + 256 j
 * (16-byte loads), j < NCH, so the row lives in registers (C <= 4096, kept as packed bf16 and
 * unpacked in each pass) and all of its loads are in flight at once. Mean, then the variance
 * around that mean (two passes over the registers: no cancellation for large-mean inputs), then
 * the output.
 * Backward, layernorm_bwd_warp_per_row_partials<NCH>: one warp per row (dout, inp, dinp held in
 * registers), rows strided over a fixed number of blocks; each warp accumulates dw/db partials in
 * its own shared-memory row, the block sums its warps in order into scratch, and
 * layernorm_bwd_reduce_partials sums the blocks in order (32 columns x 16 slices per block, so
 * ~C/16 blocks share the work: the one-thread-per-column version ran on C/256 SMs). The grid is
 * exactly one wave on 132 SMs: ln_bwd_blocks_per_sm(NCH) blocks per SM, which the kernel's
 * __launch_bounds__ guarantees registers for (the fixed 528 blocks were 1.33 waves at C = 1600,
 * where 154 registers allowed only 3 blocks per SM). Same bytes every run.
 * Formulas: dxhat = dout * w; dinp = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
 * References: llm.c layernorm_forward/backward; Ba et al. 2016 "Layer Normalization".
 */
#include "kernels/common.cuh"

#include "kernels/layernorm.h"

#define LN_EPS 1e-5f
#define LN_MAX_C 4096 /* rows live in registers: 16 chunks of 8 per lane at most */
#define LN_WARPS 4        /* backward: warps (rows in flight) per block */
#define LN_FWD_WARPS 4    /* forward: warps (rows) per block (1, 2 and 8 measured no better) */
#define LN_BWD_SMS 132    /* SMs of an H100/H200: the backward's grid is LN_BWD_SMS times the
                           * blocks per SM of its NCH class, a constant per C (the grid fixes
                           * the summation order, so it must not depend on the device) */
#define LN_RED_SLICES 16  /* partial rows each column of the partials reduction splits into */

/* Chunks of 8 channels each lane holds: lane l owns channels l*8 + 256 j, j < NCH. The row
 * lives in registers, and all of a row's loads are issued before any is used (memory-level
 * parallelism: that is what makes a warp-per-row kernel reach HBM bandwidth). */
template <int NCH, bool RESID>
static __global__ void layernorm_fwd_warp_per_row(__nv_bfloat16 *resid, __nv_bfloat16 *out,
						  float *mean, float *rstd,
						  const __nv_bfloat16 *a, const __nv_bfloat16 *b,
						  const __nv_bfloat16 *w, const __nv_bfloat16 *bias,
						  int N, int C)
{
	int warp = threadIdx.x / NG_WARP, lane = threadIdx.x % NG_WARP;
	int row = blockIdx.x * LN_FWD_WARPS + warp;
	if (row >= N)
		return;
	size_t off = (size_t)row * C;
	struct ng_bf16x8 ra[NCH], rb[NCH];
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		int c = lane * 8 + j * NG_WARP * 8;
		if (c < C) {
			ra[j] = ng_load8_stream_(a + off + c);
			if (RESID)
				rb[j] = ng_load8_stream_(b + off + c);
		}
	}
	float sum = 0.0f;
	/* the row stays packed: ra[j] holds the (rounded) row, unpacked again in each pass (d48:
	 * 36.6-39.3 us over three runs against 39.6-39.8 us with fp32 copies of the row) */
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		int c = lane * 8 + j * NG_WARP * 8;
		if (c >= C)
			continue;
		float x[8];
		ng_unpack8_(x, ra[j]);
		if (RESID) {
			float u[8];
			ng_unpack8_(u, rb[j]);
#pragma unroll
			for (int k = 0; k < 8; k++)
				x[k] += u[k];
			ra[j] = ng_pack8_(x);
			ng_store8_(resid + off + c, ra[j]);
			ng_unpack8_(x, ra[j]); /* normalise the rounded residual */
		}
#pragma unroll
		for (int k = 0; k < 8; k++)
			sum += x[k];
	}
	float m = ng_warp_sum_(sum) / C;
	float var = 0.0f;
#pragma unroll
	for (int j = 0; j < NCH; j++)
		if (lane * 8 + j * NG_WARP * 8 < C) {
			float x[8];
			ng_unpack8_(x, ra[j]);
#pragma unroll
			for (int k = 0; k < 8; k++) {
				float d = x[k] - m;
				var += d * d;
			}
		}
	float rs = rsqrtf(ng_warp_sum_(var) / C + LN_EPS);
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		int c = lane * 8 + j * NG_WARP * 8;
		if (c >= C)
			continue;
		float x[8], wv[8], bv[8], o[8];
		ng_unpack8_(x, ra[j]);
		ng_unpack8_(wv, ng_load8_(w + c));
		ng_unpack8_(bv, ng_load8_(bias + c));
#pragma unroll
		for (int k = 0; k < 8; k++)
			o[k] = (x[k] - m) * rs * wv[k] + bv[k];
		ng_store8_(out + off + c, ng_pack8_(o));
	}
	if (lane == 0) {
		if (mean)
			mean[row] = m;
		if (rstd)
			rstd[row] = rs;
	}
}

/* p[0..8) += v (p 32-byte aligned, shared memory), as two float4 updates. */
static __device__ __forceinline__ void add8_shared(float *p, const float v[8])
{
	float4 *q = reinterpret_cast<float4 *>(p);
	float4 a = q[0], b = q[1];
	a.x += v[0], a.y += v[1], a.z += v[2], a.w += v[3];
	b.x += v[4], b.y += v[5], b.z += v[6], b.w += v[7];
	q[0] = a;
	q[1] = b;
}

/* Blocks per SM the backward is built for (registers via __launch_bounds__, shared memory
 * 4 warps x 2 x C x 4 bytes within 227 KiB). */
static __host__ __device__ constexpr int ln_bwd_blocks_per_sm(int nch)
{
	return nch <= 3 ? 6 : nch <= 6 ? 4 : nch <= 8 ? 3 : nch <= 12 ? 2 : 1;
}

template <int NCH>
static __global__ void __launch_bounds__(LN_WARPS *NG_WARP, ln_bwd_blocks_per_sm(NCH))
layernorm_bwd_warp_per_row_partials(
	__nv_bfloat16 *dinp, float *part_dw, float *part_db, const __nv_bfloat16 *dout,
	const __nv_bfloat16 *inp, const __nv_bfloat16 *w, const float *mean, const float *rstd,
	int N, int C)
{
	extern __shared__ float ln_sh[];
	int warp = threadIdx.x / NG_WARP, lane = threadIdx.x % NG_WARP;
	float *sdw = ln_sh + (size_t)warp * 2 * C; /* this warp's dw partial, then its db partial */
	float *sdb = sdw + C;
	for (int c = lane; c < C; c += NG_WARP) {
		sdw[c] = 0.0f;
		sdb[c] = 0.0f;
	}
	__syncwarp(); /* lanes below add to slots other lanes zeroed */
	for (int row = blockIdx.x * LN_WARPS + warp; row < N; row += gridDim.x * LN_WARPS) {
		size_t off = (size_t)row * C;
		struct ng_bf16x8 rd[NCH], rx[NCH], rg[NCH];
#pragma unroll
		for (int j = 0; j < NCH; j++) {
			int c = lane * 8 + j * NG_WARP * 8;
			if (c < C) {
				rd[j] = ng_load8_stream_(dout + off + c);
				rx[j] = ng_load8_stream_(inp + off + c);
				rg[j] = ng_load8_stream_(dinp + off + c);
			}
		}
		float m = mean[row], rs = rstd[row];
		float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
		for (int j = 0; j < NCH; j++) {
			int c = lane * 8 + j * NG_WARP * 8;
			if (c >= C)
				continue;
			float d[8], x[8], wv[8];
			ng_unpack8_(d, rd[j]);
			ng_unpack8_(x, rx[j]);
			ng_unpack8_(wv, ng_load8_(w + c));
#pragma unroll
			for (int k = 0; k < 8; k++) {
				float xh = (x[k] - m) * rs, dx = d[k] * wv[k];
				s1 += dx;
				s2 += dx * xh;
			}
		}
		s1 = ng_warp_sum_(s1) / C;
		s2 = ng_warp_sum_(s2) / C;
#pragma unroll
		for (int j = 0; j < NCH; j++) {
			int c = lane * 8 + j * NG_WARP * 8;
			if (c >= C)
				continue;
			float d[8], x[8], wv[8], g[8];
			ng_unpack8_(d, rd[j]);
			ng_unpack8_(x, rx[j]);
			ng_unpack8_(g, rg[j]);
			ng_unpack8_(wv, ng_load8_(w + c));
			float pw[8];
#pragma unroll
			for (int k = 0; k < 8; k++) {
				float xh = (x[k] - m) * rs;
				g[k] += (d[k] * wv[k] - s1 - xh * s2) * rs;
				pw[k] = d[k] * xh;
			}
			ng_store8_(dinp + off + c, ng_pack8_(g));
			/* 16-byte shared-memory updates: a lane's 8 channels are contiguous, so scalar
			 * updates would be 8-way bank conflicts */
			add8_shared(sdw + c, pw);
			add8_shared(sdb + c, d);
		}
	}
	__syncthreads();
	for (int c = threadIdx.x; c < C; c += blockDim.x) {
		float sw = 0.0f, sb = 0.0f;
		for (int k = 0; k < LN_WARPS; k++) {
			sw += ln_sh[(size_t)k * 2 * C + c];
			sb += ln_sh[(size_t)k * 2 * C + C + c];
		}
		part_dw[(size_t)blockIdx.x * C + c] = sw;
		part_db[(size_t)blockIdx.x * C + c] = sb;
	}
}

/* Block (32, LN_RED_SLICES) sums 32 columns of dw (blockIdx.y 0) or db (1) over the nblocks
 * partial rows: slice y takes rows y, y + 16, ... in order, then row 0 of the block adds the 16
 * slices in order. Fixed order: deterministic. */
static __global__ void layernorm_bwd_reduce_partials(float *dw, float *db, const float *part_dw,
						     const float *part_db, int nblocks, int C)
{
	__shared__ float sh[LN_RED_SLICES][NG_WARP + 1];
	int c = blockIdx.x * NG_WARP + threadIdx.x;
	const float *part = blockIdx.y == 0 ? part_dw : part_db;
	float acc = 0.0f;
	if (c < C)
		for (int k = threadIdx.y; k < nblocks; k += LN_RED_SLICES)
			acc += part[(size_t)k * C + c];
	sh[threadIdx.y][threadIdx.x] = acc;
	__syncthreads();
	if (threadIdx.y != 0 || c >= C)
		return;
	for (int y = 1; y < LN_RED_SLICES; y++)
		acc += sh[y][threadIdx.x];
	float *dst = blockIdx.y == 0 ? dw : db;
	dst[c] += acc;
}

static int nch_of(int C) { return (C + NG_WARP * 8 - 1) / (NG_WARP * 8); }

/* The backward's grid: one wave of ln_bwd_blocks_per_sm blocks per SM, fewer for small N. The
 * NCH class must match the one ln_launch instantiates. */
static int bwd_blocks(int N, int C)
{
	int nch = nch_of(C);
	if (nch > 8)
		nch = nch <= 12 ? 12 : 16;
	int per_sm = ln_bwd_blocks_per_sm(nch);
	int smem_fit = (227 * 1024) / (LN_WARPS * 2 * C * 4 + 1024); /* 1 KiB reserved per block */
	if (per_sm > smem_fit)
		per_sm = smem_fit > 0 ? smem_fit : 1;
	int cap = LN_BWD_SMS * per_sm;
	int nb = (N + LN_WARPS - 1) / LN_WARPS;
	return nb < cap ? nb : cap;
}

extern "C" size_t ng_layernorm_bwd_scratch_bytes(int N, int C)
{
	if (N <= 0 || C <= 0)
		return 0;
	return 2 * (size_t)bwd_blocks(N, C) * C * sizeof(float);
}

static enum ng_status check_args(const char *who, int N, int C, const void *p0, const void *p1,
				 const void *p2, const void *p3, const void *p4, const void *p5)
{
	if (N <= 0 || C <= 0 || C % 8 != 0 || C > LN_MAX_C)
		return ng_check_arg_fail(who, "need N > 0, 0 < C <= %d and C %% 8 == 0, got N=%d C=%d",
					 LN_MAX_C, N, C);
	const void *ps[6] = {p0, p1, p2, p3, p4, p5};
	for (int i = 0; i < 6; i++)
		if (!ng_aligned16_(ps[i]))
			return ng_check_arg_fail(who, "bf16 pointer %d (%p) is not 16-byte aligned", i,
						 ps[i]);
	return NG_OK;
}

/* The kernel arguments of both directions, so the NCH dispatch is written once. */
struct ln_args {
	__nv_bfloat16 *resid, *out, *dinp;            /* outputs (bf16) */
	float *mean, *rstd, *part_dw, *part_db;       /* statistics / partials (fp32) */
	const __nv_bfloat16 *a, *b, *w, *bias, *dout; /* inputs (bf16) */
	const float *cmean, *crstd;                   /* the forward's statistics (backward) */
	int N, C;                                     /* rows, channels */
};

/* KIND 0: forward, 1: residual forward, 2: backward partials. */
template <int NCH, int KIND>
static enum ng_status ln_launch_nch(const struct ln_args *x, cudaStream_t s)
{
	if (KIND == 2) {
		size_t smem = (size_t)LN_WARPS * 2 * x->C * sizeof(float);
		enum ng_status st = ng_ensure_smem_(layernorm_bwd_warp_per_row_partials<NCH>, smem);
		if (st)
			return st;
		unsigned grid = (unsigned)bwd_blocks(x->N, x->C);
		layernorm_bwd_warp_per_row_partials<NCH><<<grid, LN_WARPS * NG_WARP, smem, s>>>(
			x->dinp, x->part_dw, x->part_db, x->dout, x->a, x->w, x->cmean, x->crstd, x->N,
			x->C);
		return NG_LAUNCH_CHECK("layernorm_bwd_warp_per_row_partials");
	}
	unsigned grid = (unsigned)((x->N + LN_FWD_WARPS - 1) / LN_FWD_WARPS);
	layernorm_fwd_warp_per_row<NCH, KIND == 1><<<grid, LN_FWD_WARPS * NG_WARP, 0, s>>>(
		x->resid, x->out, x->mean, x->rstd, x->a, x->b, x->w, x->bias, x->N, x->C);
	return NG_LAUNCH_CHECK("layernorm_fwd_warp_per_row");
}

/* Picks the smallest instantiated NCH >= C / 256 (C <= LN_MAX_C, checked by the caller). */
template <int KIND>
static enum ng_status ln_launch(const struct ln_args *x, cudaStream_t s)
{
	int nch = nch_of(x->C);
	switch (nch) {
	case 1: return ln_launch_nch<1, KIND>(x, s);
	case 2: return ln_launch_nch<2, KIND>(x, s);
	case 3: return ln_launch_nch<3, KIND>(x, s);
	case 4: return ln_launch_nch<4, KIND>(x, s);
	case 5: return ln_launch_nch<5, KIND>(x, s);
	case 6: return ln_launch_nch<6, KIND>(x, s);
	case 7: return ln_launch_nch<7, KIND>(x, s);
	case 8: return ln_launch_nch<8, KIND>(x, s);
	default: break;
	}
	if (nch <= 12)
		return ln_launch_nch<12, KIND>(x, s);
	return ln_launch_nch<16, KIND>(x, s);
}

extern "C" enum ng_status ng_layernorm_fwd(ng_bf16 *out, float *mean, float *rstd,
					   const ng_bf16 *inp, const ng_bf16 *w, const ng_bf16 *b,
					   int N, int C, cudaStream_t s)
{
	enum ng_status st = check_args("ng_layernorm_fwd", N, C, out, inp, w, b, out, inp);
	if (st)
		return st;
	struct ln_args x = {};
	x.out = (__nv_bfloat16 *)out;
	x.mean = mean;
	x.rstd = rstd;
	x.a = (const __nv_bfloat16 *)inp;
	x.w = (const __nv_bfloat16 *)w;
	x.bias = (const __nv_bfloat16 *)b;
	x.N = N;
	x.C = C;
	return ln_launch<0>(&x, s);
}

extern "C" enum ng_status ng_residual_layernorm_fwd(ng_bf16 *resid, ng_bf16 *out, float *mean,
						    float *rstd, const ng_bf16 *a,
						    const ng_bf16 *b, const ng_bf16 *w,
						    const ng_bf16 *bias, int N, int C,
						    cudaStream_t s)
{
	enum ng_status st =
		check_args("ng_residual_layernorm_fwd", N, C, resid, out, a, b, w, bias);
	if (st)
		return st;
	struct ln_args x = {};
	x.resid = (__nv_bfloat16 *)resid;
	x.out = (__nv_bfloat16 *)out;
	x.mean = mean;
	x.rstd = rstd;
	x.a = (const __nv_bfloat16 *)a;
	x.b = (const __nv_bfloat16 *)b;
	x.w = (const __nv_bfloat16 *)w;
	x.bias = (const __nv_bfloat16 *)bias;
	x.N = N;
	x.C = C;
	return ln_launch<1>(&x, s);
}

extern "C" enum ng_status ng_layernorm_bwd(ng_bf16 *dinp, float *dw, float *db,
					   const ng_bf16 *dout, const ng_bf16 *inp,
					   const ng_bf16 *w, const float *mean, const float *rstd,
					   int N, int C, void *scratch, cudaStream_t s)
{
	enum ng_status st = check_args("ng_layernorm_bwd", N, C, dinp, dout, inp, w, scratch, dinp);
	if (st)
		return st;
	int nb = bwd_blocks(N, C);
	struct ln_args x = {};
	x.dinp = (__nv_bfloat16 *)dinp;
	x.part_dw = (float *)scratch;
	x.part_db = x.part_dw + (size_t)nb * C;
	x.dout = (const __nv_bfloat16 *)dout;
	x.a = (const __nv_bfloat16 *)inp;
	x.w = (const __nv_bfloat16 *)w;
	x.cmean = mean;
	x.crstd = rstd;
	x.N = N;
	x.C = C;
	if ((st = ln_launch<2>(&x, s)))
		return st;
	dim3 rgrid((unsigned)((C + NG_WARP - 1) / NG_WARP), 2), rblock(NG_WARP, LN_RED_SLICES);
	layernorm_bwd_reduce_partials<<<rgrid, rblock, 0, s>>>(dw, db, x.part_dw, x.part_db, nb, C);
	return NG_LAUNCH_CHECK("layernorm_bwd_reduce_partials");
}
