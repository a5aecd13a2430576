/*
 * kernels/matmul.c — cuBLASLt matmuls planned ahead (see matmul.h for the shapes, the pointer
 * table and the epilogue semantics).
 *
 * Plan: descriptor + layouts + epilogue, then cublasLtMatmulAlgoGetHeuristic with the run's
 * pointer alignment and workspace limit; with autotune, the top candidates are timed on scratch
 * buffers (CUDA events: a burst median of ctx->tune_reps, then ~ctx->tune_sustained_ms of
 * back-to-back launches each on a GPU held busy) and the fastest under sustained load kept
 * (and remembered in ctx: "Choices kept", matmul.h). Run: set the bias / aux pointer
 * attributes (host-only writes into the descriptor) and call cublasLtMatmul, plus one
 * cublasLtMatrixTransform when an accumulated bias gradient must be added from its scratch.
 *
 * Column-major mapping (row-major (R, C) = column-major (C, R), ld = C):
 *   FWD : D (OC, N) = op_T(W: IC x OC, ld IC) * inp (IC x N, ld IC)
 *   DINP: D (IC, N) = W (IC x OC, ld IC) * dout (OC x N, ld OC)
 *   DW  : D (IC, OC) = inp (IC x N, ld IC) * op_T(dout: OC x N, ld OC)
 * so cuBLASLt's A is always run()'s `b` argument and B is always `a`.
 */
#include "kernels/matmul.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/gemm_sm90.h"

#define NG_MM_MAX_CANDIDATES 8
#define NG_MM_MAX_OWN 1 /* our own GEMM: one candidate after cuBLASLt's */
/* Our GEMM's mark in a choice's candidate hash (with its revision): the byte its one tile has
 * always hashed as, so that choice files already written stay valid. */
#define NG_MM_OWN_MARK 0xA0u
#define NG_MM_SCRATCH_ALIGN 256
_Static_assert(NG_MM_MAX_CANDIDATES + NG_MM_MAX_OWN <=
		       (int)(sizeof(((struct ng_matmul *)0)->tuned_ms) / sizeof(float)),
	       "ng_matmul.tuned_ms holds a time for every candidate");

static const char *kind_name_(enum ng_matmul_kind k)
{
	switch (k) {
	case NG_MATMUL_FWD: return "FWD";
	case NG_MATMUL_DINP: return "DINP";
	case NG_MATMUL_DW: return "DW";
	}
	return "?";
}

static size_t round_up_(size_t x, size_t a) { return (x + a - 1) / a * a; }

enum ng_status ng_matmul_ctx_init(struct ng_matmul_ctx *ctx, size_t workspace_bytes)
{
	memset(ctx, 0, sizeof(*ctx));
	if (NG_CUBLAS_CHECK(cublasLtCreate(&ctx->lt))) {
		ng_hint("is a CUDA device visible (nvidia-smi)?");
		return NG_ERR_RUNTIME;
	}
	ctx->workspace_bytes = workspace_bytes;
	ctx->align_bytes = 16;
	ctx->tune_candidates = NG_MM_MAX_CANDIDATES;
	ctx->tune_reps = 10;
	ctx->tune_sustained_ms = 100.0f;
	ctx->force_candidate = -1;
	ctx->own_gemm = 1;
	ctx->dbias_colsum = 1; /* measured faster than BGRADB at every d12/d48 shape (matmul.h) */
	return NG_OK;
}

void ng_matmul_ctx_free(struct ng_matmul_ctx *ctx)
{
	if (ctx->lt)
		cublasLtDestroy(ctx->lt);
	free(ctx->choices);
	memset(ctx, 0, sizeof(*ctx));
}

double ng_matmul_flops(const struct ng_matmul_spec *spec)
{
	return 2.0 * spec->N * (double)spec->IC * spec->OC;
}

void ng_matmul_free(struct ng_matmul *mm)
{
	if (mm->desc)
		cublasLtMatmulDescDestroy(mm->desc);
	if (mm->a)
		cublasLtMatrixLayoutDestroy(mm->a);
	if (mm->b)
		cublasLtMatrixLayoutDestroy(mm->b);
	if (mm->c)
		cublasLtMatrixLayoutDestroy(mm->c);
	if (mm->d)
		cublasLtMatrixLayoutDestroy(mm->d);
	if (mm->add)
		cublasLtMatrixTransformDescDestroy(mm->add);
	if (mm->vec)
		cublasLtMatrixLayoutDestroy(mm->vec);
	if (mm->sdesc)
		cublasLtMatmulDescDestroy(mm->sdesc);
	cublasLtMatrixLayout_t l[3] = {mm->sa, mm->sb, mm->sd};
	for (int i = 0; i < 3; i++)
		if (l[i])
			cublasLtMatrixLayoutDestroy(l[i]);
	memset(mm, 0, sizeof(*mm));
}

static enum ng_status check_spec_(const struct ng_matmul_spec *sp)
{
	const char *k = kind_name_(sp->kind);
	if (sp->kind != NG_MATMUL_FWD && sp->kind != NG_MATMUL_DINP && sp->kind != NG_MATMUL_DW)
		return ng_check_arg_fail("ng_matmul_plan", "unknown kind %d", (int)sp->kind);
	if (sp->N < 1 || sp->IC < 8 || sp->OC < 8 || sp->IC % 8 || sp->OC % 8) {
		ng_check_arg_fail("ng_matmul_plan",
				  "%s N=%d IC=%d OC=%d: need N >= 1 and IC, OC positive multiples of 8 "
				  "(16-byte leading dimensions)", k, sp->N, sp->IC, sp->OC);
		ng_hint("pad the channel counts to a multiple of 8");
		return NG_ERR_INPUT;
	}
	if (sp->gelu && sp->kind == NG_MATMUL_DW)
		return ng_check_arg_fail("ng_matmul_plan", "DW N=%d IC=%d OC=%d: gelu is for FWD/DINP",
					 sp->N, sp->IC, sp->OC);
	if (sp->bias && sp->kind == NG_MATMUL_DINP && !sp->own)
		return ng_check_arg_fail("ng_matmul_plan", "DINP N=%d IC=%d OC=%d: bias is for FWD/DW "
					 "(and our own GEMM's DINP)", sp->N, sp->IC, sp->OC);
	if (sp->accumulate && (sp->kind == NG_MATMUL_DINP || sp->gelu))
		return ng_check_arg_fail("ng_matmul_plan", "%s N=%d IC=%d OC=%d: accumulate is for DW, "
					 "or FWD without gelu (a residual add)", k, sp->N, sp->IC,
					 sp->OC);
	if (sp->fp8 && (sp->IC % 16 || sp->OC % 16 ||
			(sp->kind == NG_MATMUL_DW && (sp->N % 16 || sp->bias)))) {
		ng_check_arg_fail("ng_matmul_plan", "%s N=%d IC=%d OC=%d: fp8 needs IC and OC "
				  "multiples of 16, and a DW also N a multiple of 16 and no bias", k,
				  sp->N, sp->IC, sp->OC);
		ng_hint("FP8 operands need 16-byte leading dimensions in cuBLASLt's transposed-A "
			"(\"TN\") layout; a DW takes both operands transposed, (OC, N) and (IC, N)");
		return NG_ERR_INPUT;
	}
	if (sp->relu2 && (!sp->own || sp->gelu || sp->bias || sp->fp8 || sp->accumulate ||
			  sp->kind != NG_MATMUL_FWD))
		return ng_check_arg_fail("ng_matmul_plan", "%s N=%d IC=%d OC=%d: relu2 is for our "
					 "own GEMM's bf16 FWD, without gelu, bias or accumulate", k,
					 sp->N, sp->IC, sp->OC);
	if (sp->own && !sp->relu2 && (sp->kind != NG_MATMUL_DINP || !sp->gelu || sp->fp8))
		return ng_check_arg_fail("ng_matmul_plan", "%s N=%d IC=%d OC=%d: own is for a bf16 "
					 "DINP with gelu, or relu2", k, sp->N, sp->IC, sp->OC);
	if (sp->own && !ng_gemm_sm90_available()) {
		ng_fail(NG_ERR_RUNTIME, "ng_matmul_plan: DINP N=%d IC=%d OC=%d on our own GEMM needs "
			"an sm_90 GPU and a build for sm_90a", sp->N, sp->IC, sp->OC);
		ng_hint("--gelu-fusion auto or bwd take cuBLASLt's DGELU instead");
		return NG_ERR_RUNTIME;
	}
	return NG_OK;
}

static enum ng_status set_attr_(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a,
				const void *v, size_t n)
{
	return NG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, a, v, n));
}

/* Descriptor, layouts and epilogue of the spec (no algorithm yet). */
static enum ng_status build_descriptors_(struct ng_matmul *mm)
{
	const struct ng_matmul_spec *sp = &mm->spec;
	const uint64_t N = (uint64_t)sp->N, IC = (uint64_t)sp->IC, OC = (uint64_t)sp->OC;
	cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
	cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
	cudaDataType_t dt = CUDA_R_16BF;
	uint64_t ar, ac, br, bc; /* rows, cols of A and B as stored (column-major) */
	switch (sp->kind) {
	case NG_MATMUL_FWD:
		mm->m = sp->OC; mm->n = sp->N; mm->k = sp->IC;
		ta = CUBLAS_OP_T; ar = IC; ac = OC; br = IC; bc = N;
		if (sp->gelu)
			epi = sp->bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
		else if (sp->bias)
			epi = CUBLASLT_EPILOGUE_BIAS;
		break;
	case NG_MATMUL_DINP:
		mm->m = sp->IC; mm->n = sp->N; mm->k = sp->OC;
		ar = IC; ac = OC; br = OC; bc = N;
		if (sp->fp8) { /* A = W^T's E4M3 copy, (IC, OC) row-major: "TN" */
			ta = CUBLAS_OP_T;
			ar = OC; ac = IC;
		}
		if (sp->gelu)
			epi = CUBLASLT_EPILOGUE_DGELU;
		break;
	default: /* NG_MATMUL_DW */
		mm->m = sp->IC; mm->n = sp->OC; mm->k = sp->N;
		tb = CUBLAS_OP_T; ar = IC; ac = N; br = OC; bc = N;
		if (sp->fp8) { /* A = inp^T (IC, N), B = dout^T (OC, N) row-major: "TN" */
			ta = CUBLAS_OP_T;
			tb = CUBLAS_OP_N;
			ar = N; ac = IC; br = N; bc = OC;
		}
		dt = CUDA_R_32F;
		if (sp->bias && !mm->colsum)
			epi = CUBLASLT_EPILOGUE_BGRADB;
		break;
	}
	mm->beta = sp->accumulate ? 1.0f : 0.0f;

	if (NG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&mm->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)))
		return NG_ERR_RUNTIME;
	if (set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) ||
	    set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) ||
	    set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)))
		return NG_ERR_RUNTIME;
	/* The heuristic reads the bias / aux pointer values for their alignment only: a fake
	 * pointer aligned exactly as the run's pointers promise keeps its choice valid for them. */
	const void *fake = (const void *)(uintptr_t)mm->align_bytes;
	if (sp->bias && !mm->colsum) {
		int32_t bt = (sp->kind == NG_MATMUL_DW) ? CUDA_R_32F : CUDA_R_16BF;
		if (set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)) ||
		    set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &fake, sizeof(fake)))
			return NG_ERR_RUNTIME;
	}
	/* FP8: the scale pointers are part of what the heuristic matches (a plan chosen without
	 * them is refused at run time with them set, CUBLAS_STATUS_NOT_SUPPORTED); the run sets
	 * the real device pointers */
	if (sp->fp8 && (set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &fake,
				  sizeof(fake)) ||
			set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &fake,
				  sizeof(fake))))
		return NG_ERR_RUNTIME;
	if (sp->gelu) {
		int64_t ld = mm->m; /* aux has D's shape: (m, n) column-major */
		int32_t at = CUDA_R_16BF;
		if (set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)) ||
		    set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &at, sizeof(at)) ||
		    set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &fake, sizeof(fake)))
			return NG_ERR_RUNTIME;
	}
	/* FWD: A = W, B = inp, both E4M3; DINP: A = W^T in E4M3, B = dout in E5M2; DW: A =
	 * inp^T in E4M3, B = dout^T in E5M2 */
	cudaDataType_t a_t = sp->fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
	cudaDataType_t b_t = !sp->fp8 ? CUDA_R_16BF
			     : sp->kind == NG_MATMUL_FWD ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
	if (NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&mm->a, a_t, ar, ac, (int64_t)ar)) ||
	    NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&mm->b, b_t, br, bc, (int64_t)br)) ||
	    NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&mm->c, dt, (uint64_t)mm->m, (uint64_t)mm->n,
						       mm->m)) ||
	    NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&mm->d, dt, (uint64_t)mm->m, (uint64_t)mm->n,
						       mm->m)))
		return NG_ERR_RUNTIME;
	if (mm->colsum) { /* dbias (OC, 1) = dout (OC x N, ld OC) * v (N x 1, ld N up to 8) */
		if (NG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&mm->sdesc, CUBLAS_COMPUTE_32F,
							     CUDA_R_32F)) ||
		    NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&mm->sa, CUDA_R_16BF, OC, N,
							       (int64_t)OC)) ||
		    NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&mm->sb, CUDA_R_16BF, N, 1,
							       (int64_t)round_up_(N, 8))) ||
		    NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&mm->sd, CUDA_R_32F, OC, 1,
							       (int64_t)OC)))
			return NG_ERR_RUNTIME;
	} else if (sp->kind == NG_MATMUL_DW && sp->bias && sp->accumulate) {
		if (NG_CUBLAS_CHECK(cublasLtMatrixTransformDescCreate(&mm->add, CUDA_R_32F)) ||
		    NG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&mm->vec, CUDA_R_32F, OC, 1,
							       (int64_t)OC)))
			return NG_ERR_RUNTIME;
	}
	return NG_OK;
}

/* Up to `want` algorithms for desc over layouts l[0..3] (A, B, C, D) of spec sp. */
static enum ng_status heuristic_(const struct ng_matmul_ctx *ctx, cublasLtMatmulDesc_t desc,
				 cublasLtMatrixLayout_t *l, const struct ng_matmul_spec *sp,
				 const char *what, cublasLtMatmulHeuristicResult_t *res, int want,
				 int *got)
{
	cublasLtMatmulPreference_t pref = NULL;
	enum ng_status st = NG_ERR_RUNTIME;
	uint64_t ws = ctx->workspace_bytes;
	uint32_t al = ctx->align_bytes;
	if (NG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref)))
		return NG_ERR_RUNTIME;
	if (NG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
		    pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws))))
		goto out_free_pref;
	for (int i = 0; i < 4; i++) {
		cublasLtMatmulPreferenceAttributes_t at[4] = {
			CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
			CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
			CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
			CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
		if (NG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, at[i], &al,
									 sizeof(al))))
			goto out_free_pref;
	}
	*got = 0;
	cublasStatus_t cs = cublasLtMatmulAlgoGetHeuristic(ctx->lt, desc, l[0], l[1], l[2], l[3],
							   pref, want, res, got);
	if (cs != CUBLAS_STATUS_SUCCESS || *got == 0) {
		st = ng_fail(NG_ERR_RUNTIME,
			     "ng_matmul_plan: cuBLASLt has no algorithm for %s%s N=%d IC=%d OC=%d "
			     "(gelu %d, bias %d, accumulate %d): cublasLtMatmulAlgoGetHeuristic "
			     "status %d, %d results", kind_name_(sp->kind), what, sp->N, sp->IC,
			     sp->OC, sp->gelu, sp->bias, sp->accumulate, (int)cs, *got);
		ng_hint("a larger workspace (ng_matmul_ctx_init) or pointer alignment may help");
		goto out_free_pref;
	}
	/* Keep only algorithms whose own minimum pointer alignments the run's promise meets. */
	int kept = 0;
	for (int i = 0; i < *got; i++) {
		uint32_t need = 0;
		for (int j = 0; j < 4; j++) {
			cublasLtMatmulAlgoCapAttributes_t cap[4] = {
				CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES,
				CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
				CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES,
				CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES};
			uint32_t v = 0;
			size_t wr = 0;
			if (cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, cap[j], &v, sizeof(v),
							      &wr) == CUBLAS_STATUS_SUCCESS &&
			    v > need)
				need = v;
		}
		if (need <= al)
			res[kept++] = res[i];
	}
	if (kept == 0) {
		st = ng_fail(NG_ERR_RUNTIME, "ng_matmul_plan: all %d algorithms for %s%s N=%d IC=%d "
			     "OC=%d need more than %u-byte pointer alignment", *got,
			     kind_name_(sp->kind), what, sp->N, sp->IC, sp->OC, al);
		ng_hint("raise ng_matmul_ctx.align_bytes and align the tensors to it");
		goto out_free_pref;
	}
	*got = kept;
	st = NG_OK;
out_free_pref:
	cublasLtMatmulPreferenceDestroy(pref);
	return st;
}

/* Workspace: [matmul workspace | dbias scratch (OC fp32) | colsum's N bf16 3.0s]. */
static void layout_workspace_(struct ng_matmul *mm)
{
	size_t front = mm->algo_ws > mm->salgo_ws ? mm->algo_ws : mm->salgo_ws;
	size_t off = round_up_(front, NG_MM_SCRATCH_ALIGN);
	mm->scratch_off = off;
	if (mm->add)
		off = round_up_(off + (size_t)mm->spec.OC * 4, NG_MM_SCRATCH_ALIGN);
	mm->threes_off = off;
	if (mm->colsum)
		off += (size_t)mm->spec.N * 2;
	mm->workspace_need = (mm->add || mm->colsum) ? off : front;
}

static int cmp_float_(const void *x, const void *y)
{
	float a = *(const float *)x, b = *(const float *)y;
	return (a > b) - (a < b);
}

/* Scratch buffers of the right sizes for timing candidates, filled with a nonzero pattern. */
struct tune_bufs_ {
	void *a, *b, *out, *bias, *aux, *ws; /* device buffers; NULL when not needed */
};

static void tune_bufs_free_(struct tune_bufs_ *t)
{
	void *p[6] = {t->a, t->b, t->out, t->bias, t->aux, t->ws};
	for (int i = 0; i < 6; i++)
		if (p[i])
			cudaFree(p[i]);
	memset(t, 0, sizeof(*t));
}

/* A scratch buffer filled with pseudo-random bf16 N(0, 1)-ish values (fp32 buffers read them
 * in pairs: finite values too). Random data, not a constant: tensor-core power, hence clocks
 * and the ranking of candidates, depend on the data. A 1 MiB host pattern, then device copies
 * doubling the filled prefix. */
static enum ng_status tune_alloc_(void **p, size_t bytes)
{
	enum { PAT = 1 << 20 };
	static uint16_t pat[PAT / 2];
	uint64_t x = 0x9e3779b97f4a7c15ull;
	bytes = round_up_(bytes ? bytes : 16, 16);
	if (NG_CUDA_CHECK(cudaMalloc(p, bytes)))
		return NG_ERR_RUNTIME;
	for (size_t i = 0; i < PAT / 2; i++) { /* sum of 4 uniforms ~ N(0, 1.15): exponent kept */
		x ^= x << 13; x ^= x >> 7; x ^= x << 17;
		float f = ((float)(x & 0xffff) + (float)((x >> 16) & 0xffff) +
			   (float)((x >> 32) & 0xffff) + (float)((x >> 48) & 0xffff)) / 32768.0f - 4.0f;
		uint32_t u;
		memcpy(&u, &f, 4);
		pat[i] = (uint16_t)(u >> 16);
	}
	size_t done = bytes < PAT ? bytes : PAT;
	if (NG_CUDA_CHECK(cudaMemcpy(*p, pat, done, cudaMemcpyHostToDevice)))
		return NG_ERR_RUNTIME;
	while (done < bytes) {
		size_t n = bytes - done < done ? bytes - done : done;
		if (NG_CUDA_CHECK(cudaMemcpy((char *)*p + done, *p, n, cudaMemcpyDeviceToDevice)))
			return NG_ERR_RUNTIME;
		done += n;
	}
	return NG_OK;
}

/* Candidate i: cuBLASLt's res[i], or past them our own GEMM. */
static void take_candidate_(struct ng_matmul *mm, const cublasLtMatmulHeuristicResult_t *res,
			    int got, int i)
{
	mm->own = i >= got;
	mm->algo = res[i < got ? i : 0].algo;
	mm->algo_ws = res[i < got ? i : 0].workspaceSize;
}

/* Time each usable candidate (got of cuBLASLt's, then n_own of ours); keep the fastest in
 * mm->chosen. */
static enum ng_status autotune_(struct ng_matmul *mm, const struct ng_matmul_ctx *ctx,
				const cublasLtMatmulHeuristicResult_t *res, int got, int n_own)
{
	const int total = got + n_own;
	const struct ng_matmul_spec *sp = &mm->spec;
	struct tune_bufs_ t = {0};
	cudaEvent_t e0 = NULL, e1 = NULL;
	enum ng_status st = NG_ERR_RUNTIME;
	size_t es_out = sp->kind == NG_MATMUL_DW ? 4 : 2;
	size_t a_el = (size_t)sp->N * (sp->kind == NG_MATMUL_FWD ? sp->IC : sp->OC);
	size_t b_el = sp->kind == NG_MATMUL_DW ? (size_t)sp->N * sp->IC : (size_t)sp->OC * sp->IC;
	size_t max_ws = 0;
	int reps = ctx->tune_reps > 0 ? ctx->tune_reps : 1;
	float best = -1.0f;
	for (int i = 0; i < got; i++)
		if (res[i].workspaceSize > max_ws)
			max_ws = res[i].workspaceSize;
	if (tune_alloc_(&t.a, a_el * 2) || tune_alloc_(&t.b, b_el * 2) ||
	    tune_alloc_(&t.out, (size_t)mm->m * mm->n * es_out) ||
	    tune_alloc_(&t.bias, (size_t)sp->OC * 4) ||
	    tune_alloc_(&t.aux, sp->gelu ? (size_t)mm->m * mm->n * 2 : 0) ||
	    tune_alloc_(&t.ws, round_up_(max_ws > mm->salgo_ws ? max_ws : mm->salgo_ws,
					 NG_MM_SCRATCH_ALIGN) + (size_t)sp->OC * 4 + 256 +
				(size_t)sp->N * 2))
		goto out_free;
	if (NG_CUDA_CHECK(cudaEventCreate(&e0)) || NG_CUDA_CHECK(cudaEventCreate(&e1)))
		goto out_free;
	/* One launch of candidate i (fp8: the scratch's first floats serve as descales: finite;
	 * the bf16 output may overflow, which does not change the timing). */
#define TUNE_RUN_(i)                                                                           \
	(sp->accumulate && sp->kind == NG_MATMUL_FWD                                             \
		 ? ng_matmul_run_residual(mm, t.out, t.a, t.b, t.bias, t.out,                    \
					  sp->fp8 ? (const float *)t.bias : NULL,                 \
					  sp->fp8 ? (const float *)t.bias : NULL, t.ws, 0)        \
	 : sp->fp8 ? ng_matmul_run_fp8(mm, t.out, t.a, t.b, t.bias, t.aux, (const float *)t.bias,  \
				     (const float *)t.bias, t.ws, 0)                              \
		 : ng_matmul_run(mm, t.out, t.a, t.b, t.bias, t.aux, t.bias, t.ws, 0))
	float est[NG_MM_MAX_CANDIDATES + NG_MM_MAX_OWN];
	/* Burst pass: each candidate alone, reps launches each synchronised (the whole ranking
	 * when ctx->tune_sustained_ms is 0, else the estimates the sustained pass sizes from). */
	for (int i = 0; i < total; i++) {
		float ms[32];
		int nr = reps < 32 ? reps : 32, ok = 1;
		est[i] = -1.0f;
		take_candidate_(mm, res, got, i);
		layout_workspace_(mm);
		for (int r = -1; r < nr && ok; r++) { /* r = -1: warm-up, not timed */
			cudaEventRecord(e0, 0);
			if (TUNE_RUN_(i))
				ok = 0;
			cudaEventRecord(e1, 0);
			if (ok && NG_CUDA_CHECK(cudaEventSynchronize(e1)))
				goto out_free;
			if (ok && r >= 0)
				cudaEventElapsedTime(&ms[r], e0, e1);
		}
		if (!ok) { /* a candidate that fails to run is skipped, not fatal */
			ng_clear_error();
			cudaGetLastError();
			continue;
		}
		qsort(ms, (size_t)nr, sizeof(float), cmp_float_);
		est[i] = ms[nr / 2];
	}
	/* Sustained pass: the step keeps the GPU at its power limit, where the clock drops and
	 * algorithms that spend less energy per FLOP win; a burst runs at the boost clock and
	 * ranks them differently (BENCHMARKS.md). So the GPU is first held busy
	 * for ~2 * tune_sustained_ms, then every candidate runs back to back for about
	 * tune_sustained_ms between two events, no synchronisation inside. */
	if (ctx->tune_sustained_ms > 0.0f) {
		for (int pass = 0; pass < 2; pass++) /* pass 0: heat with the first runnable one */
			for (int i = 0; i < total; i++) {
				if (est[i] <= 0.0f)
					continue;
				int k = (int)((pass ? 1.0f : 2.0f) * ctx->tune_sustained_ms / est[i]);
				k = k < 4 ? 4 : k > 100000 ? 100000 : k;
				take_candidate_(mm, res, got, i);
				layout_workspace_(mm);
				int ok = 1;
				for (int r = 0; r < 2 && ok; r++) /* after a switch: not timed */
					ok = !TUNE_RUN_(i);
				cudaEventRecord(e0, 0);
				for (int r = 0; r < k && ok; r++)
					ok = !TUNE_RUN_(i);
				cudaEventRecord(e1, 0);
				if (NG_CUDA_CHECK(cudaEventSynchronize(e1)))
					goto out_free;
				if (!ok) {
					ng_clear_error();
					cudaGetLastError();
					est[i] = -1.0f;
				} else if (pass) {
					float total = 0.0f;
					cudaEventElapsedTime(&total, e0, e1);
					est[i] = total / (float)k;
				}
				if (!pass)
					break;
			}
	}
#undef TUNE_RUN_
	for (int i = 0; i < total; i++) {
		if (est[i] <= 0.0f)
			continue;
		mm->tuned_ms[i] = est[i];
		if (best < 0.0f || est[i] < best) {
			best = est[i];
			mm->chosen = i;
		}
	}
	if (best < 0.0f) {
		st = ng_fail(NG_ERR_RUNTIME, "ng_matmul_plan: none of %d candidates ran for %s N=%d "
			     "IC=%d OC=%d", got, kind_name_(sp->kind), sp->N, sp->IC, sp->OC);
		goto out_free;
	}
	st = NG_OK;
out_free:
	if (e0)
		cudaEventDestroy(e0);
	if (e1)
		cudaEventDestroy(e1);
	tune_bufs_free_(&t);
	return st;
}

/* Descriptors, the colsum algorithm if any, and the main heuristic's candidates. */
static enum ng_status describe_(struct ng_matmul *mm, struct ng_matmul_ctx *ctx,
				cublasLtMatmulHeuristicResult_t *res, int want, int *got)
{
	enum ng_status st;
	if ((st = build_descriptors_(mm)))
		return st;
	if (mm->colsum) {
		cublasLtMatmulHeuristicResult_t r1;
		cublasLtMatrixLayout_t l[4] = {mm->sa, mm->sb, mm->sd, mm->sd};
		int g = 0;
		memset(&r1, 0, sizeof(r1));
		if ((st = heuristic_(ctx, mm->sdesc, l, &mm->spec, " (bias column sums)", &r1, 1,
				     &g)))
			return st;
		mm->salgo = r1.algo;
		mm->salgo_ws = r1.workspaceSize;
	}
	cublasLtMatrixLayout_t l[4] = {mm->a, mm->b, mm->c, mm->d};
	return heuristic_(ctx, mm->desc, l, &mm->spec, "", res, want, got);
}

/* The choice's key for the candidates res[0..got) of mm and n_own of our own GEMM after them
 * (chosen and ms not set). */
static struct ng_matmul_choice choice_key_(const struct ng_matmul *mm,
					   const struct ng_matmul_ctx *ctx,
					   const cublasLtMatmulHeuristicResult_t *res, int got,
					   int n_own)
{
	struct ng_matmul_choice c;
	memset(&c, 0, sizeof(c));
	c.spec = mm->spec;
	c.align_bytes = mm->align_bytes;
	c.workspace_bytes = ctx->workspace_bytes;
	c.colsum = mm->colsum;
	c.n_candidates = got + n_own;
	uint64_t h = 14695981039346656037ull; /* FNV-1a, 64 bits */
	for (int i = 0; i < got; i++) {
		const unsigned char *b = (const unsigned char *)&res[i].algo;
		for (size_t j = 0; j < sizeof(res[i].algo); j++)
			h = (h ^ b[j]) * 1099511628211ull;
	}
	if (n_own) /* our kernel and its revision, so a changed kernel is timed again */
		h = (((h ^ NG_MM_OWN_MARK) * 1099511628211ull) ^ (unsigned char)NG_GEMM_SM90_REV) *
		    1099511628211ull;
	c.candidates_hash = h;
	return c;
}

static int same_key_(const struct ng_matmul_choice *a, const struct ng_matmul_choice *b)
{
	const struct ng_matmul_spec *x = &a->spec, *y = &b->spec;
	return x->kind == y->kind && x->N == y->N && x->IC == y->IC && x->OC == y->OC &&
	       x->gelu == y->gelu && x->bias == y->bias && x->accumulate == y->accumulate &&
	       x->fp8 == y->fp8 && a->align_bytes == b->align_bytes &&
	       a->workspace_bytes == b->workspace_bytes && a->colsum == b->colsum &&
	       a->candidates_hash == b->candidates_hash && a->n_candidates == b->n_candidates;
}

static const struct ng_matmul_choice *find_choice_(const struct ng_matmul_ctx *ctx,
						   const struct ng_matmul_choice *key)
{
	for (int i = 0; i < ctx->n_choices; i++) /* chosen < n_candidates: checked on load */
		if (same_key_(&ctx->choices[i], key))
			return &ctx->choices[i];
	return NULL;
}

enum ng_status ng_matmul_choice_add(struct ng_matmul_ctx *ctx, const struct ng_matmul_choice *c)
{
	for (int i = 0; i < ctx->n_choices; i++)
		if (same_key_(&ctx->choices[i], c)) {
			ctx->choices[i] = *c;
			return NG_OK;
		}
	if (ctx->n_choices == ctx->cap_choices) {
		int cap = ctx->cap_choices ? 2 * ctx->cap_choices : 32;
		void *p = realloc(ctx->choices, (size_t)cap * sizeof(*ctx->choices));
		if (!p)
			return ng_fail(NG_ERR_RUNTIME, "out of host memory");
		ctx->choices = p;
		ctx->cap_choices = cap;
	}
	ctx->choices[ctx->n_choices++] = *c;
	return NG_OK;
}

enum ng_status ng_matmul_plan(struct ng_matmul *mm, struct ng_matmul_ctx *ctx,
			      const struct ng_matmul_spec *spec)
{
	cublasLtMatmulHeuristicResult_t res[NG_MM_MAX_CANDIDATES];
	enum ng_status st;
	int want = 1, got = 0;
	memset(mm, 0, sizeof(*mm));
	if ((st = check_spec_(spec)))
		return st;
	if (spec->own) { /* our own GEMM's DINP with DGELU or FWD with relu^2: no cuBLASLt */
		mm->spec = *spec;
		mm->lt = ctx->lt;
		mm->align_bytes = ctx->align_bytes < 16 ? 16 : ctx->align_bytes;
		const int fwd = spec->kind == NG_MATMUL_FWD;
		mm->m = fwd ? spec->OC : spec->IC;
		mm->n = spec->N;
		mm->k = fwd ? spec->IC : spec->OC;
		mm->own = 1;
		mm->n_candidates = 1;
		if (spec->bias) /* the column sums' partial rows */
			mm->workspace_need = round_up_((size_t)ng_gemm_sm90_dgelu_parts(spec->N) *
							       spec->IC * 4,
						       NG_MM_SCRATCH_ALIGN);
		return NG_OK;
	}
	if (spec->autotune)
		want = ctx->tune_candidates < 1 ? 1
		       : ctx->tune_candidates > NG_MM_MAX_CANDIDATES ? NG_MM_MAX_CANDIDATES
								     : ctx->tune_candidates;
	for (int attempt = 0; attempt < 2; attempt++) {
		memset(mm, 0, sizeof(*mm));
		mm->spec = *spec;
		mm->lt = ctx->lt;
		mm->align_bytes = ctx->align_bytes < 16 ? 16 : ctx->align_bytes;
		mm->colsum = spec->kind == NG_MATMUL_DW && spec->bias &&
			     (ctx->dbias_colsum || attempt == 1);
		memset(res, 0, sizeof(res));
		st = describe_(mm, ctx, res, want, &got);
		if (st == NG_OK)
			break;
		ng_matmul_free(mm);
		/* no BGRADB algorithm: fall back to the column-sum matmul once */
		if (attempt == 1 || ctx->dbias_colsum || spec->kind != NG_MATMUL_DW || !spec->bias)
			return st;
		ng_clear_error();
	}
	/* our own GEMM as one more candidate: bf16 FWD, timed, where it can run */
	const int n_own = spec->autotune && ctx->own_gemm && spec->kind == NG_MATMUL_FWD &&
			  !spec->fp8 && !spec->accumulate && mm->align_bytes % 16 == 0 &&
			  ng_gemm_sm90_available()
			  ? NG_MM_MAX_OWN : 0;
	const int total = got + n_own;
	mm->n_candidates = total;
	mm->chosen = 0;
	if (spec->autotune && ctx->force_candidate >= 0) {
		mm->chosen = ctx->force_candidate < total ? ctx->force_candidate : total - 1;
	} else if (spec->autotune && total > 1) {
		struct ng_matmul_choice key = choice_key_(mm, ctx, res, got, n_own);
		const struct ng_matmul_choice *known = find_choice_(ctx, &key);
		if (known) {
			mm->chosen = known->chosen;
			ctx->choices_reused++;
		} else {
			if ((st = autotune_(mm, ctx, res, got, n_own)))
				goto out_fail;
			key.chosen = mm->chosen;
			key.ms = mm->tuned_ms[mm->chosen];
			if ((st = ng_matmul_choice_add(ctx, &key)))
				goto out_fail;
			ctx->choices_made++;
		}
	}
	take_candidate_(mm, res, got, mm->chosen);
	layout_workspace_(mm);
	return NG_OK;
out_fail:
	ng_matmul_free(mm);
	return st;
}

static enum ng_status check_ptr_(const struct ng_matmul *mm, const char *name, const void *p)
{
	const struct ng_matmul_spec *sp = &mm->spec;
	if (!p || (uintptr_t)p % mm->align_bytes)
		return ng_check_arg_fail("ng_matmul_run",
					 "%s N=%d IC=%d OC=%d: pointer %s = %p is %s (need %u-byte "
					 "alignment)", kind_name_(sp->kind), sp->N, sp->IC, sp->OC,
					 name, p, p ? "misaligned" : "NULL", mm->align_bytes);
	return NG_OK;
}

/* residual: FWD with accumulate, cuBLASLt's C (else C is out itself); post: an own DINP's
 * GELU(aux), or NULL */
static enum ng_status run_(const struct ng_matmul *mm, void *out, const void *a, const void *b,
			    const void *bias, void *aux, void *dbias, const void *residual,
			    void *post, void *workspace, cudaStream_t s)
{
	const struct ng_matmul_spec *sp = &mm->spec;
	const float one = 1.0f;
	const void *bias_ptr = NULL;
	if (check_ptr_(mm, "out", out) || check_ptr_(mm, "a", a) || check_ptr_(mm, "b", b))
		return NG_ERR_INPUT;
	if (sp->gelu && check_ptr_(mm, "aux", aux))
		return NG_ERR_INPUT;
	if (mm->workspace_need && (!workspace || (uintptr_t)workspace % NG_MATMUL_WORKSPACE_ALIGN))
		return ng_check_arg_fail("ng_matmul_run", "%s N=%d IC=%d OC=%d: workspace %p is %s "
					 "(need %d-byte alignment, %zu bytes)", kind_name_(sp->kind),
					 sp->N, sp->IC, sp->OC, workspace,
					 workspace ? "misaligned" : "NULL", NG_MATMUL_WORKSPACE_ALIGN,
					 mm->workspace_need);
	if (sp->bias && sp->kind == NG_MATMUL_FWD) {
		if (check_ptr_(mm, "bias", bias))
			return NG_ERR_INPUT;
		bias_ptr = bias;
	}
	if (sp->bias && sp->kind == NG_MATMUL_DW) {
		if (check_ptr_(mm, "dbias", dbias))
			return NG_ERR_INPUT;
		if (!mm->colsum)
			bias_ptr = mm->add ? (const char *)workspace + mm->scratch_off : dbias;
	}
	if (mm->own && sp->kind == NG_MATMUL_DINP) { /* b is W^T (IC, OC) */
		if ((post && check_ptr_(mm, "post", post)) ||
		    (sp->bias && check_ptr_(mm, "dbias", dbias)))
			return NG_ERR_INPUT;
		float *part = sp->bias ? (float *)workspace : NULL;
		enum ng_status st = ng_gemm_sm90_dgelu(out, post, part, aux, a, b, sp->N, sp->IC,
						       sp->OC, s);
		if (st || !sp->bias)
			return st;
		return ng_bias_grad_reduce(dbias, part, ng_gemm_sm90_dgelu_parts(sp->N), sp->IC,
					   mm->beta != 0.0f, s);
	}
	if (mm->own) /* our own GEMM (FWD, bf16): the same outputs, no workspace */
		return ng_gemm_sm90_fwd(out, sp->gelu ? aux : NULL, a, b, bias_ptr, sp->N, sp->OC,
					sp->IC, sp->relu2 ? NG_GEMM_ACT_RELU2 : sp->gelu, s);
	if (bias_ptr && set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
				  sizeof(bias_ptr)))
		return NG_ERR_RUNTIME;
	if (sp->gelu && set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
				  sizeof(aux)))
		return NG_ERR_RUNTIME;
	cublasStatus_t cs = cublasLtMatmul(mm->lt, mm->desc, &one, b, mm->a, a, mm->b, &mm->beta,
					   residual ? residual : out, mm->c, out, mm->d, &mm->algo,
					   mm->algo_ws ? workspace : NULL, mm->algo_ws, s);
	if (cs != CUBLAS_STATUS_SUCCESS)
		return ng_fail(NG_ERR_RUNTIME, "ng_matmul_run: cublasLtMatmul failed for %s N=%d IC=%d "
			       "OC=%d (gelu %d, bias %d, accumulate %d): cublasStatus %d",
			       kind_name_(sp->kind), sp->N, sp->IC, sp->OC, sp->gelu, sp->bias,
			       sp->accumulate, (int)cs);
	if (mm->colsum) {
		const float third = 1.0f / 3.0f;
		void *v = (char *)workspace + mm->threes_off;
		if (NG_CUDA_CHECK(cudaMemsetAsync(v, 0x40, (size_t)sp->N * 2, s)))
			return NG_ERR_RUNTIME;
		cs = cublasLtMatmul(mm->lt, mm->sdesc, &third, a, mm->sa, v, mm->sb, &mm->beta,
				    dbias, mm->sd, dbias, mm->sd, &mm->salgo,
				    mm->salgo_ws ? workspace : NULL, mm->salgo_ws, s);
		if (cs != CUBLAS_STATUS_SUCCESS)
			return ng_fail(NG_ERR_RUNTIME, "ng_matmul_run: cublasLtMatmul (bias column "
				       "sums) failed for DW N=%d IC=%d OC=%d: cublasStatus %d",
				       sp->N, sp->IC, sp->OC, (int)cs);
	}
	if (mm->add) {
		cs = cublasLtMatrixTransform(mm->lt, mm->add, &one, bias_ptr, mm->vec, &one, dbias,
					     mm->vec, dbias, mm->vec, s);
		if (cs != CUBLAS_STATUS_SUCCESS)
			return ng_fail(NG_ERR_RUNTIME, "ng_matmul_run: cublasLtMatrixTransform "
				       "(dbias += scratch) failed for DW N=%d IC=%d OC=%d: "
				       "cublasStatus %d", sp->N, sp->IC, sp->OC, (int)cs);
	}
	return NG_OK;
}

enum ng_status ng_matmul_run(const struct ng_matmul *mm, void *out, const void *a, const void *b,
			     const void *bias, void *aux, void *dbias, void *workspace,
			     cudaStream_t s)
{
	if (mm->spec.fp8)
		return ng_check_arg_fail("ng_matmul_run", "FWD N=%d IC=%d OC=%d is an fp8 plan: run "
					 "it with ng_matmul_run_fp8 and its descales", mm->spec.N,
					 mm->spec.IC, mm->spec.OC);
	if (mm->spec.accumulate && mm->spec.kind == NG_MATMUL_FWD)
		return ng_check_arg_fail("ng_matmul_run", "FWD N=%d IC=%d OC=%d adds a residual: run "
					 "it with ng_matmul_run_residual", mm->spec.N, mm->spec.IC,
					 mm->spec.OC);
	if (mm->spec.own && mm->spec.kind == NG_MATMUL_DINP)
		return ng_check_arg_fail("ng_matmul_run", "DINP N=%d IC=%d OC=%d is our own GEMM's "
					 "plan: run it with ng_matmul_run_dgelu and W^T", mm->spec.N,
					 mm->spec.IC, mm->spec.OC);
	return run_(mm, out, a, b, bias, aux, dbias, NULL, NULL, workspace, s);
}

enum ng_status ng_matmul_run_dgelu(const struct ng_matmul *mm, void *dinp, const void *dout,
				   const void *wt, void *aux, void *post, float *dbias,
				   int accumulate, void *workspace, cudaStream_t s)
{
	if (!mm->spec.own)
		return ng_check_arg_fail("ng_matmul_run_dgelu", "%s N=%d IC=%d OC=%d: not a plan with "
					 "spec.own", kind_name_(mm->spec.kind), mm->spec.N,
					 mm->spec.IC, mm->spec.OC);
	struct ng_matmul run = *mm; /* "=" or "+=" for dbias, per call */
	run.beta = accumulate ? 1.0f : 0.0f;
	return run_(&run, dinp, dout, wt, NULL, aux, dbias, NULL, post, workspace, s);
}

/* The fp8 descales into the plan's descriptor (cuBLASLt's A is W, run's b; its B the input) */
static enum ng_status set_descales_(const struct ng_matmul *mm, const char *who,
				    const float *a_descale, const float *b_descale)
{
	const struct ng_matmul_spec *sp = &mm->spec;
	if (!sp->fp8 || !a_descale || !b_descale || (uintptr_t)a_descale % 16 ||
	    (uintptr_t)b_descale % 16)
		return ng_check_arg_fail(who, "FWD N=%d IC=%d OC=%d: %s", sp->N, sp->IC,
					 sp->OC, !sp->fp8 ? "not an fp8 plan (spec.fp8 = 0)"
					 : "both descales must be 16-byte aligned device pointers "
					   "(cuBLASLt refuses others)");
	if (set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_descale,
		      sizeof(b_descale)) ||
	    set_attr_(mm->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_descale,
		      sizeof(a_descale)))
		return NG_ERR_RUNTIME;
	return NG_OK;
}

enum ng_status ng_matmul_run_residual(const struct ng_matmul *mm, void *out, const void *a,
				      const void *b, const void *bias, const void *residual,
				      const float *a_descale, const float *b_descale,
				      void *workspace, cudaStream_t s)
{
	const struct ng_matmul_spec *sp = &mm->spec;
	const char *who = "ng_matmul_run_residual";
	if (sp->kind != NG_MATMUL_FWD || !sp->accumulate)
		return ng_check_arg_fail(who, "N=%d IC=%d OC=%d: not a FWD plan with accumulate",
					 sp->N, sp->IC, sp->OC);
	if (check_ptr_(mm, "residual", residual))
		return NG_ERR_INPUT;
	if (sp->fp8) {
		enum ng_status st = set_descales_(mm, who, a_descale, b_descale);
		if (st)
			return st;
	} else if (a_descale || b_descale) {
		return ng_check_arg_fail(who, "N=%d IC=%d OC=%d: a bf16 plan takes no descales",
					 sp->N, sp->IC, sp->OC);
	}
	return run_(mm, out, a, b, bias, NULL, NULL, residual, NULL, workspace, s);
}

enum ng_status ng_matmul_run_fp8(const struct ng_matmul *mm, void *out, const void *a,
				 const void *b, const void *bias, void *aux, const float *a_descale,
				 const float *b_descale, void *workspace, cudaStream_t s)
{
	if (mm->spec.accumulate && mm->spec.kind == NG_MATMUL_FWD)
		return ng_check_arg_fail("ng_matmul_run_fp8", "FWD N=%d IC=%d OC=%d adds a residual: "
					 "run it with ng_matmul_run_residual", mm->spec.N,
					 mm->spec.IC, mm->spec.OC);
	enum ng_status st = set_descales_(mm, "ng_matmul_run_fp8", a_descale, b_descale);
	if (st)
		return st;
	return run_(mm, out, a, b, bias, aux, NULL, NULL, NULL, workspace, s);
}
