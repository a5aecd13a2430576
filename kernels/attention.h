/*
 * kernels/attention.h — multi-head attention, forward in training mode (with the softmax
 * log-sum-exp statistics) and backward, behind one plan object: GPT-2's causal attention, and
 * the speedrun model's (causal within a document, within a sliding window, scale 0.12).
 *
 * Two backends:
 *   - cuDNN flash attention described through the backend API of cudnn_graph.h (plain C, no
 *     cudnn-frontend): a graph of matmul/pointwise/reduction ops that cuDNN's heuristics turn
 *     into a fused engine (kernels/attention_cudnn.c; facts in docs/GPU.md);
 *   - a plain CUDA implementation, one warp per query (or key) row with an online softmax:
 *     correct for every shape and mask up to D = 256, deterministic, slower; it visits only the
 *     keys a query may see, so a window of w tokens costs ~T w, not T^2
 *     (kernels/attention_naive.cu).
 * Every choice (backend per direction, engine, workspace sizes, why a fallback was taken) is made
 * by ng_attention_plan / ng_attention_plan_masked, before any step runs; the forward and
 * backward only enqueue work, so they can be recorded by cudaStreamBeginCapture.
 * ng_attention_describe says what was chosen and why.
 *
 * The mask. Query t of sequence b sees key s iff
 *     s <= t,  t - s < max_window (when max_window > 0),  s >= lo[b, t] (when lower_bound),
 * where lo (B, T) int32 is a device input of each call: the first key a query may see. The step
 * computes it with ng_attention_lower_bound from the tokens (a document starts at each BOS
 * token) and a device int32 window, so the window can change every step without a re-plan:
 * max_window is the plan-time band (cuDNN skips the tiles outside it; a step may capture a few
 * plans with different bands and pick one), the device window narrows it through lo. lo must be
 * what ng_attention_lower_bound writes: lo[b, t] <= t and non-decreasing in t.
 *
 * Shapes (no permutes: Q, K, V are read straight from the fused buffer through strides):
 *   qkv, dqkv (B, T, 3, H, D) bf16   — q | k | v, head-major inside each; C = H * D
 *   out, dout (B, T, H, D)    bf16
 *   lse       (B, H, T)       fp32   — natural log of sum_s exp(scale * q_t . k_s) over the keys
 *                                      t sees (cuDNN's "Stats"); scale 1/sqrt(D) unless set
 *   lo        (B, T)          int32  — the first key each query may see (masked plans)
 * Pointers must be 16-byte aligned for the cuDNN backend (C a multiple of 8), lo included.
 */
#ifndef NG_KERNELS_ATTENTION_H
#define NG_KERNELS_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>
#include <cudnn.h>

#include "kernels/types.h"
#include "kernels/window.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum ng_attention_backend {
	NG_ATTENTION_BACKEND_CUDNN = 0, /* cuDNN fused flash attention (backend API) */
	NG_ATTENTION_BACKEND_NAIVE = 1, /* plain CUDA, warp per row */
};

/* Most descriptors one cuDNN operation graph keeps alive (tensors + ops + graph + plan). */
#define NG_ATTENTION_MAX_DESCS 256

/* Where the lower-bound select sits in the cuDNN score graph (struct ng_attention_opts). */
enum ng_attention_lo_order {
	NG_ATTENTION_LO_AUTO = 0,   /* after the band; if no engine takes that, before the causal */
	NG_ATTENTION_LO_AFTER = 1,  /* after the causal and band selects only */
	NG_ATTENTION_LO_BEFORE = 2, /* before them only (where cudnn-frontend puts its padding mask) */
};

/* The options of a masked plan; zero-filled is GPT-2's causal attention. */
struct ng_attention_opts {
	float scale;         /* softmax scale; 0: 1/sqrt(D) */
	int max_window;      /* the band: keys with t - s < max_window only (tokens); 0: none */
	int lower_bound;     /* 1: the forward and backward take lo (B, T) int32 */
	int band_on_device;  /* 1 (needs max_window): the band's width is the device int32 `window`
			      * of each call, 1 <= *window <= max_window (cuDNN reads it as a tensor
			      * instead of the by-value max_window) */
	enum ng_attention_lo_order lo_order; /* cuDNN graph: where the lower-bound select goes */
};

/* One finalized cuDNN execution plan and every descriptor it was built from. */
struct ng_attention_cudnn_plan_ {
	cudnnBackendDescriptor_t plan;   /* the finalized EXECUTION_PLAN (NULL: none) */
	cudnnBackendDescriptor_t descs[NG_ATTENTION_MAX_DESCS]; /* everything else, freed with it */
	int n_descs;                     /* used entries of descs */
	int64_t engine;                  /* the engine's global index (-1 before planning) */
	int64_t workspace;               /* bytes cuDNN's engine itself needs */
};

/* The attention plan for one shape. Fill with ng_attention_plan, release with ng_attention_free. */
struct ng_attention {
	int B, H, T, D;                  /* batch, heads, sequence length, head size */
	int deterministic;               /* 1: the backward gives the same bytes on every run */
	int max_window;                  /* the band (tokens, 0: none): t - s < max_window */
	int lower_bound;                 /* 1: calls take lo (B, T) int32 */
	int band_on_device;              /* 1: the cuDNN band's width is the call's device window */
	int fwd_lo_before;               /* 1: the cuDNN forward selects lo before the causal mask */
	int bwd_lo_before;               /* 1: the cuDNN backward does */
	enum ng_attention_backend fwd_backend; /* who runs the forward */
	enum ng_attention_backend bwd_backend; /* who runs the backward */
	cudnnHandle_t handle;            /* the caller's cuDNN handle (NULL when cuDNN is unused) */
	size_t cudnn_version;            /* cudnnGetVersion() of the loaded library, 0 if unknown */
	float scale;                     /* softmax scale; passed to cuDNN by value (host pointer) */
	float band;                      /* max_window as fp32: the by-value band of cuDNN graphs */
	float mask_value;                /* -inf (cuDNN >= 9.10) or -FLT_MAX: masked scores */
	float one;                       /* the constant 1.0 the backward graph multiplies by */
	struct ng_attention_cudnn_plan_ fwd; /* cuDNN forward plan (when fwd_backend is cuDNN) */
	struct ng_attention_cudnn_plan_ bwd; /* cuDNN backward plan (when bwd_backend is cuDNN) */
	size_t fwd_ws;                   /* forward workspace bytes (the caller provides them) */
	size_t bwd_ws;                   /* backward workspace bytes */
	size_t bwd_sum_off;              /* bwd workspace: softmax_sum / row dots (B,H,T) fp32 */
	size_t bwd_accum_off;            /* bwd workspace: cuDNN dQ_accum (B,H,T,D) fp32, or 0 */
	size_t bwd_seq_off;              /* bwd workspace: 2 x B int32 sequence lengths, or 0 */
	size_t bwd_cudnn_off;            /* bwd workspace: cuDNN's own scratch */
	int bwd_seqlen;                  /* 1: cuDNN backward with the padding-mask workaround */
	char reason[512];                /* why a fallback to the naive kernels was taken, or which
					  * cuDNN graph failed before another was taken ("" none) */
	char text[1024];                 /* ng_attention_describe's line */
};

/* Plan GPT-2's causal attention for (B, H, T, D) (ng_attention_plan_masked with no options):
 * pick a backend per direction, build and finalize the cuDNN graphs (slow: runtime
 * compilation, seconds), size the workspaces. `h` may be NULL (naive only).
 * force_naive: use the plain CUDA kernels. A shape cuDNN cannot do falls back to them here, with
 * the reason kept for ng_attention_describe; a shape nothing can do (D > 256, sizes <= 0) is
 * NG_ERR_INPUT. On failure nothing stays allocated. */
enum ng_status ng_attention_plan(struct ng_attention *att, cudnnHandle_t h, int B, int H, int T,
				 int D, int deterministic, int force_naive);
/* The same with a mask and scale (opts may be NULL: GPT-2's). A graph cuDNN does not take falls
 * back to the naive kernels with the reason kept; max_window < 0, a negative scale or
 * band_on_device without max_window is NG_ERR_INPUT. */
enum ng_status ng_attention_plan_masked(struct ng_attention *att, cudnnHandle_t h, int B, int H,
					int T, int D, int deterministic, int force_naive,
					const struct ng_attention_opts *opts);
size_t ng_attention_fwd_workspace(const struct ng_attention *att);
size_t ng_attention_bwd_workspace(const struct ng_attention *att);
/* One line: shape, backend and engine per direction, cuDNN version, fallback reason. */
const char *ng_attention_describe(const struct ng_attention *att);

/* out (B,T,H,D) bf16 =, lse (B,H,T) fp32 = from qkv (B,T,3,H,D) bf16. workspace: at least
 * ng_attention_fwd_workspace bytes, 256-byte aligned (may be NULL when that is 0). */
enum ng_status ng_attention_fwd(const struct ng_attention *att, ng_bf16 *out, float *lse,
				const ng_bf16 *qkv, void *workspace, cudaStream_t s);
/* dqkv (B,T,3,H,D) bf16 = from dout (B,T,H,D), qkv, out and lse of the forward. workspace: at
 * least ng_attention_bwd_workspace bytes, 256-byte aligned. */
enum ng_status ng_attention_bwd(const struct ng_attention *att, ng_bf16 *dqkv, const ng_bf16 *dout,
				const ng_bf16 *qkv, const ng_bf16 *out, const float *lse,
				void *workspace, cudaStream_t s);
/* The forward and backward of a masked plan: lo (B, T) int32 (required when the plan has
 * lower_bound, else ignored), window: device int32 scalar, the band's width (required when the
 * plan has band_on_device, else ignored), both 16-byte aligned. */
enum ng_status ng_attention_fwd_masked(const struct ng_attention *att, ng_bf16 *out, float *lse,
				       const ng_bf16 *qkv, const int32_t *lo,
				       const int32_t *window, void *workspace, cudaStream_t s);
enum ng_status ng_attention_bwd_masked(const struct ng_attention *att, ng_bf16 *dqkv,
				       const ng_bf16 *dout, const ng_bf16 *qkv, const ng_bf16 *out,
				       const float *lse, const int32_t *lo, const int32_t *window,
				       void *workspace, cudaStream_t s);
void ng_attention_free(struct ng_attention *att);

/* lo (B, T) int32 = the first key each query may see (kernels/attention_mask.cu):
 *     lo[b, t] = max(start, ng_attention_window_first(t, w, block)),
 * start = the last position p <= t with tok[b, p] == bos (0 when there is none, or tok NULL),
 * w = *window (device int32, read when the kernel runs; <= 0 or window NULL: no window), capped
 * at max_window when max_window > 0 (the plan's band, so every backend sees the same mask);
 * block >= 1 the window's granularity (the speedrun's 128: its reference's block window).
 * One block per sequence scans its BOS positions; exact integer maxima, so deterministic. */
enum ng_status ng_attention_lower_bound(int32_t *lo,           /* (B, T) int32, = */
					const int32_t *tok,    /* (B, T) int32 (or NULL) */
					const int32_t *window, /* device scalar (or NULL) */
					int max_window, int block, int B, int T,
					int32_t bos, cudaStream_t s);

/* The mask and scale of the plain CUDA kernels: keys max(0, t - w + 1, lo[b, t]) .. t, with
 * w = window, or min(*window_dev, window) when window_dev is set and *window_dev > 0. */
struct ng_attention_naive_mask_ {
	float scale;              /* softmax scale */
	int window;               /* the band (tokens), 0: none */
	const int32_t *window_dev; /* device int32 band width (NULL: window alone) */
	const int32_t *lo;        /* (B, T) int32 first keys (NULL: none) */
};

/* The plain CUDA kernels (attention_naive.cu); internal, called through the plan, which has
 * checked the shape (1 <= D <= 256). They return the launch's error. rowdot (B,H,T) fp32 is
 * scratch: sum_d dout * out per row. */
cudaError_t ng_attention_naive_fwd_(ng_bf16 *out, float *lse, const ng_bf16 *qkv, int B, int H,
				       int T, int D, struct ng_attention_naive_mask_ m,
				       cudaStream_t s);
cudaError_t ng_attention_naive_bwd_(ng_bf16 *dqkv, float *rowdot, const ng_bf16 *dout,
				       const ng_bf16 *qkv, const ng_bf16 *out, const float *lse,
				       int B, int H, int T, int D, struct ng_attention_naive_mask_ m,
				       cudaStream_t s);
/* p[0..n) = v (the sequence lengths of the cuDNN padding-mask workaround). */
cudaError_t ng_attention_fill_i32_(int *p, int n, int v, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
