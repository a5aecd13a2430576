/*
 * kernels/gemm_sm90.h — our own Hopper GEMM for the forward of a linear layer, with the bias
 * and GELU epilogue that cuBLASLt runs slowly, and for the MLP projection's input gradient
 * with the GELU backward (and the recomputed GELU) in its epilogue.
 *
 * Why: cuBLASLt's GELU_AUX_BIAS epilogue offers five algorithms for the MLP's fc forward, and
 * the best runs at ~500 TFLOP/s against ~660 for the plain matmul of the same shape
 * (BENCHMARKS.md: ~3 ms of a d24 step). This kernel computes the same thing with
 * the epilogue of one warpgroup overlapping the matrix work of the other, so the tensor cores do
 * not wait for the stores. It is one more candidate for the plan's autotune (kernels/matmul.h),
 * which keeps it only where it times faster.
 *
 *   out (M, N) bf16 = inp (M, K) @ W^T + bias       W is (N, K), torch.nn.Linear's layout
 *   gelu: aux (M, N) bf16 = the pre-activation above; out = GELU(pre-activation)
 *   relu^2 (the speedrun model's MLP, no bias): out = max(pre-activation, 0)^2, rounded once
 *
 *   ng_gemm_sm90_dgelu, the backward of GELU(pre) @ W2^T for W2 (K, N) (the MLP projection):
 *   dpre (M, N) bf16 = (dout (M, K) @ wt^T) * GELU'(pre)      wt = W2^T, (N, K) row-major
 *   post (M, N) bf16 = GELU(pre), when post is not NULL (--recompute gelu's activation)
 *   part (ng_gemm_sm90_dgelu_parts(M), N) fp32, when not NULL: column sums of dpre as
 *     stored (bf16), each row over one consumer warp's rows of one tile row, written in a fixed
 *     order; their sum over the rows (ng_bias_grad_reduce) is the bias gradient of the layer
 *     whose output gradient dpre is (the MLP's fc), without reading dpre again
 * The product stays fp32 until it is multiplied by GELU'(pre) and rounded once (cuBLASLt's DGELU
 * epilogue does the same; the unfused pair rounds the product to bf16 first). Why: the unfused
 * pair writes the product and reads it back (2 x 4C bf16 a token), and cuBLASLt's DGELU
 * epilogue runs at ~60% of its plain matmul at d24 (BENCHMARKS.md).
 *
 * GELU is the tanh form of GPT-2, evaluated in fp32 on the fp32 pre-activation (as cuBLASLt
 * does; the function is kernels/common.cuh's ng_gelu_f, which the elementwise kernels use too):
 * gelu(x) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
 * Accumulation is fp32; bias is added to the fp32 sum; each output is rounded once to bf16.
 * Deterministic: every output element is summed by one warpgroup in a fixed order.
 *
 * How: a persistent grid (one block per SM), three warpgroups a block. The first issues the
 * tensor-memory-accelerator loads of A and W tiles (k = 64 per stage, 128-byte swizzle) into a
 * ring of shared-memory stages; the other two each take every other tile of the block and run
 * wgmma (sm_90a) on it, then write its epilogue through shared memory; a consumer's tile is
 * 128 x 128 (bench_gemm measured it the fastest of the tiles tried).
 *
 * The DGELU epilogue: each consumer loads its tile's pre-activation into shared memory with the
 * copy engine while it multiplies, then writes the gradient over it and stores it from there.
 *
 * Preconditions (checked; a failure names the value): an sm_90 GPU and a build with the sm_90a
 * target; M, N, K >= 1; N and K multiples of 8; every pointer 16-byte aligned; gelu needs aux.
 * Any M, N, K otherwise: the loads fill past the edges with zeros, the stores check bounds.
 */
#ifndef NG_KERNELS_GEMM_SM90_H
#define NG_KERNELS_GEMM_SM90_H

#include <cuda_runtime.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Raise when a change may alter the kernel's speed: autotune's kept choices then time it again. */
#define NG_GEMM_SM90_REV 7

/* 1 when this process can run ng_gemm_sm90_fwd on the current device (an sm_90 GPU, and the
 * kernel was built for sm_90a); 0 otherwise. Never fails. */
int ng_gemm_sm90_available(void);

/* The forward's activation (act): none, GELU (with aux), or relu^2 (no bias, no aux). */
enum { NG_GEMM_ACT_NONE = 0, NG_GEMM_ACT_GELU = 1, NG_GEMM_ACT_RELU2 = 2 };

enum ng_status ng_gemm_sm90_fwd(ng_bf16 *out,        /* (M, N) bf16, = */
				ng_bf16 *aux,        /* (M, N) bf16, = the pre-activation; GELU only */
				const ng_bf16 *inp,  /* (M, K) bf16 */
				const ng_bf16 *w,    /* (N, K) bf16 */
				const ng_bf16 *bias, /* (N) bf16, or NULL (always with relu^2) */
				int M, int N, int K, int act, cudaStream_t s);

enum ng_status ng_gemm_sm90_dgelu(ng_bf16 *dpre,       /* (M, N) bf16, = */
				  ng_bf16 *post,       /* (M, N) bf16, = GELU(pre); or NULL */
				  float *part,         /* (parts, N) fp32 column sums, or NULL */
				  const ng_bf16 *pre,  /* (M, N) bf16, the pre-activation */
				  const ng_bf16 *dout, /* (M, K) bf16 */
				  const ng_bf16 *wt,   /* (N, K) bf16 */
				  int M, int N, int K, cudaStream_t s);
/* The rows of ng_gemm_sm90_dgelu's part: 4 a tile row of 128 (one a consumer warp). */
int ng_gemm_sm90_dgelu_parts(int M);


#ifdef __cplusplus
}
#endif

#endif
