/*
 * kernels/muon_ns.h — Muon's Newton-Schulz orthogonalisation (kernels/muon.h) of a batch of
 * same-shape bf16 matrices as strided-batched cuBLASLt GEMMs, planned ahead: ng_muon_ns_plan
 * builds the three GEMMs of one step (A = X X^T; B = b A + c A A; X' = a X + B X, or for a tall
 * X: A = X^T X, X' = a X + X B) for the whole batch, with their layouts, batch strides and
 * algorithms (cuBLASLt's heuristic, within the workspace given); ng_muon_ns_run only enqueues
 * 3 x steps cublasLtMatmul calls, so it can be captured. One launch a sub-step for the whole
 * batch (all L layers of a kind), not one a matrix. Operands bf16, accumulation fp32
 * (CUBLAS_COMPUTE_32F), alpha and beta fp32 constants of the plan.
 *
 * Row-major (R, C) matrices are column-major (C, R) ones with ld = C (as kernels/matmul.h).
 * Buffers: x0 and x1 (batch, x_stride) bf16, the iterate ping-ponging between them (x0 in,
 * the result in x0 when steps is even, else x1); a and b (batch, n, n) bf16 with n = min(rows,
 * cols), n * n apart; the workspace ws_bytes. Pointers 16-byte aligned; x_stride >= rows * cols.
 */
#ifndef NG_KERNELS_MUON_NS_H
#define NG_KERNELS_MUON_NS_H

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stddef.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The heuristic's offers kept per GEMM for ng_muon_ns_tune. */
#define NG_MUON_NS_CANDIDATES 8

struct ng_muon_ns {
	int batch;                        /* matrices */
	int rows, cols;                   /* each, row-major */
	int n;                            /* min(rows, cols): the Gram matrix's size */
	int steps;                        /* Newton-Schulz steps */
	size_t x_stride;                  /* elements between two matrices of x0 / x1 */
	size_t ws_bytes;                  /* cuBLASLt workspace each GEMM may use */
	cublasLtHandle_t lt;
	cublasLtMatmulDesc_t desc[3];     /* gram, poly, update */
	cublasLtMatrixLayout_t lay[3][3]; /* per GEMM: cuBLASLt's A, B, C (= D) */
	cublasLtMatmulAlgo_t algo[3];     /* the one each GEMM runs */
	cublasLtMatmulAlgo_t cand[3][NG_MUON_NS_CANDIDATES]; /* the heuristic's offers, best first */
	int n_cand[3];
	float alpha[3], beta[3];
	int planned;
};

/* Plan the batch. NG_ERR_INPUT for bad sizes, NG_ERR_RUNTIME when cuBLASLt offers no
 * algorithm (naming the GEMM and the shape). */
enum ng_status ng_muon_ns_plan(struct ng_muon_ns *p, cublasLtHandle_t lt, int batch, int rows,
			       int cols, size_t x_stride, int steps, size_t ws_bytes);
/* Time every offered algorithm of each GEMM on the buffers of ng_muon_ns_run (x0 holding a
 * normalised batch; left as scratch) and keep the fastest; ms[k] (may be NULL) gets the chosen
 * time of GEMM k. Synchronises s: call at plan time, never while capturing. */
enum ng_status ng_muon_ns_tune(struct ng_muon_ns *p, ng_bf16 *x0, ng_bf16 *x1, ng_bf16 *a,
			       ng_bf16 *b, void *ws, cudaStream_t s, float ms[3]);
/* Enqueue the iteration: x0 holds the normalised X; *result gets x0 or x1. */
enum ng_status ng_muon_ns_run(const struct ng_muon_ns *p,
			      ng_bf16 *x0,      /* (batch, x_stride) bf16, in; scratch after */
			      ng_bf16 *x1,      /* (batch, x_stride) bf16, scratch */
			      ng_bf16 *a,       /* (batch, n, n) bf16, scratch */
			      ng_bf16 *b,       /* (batch, n, n) bf16, scratch */
			      void *ws,         /* ws_bytes */
			      ng_bf16 **result, cudaStream_t s);
void ng_muon_ns_free(struct ng_muon_ns *p);

#ifdef __cplusplus
}
#endif

#endif
