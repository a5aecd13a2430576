/*
 * kernels/layernorm.cu — LayerNorm forward (optionally with an E4M3 copy of its output) and
 * backward. The block's residual adds are not here: they are in the epilogues of the attproj and
 * fcproj matmuls (ng_matmul_run_residual), so the forward only reads the residual stream.
 *
 * Forward, layernorm_fwd_warp_per_row<NCH>: one warp per row; lane l owns channels l*8 + 256 j
 * (16-byte loads), j < NCH, so the row lives in registers (C <= 4096, kept as packed bf16 and
 * unpacked in each pass) and all of its loads are in flight at once. Mean, then the variance
 * around that mean (two passes over the registers: no cancellation for large-mean inputs), then
 * the output.
 * Backward, layernorm_bwd_warp_per_row_partials<NCH>: one warp per row (dout, inp, dinp held in
 * registers), rows strided over a fixed number of blocks; each lane accumulates the dw/db
 * partials of its channels in registers over the warp's rows (d24 on an H200: 77.2 us in a graph
 * against 80.2 us for read-modify-writes of a shared-memory row each row), writes them to its
 * warp's shared-memory row once, the block sums its warps in order into scratch, and
 * layernorm_bwd_reduce_partials sums the blocks in order (32 columns x 16 slices per block, so
 * ~C/16 blocks share the work: the one-thread-per-column version ran on C/256 SMs). The grid is
 * exactly one wave on 132 SMs: ln_bwd_blocks_per_sm(NCH) blocks per SM, which the kernel's
 * __launch_bounds__ guarantees registers for (the fixed 528 blocks were 1.33 waves at C = 1600,
 * where 154 registers allowed only 3 blocks per SM). Same bytes every run. Used for C <= 1024.
 * Backward above C = 1024, layernorm_bwd_staged: there the warp per row needs 145 registers
 * (12 warps per SM, its loads in flight only between rows). Instead C/8 threads per block, each
 * owning 8 channels of every row, so the dw/db partials are registers; the block's rows stream
 * through 4 shared-memory stages with cp.async (3 rows in flight while one is processed), one
 * block sum per row; same partials-reduce kernel after it (d48: 91-93 -> 72-77 us).
 * Formulas: dxhat = dout * w; dinp = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
 * References: llm.c layernorm_forward/backward; Ba et al. 2016 "Layer Normalization".
 */
#include <cuda_fp8.h>

#include "kernels/common.cuh"
#include "kernels/fp8.h"

#include "kernels/layernorm.h"

#define LN_EPS 1e-5f
#define LN_MAX_C 4096 /* rows live in registers: 16 chunks of 8 per lane at most */
#define LN_WARPS 4        /* backward: warps (rows in flight) per block */
#define LN_FWD_WARPS 4    /* forward: warps (rows) per block (1, 2 and 8 measured no better) */
#define LN_BWD_SMS 132    /* SMs of an H100/H200: the backward's grid is LN_BWD_SMS times the
                           * blocks per SM of its NCH class, a constant per C (the grid fixes
                           * the summation order, so it must not depend on the device) */
#define LN_RED_SLICES 32  /* partial rows each column of the partials reduction splits into
                           * (16, with one load in flight a thread: ~10 us of the 72.8 us of the
                           * d48 backward on the H200, where ncu timed the staged kernel at 62.3) */
#define LN_BWD_WARP_MAX_C 1024 /* backward: warp per row up to this C, staged above (measured:
                                * staged 71.6-77.2 us vs 91-93 at C = 1600, but 129-131 vs
                                * 121-125 at C = 768) */
#define LN_BWD_STAGES 4   /* staged backward: shared-memory stages (3 and 6 measured no better) */
#define LN_MAXW 16        /* warps of a staged block: C/8 threads, C <= 4096 */

/* Chunks of 8 channels each lane holds: lane l owns channels l*8 + 256 j, j < NCH. The row
 * lives in registers, and all of a row's loads are issued before any is used (memory-level
 * parallelism: that is what makes a warp-per-row kernel reach HBM bandwidth). */
template <int NCH>
static __global__ void layernorm_fwd_warp_per_row(__nv_bfloat16 *out, float *mean, float *rstd,
						  const __nv_bfloat16 *a, const __nv_bfloat16 *w,
						  const __nv_bfloat16 *bias, int N, int C,
						  uint8_t *out8, const float *scale8, float *amax8)
{
	int warp = threadIdx.x / NG_WARP, lane = threadIdx.x % NG_WARP;
	int row = blockIdx.x * LN_FWD_WARPS + warp;
	if (row >= N)
		return;
	size_t off = (size_t)row * C;
	struct ng_bf16x8 ra[NCH];
	ng_load_row8_<NCH>(ra, a + off, C, lane);
	float sum = 0.0f;
	/* the row stays packed: ra[j] holds the row, unpacked again in each pass (d48: 36.6-39.3
	 * us over three runs against 39.6-39.8 us with fp32 copies of the row) */
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		int c = lane * 8 + j * NG_WARP * 8;
		if (c >= C)
			continue;
		float x[8];
		ng_unpack8_(x, ra[j]);
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
	float sc8 = out8 ? *scale8 : 0.0f, m8 = 0.0f;
	bool nan8 = false;
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
		struct ng_bf16x8 ob = ng_pack8_(o);
		ng_store8_(out + off + c, ob);
		if (out8) { /* the E4M3 copy of the rounded output, as a cast of `out` would make */
			ng_unpack8_(o, ob);
			uint2 v;
			uint8_t *q = reinterpret_cast<uint8_t *>(&v);
#pragma unroll
			for (int k = 0; k < 8; k++) {
				q[k] = __nv_cvt_float_to_fp8(o[k] * sc8, __NV_SATFINITE, __NV_E4M3);
				nan8 |= o[k] != o[k];
				m8 = fmaxf(m8, fabsf(o[k]));
			}
			*reinterpret_cast<uint2 *>(out8 + off + c) = v;
		}
	}
	if (out8) { /* one atomic per row, spread over NG_FP8_AMAX_SUB cache lines */
		m8 = ng_warp_max_(m8);
		nan8 = __any_sync(0xffffffffu, nan8);
		if (lane == 0)
			atomicMax(reinterpret_cast<unsigned *>(amax8 + (row % NG_FP8_AMAX_SUB) *
									     NG_FP8_AMAX_STRIDE),
				  nan8 ? 0x7fc00000u : __float_as_uint(m8));
	}
	if (lane == 0) {
		if (mean)
			mean[row] = m;
		if (rstd)
			rstd[row] = rs;
	}
}

/* Blocks per SM the backward is built for (registers via __launch_bounds__: the partials take
 * 16 NCH of them, the row 12 NCH; shared memory 4 warps x 2 x C x 4 bytes within 227 KiB). */
static __host__ __device__ constexpr int ln_bwd_blocks_per_sm(int nch)
{
	return nch <= 2 ? 6 : nch <= 3 ? 4 : nch <= 4 ? 3 : nch <= 12 ? 2 : 1;
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
	float pw[NCH][8], pb[NCH][8]; /* the lane's dw and db partials of its channels */
#pragma unroll
	for (int j = 0; j < NCH; j++)
#pragma unroll
		for (int k = 0; k < 8; k++)
			pw[j][k] = pb[j][k] = 0.0f;
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
#pragma unroll
			for (int k = 0; k < 8; k++) {
				float xh = (x[k] - m) * rs;
				g[k] += (d[k] * wv[k] - s1 - xh * s2) * rs;
				pw[j][k] += d[k] * xh;
				pb[j][k] += d[k];
			}
			ng_store8_(dinp + off + c, ng_pack8_(g));
		}
	}
	/* the warp's partials into its shared-memory rows: a lane's 8 channels are contiguous,
	 * so two 16-byte stores each (scalar stores would be 8-way bank conflicts) */
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		int c = lane * 8 + j * NG_WARP * 8;
		if (c < C) {
			float4 *qw = reinterpret_cast<float4 *>(sdw + c);
			float4 *qb = reinterpret_cast<float4 *>(sdb + c);
			qw[0] = make_float4(pw[j][0], pw[j][1], pw[j][2], pw[j][3]);
			qw[1] = make_float4(pw[j][4], pw[j][5], pw[j][6], pw[j][7]);
			qb[0] = make_float4(pb[j][0], pb[j][1], pb[j][2], pb[j][3]);
			qb[1] = make_float4(pb[j][4], pb[j][5], pb[j][6], pb[j][7]);
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
 * partial rows: slice y takes rows y, y + 32, ... in order (8 rows' loads in flight), then row 0
 * of the block adds the 32 slices in order. Fixed order: deterministic. */
static __global__ void layernorm_bwd_reduce_partials(float *dw, float *db, const float *part_dw,
						     const float *part_db, int nblocks, int C)
{
	__shared__ float sh[LN_RED_SLICES][NG_WARP + 1];
	int c = blockIdx.x * NG_WARP + threadIdx.x;
	const float *part = blockIdx.y == 0 ? part_dw : part_db;
	float acc = 0.0f;
	if (c < C) {
		int k = threadIdx.y;
		for (; k + 7 * LN_RED_SLICES < nblocks; k += 8 * LN_RED_SLICES) {
			float v[8];
#pragma unroll
			for (int u = 0; u < 8; u++)
				v[u] = part[(size_t)(k + u * LN_RED_SLICES) * C + c];
#pragma unroll
			for (int u = 0; u < 8; u++)
				acc += v[u];
		}
		for (; k < nblocks; k += LN_RED_SLICES)
			acc += part[(size_t)k * C + c];
	}
	sh[threadIdx.y][threadIdx.x] = acc;
	__syncthreads();
	if (threadIdx.y != 0 || c >= C)
		return;
	for (int y = 1; y < LN_RED_SLICES; y++)
		acc += sh[y][threadIdx.x];
	float *dst = blockIdx.y == 0 ? dw : db;
	dst[c] += acc;
}

/* 16-byte asynchronous copy global -> shared (cp.async, sm_80+): bytes in flight hold no
 * registers. A thread only ever reads back what it copied itself, so its own wait_group is the
 * only synchronisation the staged rows need. */
static __device__ __forceinline__ void ln_cp16_(void *smem, const void *gmem)
{
	unsigned d = (unsigned)__cvta_generic_to_shared(smem);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem) : "memory");
}
static __device__ __forceinline__ void ln_cp_commit_()
{
	asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int K> static __device__ __forceinline__ void ln_cp_wait_()
{
	asm volatile("cp.async.wait_group %0;\n" ::"n"(K) : "memory");
}

/* (a, b) summed over the block, in every thread: warp butterflies, then the warps' sums in warp
 * order (fixed order). red: LN_MAXW slots that no thread may still be reading. */
static __device__ __forceinline__ float2 ln_block_sum2_(float2 v, float2 *red, int nw)
{
	v = make_float2(ng_warp_sum_(v.x), ng_warp_sum_(v.y));
	if (threadIdx.x % NG_WARP == 0)
		red[threadIdx.x / NG_WARP] = v;
	__syncthreads();
	float2 t = red[0];
	for (int i = 1; i < nw; i++)
		t = make_float2(t.x + red[i].x, t.y + red[i].y);
	return t;
}

/* Backward, staged (C > LN_BWD_WARP_MAX_C): C/8 threads, thread t owns channels 8t..8t+7 of
 * every row, so its dw/db partials stay in registers (no shared-memory accumulation, 64
 * registers instead of 145). Block b owns the rows [N b / grid, N (b + 1) / grid) and streams
 * them (dout, inp, dinp) through S shared-memory stages with cp.async, S - 1 rows in flight
 * while one is processed; one block sum (of the two row reductions) per row. Each block writes
 * one partial row of dw and of db, summed in order by layernorm_bwd_reduce_partials. */
template <int S, int MAXT>
static __global__ void __launch_bounds__(MAXT, 1024 / MAXT)
layernorm_bwd_staged(__nv_bfloat16 *dinp, float *part_dw, float *part_db,
		     const __nv_bfloat16 *dout, const __nv_bfloat16 *inp, const __nv_bfloat16 *w,
		     const float *mean, const float *rstd, int N, int C)
{
	extern __shared__ __align__(16) unsigned char ln_dyn[];
	__nv_bfloat16 *stg = reinterpret_cast<__nv_bfloat16 *>(ln_dyn); /* (S, 3, C) */
	__shared__ float2 red[2][LN_MAXW]; /* by row parity: one block sum per row */
	int nw = blockDim.x / NG_WARP, c = threadIdx.x * 8;
	bool on = c < C;
	int r0 = (int)((long long)N * blockIdx.x / gridDim.x);
	int r1 = (int)((long long)N * (blockIdx.x + 1) / gridDim.x);
	float wv[8], dw[8], db[8];
#pragma unroll
	for (int q = 0; q < 8; q++)
		dw[q] = db[q] = wv[q] = 0.0f;
	if (on)
		ng_unpack8_(wv, ng_load8_(w + c));
#pragma unroll
	for (int s = 0; s < S - 1; s++) {
		int r = r0 + s;
		if (on && r < r1) {
			size_t off = (size_t)r * C + c;
			ln_cp16_(stg + (size_t)(s * 3) * C + c, dout + off);
			ln_cp16_(stg + (size_t)(s * 3 + 1) * C + c, inp + off);
			ln_cp16_(stg + (size_t)(s * 3 + 2) * C + c, dinp + off);
		}
		ln_cp_commit_();
	}
	float m_next = 0.0f, rs_next = 0.0f; /* the next row's statistics, loaded a row ahead */
	if (r0 < r1) {
		m_next = mean[r0];
		rs_next = rstd[r0];
	}
	for (int r = r0, k = 0; r < r1; r++, k++) {
		int rn = r + S - 1, sn = (k + S - 1) % S, sc = k % S;
		if (on && rn < r1) {
			size_t off = (size_t)rn * C + c;
			ln_cp16_(stg + (size_t)(sn * 3) * C + c, dout + off);
			ln_cp16_(stg + (size_t)(sn * 3 + 1) * C + c, inp + off);
			ln_cp16_(stg + (size_t)(sn * 3 + 2) * C + c, dinp + off);
		}
		ln_cp_commit_(); /* empty groups too: the count wait_group relies on */
		float m = m_next, rs = rs_next;
		if (r + 1 < r1) {
			m_next = mean[r + 1];
			rs_next = rstd[r + 1];
		}
		ln_cp_wait_<S - 1>(); /* row r (this thread's part of it) has landed */
		float d[8], x[8];
		float2 sum = make_float2(0.0f, 0.0f);
		const __nv_bfloat16 *st = stg + (size_t)(sc * 3) * C + c;
		if (on) {
			ng_unpack8_(d, *reinterpret_cast<const struct ng_bf16x8 *>(st));
			ng_unpack8_(x, *reinterpret_cast<const struct ng_bf16x8 *>(st + C));
#pragma unroll
			for (int q = 0; q < 8; q++) {
				float xh = (x[q] - m) * rs, dx = d[q] * wv[q];
				sum.x += dx;
				sum.y += dx * xh;
			}
		}
		sum = ln_block_sum2_(sum, red[k & 1], nw);
		float s1 = sum.x / C, s2 = sum.y / C;
		if (on) {
			float g[8];
			ng_unpack8_(g, *reinterpret_cast<const struct ng_bf16x8 *>(st + 2 * C));
#pragma unroll
			for (int q = 0; q < 8; q++) {
				float xh = (x[q] - m) * rs;
				g[q] += (d[q] * wv[q] - s1 - xh * s2) * rs;
				dw[q] += d[q] * xh;
				db[q] += d[q];
			}
			ng_store8_(dinp + (size_t)r * C + c, ng_pack8_(g));
		}
	}
	if (on) {
		float4 *pw = reinterpret_cast<float4 *>(part_dw + (size_t)blockIdx.x * C + c);
		float4 *pb = reinterpret_cast<float4 *>(part_db + (size_t)blockIdx.x * C + c);
		pw[0] = make_float4(dw[0], dw[1], dw[2], dw[3]);
		pw[1] = make_float4(dw[4], dw[5], dw[6], dw[7]);
		pb[0] = make_float4(db[0], db[1], db[2], db[3]);
		pb[1] = make_float4(db[4], db[5], db[6], db[7]);
	}
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

static int bwd_is_staged(int C) { return C > LN_BWD_WARP_MAX_C; }

/* The staged backward: C/8 threads rounded up to a warp; its __launch_bounds__ class (256 or
 * 512 threads) guarantees 64 registers a thread. */
static int staged_threads(int C) { return ((C / 8 + NG_WARP - 1) / NG_WARP) * NG_WARP; }
static size_t staged_smem(int S, int nin, int C) { return (size_t)S * nin * C * 2; }

/* Blocks per SM of a staged kernel on an H100/H200, from C alone (threads, 64 registers a
 * thread, shared memory): the backward's grid, which fixes its summation order. */
static int staged_per_sm(int C, size_t smem)
{
	int t = staged_threads(C), per = 2048 / t;
	if (per > 65536 / (t * 64))
		per = 65536 / (t * 64);
	int fit = (int)((227 * 1024) / (smem + 1024 + 256));
	if (per > fit)
		per = fit;
	if (per > 32)
		per = 32;
	return per < 1 ? 1 : per;
}

/* At most one wave, and as many rows in every block: ceil(N / cap) rows a block, so no block
 * runs a row longer than the others (d48: 512 blocks of 32 rows, not 528 of 31 or 32). */
static int bwd_staged_blocks(int N, int C)
{
	int cap = LN_BWD_SMS * staged_per_sm(C, staged_smem(LN_BWD_STAGES, 3, C));
	if (N <= cap)
		return N;
	int rows = (N + cap - 1) / cap;
	return (N + rows - 1) / rows;
}

static int bwd_nblocks(int N, int C)
{
	return bwd_is_staged(C) ? bwd_staged_blocks(N, C) : bwd_blocks(N, C);
}

extern "C" size_t ng_layernorm_bwd_scratch_bytes(int N, int C)
{
	if (N <= 0 || C <= 0)
		return 0;
	return 2 * (size_t)bwd_nblocks(N, C) * C * sizeof(float);
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
	__nv_bfloat16 *out, *dinp;                 /* outputs (bf16) */
	float *mean, *rstd, *part_dw, *part_db;    /* statistics / partials (fp32) */
	const __nv_bfloat16 *a, *w, *bias, *dout;  /* inputs (bf16): a is the LayerNorm input */
	const float *cmean, *crstd;                /* the forward's statistics (backward) */
	int N, C;                                  /* rows, channels */
	uint8_t *out8;                             /* forward: E4M3 copy of out, or NULL */
	const float *scale8;                       /* its scale (1) */
	float *amax8;                              /* its maximum (NG_FP8_AMAX_FLOATS), max= */
};

/* KIND 0: forward, 1: backward partials. */
template <int NCH, int KIND>
static enum ng_status ln_launch_nch(const struct ln_args *x, cudaStream_t s)
{
	if (KIND == 1) {
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
	layernorm_fwd_warp_per_row<NCH><<<grid, LN_FWD_WARPS * NG_WARP, 0, s>>>(
		x->out, x->mean, x->rstd, x->a, x->w, x->bias, x->N, x->C, x->out8, x->scale8,
		x->amax8);
	return NG_LAUNCH_CHECK("layernorm_fwd_warp_per_row");
}

/* The launch at the smallest instantiated NCH >= C / 256 (C <= LN_MAX_C, checked by the
 * caller). */
template <int KIND> struct ln_launcher {
	const struct ln_args *x;
	cudaStream_t s;
	template <int NCH> enum ng_status run() const { return ln_launch_nch<NCH, KIND>(x, s); }
};
template <int KIND>
static enum ng_status ln_launch(const struct ln_args *x, cudaStream_t s)
{
	return ng_nch_dispatch_(nch_of(x->C), ln_launcher<KIND>{x, s});
}

/* The staged backward at thread class MAXT. */
template <int MAXT>
static enum ng_status ln_launch_bwd_staged_t(const struct ln_args *x, cudaStream_t s)
{
	int C = x->C;
	size_t smem = staged_smem(LN_BWD_STAGES, 3, C);
	auto k = layernorm_bwd_staged<LN_BWD_STAGES, MAXT>;
	enum ng_status st = ng_ensure_smem_(k, smem);
	if (st)
		return st;
	k<<<bwd_staged_blocks(x->N, C), staged_threads(C), smem, s>>>(
		x->dinp, x->part_dw, x->part_db, x->dout, x->a, x->w, x->cmean, x->crstd, x->N, C);
	return NG_LAUNCH_CHECK("layernorm_bwd_staged");
}

/* The backward's partials: warp per row up to LN_BWD_WARP_MAX_C, staged above. */
static enum ng_status ln_launch_bwd(const struct ln_args *x, cudaStream_t s)
{
	if (!bwd_is_staged(x->C))
		return ln_launch<1>(x, s);
	if (staged_threads(x->C) <= 256)
		return ln_launch_bwd_staged_t<256>(x, s);
	return ln_launch_bwd_staged_t<512>(x, s);
}

static enum ng_status check_fp8(const char *who, const uint8_t *out8, const float *scale8,
				const float *amax8)
{
	if (out8 && ((uintptr_t)out8 % 8 || !scale8 || !amax8))
		return ng_check_arg_fail(who, "the E4M3 output (%p) must be 8-byte aligned, with a "
					 "scale and maxima", (const void *)out8);
	return NG_OK;
}

extern "C" enum ng_status ng_layernorm_fwd_fp8(ng_bf16 *out, uint8_t *out8, const float *scale8,
					       float *amax8, float *mean, float *rstd,
					       const ng_bf16 *inp, const ng_bf16 *w,
					       const ng_bf16 *b, int N, int C, cudaStream_t s)
{
	enum ng_status st = check_args("ng_layernorm_fwd", N, C, out, inp, w, b, out, inp);
	if (!st)
		st = check_fp8("ng_layernorm_fwd", out8, scale8, amax8);
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
	x.out8 = out8;
	x.scale8 = scale8;
	x.amax8 = amax8;
	return ln_launch<0>(&x, s);
}

extern "C" enum ng_status ng_layernorm_fwd(ng_bf16 *out, float *mean, float *rstd,
					   const ng_bf16 *inp, const ng_bf16 *w, const ng_bf16 *b,
					   int N, int C, cudaStream_t s)
{
	return ng_layernorm_fwd_fp8(out, NULL, NULL, NULL, mean, rstd, inp, w, b, N, C, s);
}

extern "C" enum ng_status ng_layernorm_bwd(ng_bf16 *dinp, float *dw, float *db,
					   const ng_bf16 *dout, const ng_bf16 *inp,
					   const ng_bf16 *w, const float *mean, const float *rstd,
					   int N, int C, void *scratch, cudaStream_t s)
{
	enum ng_status st = check_args("ng_layernorm_bwd", N, C, dinp, dout, inp, w, scratch, dinp);
	if (st)
		return st;
	int nb = bwd_nblocks(N, C);
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
	if ((st = ln_launch_bwd(&x, s)))
		return st;
	dim3 rgrid((unsigned)((C + NG_WARP - 1) / NG_WARP), 2), rblock(NG_WARP, LN_RED_SLICES);
	layernorm_bwd_reduce_partials<<<rgrid, rblock, 0, s>>>(dw, db, x.part_dw, x.part_db, nb, C);
	return NG_LAUNCH_CHECK("layernorm_bwd_reduce_partials");
}
