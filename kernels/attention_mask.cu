/*
 * kernels/attention_mask.cu — the per-query lower bound of the speedrun model's attention mask
 * (kernels/attention.h): lo[b, t] = max(start of t's document, the first key of t's window),
 * the first key query t may see, from the step's tokens, a device window w and the window's
 * granularity (1: the last w tokens; the speedrun's 128: w / 128 blocks of 128 tokens, the
 * query's own block included; ng_attention_window_first). It is the device input that lets the
 * window change every step inside one captured graph, and that carries the documents into both
 * attention backends.
 *
 * Algorithm, lower_bound_row_scan: one block of LB_THREADS threads per sequence b walks its row
 * in tiles of LB_THREADS tokens. Each thread's candidate is its position if the token is BOS,
 * else 0; an inclusive max-scan over the tile (warp shuffles, then a scan of the 32 warp maxima
 * in shared memory), combined with the running maximum of the earlier tiles, is the last BOS
 * position at or before t: the document's start. Integer maxima are exact, so the result is
 * deterministic whatever the order. T = 49152 is 48 tiles of one block; the cost is one read
 * of the tokens and one write of lo.
 * Shapes: tok, lo (B, T) int32; the window a device int32 scalar.
 */
#include "kernels/attention.h"
#include "kernels/common.cuh"

#define LB_THREADS 1024 /* 32 warps: one warp scans the 32 warp maxima */
#define FULL_MASK 0xffffffffu

/* grid: B blocks of LB_THREADS; block b writes row b of lo. */
static __global__ void __launch_bounds__(LB_THREADS)
	lower_bound_row_scan(int32_t *lo, const int32_t *tok, const int32_t *window, int max_window,
			     int block, int T, int32_t bos)
{
	__shared__ int warp_max[LB_THREADS / NG_WARP];
	int lane = threadIdx.x % NG_WARP, warp = threadIdx.x / NG_WARP;
	size_t row = (size_t)blockIdx.x * T;
	int w = window ? *window : 0;
	if (max_window > 0 && (w <= 0 || w > max_window))
		w = max_window;
	int carry = 0; /* the last BOS position of the tiles before this one (0: none) */
	for (int base = 0; base < T; base += LB_THREADS) {
		int t = base + (int)threadIdx.x;
		int v = t < T && tok && tok[row + t] == bos ? t : 0;
		for (int o = 1; o < NG_WARP; o <<= 1) {
			int u = __shfl_up_sync(FULL_MASK, v, o);
			if (lane >= o)
				v = max(v, u);
		}
		if (lane == NG_WARP - 1)
			warp_max[warp] = v;
		__syncthreads();
		if (warp == 0) {
			int x = warp_max[lane];
			for (int o = 1; o < NG_WARP; o <<= 1) {
				int u = __shfl_up_sync(FULL_MASK, x, o);
				if (lane >= o)
					x = max(x, u);
			}
			warp_max[lane] = x; /* inclusive: the maximum of warps 0 .. lane */
		}
		__syncthreads();
		if (warp > 0)
			v = max(v, warp_max[warp - 1]);
		v = max(v, carry);
		if (t < T)
			lo[row + t] = w > 0 ? max(v, ng_attention_window_first(t, w, block)) : v;
		carry = max(carry, warp_max[LB_THREADS / NG_WARP - 1]);
		__syncthreads(); /* every thread has read warp_max before the next tile writes it */
	}
}

extern "C" enum ng_status ng_attention_lower_bound(int32_t *lo, const int32_t *tok,
						   const int32_t *window, int max_window, int block,
						   int B, int T, int32_t bos, cudaStream_t s)
{
	if (!lo || B <= 0 || T <= 0 || max_window < 0 || block < 1)
		return ng_check_arg_fail("ng_attention_lower_bound",
					 "need lo, B > 0, T > 0, max_window >= 0 and block >= 1, got "
					 "lo %p B=%d T=%d max_window=%d block=%d", (void *)lo, B, T,
					 max_window, block);
	lower_bound_row_scan<<<B, LB_THREADS, 0, s>>>(lo, tok, window, max_window, block, T, bos);
	return NG_LAUNCH_CHECK("lower_bound_row_scan");
}
