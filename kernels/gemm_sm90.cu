/*
 * kernels/gemm_sm90.cu — the Hopper GEMM of gemm_sm90.h: TMA loads into a ring of shared-memory
 * stages, wgmma in two consumer warpgroups that take alternate tiles ("ping-pong": one writes its
 * epilogue while the other multiplies), a persistent grid.
 *
 * References (facts, not code): PTX ISA 8.x, "wgmma.mma_async" (shared-memory matrix
 * descriptor: start address, leading/stride byte offsets, swizzle mode; the accumulator
 * fragment layout), "cp.async.bulk.tensor", "mbarrier", "setmaxnreg"; CUDA driver API
 * cuTensorMapEncodeTiled. The ping-pong schedule is the one CUTLASS names
 * KernelTmaWarpSpecializedPingpong.
 *
 * Shared memory of a stage: A (WM rows x 64 bf16) then W (BN rows x 64 bf16), each row 128
 * bytes, rows swizzled in groups of 8 (1024 bytes) by the copy engine's 128-byte mode, which is
 * the layout wgmma's K-major 128-byte-swizzle descriptor reads (stride between 8-row groups
 * 1024 bytes; the k = 16 slices start 32 bytes apart inside the swizzled row).
 *
 * The ring: position p = (tile's index among the block's tiles) * kblocks + kb; stage p % S,
 * phase (p / S) & 1. full[s] completes when the stage's bytes have landed (one arrive with the
 * byte count, then the copy engine's transactions); empty[s] when the 128 threads of the
 * warpgroup that read it have finished the wgmma that read it. The consumers' mainloops take
 * turns (named barriers 1 and 2), so neither waits on a stage two phases ahead.
 *
 * Shared memory: the ring, then each consumer's epilogue units, then the barriers (apart from
 * the units: an epilogue row written over a barrier passes every test and is wrong all the
 * same).
 *
 * The DGELU epilogues (ng_gemm_sm90_dgelu): at a tile's start one consumer thread waits until
 * its previous tile's stores have read their units, then has the copy engine load the tile's
 * pre-activation into 4 units (a 64 x 64 box each, the store's swizzle) on a barrier of its own,
 * while the mainloop runs; the epilogue waits on that barrier, reads a whole unit of
 * pre-activations (ldmatrix) before it writes the gradient over them (stmatrix; a warp touches
 * only its own rows, so no barrier between the two), and stores the unit; post goes through 2
 * more units. Reading the whole unit first matters: with a load and a store a pair, the compiler
 * kept each pair's load behind the previous pair's store, and the epilogue ran ~1.5x its
 * mainloop's time.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/check.h"
#include "kernels/common.cuh"
#include "kernels/gemm_sm90.h"

#define GM_BK 64          /* k of a stage: one 128-byte swizzled row of bf16 */
#define GM_THREADS 384    /* the producer warpgroup and two consumer warpgroups */
#define GM_SMEM_MAX (227 * 1024) /* dynamic shared memory a block may have on sm_90 */
#define GM_UNIT 8192      /* an epilogue unit: 64 rows x 64 bf16, 128-byte swizzled, one store box */
#define GM_WM 128         /* rows of a consumer's tile */
#define GM_BN 128         /* columns of a tile */

/* The epilogues: EPI_PLAIN out = acc (+ bias); EPI_GELU aux = acc + bias, out = GELU(aux);
 * EPI_DGELU out = acc * GELU'(pre), the pre-activation read from the aux matrix; EPI_DGELU_POST
 * that and post = GELU(pre) as well (the activation --recompute gelu needs); EPI_RELU2 out =
 * max(acc, 0)^2 (the speedrun model's MLP, whose pre-activation is then never stored). */
enum { EPI_PLAIN = 0, EPI_GELU = 1, EPI_DGELU = 2, EPI_DGELU_POST = 3, EPI_RELU2 = 4 };

/* Does the epilogue read a matrix of the output's shape (aux) into its units? */
static constexpr bool gm_reads_aux_(int epi) { return epi == EPI_DGELU || epi == EPI_DGELU_POST; }

/* Does the epilogue write one output from the accumulator alone (no aux, no second output)? */
static constexpr bool gm_one_out_(int epi) { return epi == EPI_PLAIN || epi == EPI_RELU2; }

/* A consumer cycles through its own epilogue units, a tile's output's worth (4): without GELU
 * the copy engine has a whole mainloop to read a unit before it is written again; with GELU
 * (two outputs) the second output's units wait for the first's stores. The ring takes what
 * shared memory is left, up to 4 stages. Measured on the H200 (bench_gemm, one
 * machine per run so only roughly): 4 stages and 4 units ran 2-7% closer to cuBLASLt than 5
 * stages, or 4 stages with 6 units for GELU; 3 stages with 8 units was no better.
 * DGELU: a consumer loads its tile's pre-activation whole into PRE_UNITS units while it
 * multiplies, and writes the gradient over it in place; post cycles through GU more units. */
template <int EPI, int GU = 4> struct gm_cfg {
	static constexpr int WM = GM_WM, BN = GM_BN;
	static constexpr int A_BYTES = WM * GM_BK * 2;
	static constexpr int STAGE_BYTES = (WM + BN) * GM_BK * 2;
	static constexpr int TILE_UNITS = (WM / 64) * (BN / 64);
	static constexpr int UNITS = gm_one_out_(EPI)                         ? TILE_UNITS
				     : EPI == EPI_DGELU                      ? 0
									     : GU;
	static constexpr int PRE_UNITS = gm_reads_aux_(EPI) ? TILE_UNITS : 0;
	static constexpr int UNIT_BYTES = 2 * (PRE_UNITS + UNITS) * GM_UNIT;
	static constexpr int FIT = (GM_SMEM_MAX - 1024 - 256 - UNIT_BYTES) / STAGE_BYTES;
	static constexpr int STAGES = FIT > 4 ? 4 : FIT;
	static constexpr int RING = STAGES * STAGE_BYTES;
	/* the ring, each consumer's epilogue units, the barriers (full and empty a stage, one
	 * pre-activation barrier a consumer), 1024 bytes to align the ring */
	static constexpr int BARS = RING + UNIT_BYTES;
	static constexpr int SMEM = BARS + 2 * STAGES * 8 + 2 * 8 + 1024;
	static_assert(STAGES >= 2, "the ring needs two stages");
	static_assert(SMEM <= GM_SMEM_MAX, "shared memory");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GM_SM90A 1
#endif

#ifdef GM_SM90A
static __device__ __forceinline__ uint32_t smem_u32_(const void *p)
{
	return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void mbar_init_(uint64_t *bar, unsigned count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32_(bar)), "r"(count));
}

static __device__ __forceinline__ void mbar_expect_tx_(uint64_t *bar, unsigned bytes)
{
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32_(bar)),
		     "r"(bytes) : "memory");
}

static __device__ __forceinline__ void mbar_arrive_(uint64_t *bar)
{
	asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32_(bar)) : "memory");
}

static __device__ __forceinline__ void mbar_wait_(uint64_t *bar, unsigned parity)
{
	uint32_t done = 0;
	while (!done)
		asm volatile("{\n.reg .pred p;\n"
			     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
			     "selp.u32 %0, 1, 0, p;\n}\n"
			     : "=r"(done) : "r"(smem_u32_(bar)), "r"(parity) : "memory");
}

/* One 2-D box of the tensor map into shared memory; completes on bar. c0 is the inner (k)
 * coordinate, c1 the row. */
static __device__ __forceinline__ void tma_load_(void *dst, const CUtensorMap *map, int c0, int c1,
						 uint64_t *bar)
{
	asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
		     " [%0], [%1, {%2, %3}], [%4];"
		     ::"r"(smem_u32_(dst)), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(smem_u32_(bar))
		     : "memory");
}

/* One 64 x 64 box from shared memory to the tensor map's matrix at (c0 = column, c1 = row);
 * the copy engine skips what lies past the matrix's edges. */
static __device__ __forceinline__ void tma_store_(const CUtensorMap *map, const void *src, int c0,
						  int c1)
{
	asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
		     ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(smem_u32_(src)) : "memory");
}
static __device__ __forceinline__ void bulk_commit_(void)
{
	asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
/* until at most N of this thread's store groups still read shared memory */
template <int N> static __device__ __forceinline__ void bulk_wait_read_(void)
{
	asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
static __device__ __forceinline__ void bulk_wait_all_(void)
{
	asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
/* ordinary shared-memory stores, then read by the copy engine */
static __device__ __forceinline__ void fence_async_smem_(void)
{
	asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
/* a barrier of one warpgroup (ids 3 and 4) */
static __device__ __forceinline__ void wg_sync_(int id)
{
	asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

/* The shared-memory address, in an epilogue unit, of the 16-byte row that this lane names for
 * ldmatrix / stmatrix .x4 over 8-column blocks jj0 and jj0 + 1 of the warp's 16 rows: lanes
 * 8m..8m+7 name the 8 rows of matrix m = (block jj0 + m / 2, row half m % 2). Register m of a
 * lane is then its pair (row warp*16 + lane/4 + 8 (m % 2), columns 8 (jj0 + m / 2) + 2 (lane % 4)),
 * the accumulator's layout: one instruction moves four of a thread's pairs. */
static __device__ __forceinline__ uint32_t unit_row_(uint32_t unit, int warp, int lane, int jj0)
{
	const int m = lane / 8, r = warp * 16 + 8 * (m % 2) + lane % 8;
	return unit + r * 128 + (((jj0 + m / 2) ^ (r & 7)) << 4);
}
static __device__ __forceinline__ void ldsm_x4_(uint32_t addr, uint32_t *v)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
		     : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(addr));
}
static __device__ __forceinline__ void stsm_x4_(uint32_t addr, const uint32_t *v)
{
	asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
		     ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
}
static __device__ __forceinline__ uint32_t pack_bf16x2_(float lo, float hi)
{
	const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
	return *reinterpret_cast<const uint32_t *>(&p);
}
static __device__ __forceinline__ float2 unpack_bf16x2_(uint32_t v)
{
	return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

/* wgmma's shared-memory descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart. */
static __device__ __forceinline__ uint64_t desc_(uint32_t saddr)
{
	return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) |
	       ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

/* Named barriers 1 and 2 (0 is __syncthreads'), between the two consumer warpgroups: one
 * arrives (not waiting), the other syncs; 256 threads complete it. */
static __device__ __forceinline__ void named_sync_(int id)
{
	asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory");
}
static __device__ __forceinline__ void named_arrive_(int id)
{
	asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory");
}

static __device__ __forceinline__ void wgmma_fence_(void)
{
	asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
static __device__ __forceinline__ void wgmma_commit_(void)
{
	asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> static __device__ __forceinline__ void wgmma_wait_(void)
{
	asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* d (64 x 128 fp32, wgmma's accumulator layout) = (acc ? d : 0) + A (64 x 16) B (128 x 16)^T;
 * A and B bf16 in shared memory, K-major, 128-byte swizzle. Generated text: 64 operands. */
static __device__ __forceinline__ void wgmma_n128_(float *d, uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
		     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
		     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
		     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
		     "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
		     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
		       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
		       "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
		       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
		       "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
		       "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
		       "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
		       "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
		     : "l"(da), "l"(db), "r"(acc));
}

#endif /* GM_SM90A */

template <int EPI, int GU = 4>
static __global__ void __launch_bounds__(GM_THREADS, 1)
gm_fwd_(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tw,
	const __grid_constant__ CUtensorMap tout, const __grid_constant__ CUtensorMap taux,
	const __grid_constant__ CUtensorMap tpost, const __nv_bfloat16 *bias, float *part, int M,
	int N, int K)
{
#ifdef GM_SM90A
	typedef gm_cfg<EPI, GU> C;
	constexpr int S = C::STAGES, WM = GM_WM, BN = GM_BN;
	extern __shared__ unsigned char smem_raw_[];
	unsigned char *ring = (unsigned char *)(((uintptr_t)smem_raw_ + 1023) & ~(uintptr_t)1023);
	uint64_t *full = (uint64_t *)(ring + C::BARS), *empty = full + S, *prebar = empty + S;
	const uint32_t ring_s = smem_u32_(ring); /* the ring's shared-memory address */
	/* Tiles in row-major order: tile st covers rows (st / tiles_n) WM and columns
	 * (st % tiles_n) BN; block b takes tiles b, b + grid, b + 2 grid, ... */
	const int tiles_n = (N + BN - 1) / BN, tiles_m = (M + WM - 1) / WM;
	const int stiles = tiles_m * tiles_n;
	const int cid = blockIdx.x, ncl = gridDim.x;
	const int kbs = (K + GM_BK - 1) / GM_BK;
	/* The warpgroup through a shuffle from lane 0: the compiler then knows it is the same in
	 * every lane, so the tile and stage indices derived from it, the stage addresses and the
	 * wgmma descriptors live in uniform registers; from threadIdx.x directly it built each
	 * descriptor in ordinary registers and moved it over: ~130 instructions a warp a stage,
	 * and 69.2 M for d24's qkv forward against 39.6 M with the shuffle (ncu). */
	const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0), t = threadIdx.x % 128;

	if (threadIdx.x == 0) {
		/* the descriptors into the cache while the barriers are made */
		const CUtensorMap *maps[5] = { &ta, &tw, &tout, &taux, &tpost };
		for (int i = 0; i < (gm_one_out_(EPI) ? 3 : EPI == EPI_DGELU_POST ? 5 : 4); i++)
			asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)maps[i]) : "memory");
		for (int s = 0; s < S; s++) {
			mbar_init_(&full[s], 1);
			mbar_init_(&empty[s], 128); /* every thread of the consumer that read it */
		}
		mbar_init_(&prebar[0], 1);
		mbar_init_(&prebar[1], 1);
		asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
	}
	__syncthreads();

	if (wg == 0) { /* the producer: one thread issues every load */
		asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
		if (t == 0) {
			int p = 0;
			for (int st = cid; st < stiles; st += ncl) {
				const int m0 = st / tiles_n * WM, n0 = st % tiles_n * BN;
				for (int kb = 0; kb < kbs; kb++, p++) {
					const int s = p % S;
					mbar_wait_(&empty[s], ((p / S) & 1) ^ 1);
					mbar_expect_tx_(&full[s], C::STAGE_BYTES);
					unsigned char *a = ring + s * C::STAGE_BYTES;
					tma_load_(a, &ta, kb * GM_BK, m0, &full[s]);
					tma_load_(a + C::A_BYTES, &tw, kb * GM_BK, n0, &full[s]);
				}
			}
		}
	} else { /* a consumer: every other tile of the block */
		asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
		const int c = wg - 1, warp = t / 32, lane = t % 32;
		float d[WM / 64][BN / 2];
		/* this consumer's units: the pre-activation's (DGELU), then the cycling ones */
		unsigned char *pre = ring + C::RING + c * (C::PRE_UNITS + C::UNITS) * GM_UNIT;
		unsigned char *units = pre + C::PRE_UNITS * GM_UNIT;
		int local = c, unit = 0;
		for (int st = cid + c * ncl; st < stiles; st += 2 * ncl, local += 2) {
			const int m0 = st / tiles_n * WM, n0 = st % tiles_n * BN;
			const int p0 = local * kbs;
			if (gm_reads_aux_(EPI) && t == 0) {
				/* the tile's pre-activation, landing while the mainloop runs, into
				 * units the previous tile's stores must have finished reading */
				bulk_wait_read_<0>();
				mbar_expect_tx_(&prebar[c], C::PRE_UNITS * GM_UNIT);
#pragma unroll
				for (int h = 0; h < WM / 64; h++)
#pragma unroll
					for (int b = 0; b < BN / 64; b++)
						tma_load_(pre + (h * (BN / 64) + b) * GM_UNIT, &taux,
							  n0 + 64 * b, m0 + 64 * h, &prebar[c]);
			}
			/* Ping-pong order: this mainloop starts once the other consumer's previous one
			 * has made all its waits. Without it this warpgroup would wait on a stage two
			 * phases ahead, and a phase parity cannot tell the two apart. */
			if (local > 0)
				named_sync_(1 + c);
			for (int kb = 0; kb < kbs; kb++) {
				const int p = p0 + kb, s = p % S;
				mbar_wait_(&full[s], (p / S) & 1);
				const uint32_t a = ring_s + s * C::STAGE_BYTES, w = a + C::A_BYTES;
				/* the stage's two descriptors once; each k16 slice and row half adds its
				 * offset / 16 to the start-address field (bits 0-13: shared memory stays
				 * under 256 KiB, so no carry leaves it) */
				const uint64_t da0 = desc_(a), dw0 = desc_(w);
				wgmma_fence_();
#pragma unroll
				for (int k = 0; k < GM_BK / 16; k++) {
#pragma unroll
					for (int h = 0; h < WM / 64; h++) {
						const uint64_t da = da0 + (uint64_t)((h * 64 * 128 + k * 32) >> 4);
						const uint64_t dw = dw0 + (uint64_t)((k * 32) >> 4);
						wgmma_n128_(d[h], da, dw, kb > 0 || k > 0);
					}
				}
				wgmma_commit_();
				if (kb > 0) { /* the previous stage's wgmma is done: release it */
					wgmma_wait_<1>();
					mbar_arrive_(&empty[(p - 1) % S]);
				}
			}
			wgmma_wait_<0>();
			mbar_arrive_(&empty[(p0 + kbs - 1) % S]);
			if (st + ncl < stiles) /* the block's next tile is the other's */
				named_arrive_(2 - c);

			/* Epilogue, one 64 x 64 unit at a time: thread (warp, lane) holds rows
			 * warp*16 + lane/4 (+8) of each 64-row half and columns 8j + 2(lane%4) (+1)
			 * of each 8-column block j. It writes them into a unit in the copy engine's
			 * 128-byte swizzle (the 16-byte chunk j of row r at chunk j ^ (r % 8): the
			 * warp's 8 rows land in 8 different chunks, no bank conflicts), four pairs a
			 * stmatrix (unit_row_), and one thread stores the unit with the copy engine,
			 * which runs on while the next unit is written. */
			if constexpr (gm_reads_aux_(EPI)) {
				/* the gradient over the pre-activation, in place (a warp reads and
				 * writes only its own 16 rows of a unit, and reads them all before it
				 * writes: no barrier between); post into the GU
				 * cycling units, one store group a unit, so the unit GU back is free
				 * once at most GU - 1 groups still read */
				mbar_wait_(&prebar[c], (local >> 1) & 1);
#pragma unroll
				for (int b = 0; b < BN / 64; b++) {
					float cs[8][2]; /* part: this thread's column sums of the unit column */
#pragma unroll
					for (int jj = 0; jj < 8; jj++)
						cs[jj][0] = cs[jj][1] = 0.0f;
#pragma unroll
					for (int h = 0; h < WM / 64; h++, unit++) {
						unsigned char *u = pre + (h * (BN / 64) + b) * GM_UNIT;
						unsigned char *v = units + (unit % GU) * GM_UNIT;
						/* the unit's pre-activation, all of it before any store (in
						 * place), four pairs an ldmatrix: [jj][e] = row half e of
						 * 8-column block jj */
						const uint32_t us = smem_u32_(u), vs = smem_u32_(v);
						uint32_t px[8][2];
#pragma unroll
						for (int q = 0; q < 4; q++) {
							uint32_t r4[4];
							ldsm_x4_(unit_row_(us, warp, lane, 2 * q), r4);
							px[2 * q][0] = r4[0], px[2 * q][1] = r4[1];
							px[2 * q + 1][0] = r4[2], px[2 * q + 1][1] = r4[3];
						}
						if (EPI == EPI_DGELU_POST) {
							if (t == 0)
								bulk_wait_read_<GU - 1>();
							wg_sync_(3 + c);
						}
						uint32_t dq[8][2], gq[8][2];
#pragma unroll
						for (int jj = 0; jj < 8; jj++) {
							const int j = 8 * b + jj;
#pragma unroll
							for (int e = 0; e < 2; e++) {
								const float2 x = unpack_bf16x2_(px[jj][e]);
								float g0, g1;
								const float d0 = ng_gelu_grad_value_f(x.x, &g0);
								const float d1 = ng_gelu_grad_value_f(x.y, &g1);
								dq[jj][e] = pack_bf16x2_(d[h][4 * j + 2 * e] * d0,
											 d[h][4 * j + 2 * e + 1] * d1);
								const float2 dr = unpack_bf16x2_(dq[jj][e]);
								cs[jj][0] += dr.x; /* the stored values */
								cs[jj][1] += dr.y;
								if (EPI == EPI_DGELU_POST)
									gq[jj][e] = pack_bf16x2_(g0, g1);
							}
						}
#pragma unroll
						for (int q = 0; q < 4; q++) {
							const uint32_t r4[4] = { dq[2 * q][0], dq[2 * q][1],
										 dq[2 * q + 1][0], dq[2 * q + 1][1] };
							stsm_x4_(unit_row_(us, warp, lane, 2 * q), r4);
						}
						if (EPI == EPI_DGELU_POST)
#pragma unroll
							for (int q = 0; q < 4; q++) {
								const uint32_t r4[4] = { gq[2 * q][0], gq[2 * q][1],
											 gq[2 * q + 1][0],
											 gq[2 * q + 1][1] };
								stsm_x4_(unit_row_(vs, warp, lane, 2 * q), r4);
							}
						fence_async_smem_();
						wg_sync_(3 + c);
						if (t == 0) {
							tma_store_(&tout, u, n0 + 64 * b, m0 + 64 * h);
							if (EPI == EPI_DGELU_POST)
								tma_store_(&tpost, v, n0 + 64 * b, m0 + 64 * h);
							bulk_commit_();
						}
					}
					/* m0 < M holds for every tile; the test keeps the epilogue compiled as
					 * it was measured */
					if (part && m0 < M) {
						/* the warp's rows of each column: lanes that share lane % 4
						 * share columns; their butterfly sum, written by lanes 0-3 as
						 * partial row (tile row) * 4 + warp of part (fixed order, no
						 * atomics) */
#pragma unroll
						for (int jj = 0; jj < 8; jj++)
#pragma unroll
							for (int q = 0; q < 2; q++)
#pragma unroll
								for (int x = 4; x < 32; x <<= 1)
									cs[jj][q] += __shfl_xor_sync(0xffffffffu,
												     cs[jj][q], x);
						const int row = (m0 / WM) * 4 + warp;
						if (lane < 4)
#pragma unroll
							for (int jj = 0; jj < 8; jj++) {
								const int col = n0 + 64 * b + 8 * jj + 2 * lane;
								if (col < N)
									*reinterpret_cast<float2 *>(
										part + (size_t)row * N + col) =
										make_float2(cs[jj][0], cs[jj][1]);
							}
					}
				}
			} else {
				/* aux (the pre-activation) first, then GELU of the same fp32 values */
				if (bias) { /* the fp32 pre-activation, in place */
#pragma unroll
					for (int j = 0; j < BN / 8; j++) {
						const int col = n0 + 8 * j + 2 * (lane % 4);
						float2 bb = make_float2(0.0f, 0.0f);
						if (col < N)
							bb = __bfloat1622float2(
								*reinterpret_cast<const __nv_bfloat162 *>(bias + col));
#pragma unroll
						for (int h = 0; h < WM / 64; h++) {
							d[h][4 * j] += bb.x;
							d[h][4 * j + 1] += bb.y;
							d[h][4 * j + 2] += bb.x;
							d[h][4 * j + 3] += bb.y;
						}
					}
				}
#pragma unroll
				for (int o = 0; o < (EPI == EPI_GELU ? 2 : 1); o++) {
#pragma unroll
					for (int h = 0; h < WM / 64; h++) {
#pragma unroll
						for (int b = 0; b < BN / 64; b++, unit++) {
							unsigned char *u = units + (unit % C::UNITS) * GM_UNIT;
							if (t == 0) /* the store that last read u is done with it */
								bulk_wait_read_<C::UNITS - 1>();
							wg_sync_(3 + c);
#pragma unroll
							for (int q = 0; q < 4; q++) { /* blocks 2q, 2q + 1 */
								uint32_t r4[4];
#pragma unroll
								for (int m = 0; m < 4; m++) {
									const int j = 8 * b + 2 * q + m / 2, e = m % 2;
									float x0 = d[h][4 * j + 2 * e];
									float x1 = d[h][4 * j + 2 * e + 1];
									if (EPI == EPI_GELU && o == 1) {
										x0 = ng_gelu_f(x0);
										x1 = ng_gelu_f(x1);
									}
									if (EPI == EPI_RELU2) { /* NaN stays NaN */
										x0 = x0 < 0.0f ? 0.0f : x0 * x0;
										x1 = x1 < 0.0f ? 0.0f : x1 * x1;
									}
									r4[m] = pack_bf16x2_(x0, x1);
								}
								stsm_x4_(unit_row_(smem_u32_(u), warp, lane, 2 * q),
									 r4);
							}
							fence_async_smem_();
							wg_sync_(3 + c);
							if (t == 0) {
								tma_store_(EPI == EPI_GELU && o == 0 ? &taux : &tout, u,
									   n0 + 64 * b, m0 + 64 * h);
								bulk_commit_();
							}
						}
					}
				}
			}
		}
		if (t == 0)
			bulk_wait_all_();
	}
#endif
}

/* ---- host side ---- */

static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled_;

static enum ng_status encode_init_(void)
{
	if (encode_tiled_)
		return NG_OK;
	void *fn = NULL;
	cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
	if (NG_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
							   cudaEnableDefault, &q)))
		return NG_ERR_RUNTIME;
	if (q != cudaDriverEntryPointSuccess || !fn)
		return ng_fail(NG_ERR_RUNTIME, "ng_gemm_sm90: the driver has no "
			       "cuTensorMapEncodeTiled (query result %d)", (int)q);
	encode_tiled_ = (PFN_cuTensorMapEncodeTiled_v12000)fn;
	return NG_OK;
}

/* A row-major (rows, K) bf16 matrix as boxes of box_rows x 64 with the 128-byte swizzle. */
static enum ng_status encode_(CUtensorMap *map, const void *p, int rows, int K, int box_rows)
{
	cuuint64_t dim[2] = { (cuuint64_t)K, (cuuint64_t)rows };
	cuuint64_t stride[1] = { (cuuint64_t)K * 2 };
	cuuint32_t box[2] = { 64, (cuuint32_t)box_rows };
	cuuint32_t elem[2] = { 1, 1 };
	CUresult r = encode_tiled_(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)p, dim, stride,
				   box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
				   CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
				   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
	if (r != CUDA_SUCCESS)
		return ng_fail(NG_ERR_RUNTIME, "ng_gemm_sm90: cuTensorMapEncodeTiled failed (%d) for "
			       "a %d x %d matrix at %p", (int)r, rows, K, p);
	return NG_OK;
}

static int device_sm90_(int *sms)
{
	int dev = 0, major = 0, minor = 0;
	if (cudaGetDevice(&dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
		cudaGetLastError();
		return 0;
	}
	return major == 9 && minor == 0;
}

/* Was the kernel built with sm_90a machine code? (a build without that target has no wgmma:
 * the kernel body would be empty) */
static int built_sm90a_(void)
{
	cudaFuncAttributes fa;
	if (cudaFuncGetAttributes(&fa, gm_fwd_<EPI_GELU>) != cudaSuccess) {
		cudaGetLastError();
		return 0;
	}
	return fa.binaryVersion == 90;
}

extern "C" int ng_gemm_sm90_available(void)
{
	int sms = 0;
	return device_sm90_(&sms) && built_sm90a_();
}

/* One kernel of the epilogue asked for: a persistent grid of one block an SM, or one a tile
 * when there are fewer tiles. */
template <int EPI, int GU = 4>
static enum ng_status launch_(const CUtensorMap *ta, const CUtensorMap *tw, const CUtensorMap *to,
			      const CUtensorMap *tx, const CUtensorMap *tp,
			      const __nv_bfloat16 *bias, float *part, int M, int N, int K, int sms,
			      cudaStream_t s)
{
	typedef gm_cfg<EPI, GU> C;
	void (*kernel)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap,
		       const __nv_bfloat16 *, float *, int, int, int) = gm_fwd_<EPI, GU>;
	enum ng_status st = ng_ensure_smem_(kernel, C::SMEM);
	if (st)
		return st;
	const long long tiles = (long long)((M + GM_WM - 1) / GM_WM) * ((N + GM_BN - 1) / GM_BN);
	cudaLaunchConfig_t cfg = {};
	cfg.gridDim = dim3((unsigned)(tiles < sms ? tiles : sms));
	cfg.blockDim = dim3(GM_THREADS);
	cfg.dynamicSmemBytes = C::SMEM;
	cfg.stream = s;
	if (NG_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, *ta, *tw, *to, *tx, *tp, bias, part, M, N,
					     K)))
		return NG_ERR_RUNTIME;
	return NG_LAUNCH_CHECK("gm_fwd_");
}

/* The checks both entry points share: the shape. */
static enum ng_status check_shape_(const char *who, int M, int N, int K)
{
	if (M < 1 || N < 1 || K < 1 || N % 8 || K % 8)
		return ng_check_arg_fail(who, "M = %d, N = %d, K = %d: all >= 1, N and K multiples "
					 "of 8", M, N, K);
	if ((long long)M * N > (1ll << 40))
		return ng_check_arg_fail(who, "M = %d, N = %d: the output is too large", M, N);
	return NG_OK;
}

static enum ng_status check_device_(const char *who, int *sms)
{
	if (!device_sm90_(sms) || !built_sm90a_())
		return ng_fail(NG_ERR_RUNTIME, "%s: needs an sm_90 GPU and a build for sm_90a", who);
	return encode_init_();
}

/* The inputs in boxes of a stage's rows x 64 (A: GM_WM rows, W: GM_BN rows); the outputs and
 * the pre-activation are encoded in 64 x 64 units. */
static enum ng_status encode_inputs_(CUtensorMap *ta, CUtensorMap *tw, const void *a,
				     const void *w, int M, int N, int K)
{
	enum ng_status st = encode_(ta, a, M, K, GM_WM);
	return st ? st : encode_(tw, w, N, K, GM_BN);
}

extern "C" enum ng_status ng_gemm_sm90_fwd(ng_bf16 *out, ng_bf16 *aux, const ng_bf16 *inp,
					   const ng_bf16 *w, const ng_bf16 *bias, int M, int N,
					   int K, int act, cudaStream_t s)
{
	static const char *who = "ng_gemm_sm90_fwd";
	int sms = 0;
	enum ng_status st = check_shape_(who, M, N, K);
	if (st)
		return st;
	if (act < NG_GEMM_ACT_NONE || act > NG_GEMM_ACT_RELU2 || (act == NG_GEMM_ACT_RELU2 && bias))
		return ng_check_arg_fail(who, "act %d (bias %p): none, GELU, or relu^2 without bias",
					 act, (const void *)bias);
	const int gelu = act == NG_GEMM_ACT_GELU;
	if (!out || !inp || !w || (gelu && !aux))
		return ng_check_arg_fail(who, "NULL pointer (out %p, inp %p, w %p, aux %p, gelu %d)",
					 (void *)out, (const void *)inp, (const void *)w, (void *)aux,
					 gelu);
	if (!ng_aligned16_(out) || !ng_aligned16_(inp) || !ng_aligned16_(w) ||
	    (aux && !ng_aligned16_(aux)) || (bias && !ng_aligned16_(bias)))
		return ng_check_arg_fail(who, "pointers must be 16-byte aligned");
	if ((st = check_device_(who, &sms)))
		return st;
	CUtensorMap ta, tw, to, tx;
	if ((st = encode_inputs_(&ta, &tw, inp, w, M, N, K)) ||
	    (st = encode_(&to, out, M, N, 64)) || (st = encode_(&tx, gelu ? aux : out, M, N, 64)))
		return st;
	const __nv_bfloat16 *b = (const __nv_bfloat16 *)bias;
	if (act == NG_GEMM_ACT_RELU2)
		return launch_<EPI_RELU2>(&ta, &tw, &to, &tx, &tx, NULL, NULL, M, N, K, sms, s);
	return gelu ? launch_<EPI_GELU>(&ta, &tw, &to, &tx, &tx, b, NULL, M, N, K, sms, s)
		    : launch_<EPI_PLAIN>(&ta, &tw, &to, &tx, &tx, b, NULL, M, N, K, sms, s);
}

extern "C" int ng_gemm_sm90_dgelu_parts(int M)
{
	return M < 1 ? 0 : (M + GM_WM - 1) / GM_WM * 4;
}

extern "C" enum ng_status ng_gemm_sm90_dgelu(ng_bf16 *dpre, ng_bf16 *post, float *part,
					     const ng_bf16 *pre, const ng_bf16 *dout,
					     const ng_bf16 *wt, int M, int N, int K, cudaStream_t s)
{
	static const char *who = "ng_gemm_sm90_dgelu";
	int sms = 0;
	enum ng_status st = check_shape_(who, M, N, K);
	if (st)
		return st;
	if (!dpre || !pre || !dout || !wt)
		return ng_check_arg_fail(who, "NULL pointer (dpre %p, pre %p, dout %p, wt %p)",
					 (void *)dpre, (const void *)pre, (const void *)dout,
					 (const void *)wt);
	if (!ng_aligned16_(dpre) || !ng_aligned16_(pre) || !ng_aligned16_(dout) ||
	    !ng_aligned16_(wt) || (post && !ng_aligned16_(post)) || (part && !ng_aligned16_(part)))
		return ng_check_arg_fail(who, "pointers must be 16-byte aligned");
	if ((st = check_device_(who, &sms)))
		return st;
	CUtensorMap ta, tw, to, tx, tp;
	if ((st = encode_inputs_(&ta, &tw, dout, wt, M, N, K)) ||
	    (st = encode_(&to, dpre, M, N, 64)) || (st = encode_(&tx, pre, M, N, 64)) ||
	    (st = encode_(&tp, post ? post : dpre, M, N, 64)))
		return st;
	/* post cycles through 2 units, which leaves the ring 4 stages: with 4 units and 3 stages
	 * the kernel ran 8% slower at d24 (0.652 against 0.601 ms, bench_gemm --dgelu) */
	if (!post)
		return launch_<EPI_DGELU>(&ta, &tw, &to, &tx, &tp, NULL, part, M, N, K, sms, s);
	return launch_<EPI_DGELU_POST, 2>(&ta, &tw, &to, &tx, &tp, NULL, part, M, N, K, sms, s);
}
