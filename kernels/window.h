/*
 * kernels/window.h — the sliding window of the speedrun model's attention mask, one definition
 * for the CUDA kernels (kernels/attention_mask.cu, kernels/decode.cu) and the double-precision
 * CPU reference (graph/cpu_spr_ops.c, graph/cpu_spr_decode.c). Plain C, no CUDA headers.
 */
#ifndef NG_KERNELS_WINDOW_H
#define NG_KERNELS_WINDOW_H

/* The first key of query t's window of w tokens (w > 0) at granularity block >= 1: with block 1
 * the last w tokens, t - w + 1; otherwise the max(1, w / block) blocks of `block` tokens up to
 * and including t's own, the speedrun reference's mask. For w a multiple of block it is never
 * below t - w + 1, so a band t - s < w holds every key it lets through. */
#ifdef __CUDACC__
__host__ __device__
#endif
static inline int ng_attention_window_first(int t, int w, int block)
{
	int n = w / block > 0 ? w / block : 1;
	return (t / block - n + 1) * block;
}

#endif
