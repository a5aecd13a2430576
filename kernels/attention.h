/*
 * kernels/attention.h — causal multi-head attention (GPT-2's), forward in training mode (with the
 * softmax log-sum-exp statistics) and backward, behind one plan object.
 *
 * Two backends:
 *   - cuDNN flash attention described through the backend API of cudnn_graph.h (plain C, no
 *     cudnn-frontend): a graph of matmul/pointwise/reduction ops that cuDNN's heuristics turn
 *     into a fused engine (kernels/attention_cudnn.c; facts in docs/GPU.md);
 *   - a plain CUDA implementation, one warp per query (or key) row with an online softmax:
 *     correct for every shape up to D = 256, deterministic, slower (kernels/attention_naive.cu).
 * Every choice (backend per direction, engine, workspace sizes, why a fallback was taken) is made
 * by ng_attention_plan, before any step runs; ng_attention_fwd/bwd only enqueue work, so they can
 * be recorded by cudaStreamBeginCapture. ng_attention_describe says what was chosen and why.
 *
 * Shapes (no permutes: Q, K, V are read straight from the fused buffer through strides):
 *   qkv, dqkv (B, T, 3, H, D) bf16   — q | k | v, head-major inside each; C = H * D
 *   out, dout (B, T, H, D)    bf16
 *   lse       (B, H, T)       fp32   — natural log of sum_s exp(scale * q_t . k_s), s <= t,
 *                                      scale = 1/sqrt(D) (cuDNN's "Stats")
 * Pointers must be 16-byte aligned for the cuDNN backend (C a multiple of 8).
 */
#ifndef NG_KERNELS_ATTENTION_H
#define NG_KERNELS_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>
#include <cudnn.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum ng_attention_backend {
	NG_ATTENTION_BACKEND_CUDNN = 0, /* cuDNN fused flash attention (backend API) */
	NG_ATTENTION_BACKEND_NAIVE = 1, /* plain CUDA, warp per row */
};

/* Most descriptors one cuDNN operation graph keeps alive (tensors + ops + graph + plan). */
#define NG_ATTENTION_MAX_DESCS 192

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
	enum ng_attention_backend fwd_backend; /* who runs the forward */
	enum ng_attention_backend bwd_backend; /* who runs the backward */
	cudnnHandle_t handle;            /* the caller's cuDNN handle (NULL when cuDNN is unused) */
	size_t cudnn_version;            /* cudnnGetVersion() of the loaded library, 0 if unknown */
	float scale;                     /* 1/sqrt(D); passed to cuDNN by value (host pointer) */
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
	char reason[384];                /* why a fallback to the naive kernels was taken ("" none) */
	char text[768];                  /* ng_attention_describe's line */
};

/* Plan attention for (B, H, T, D): pick a backend per direction, build and finalize the cuDNN
 * graphs (slow: runtime compilation, seconds), size the workspaces. `h` may be NULL (naive only).
 * force_naive: use the plain CUDA kernels. A shape cuDNN cannot do falls back to them here, with
 * the reason kept for ng_attention_describe; a shape nothing can do (D > 256, sizes <= 0) is
 * NG_ERR_INPUT. On failure nothing stays allocated. */
enum ng_status ng_attention_plan(struct ng_attention *att, cudnnHandle_t h, int B, int H, int T,
				 int D, int deterministic, int force_naive);
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
void ng_attention_free(struct ng_attention *att);

/* The plain CUDA kernels (attention_naive.cu); internal, called through the plan, which has
 * checked the shape (1 <= D <= 256). They return the launch's error. rowdot (B,H,T) fp32 is
 * scratch: sum_d dout * out per row. */
cudaError_t ng_attention_naive_fwd_(ng_bf16 *out, float *lse, const ng_bf16 *qkv, int B, int H,
				       int T, int D, cudaStream_t s);
cudaError_t ng_attention_naive_bwd_(ng_bf16 *dqkv, float *rowdot, const ng_bf16 *dout,
				       const ng_bf16 *qkv, const ng_bf16 *out, const float *lse,
				       int B, int H, int T, int D, cudaStream_t s);
/* p[0..n) = v (the sequence lengths of the cuDNN padding-mask workaround). */
cudaError_t ng_attention_fill_i32_(int *p, int n, int v, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
