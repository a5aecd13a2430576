/*
 * kernels/matmul.h — every matmul of the GPT-2 step through cuBLASLt, planned ahead.
 *
 * Why: DESIGN.md wants everything decided before the first step. ng_matmul_plan() builds the
 * operation descriptor, the four matrix layouts and the epilogue, asks the heuristic (and, on
 * request, times up to 8 candidates on scratch buffers) and keeps the chosen algorithm;
 * ng_matmul_run() then only sets the pointer attributes (bias / aux) and calls cublasLtMatmul
 * — no descriptor creation, no heuristic query, no allocation — so it can be captured into the
 * step's CUDA graph.
 *
 * Conventions (row-major throughout, as graph/cpu_ops.h): N rows (B*T tokens), a linear layer
 * stores W as (OC, IC) like torch.nn.Linear. cuBLASLt is column-major, so a row-major (R, C)
 * matrix is used as a column-major (C, R) one with ld = C; no copies, only the ops change.
 *
 *   kind                    computes (row-major)                             cuBLASLt (m, n, k)
 *   NG_MATMUL_FWD   out (N, OC) bf16 = inp (N, IC) @ W^T [+ bias (OC) bf16]      (OC, N, IC)
 *                   gelu: aux (N, OC) bf16 = the pre-activation inp @ W^T + bias,
 *                         out = GELU(pre-activation) (epilogue GELU_AUX_BIAS / GELU_AUX)
 *                   accumulate: out = residual (N, OC) bf16 + inp @ W^T [+ bias], the
 *                         residual read as cuBLASLt's C with beta = 1 (the block's residual
 *                         add, summed in fp32 and rounded once); not with gelu; run with
 *                         ng_matmul_run_residual
 *   NG_MATMUL_DINP  dinp (N, IC) bf16 = dout (N, OC) @ W                         (IC, N, OC)
 *                   gelu: dinp = (dout @ W) * GELU'(aux), elementwise, where aux (N, IC)
 *                         bf16 is the pre-activation whose GELU was this layer's INPUT in the
 *                         forward (for the MLP projection: the fc layer's aux). cuBLASLt's
 *                         DGELU epilogue multiplies the matmul RESULT (D) by the GELU
 *                         derivative of an aux matrix of D's shape: aux is read, never written.
 *   NG_MATMUL_DW    dW (OC, IC) fp32 (+)= dout^T (OC, N) @ inp (N, IC)              (IC, OC, N)
 *                   bias: dbias (OC) fp32 (+)= column sums of dout, see "Bias gradient".
 *                   accumulate: "+=" (beta = 1: gradient accumulation over micro-batches);
 *                   otherwise "=".
 *
 * Bias gradient (DW + bias), two ways, both deterministic, both "+=" under accumulate:
 *   colsum (ctx->dbias_colsum = 1, the default): after the weight-gradient matmul, a second
 *     matmul dbias (OC,1) (+)= (1/3) * dout^T @ v with v = N bf16 3.0 values that a
 *     cudaMemsetAsync of byte 0x40 writes into the workspace (bf16 0x4040 = 3.0 exactly;
 *     times 3 is exact in fp32, the 1/3 costs one fp32 rounding). beta = 1 makes it "+=".
 *   BGRADB (ctx->dbias_colsum = 0): the epilogue reduces the B operand (dout) over k = N
 *     inside the weight-gradient matmul. It always WRITES its vector, so with accumulate it
 *     writes into a scratch slot of the workspace and cublasLtMatrixTransform adds it
 *     (dbias = 1*scratch + 1*dbias). If cuBLASLt offers no BGRADB algorithm, the plan falls
 *     back to colsum.
 *   Decided by measurement (tools/bench_matmul.c on the H200, cuBLASLt 13.1: time on top of
 *   the DW matmul alone, accumulate on, wrapper and direct launches alternated):
 *     d12 (N=65536)  qkv  BGRADB+add +0.154 ms, colsum +0.077 | attproj +0.058, +0.037
 *                    fc   +0.115, +0.112                      | fcproj  +0.061, +0.034
 *     d48 (N=16384)  qkv  +0.093, +0.068 | attproj +0.036, +0.025 | fc +0.110, +0.079
 *                    fcproj -0.004, +0.032 (the one shape where BGRADB wins)
 *   Per step: d12 4.7 ms (BGRADB) vs 3.1 ms (colsum); d48 11.3 vs 9.8 ms. BGRADB slows the
 *   weight-gradient matmul itself (writing "=" without the add is no faster). colsum's extra
 *   time is 54-92% efficient against reading dout once at the 4.28 TB/s copy bandwidth
 *   (d12 qkv 0.077 ms vs a 0.071 ms floor, fc 0.112 vs 0.094; narrow OC = C shapes are
 *   launch-bound), so a hand-written column-sum kernel could save at most ~0.6 ms per d12 step.
 *
 * Our own GEMM for the MLP projection's DINP with DGELU (spec.own, chosen by the executor's
 * --gelu-fusion timing, not by autotune): dinp = (dout @ W) * GELU'(aux) from W^T (IC x OC
 * bf16, which the caller makes with ng_transpose_bf16), so that the GEMM reads both operands
 * K-major as in the forward; it can also write GELU(aux), which --recompute gelu needs next.
 * The step transposes every layer's W at the start of the backward: read right after its
 * transpose, W^T made the GEMM ~10% slower (BENCHMARKS.md).
 *
 * Our own GEMM: for a bf16 FWD with autotune on an sm_90 GPU, the candidates also include
 * kernels/gemm_sm90.h's kernel (128 x 128 tiles, TMA and wgmma, the bias and GELU epilogue
 * through shared memory), timed the same way; it runs only where it is the fastest. On the
 * H200 it is not yet: 4-12% slower than cuBLASLt at the plain forward shapes of d12/d24, and
 * 1% slower to 3% faster at the GELU one (tools/bench_gemm; held for 2 s at
 * the power cap it needs as few cycles as cuBLASLt or fewer, but runs 100-150 MHz slower:
 * BENCHMARKS.md), so no plan took it in the step and today it only costs autotune
 * time: one more candidate per bf16 forward shape (~0.1 s each, from the 100 ms sustained pass;
 * not measured). It computes
 * the same outputs (GELU in the same tanh form, the bias added to the fp32 sum, one bf16
 * rounding). Written because cuBLASLt's GELU_AUX_BIAS epilogue runs at ~500 TFLOP/s against
 * ~650 for the plain matmul (BENCHMARKS.md).
 *
 * GELU is cuBLASLt's, and it is the tanh form of GPT-2 (tests/test_matmul.c projects the GPU
 * error onto the erf-minus-tanh difference: t = -0.01..0.06 for GELU and DGELU on the 37- and
 * 111-row cases, -0.32 on the noisier 1-row DGELU case; the erf form would give 1). DGELU's aux is an INPUT of D's shape (the forward pre-activation), the
 * derivative multiplies the fp32 matmul result before the bf16 rounding. Accumulation is fp32
 * (CUBLAS_COMPUTE_32F), alpha = 1.
 *
 * Preconditions checked (failures name the shape and the value): IC and OC multiples of 8 (every
 * leading dimension, aux's included, is IC or OC bf16 elements: 16 bytes), N >= 1; at run time
 * every data pointer 16-byte aligned (ctx->align_bytes; the plan keeps only algorithms whose
 * own minimum alignments that meets), required pointers non-NULL, the workspace 256-byte
 * aligned (NG_MATMUL_WORKSPACE_ALIGN) and non-NULL when the plan needs one.
 *
 * One plan per call site: ng_matmul_run() writes the bias/aux pointers into the plan's
 * descriptor, so one plan must not run concurrently from two host threads.
 *
 * References: cuBLASLt API (cublasLt.h: cublasLtEpilogue_t, CUBLASLT_MATMUL_DESC_*),
 * "cuBLASLt matmul, epilogues" in the cuBLAS documentation.
 */
#ifndef NG_KERNELS_MATMUL_H
#define NG_KERNELS_MATMUL_H

#include <stddef.h>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shared by every plan of a run. */
/* The caller's workspace pointer must be aligned to this (the arena's alignment): cuBLAS(Lt)
 * rejects a less aligned workspace. */
#define NG_MATMUL_WORKSPACE_ALIGN 256

struct ng_matmul_ctx {
	cublasLtHandle_t lt;       /* the cuBLASLt handle */
	size_t workspace_bytes;    /* the most workspace one matmul may ask for (heuristic limit) */
	unsigned align_bytes;      /* alignment every pointer passed to run has (16 or more); the
	                            * heuristic only offers algorithms that work with it */
	int tune_candidates;       /* autotune: heuristic candidates timed (1..8) */
	int tune_reps;             /* autotune: timed repetitions per candidate (median kept) */
	float tune_sustained_ms;   /* autotune: > 0: rank candidates by their time under sustained
	                            * load, about this many ms of back-to-back launches each after
	                            * the GPU is heated (default 100); 0: by the burst medians */
	int dbias_colsum;          /* DW + bias: 1 = a separate column-sum matmul instead of the
	                            * BGRADB epilogue (0 by default; see "Bias gradient") */
	int force_candidate;       /* tools' hook: >= 0 with autotune takes that heuristic candidate
	                            * untimed (when it exists; past the last, the last: our own
	                            * GEMM where it is a candidate); -1 (the default): not used */
	int own_gemm;              /* autotune of a bf16 FWD also times our own Hopper GEMM
	                            * (kernels/gemm_sm90.h) where it can run: 1 (the default), 0
	                            * never (the executor's no_own_gemm: train --own-gemm off) */
	struct ng_matmul_choice *choices; /* autotune choices known (see "Choices kept") */
	int n_choices, cap_choices;
	int choices_made;          /* timed by this ctx (what ng_matmul_choices_save adds) */
	int choices_reused;        /* plans that took a known choice, untimed */
};

enum ng_matmul_kind {
	NG_MATMUL_FWD,  /* out = inp @ W^T (+ bias) (GELU) */
	NG_MATMUL_DINP, /* dinp = dout @ W (* GELU'(aux)) */
	NG_MATMUL_DW,   /* dW (+)= dout^T @ inp, dbias (+)= colsum(dout) */
};

/* What one call site computes. */
struct ng_matmul_spec {
	enum ng_matmul_kind kind;
	int N;          /* rows (B*T tokens of this call), >= 1 */
	int IC;         /* input features: W is (OC, IC); multiple of 8 */
	int OC;         /* output features; multiple of 8 */
	int gelu;       /* FWD: GELU epilogue with aux output; DINP: DGELU with aux input */
	int bias;       /* FWD: add bias (OC) bf16; DW: also produce dbias (OC) fp32 */
	int accumulate; /* DW: dW and dbias "+=" (beta = 1) instead of "="; FWD: out = a residual
	                 * + the product (beta = 1, see the table above) */
	int autotune;   /* time the heuristic's top candidates at plan time, keep the fastest */
	int fp8;        /* FWD: inp and W are E4M3 bytes (kernels/fp8.h); DINP: dout is E5M2 and
	                 * W comes as its transpose (IC, OC) in E4M3; DW (no bias): both operands
	                 * transposed, dout^T (OC, N) E5M2 and inp^T (IC, N) E4M3, dW fp32; each
	                 * with a device descale (ng_matmul_run_fp8); out, aux and bias stay bf16;
	                 * IC and OC (DW: and N) multiples of 16; needs an FP8 GPU (sm_89 / sm_90) */
	int own;        /* (FWD: with relu2, below) DINP with gelu, bf16: run our own Hopper GEMM (kernels/gemm_sm90.h) with
	                 * the DGELU epilogue, untimed, no cuBLASLt: W comes as its transpose (IC,
	                 * OC), and ng_matmul_run_dgelu can write GELU(aux) as well (the activation
	                 * --recompute gelu needs); with bias, also the column sums of dinp (the fc
	                 * bias gradient). Needs ng_gemm_sm90_available(). */
	int relu2;      /* FWD with own, no bias / gelu / fp8 / accumulate (the speedrun model's
	                 * MLP): out = max(inp @ W^T, 0)^2 on our own GEMM, rounded once */
};

/* Choices kept: autotune's pick for one matmul, remembered so that the next plan of the same
 * matmul on the same GPU and cuBLASLt takes it untimed. The key is the spec, the ctx's alignment
 * and workspace limit, the bias-gradient form, and a hash of the heuristic's candidates in their
 * order: a cuBLASLt that offers other candidates gets timed again. */
struct ng_matmul_choice {
	struct ng_matmul_spec spec;
	unsigned align_bytes;
	unsigned long long workspace_bytes;
	int colsum;
	unsigned long long candidates_hash; /* FNV-1a over the candidates' algo bytes */
	int n_candidates;
	int chosen;                         /* index among them */
	float ms;                           /* its time when chosen (informative) */
};

/* A planned matmul; every descriptor lives until ng_matmul_free(). */
struct ng_matmul {
	struct ng_matmul_spec spec;       /* what was asked for */
	cublasLtHandle_t lt;              /* the ctx's handle */
	cublasLtMatmulDesc_t desc;        /* ops, compute type, epilogue, aux ld/type, bias type */
	cublasLtMatrixLayout_t a, b, c, d;/* column-major layouts of A, B, C (= D) and D */
	cublasLtMatmulAlgo_t algo;        /* the chosen algorithm */
	cublasLtMatrixTransformDesc_t add;/* DW + bias + accumulate: dbias += scratch; else NULL */
	cublasLtMatrixLayout_t vec;       /* layout of dbias / its scratch (OC, 1) fp32; or NULL */
	size_t algo_ws;                   /* workspace bytes the algorithm uses (front of ws) */
	int colsum;                       /* DW + bias by the column-sum matmul below */
	cublasLtMatmulDesc_t sdesc;       /* colsum: dbias (OC,1) (+)= 1/3 dout^T (OC,N) @ 3s (N,1) */
	cublasLtMatrixLayout_t sa, sb, sd;/* colsum: layouts of dout, the 3s vector, dbias */
	cublasLtMatmulAlgo_t salgo;       /* colsum: its algorithm (heuristic's first) */
	size_t salgo_ws;                  /* colsum: its workspace bytes (front of ws) */
	size_t threes_off;                /* colsum: offset of the N bf16 3.0s in the workspace */
	size_t scratch_off;               /* offset of the dbias scratch in the workspace */
	size_t workspace_need;            /* bytes the caller's workspace must have */
	unsigned align_bytes;             /* pointer alignment checked at run */
	int m, n, k;                      /* cuBLASLt's problem size (see the table above) */
	float beta;                       /* 0, or 1 when DW accumulates */
	int n_candidates;                 /* candidates considered: the heuristic's results, then
	                                   * our own GEMM where it is one (see own_gemm) */
	int chosen;                       /* index of the chosen one among them (0 = heuristic's) */
	int own;                          /* 0: cuBLASLt runs; 1: our own GEMM runs instead (the
	                                   * chosen candidate, or spec.own) */
	float tuned_ms[10];               /* autotune: ms per candidate (0 when not timed) */
};

/* Create the cuBLASLt handle. workspace_bytes: the most one matmul may use (32 MiB is plenty on
 * Hopper). Defaults: align 16, autotune 8 candidates x 10 repetitions then 100 ms sustained each,
 * dbias_colsum 1. */
enum ng_status ng_matmul_ctx_init(struct ng_matmul_ctx *ctx, size_t workspace_bytes);
void ng_matmul_ctx_free(struct ng_matmul_ctx *ctx);

/* Describe one matmul and choose its algorithm. With spec->autotune it allocates scratch
 * buffers, times candidates on the legacy default stream and frees them: call it before any
 * capture. Fails with NG_ERR_INPUT for a bad shape, NG_ERR_RUNTIME when cuBLASLt offers no
 * algorithm (the message names the shape and the cuBLASLt status). */
enum ng_status ng_matmul_plan(struct ng_matmul *mm, struct ng_matmul_ctx *ctx,
			      const struct ng_matmul_spec *spec);

/* ctx learns choice c (replacing the one of the same key). */
enum ng_status ng_matmul_choice_add(struct ng_matmul_ctx *ctx, const struct ng_matmul_choice *c);

/* Read the choices kept in the text file at path into ctx, for the GPU and cuBLASLt named by
 * device (one word, e.g. "NVIDIA_H200_sm_90_cublasLt_130000"). A missing file, or one made for
 * another device, loads nothing and is not an error; a file that cannot be parsed loads
 * nothing and fails with NG_ERR_INPUT naming the line (the caller may go on: the choices are
 * only a cache). All or nothing: on failure ctx is as before. *loaded: how many were read. */
enum ng_status ng_matmul_choices_load(struct ng_matmul_ctx *ctx, const char *path,
				      const char *device, int *loaded);

/* Write every choice ctx knows to path (through path.tmp.PID and a rename, so a reader never
 * sees half a file), creating path's directory if missing. NG_ERR_INPUT when it cannot. */
enum ng_status ng_matmul_choices_save(const struct ng_matmul_ctx *ctx, const char *path,
				      const char *device);

/* Run a planned matmul on stream s. Pointer meanings per kind (all device, row-major):
 *              out               a                 b                bias       aux         dbias
 *   FWD   out (N,OC) bf16  inp (N,IC) bf16   W (OC,IC) bf16   (OC) bf16  (N,OC) bf16 w  -
 *   DINP  dinp (N,IC) bf16 dout (N,OC) bf16  W (OC,IC) bf16   -          (N,IC) bf16 r  -
 *   DW    dW (OC,IC) fp32  dout (N,OC) bf16  inp (N,IC) bf16  -          -           (OC) fp32
 * "-": ignored, pass NULL. bias / aux / dbias are required exactly when spec.bias / spec.gelu
 * ask for them. workspace: device memory of mm->workspace_need bytes, NG_MATMUL_WORKSPACE_ALIGN-
 * aligned (may be NULL when the need is 0), not used by anything else running concurrently. */
enum ng_status ng_matmul_run(const struct ng_matmul *mm, void *out, const void *a, const void *b,
			     const void *bias, void *aux, void *dbias, void *workspace,
			     cudaStream_t s);

/* Run a FWD plan with spec.accumulate: out = residual + inp @ W^T (+ bias). residual (N, OC)
 * bf16 may be out itself (cuBLASLt's C and D may share a buffer). a_descale / b_descale:
 * NULL for a bf16 plan, the device descales of ng_matmul_run_fp8 for an fp8 one. */
enum ng_status ng_matmul_run_residual(const struct ng_matmul *mm, void *out, const void *a,
				      const void *b, const void *bias, const void *residual,
				      const float *a_descale, const float *b_descale,
				      void *workspace, cudaStream_t s);

/* Run an fp8 plan. FWD: a = inp (N, IC) E4M3, b = W (OC, IC) E4M3, out = a_descale *
 * b_descale * (a @ b^T) (+ bias) (GELU), bf16. DINP: a = dout (N, OC) E5M2, b = W^T (IC, OC)
 * E4M3, out (N, IC) = a_descale * b_descale * (a @ b^T) (DGELU with aux), bf16. DW: a = dout^T
 * (OC, N) E5M2, b = inp^T (IC, N) E4M3, out (OC, IC) fp32 (+)= a_descale * b_descale * (a @
 * b^T). The descales are device floats (kernels/fp8.h), read when
 * the matmul runs, so a captured graph follows their updates; each must be 16-byte aligned
 * (cuBLASLt answers CUBLAS_STATUS_NOT_SUPPORTED otherwise). Other pointers as ng_matmul_run. */
enum ng_status ng_matmul_run_fp8(const struct ng_matmul *mm, void *out, const void *a,
				 const void *b, const void *bias, void *aux, const float *a_descale,
				 const float *b_descale, void *workspace, cudaStream_t s);

/* Run a DINP plan with spec.own: dinp = (dout @ W) * GELU'(aux) as ng_matmul_run, from wt = W^T
 * (IC, OC) bf16 (ng_transpose_bf16 makes it), and post (N, IC) bf16 = GELU(aux) unless post is
 * NULL, from the same read of aux. With spec.bias also dbias (IC) fp32 = (accumulate: dbias +)
 * the column sums of dinp as stored (bf16): the bias gradient of the layer whose output
 * gradient dinp is, summed in the epilogue (partial rows in the workspace, then reduced in a
 * fixed order), so dinp is not read again. The workspace: mm->workspace_need bytes. */
enum ng_status ng_matmul_run_dgelu(const struct ng_matmul *mm, void *dinp, const void *dout,
				   const void *wt, void *aux, void *post, float *dbias,
				   int accumulate, void *workspace, cudaStream_t s);

/* FLOPs of one run (2 * N * IC * OC), for benchmarks. */
double ng_matmul_flops(const struct ng_matmul_spec *spec);

void ng_matmul_free(struct ng_matmul *mm);

#ifdef __cplusplus
}
#endif

#endif
