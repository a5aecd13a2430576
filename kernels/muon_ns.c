/*
 * kernels/muon_ns.c — the Newton-Schulz iteration of Muon as strided-batched cuBLASLt GEMMs
 * (see muon_ns.h). Its own file rather than kernels/matmul.c: that wrapper plans the GPT-2
 * layer shapes (one matrix, bias and GELU epilogues), while these GEMMs need a batch count,
 * batch strides and general alpha / beta with C = one of the inputs' shape.
 *
 * A row-major product D (M x N) = op(P) (M x K) op(Q) (K x N) is, column-major,
 * D^T = op(Q)^T op(P)^T: cuBLASLt's A is Q's storage and its B is P's (no copies):
 *   Q stored (K, N) row-major -> A = (N x K, ld N), op N;  stored (N, K) -> (K x N, ld K), op T
 *   P stored (M, K) row-major -> B = (K x M, ld K), op N;  stored (K, M) -> (M x K, ld M), op T
 *   C = D = (N x M, ld N).
 * The three GEMMs of a step, wide X (rows <= cols, n = rows) and tall X (n = cols):
 *   gram    A = X X^T (P = X, Q = X^T)           A = X^T X (P = X^T, Q = X)
 *   poly    B = c (A A) + b A                    the same
 *   update  X' = B X + a X                       X' = X B + a X
 * References: cuBLASLt documentation, cublasLtMatmul and "cublasLtMatrixLayoutAttribute_t"
 * (BATCH_COUNT, STRIDED_BATCH_OFFSET).
 */
#include "kernels/muon_ns.h"

#include <string.h>

#include "kernels/check.h"
#include "kernels/muon.h"

enum { GEMM_GRAM, GEMM_POLY, GEMM_UPDATE };

/* The largest power of two <= 16 that divides the byte stride of a batch (the bases are
 * 16-byte aligned), so that the heuristic only offers algorithms this alignment allows. */
static unsigned stride_align(size_t stride_elems)
{
	size_t b = stride_elems * 2;
	unsigned a = 16;
	while (a > 2 && b % a)
		a /= 2;
	return a;
}

static enum ng_status layout(cublasLtMatrixLayout_t *l, int rows, int cols, int ld, int batch,
			     size_t stride)
{
	int64_t st = (int64_t)stride;
	if (NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(l, CUDA_R_16BF, (uint64_t)rows,
						       (uint64_t)cols, ld)) ||
	    NG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
							     &batch, sizeof(batch))) ||
	    NG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
		    *l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &st, sizeof(st))))
		return NG_ERR_RUNTIME;
	return NG_OK;
}

/* GEMM k: D (M x N) = alpha op(P) op(Q) + beta C, row-major; tp / tq: P stored (K, M) / Q
 * stored (N, K); sp, sq, sd the batch strides. */
static enum ng_status plan_gemm(struct ng_muon_ns *p, int k, int M, int N, int K, int tp,
				int tq, size_t sp, size_t sq, size_t sd, float alpha, float beta)
{
	static const char *names[3] = { "gram", "poly", "update" };
	cublasOperation_t opa = tq ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tp ? CUBLAS_OP_T : CUBLAS_OP_N;
	p->alpha[k] = alpha;
	p->beta[k] = beta;
	if (NG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc[k], CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
	    NG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc[k], CUBLASLT_MATMUL_DESC_TRANSA,
							   &opa, sizeof(opa))) ||
	    NG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc[k], CUBLASLT_MATMUL_DESC_TRANSB,
							   &opb, sizeof(opb))))
		return NG_ERR_RUNTIME;
	enum ng_status st = tq ? layout(&p->lay[k][0], K, N, K, p->batch, sq)
			       : layout(&p->lay[k][0], N, K, N, p->batch, sq);
	if (!st)
		st = tp ? layout(&p->lay[k][1], M, K, M, p->batch, sp)
			: layout(&p->lay[k][1], K, M, K, p->batch, sp);
	if (!st)
		st = layout(&p->lay[k][2], N, M, N, p->batch, sd);
	if (st)
		return st;
	cublasLtMatmulPreference_t pref;
	if (NG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref)))
		return NG_ERR_RUNTIME;
	uint32_t aa = stride_align(sq), ab = stride_align(sp), ad = stride_align(sd);
	cublasLtMatmulHeuristicResult_t res[NG_MUON_NS_CANDIDATES];
	int found = 0;
	if (NG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
		    pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &p->ws_bytes,
		    sizeof(p->ws_bytes))) ||
	    NG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
		    pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa))) ||
	    NG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
		    pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab))) ||
	    NG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
		    pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ad, sizeof(ad))) ||
	    NG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
		    pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof(ad)))) {
		cublasLtMatmulPreferenceDestroy(pref);
		return NG_ERR_RUNTIME;
	}
	cublasStatus_t cs = cublasLtMatmulAlgoGetHeuristic(p->lt, p->desc[k], p->lay[k][0],
							   p->lay[k][1], p->lay[k][2], p->lay[k][2],
							   pref, NG_MUON_NS_CANDIDATES, res, &found);
	cublasLtMatmulPreferenceDestroy(pref);
	if (cs != CUBLAS_STATUS_SUCCESS || found == 0) {
		ng_fail(NG_ERR_RUNTIME, "muon: cuBLASLt has no algorithm for the %s GEMM of %d "
			"matrices (%d x %d) x (%d x %d) (status %d)", names[k], p->batch, M, K, K, N,
			(int)cs);
		ng_hint("a larger workspace may help");
		return NG_ERR_RUNTIME;
	}
	p->n_cand[k] = 0;
	for (int i = 0; i < found; i++)
		if (res[i].state == CUBLAS_STATUS_SUCCESS)
			p->cand[k][p->n_cand[k]++] = res[i].algo;
	if (p->n_cand[k] == 0)
		return ng_fail(NG_ERR_RUNTIME, "muon: no usable algorithm for the %s GEMM", names[k]);
	p->algo[k] = p->cand[k][0];
	return NG_OK;
}

enum ng_status ng_muon_ns_plan(struct ng_muon_ns *p, cublasLtHandle_t lt, int batch, int rows,
			       int cols, size_t x_stride, int steps, size_t ws_bytes)
{
	memset(p, 0, sizeof(*p));
	if (batch < 1 || rows < 1 || cols < 1 || steps < 1 || x_stride < (size_t)rows * cols)
		return ng_check_arg_fail("ng_muon_ns_plan", "batch %d of (%d x %d), stride %zu, "
					 "%d steps", batch, rows, cols, x_stride, steps);
	p->lt = lt;
	p->batch = batch;
	p->rows = rows;
	p->cols = cols;
	p->steps = steps;
	p->x_stride = x_stride;
	p->ws_bytes = ws_bytes;
	int tall = rows > cols, n = tall ? cols : rows, r = rows, c = cols;
	p->n = n;
	size_t nn = (size_t)n * n;
	enum ng_status st;
	if (!tall) /* A = X X^T: P = X (r x c), Q = X^T, stored (r, c) = (N, K) */
		st = plan_gemm(p, GEMM_GRAM, r, r, c, 0, 1, x_stride, x_stride, nn, 1.0f, 0.0f);
	else /* A = X^T X: P = X^T, stored (r, c) = (K, M); Q = X (K x N) */
		st = plan_gemm(p, GEMM_GRAM, c, c, r, 1, 0, x_stride, x_stride, nn, 1.0f, 0.0f);
	if (!st)
		st = plan_gemm(p, GEMM_POLY, n, n, n, 0, 0, nn, nn, nn, (float)NG_MUON_NS_C,
			       (float)NG_MUON_NS_B);
	if (!st && !tall) /* X' = B X: P = B (r x r), Q = X (r x c) */
		st = plan_gemm(p, GEMM_UPDATE, r, c, r, 0, 0, nn, x_stride, x_stride, 1.0f,
			       (float)NG_MUON_NS_A);
	else if (!st) /* X' = X B: P = X (r x c), Q = B (c x c) */
		st = plan_gemm(p, GEMM_UPDATE, r, c, c, 0, 0, x_stride, nn, x_stride, 1.0f,
			       (float)NG_MUON_NS_A);
	if (st) {
		ng_muon_ns_free(p);
		return st;
	}
	p->planned = 1;
	return NG_OK;
}

/* D = alpha op(P) op(Q) + beta C of GEMM k with its algorithm: cuBLASLt's status, unchecked
 * (the tuner skips an offered algorithm that does not run here without recording an error). */
static cublasStatus_t gemm_status(const struct ng_muon_ns *p, int k, const void *P, const void *Q,
				  const void *C, void *D, void *ws, cudaStream_t s)
{
	return cublasLtMatmul(p->lt, p->desc[k], &p->alpha[k], Q, p->lay[k][0], P, p->lay[k][1],
			      &p->beta[k], C, p->lay[k][2], D, p->lay[k][2], &p->algo[k], ws,
			      p->ws_bytes, s);
}

/* The same, checked. */
static enum ng_status run_gemm(const struct ng_muon_ns *p, int k, const void *P, const void *Q,
			       const void *C, void *D, void *ws, cudaStream_t s)
{
	return NG_CUBLAS_CHECK(gemm_status(p, k, P, Q, C, D, ws, s)) ? NG_ERR_RUNTIME : NG_OK;
}

/* The operands of GEMM k in the first Newton-Schulz step (as ng_muon_ns_run passes them). */
static void operands(const struct ng_muon_ns *p, int k, ng_bf16 *x, ng_bf16 *y, ng_bf16 *a,
		     ng_bf16 *b, const void *io[4])
{
	int tall = p->rows > p->cols;
	const void *gram[4] = { x, x, a, a }, *poly[4] = { a, a, a, b };
	const void *upd_w[4] = { b, x, x, y }, *upd_t[4] = { x, b, x, y };
	const void *const *src = k == GEMM_GRAM ? gram : k == GEMM_POLY ? poly
				 : tall ? upd_t : upd_w;
	for (int i = 0; i < 4; i++)
		io[i] = src[i];
}

enum ng_status ng_muon_ns_tune(struct ng_muon_ns *p, ng_bf16 *x0, ng_bf16 *x1, ng_bf16 *a,
			       ng_bf16 *b, void *ws, cudaStream_t s, float ms[3])
{
	enum { WARM = 2, REPS = 10 };
	if (!p->planned)
		return ng_check_arg_fail("ng_muon_ns_tune", "not planned");
	cudaEvent_t ev[2] = { 0, 0 };
	enum ng_status st = NG_CUDA_CHECK(cudaEventCreate(&ev[0]));
	if (!st)
		st = NG_CUDA_CHECK(cudaEventCreate(&ev[1]));
	for (int k = 0; k < 3 && !st; k++) {
		const void *io[4];
		operands(p, k, x0, x1, a, b, io);
		float best = -1.0f;
		int pick = 0;
		for (int c = 0; c < p->n_cand[k] && !st; c++) {
			p->algo[k] = p->cand[k][c];
			cublasStatus_t cs = CUBLAS_STATUS_SUCCESS;
			for (int i = 0; i < WARM && cs == CUBLAS_STATUS_SUCCESS; i++)
				cs = gemm_status(p, k, io[0], io[1], io[2], (void *)io[3], ws, s);
			if (cs != CUBLAS_STATUS_SUCCESS) /* an offer that does not run here */
				continue;
			st = NG_CUDA_CHECK(cudaEventRecord(ev[0], s));
			for (int i = 0; i < REPS && !st; i++)
				st = run_gemm(p, k, io[0], io[1], io[2], (void *)io[3], ws, s);
			float t = 0.0f;
			if (!st)
				st = NG_CUDA_CHECK(cudaEventRecord(ev[1], s));
			if (!st)
				st = NG_CUDA_CHECK(cudaEventSynchronize(ev[1]));
			if (!st)
				st = NG_CUDA_CHECK(cudaEventElapsedTime(&t, ev[0], ev[1]));
			if (!st && (best < 0.0f || t < best)) {
				best = t;
				pick = c;
			}
		}
		p->algo[k] = p->cand[k][pick];
		if (ms)
			ms[k] = best / REPS;
	}
	for (int i = 0; i < 2; i++)
		if (ev[i])
			cudaEventDestroy(ev[i]);
	return st;
}

enum ng_status ng_muon_ns_run(const struct ng_muon_ns *p, ng_bf16 *x0, ng_bf16 *x1, ng_bf16 *a,
			      ng_bf16 *b, void *ws, ng_bf16 **result, cudaStream_t s)
{
	if (!p->planned)
		return ng_check_arg_fail("ng_muon_ns_run", "not planned");
	int tall = p->rows > p->cols;
	ng_bf16 *x = x0, *y = x1;
	for (int i = 0; i < p->steps; i++) {
		enum ng_status st = run_gemm(p, GEMM_GRAM, x, x, a, a, ws, s); /* P, Q: X */
		if (!st)
			st = run_gemm(p, GEMM_POLY, a, a, a, b, ws, s);
		if (!st)
			st = tall ? run_gemm(p, GEMM_UPDATE, x, b, x, y, ws, s)
				  : run_gemm(p, GEMM_UPDATE, b, x, x, y, ws, s);
		if (st)
			return st;
		ng_bf16 *t = x;
		x = y;
		y = t;
	}
	*result = x;
	return NG_OK;
}

void ng_muon_ns_free(struct ng_muon_ns *p)
{
	for (int k = 0; k < 3; k++) {
		for (int j = 0; j < 3; j++)
			if (p->lay[k][j])
				cublasLtMatrixLayoutDestroy(p->lay[k][j]);
		if (p->desc[k])
			cublasLtMatmulDescDestroy(p->desc[k]);
	}
	memset(p, 0, sizeof(*p));
}
