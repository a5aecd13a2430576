/*
 * kernels/attention_cudnn.c — the attention plan (kernels/attention.h): cuDNN flash attention
 * through the backend descriptors of cudnn_graph.h, in plain C, with the plain CUDA kernels of
 * attention_naive.cu as the fallback.
 *
 * cuDNN (before 9.21) has no fused causal-attention op we can use; instead we describe attention
 * as a graph of matmul, pointwise and reduction ops, and its heuristics hand back a fused
 * flash-attention engine — the same graphs cudnn-frontend builds for SDPA. The graphs, attribute
 * choices and pitfalls are in docs/GPU.md; in brief:
 *   forward (14 ops):  S = Q Kᵀ · scale, causal mask (GEN_INDEX, CMP_GE, BINARY_SELECT with
 *     -inf), M = max, E = exp(S - M), Sum = ΣE, Stats = M + log Sum, P = E / Sum (bf16), O = P V
 *   backward (22 ops, 21 deterministic): softmax_sum = Σ dO·O; P = exp(mask(Q Kᵀ · scale -
 *     Stats)); dV = Pᵀ dO; dS = P (dO Vᵀ - softmax_sum) · scale; dK = dSᵀ Q; dQ = dS K (through
 *     an fp32 dQ_accum in the workspace, or written directly in the deterministic variant).
 * cuDNN <= 9.15.0 backward reads out of bounds (under graph replay) when T is not a multiple of
 * 128; as cudnn-frontend does there, the backward graph then describes the batch as padded
 * sequences whose lengths are all T (a padding mask, GEMM size overrides, int32 lengths in the
 * workspace). If no engine takes that graph, the naive backward runs, decided at plan time.
 * The speedrun model's mask (ng_attention_plan_masked) adds, after the causal select, the band
 * of a sliding window the way cudnn-frontend's composite diagonal-band node builds it before
 * cuDNN 9.21 (col + window > row with the window a by-value FLOAT scalar, its own select), which
 * is what lets the fused engines skip the tiles outside the band; and the per-query lower bound
 * lo (B, T) as a [B,1,T,1] int32 tensor (col >= lo[b, row], its own select), after the band or,
 * if no engine takes that, before the causal select (where the frontend puts its padding mask).
 * Whether cuDNN's heuristics accept each graph is known only on the GPU; a graph without an
 * engine falls back to the naive kernels with the reason kept (tools/probe_attention_mask.c
 * plans each variant and times it).
 * Tensors are logically [B, H, T, D]; the fused QKV layout (B, T, 3, H, D) lives in the strides,
 * so no permutes are needed. K (and V in the backward) enter as transposed views [B, H, D, T].
 *
 * Everything slow or fallible (graph finalisation, heuristics, NVRTC compilation of runtime
 * engines) happens in ng_attention_plan; ng_attention_fwd/bwd build a variant pack and execute,
 * which a stream capture records like any other launch.
 */
#include "kernels/attention.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kernels/check.h"

/* CUDNN_ATTR_OPERATIONGRAPH_HANDLE / CUDNN_ATTR_EXECUTION_PLAN_HANDLE: marked deprecated in the
 * 9.19 headers (replaced by device-property descriptors), still the way on the 9.14 library the
 * GPU machine has. Named by value so the build stays free of deprecation warnings. */
#define ATTR_OPERATIONGRAPH_HANDLE ((cudnnBackendAttributeName_t)800)
#define ATTR_EXECUTION_PLAN_HANDLE ((cudnnBackendAttributeName_t)400)

/* Unique ids of the tensors the caller provides (virtual tensors count up from UID_VIRTUAL). */
enum {
	UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_MASK, UID_DO, UID_DQ, UID_DK,
	UID_DV, UID_SOFTMAX_SUM, UID_DQ_ACCUM, UID_ONE, UID_SEQ_Q, UID_SEQ_KV, UID_LO, UID_BAND,
	UID_WINDOW, UID_VIRTUAL = 100,
};

/* Most operations in one graph (the backward with the padding-mask workaround, the band and
 * the lower bound has 36). */
#define MAX_OPS 48

/* A tensor's dims and strides (always 4-D). */
struct tshape {
	int64_t dims[4];
	int64_t strides[4];
};

/* One operation graph under construction. Failures are sticky: after the first one every helper
 * does nothing, and the builder reports what failed. */
struct builder {
	struct ng_attention_cudnn_plan_ *p; /* where the descriptors are kept */
	cudnnBackendDescriptor_t ops[MAX_OPS]; /* the graph's operations, in order */
	int n_ops;                           /* used entries of ops */
	int64_t next_uid;                    /* next virtual tensor id */
	cudnnStatus_t st;                    /* first failure (SUCCESS while none) */
	const char *what;                    /* the step that failed first */
};

static void fail_at(struct builder *b, cudnnStatus_t st, const char *what)
{
	if (!b->st && st != CUDNN_STATUS_SUCCESS) {
		b->st = st;
		b->what = what;
	}
}

static cudnnBackendDescriptor_t new_desc(struct builder *b, cudnnBackendDescriptorType_t type)
{
	cudnnBackendDescriptor_t d = NULL;
	if (b->st)
		return NULL;
	if (b->p->n_descs >= NG_ATTENTION_MAX_DESCS) {
		fail_at(b, CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED, "descriptor table full");
		return NULL;
	}
	fail_at(b, cudnnBackendCreateDescriptor(type, &d), "cudnnBackendCreateDescriptor");
	if (!b->st)
		b->p->descs[b->p->n_descs++] = d;
	return b->st ? NULL : d;
}

static void set(struct builder *b, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
		cudnnBackendAttributeType_t type, int64_t n, const void *v, const char *what)
{
	if (!b->st)
		fail_at(b, cudnnBackendSetAttribute(d, name, type, n, v), what);
}

static void finalize(struct builder *b, cudnnBackendDescriptor_t d, const char *what)
{
	if (!b->st)
		fail_at(b, cudnnBackendFinalize(d), what);
}

/* A tensor: uid 0 makes a virtual one with the next free id. */
static cudnnBackendDescriptor_t tensor(struct builder *b, int64_t uid, cudnnDataType_t dtype,
				       const struct tshape *sh, int by_value)
{
	cudnnBackendDescriptor_t t = new_desc(b, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
	bool virt = uid == 0, byval = by_value != 0;
	int64_t align = 16;
	if (virt)
		uid = b->next_uid++;
	set(b, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dtype, "tensor data type");
	set(b, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, sh->dims, "tensor dims");
	set(b, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, sh->strides, "tensor strides");
	set(b, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
	set(b, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
	set(b, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, "tensor virtual");
	if (byval)
		set(b, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &byval, "tensor by value");
	finalize(b, t, "tensor finalize");
	return t;
}

static void add_op(struct builder *b, cudnnBackendDescriptor_t op, const char *what)
{
	finalize(b, op, what);
	if (!b->st && b->n_ops == MAX_OPS)
		fail_at(b, CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED, "operation table full");
	if (!b->st)
		b->ops[b->n_ops++] = op;
}

/* y = mode(x[, x2][, cond]); math precision `prec`; the axis is set for GEN_INDEX and, when
 * positive, for other modes (cudnn-frontend sets axis 3 on the band's index addition). */
static void pointwise(struct builder *b, cudnnPointwiseMode_t mode, cudnnDataType_t prec,
		      cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t x2,
		      cudnnBackendDescriptor_t cond, cudnnBackendDescriptor_t y, int64_t axis,
		      const char *what)
{
	cudnnBackendDescriptor_t pw = new_desc(b, CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
	float one = 1.0f;
	set(b, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what);
	set(b, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, what);
	if (mode == CUDNN_POINTWISE_GEN_INDEX || axis > 0)
		set(b, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what);
	finalize(b, pw, what);
	cudnnBackendDescriptor_t op = new_desc(b, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
	set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw,
	    what);
	set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
	if (x2)
		set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x2,
		    what);
	if (cond)
		set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cond,
		    what);
	set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
	set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, what);
	set(b, op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, what);
	add_op(b, op, what);
}

/* A float pointwise op into a fresh virtual tensor of shape `sh` and type `dtype`. */
static cudnnBackendDescriptor_t pw_new(struct builder *b, cudnnPointwiseMode_t mode,
				       cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t x2,
				       cudnnDataType_t dtype, const struct tshape *sh,
				       const char *what)
{
	cudnnBackendDescriptor_t y = tensor(b, 0, dtype, sh, 0);
	pointwise(b, mode, CUDNN_DATA_FLOAT, x, x2, NULL, y, 0, what);
	return y;
}

/* c = a bm; m, n, k: optional int32 [B,1,1,1] tensors overriding the GEMM sizes per batch. */
static void matmul(struct builder *b, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t bm,
		   cudnnBackendDescriptor_t c, cudnnBackendDescriptor_t m, cudnnBackendDescriptor_t n,
		   cudnnBackendDescriptor_t k, const char *what)
{
	cudnnBackendDescriptor_t mm = new_desc(b, CUDNN_BACKEND_MATMUL_DESCRIPTOR);
	cudnnDataType_t f = CUDNN_DATA_FLOAT;
	set(b, mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f, what);
	finalize(b, mm, what);
	cudnnBackendDescriptor_t op = new_desc(b, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
	set(b, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, what);
	set(b, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &bm, what);
	set(b, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, what);
	set(b, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, what);
	if (m)
		set(b, op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC,
		    CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &m, what);
	if (n)
		set(b, op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC,
		    CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, what);
	if (k)
		set(b, op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC,
		    CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &k, what);
	add_op(b, op, what);
}

static void reduce(struct builder *b, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
		   cudnnBackendDescriptor_t y, const char *what)
{
	cudnnBackendDescriptor_t rd = new_desc(b, CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
	cudnnDataType_t f = CUDNN_DATA_FLOAT;
	set(b, rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what);
	set(b, rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f, what);
	finalize(b, rd, what);
	cudnnBackendDescriptor_t op = new_desc(b, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
	set(b, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
	set(b, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
	set(b, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd, what);
	add_op(b, op, what);
}

static void reshape(struct builder *b, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
		    const char *what)
{
	cudnnBackendDescriptor_t op = new_desc(b, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
	set(b, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
	set(b, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
	add_op(b, op, what);
}

/* The row and column indices of scores x (GEN_INDEX over axes 2 and 3, INT32); row may be
 * NULL. */
static cudnnBackendDescriptor_t gen_indices(struct builder *b, cudnnBackendDescriptor_t x,
					    const struct tshape *ss, cudnnBackendDescriptor_t *row)
{
	if (row) {
		*row = tensor(b, 0, CUDNN_DATA_INT32, ss, 0);
		pointwise(b, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, x, NULL, NULL, *row, 2,
			  "row index");
	}
	cudnnBackendDescriptor_t col = tensor(b, 0, CUDNN_DATA_INT32, ss, 0);
	pointwise(b, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, x, NULL, NULL, col, 3, "col index");
	return col;
}

/* keep = mode(l, r) (BOOLEAN math precision), then y = keep ? x : mask (a fresh f32 tensor). */
static cudnnBackendDescriptor_t select_where(struct builder *b, cudnnPointwiseMode_t mode,
					     cudnnBackendDescriptor_t l, cudnnBackendDescriptor_t r,
					     cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t mask,
					     const struct tshape *ss, const char *what)
{
	cudnnBackendDescriptor_t keep = tensor(b, 0, CUDNN_DATA_BOOLEAN, ss, 0);
	cudnnBackendDescriptor_t y = tensor(b, 0, CUDNN_DATA_FLOAT, ss, 0);
	pointwise(b, mode, CUDNN_DATA_BOOLEAN, l, r, NULL, keep, 0, what);
	pointwise(b, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, mask, keep, y, 0, what);
	return y;
}

/* The causal mask on a score-shaped f32 tensor: keep x[.., row, col] where row >= col, else the
 * by-value mask tensor (-inf). Index and comparison ops need INT32 / BOOLEAN math precision. */
static cudnnBackendDescriptor_t causal_mask(struct builder *b, cudnnBackendDescriptor_t x,
					    cudnnBackendDescriptor_t mask, const struct tshape *ss)
{
	cudnnBackendDescriptor_t row, col = gen_indices(b, x, ss, &row);
	return select_where(b, CUDNN_POINTWISE_CMP_GE, row, col, x, mask, ss, "row >= col");
}

/* The band of a sliding window: keep x[.., row, col] where col + width > row (row - col <
 * width), as cudnn-frontend's composite left-bound mask builds it: the addition computes in the
 * width's type (FLOAT for the by-value band, INT32 for a device tensor), the comparison in
 * BOOLEAN, then its own select. */
static cudnnBackendDescriptor_t band_mask(struct builder *b, cudnnBackendDescriptor_t x,
					  cudnnBackendDescriptor_t mask,
					  cudnnBackendDescriptor_t width, cudnnDataType_t wtype,
					  const struct tshape *ss)
{
	cudnnBackendDescriptor_t row, col = gen_indices(b, x, ss, &row);
	cudnnBackendDescriptor_t colw = tensor(b, 0, wtype, ss, 0);
	pointwise(b, CUDNN_POINTWISE_ADD, wtype, col, width, NULL, colw, 3, "col + window");
	return select_where(b, CUDNN_POINTWISE_CMP_GT, colw, row, x, mask, ss,
			    "col + window > row");
}

/* The per-query lower bound: keep x[b, .., row, col] where col >= lo[b, row] (lo a [B,1,T,1]
 * int32 tensor, broadcast over heads and columns). */
static cudnnBackendDescriptor_t lower_bound_mask(struct builder *b, cudnnBackendDescriptor_t x,
						 cudnnBackendDescriptor_t mask,
						 cudnnBackendDescriptor_t lo, const struct tshape *ss)
{
	cudnnBackendDescriptor_t col = gen_indices(b, x, ss, NULL);
	return select_where(b, CUDNN_POINTWISE_CMP_GE, col, lo, x, mask, ss, "col >= lo");
}

/* The mask's extra inputs of one graph (NULL: not in it). */
struct mask_in {
	cudnnBackendDescriptor_t band; /* the band's width: by-value FLOAT or device INT32 scalar */
	cudnnDataType_t band_type;     /* its type */
	cudnnBackendDescriptor_t lo;   /* [B,1,T,1] int32 first keys */
	int lo_before;                 /* 1: select lo before the causal mask, 0: after the band */
};

/* The padding mask: keep x where row < seq_q[b] and col < seq_kv[b], else the mask value. Only
 * the cuDNN <= 9.15.0 workaround uses it (every length is T), as cudnn-frontend does. */
static cudnnBackendDescriptor_t padding_mask(struct builder *b, cudnnBackendDescriptor_t x,
					     cudnnBackendDescriptor_t mask, cudnnBackendDescriptor_t sq,
					     cudnnBackendDescriptor_t skv, const struct tshape *ss)
{
	cudnnBackendDescriptor_t lim[2] = {sq, skv}, in[2];
	cudnnBackendDescriptor_t keep = tensor(b, 0, CUDNN_DATA_BOOLEAN, ss, 0);
	for (int i = 0; i < 2; i++) { /* i = 0: rows (axis 2) vs seq_q, 1: columns vs seq_kv */
		cudnnBackendDescriptor_t idx = tensor(b, 0, CUDNN_DATA_INT32, ss, 0);
		in[i] = tensor(b, 0, CUDNN_DATA_BOOLEAN, ss, 0);
		pointwise(b, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, x, NULL, NULL, idx, 2 + i,
			  "padding index");
		pointwise(b, CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, idx, lim[i], NULL, in[i], 0,
			  "index < length");
	}
	pointwise(b, CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, in[0], in[1], NULL, keep, 0,
		  "padding and");
	cudnnBackendDescriptor_t y = tensor(b, 0, CUDNN_DATA_FLOAT, ss, 0);
	pointwise(b, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, mask, keep, y, 0,
		  "padding select");
	return y;
}

/* The shapes of one problem. */
struct shapes {
	struct tshape qkv;   /* Q, K, V, dQ, dK, dV: [B,H,T,D] inside (B,T,3,H,D) */
	struct tshape kt;    /* Kᵀ / Vᵀ views: [B,H,D,T] */
	struct tshape o;     /* O, dO: [B,H,T,D] inside (B,T,H,D) */
	struct tshape dense; /* dQ_accum: [B,H,T,D] packed */
	struct tshape dodo;  /* dO·O, virtual (the strides cudnn-frontend uses) */
	struct tshape row;   /* Stats, softmax_sum, row max/sum: [B,H,T,1] */
	struct tshape ss;    /* scores [B,H,T,T] */
	struct tshape sst;   /* transposed scores */
	struct tshape one;   /* by-value scalars [1,1,1,1] */
	struct tshape seq;   /* per-batch sequence lengths [B,1,1,1] */
	struct tshape lo;    /* per-query first keys [B,1,T,1] */
};

static void fill_shapes(struct shapes *s, int64_t B, int64_t H, int64_t T, int64_t D)
{
	int64_t C = H * D;
	*s = (struct shapes){
		.qkv = {{B, H, T, D}, {3 * C * T, D, 3 * C, 1}},
		.kt = {{B, H, D, T}, {3 * C * T, D, 1, 3 * C}},
		.o = {{B, H, T, D}, {C * T, D, C, 1}},
		.dense = {{B, H, T, D}, {H * T * D, T * D, D, 1}},
		.dodo = {{B, H, T, D}, {H * T * D, T * D, H * D, 1}},
		.row = {{B, H, T, 1}, {H * T, T, 1, 1}},
		.ss = {{B, H, T, T}, {H * T * T, T * T, T, 1}},
		.sst = {{B, H, T, T}, {H * T * T, T * T, 1, T}},
		.one = {{1, 1, 1, 1}, {1, 1, 1, 1}},
		.seq = {{B, 1, 1, 1}, {1, 1, 1, 1}},
		.lo = {{B, 1, T, 1}, {T, T, 1, 1}},
	};
}

/* The mask's input tensors of the plan's options (created in every graph that uses them). */
static struct mask_in mask_inputs(struct builder *b, const struct ng_attention *att,
				  const struct shapes *s, int lo_before)
{
	struct mask_in m = {.lo_before = lo_before};
	if (att->max_window > 0) {
		m.band_type = att->band_on_device ? CUDNN_DATA_INT32 : CUDNN_DATA_FLOAT;
		m.band = tensor(b, att->band_on_device ? UID_WINDOW : UID_BAND, m.band_type, &s->one,
				!att->band_on_device);
	}
	if (att->lower_bound)
		m.lo = tensor(b, UID_LO, CUDNN_DATA_INT32, &s->lo, 0);
	return m;
}

/* The whole mask on scores x: [lower bound,] causal[, band][, lower bound]. */
static cudnnBackendDescriptor_t score_mask(struct builder *b, cudnnBackendDescriptor_t x,
					   cudnnBackendDescriptor_t mask, const struct mask_in *m,
					   const struct tshape *ss)
{
	if (m->lo && m->lo_before)
		x = lower_bound_mask(b, x, mask, m->lo, ss);
	x = causal_mask(b, x, mask, ss);
	if (m->band)
		x = band_mask(b, x, mask, m->band, m->band_type, ss);
	if (m->lo && !m->lo_before)
		x = lower_bound_mask(b, x, mask, m->lo, ss);
	return x;
}

static void build_fwd(struct builder *b, const struct shapes *s, const struct ng_attention *att,
		      int lo_before)
{
	cudnnDataType_t bf = CUDNN_DATA_BFLOAT16, f = CUDNN_DATA_FLOAT;
	cudnnBackendDescriptor_t q = tensor(b, UID_Q, bf, &s->qkv, 0);
	cudnnBackendDescriptor_t kt = tensor(b, UID_K, bf, &s->kt, 0);
	cudnnBackendDescriptor_t v = tensor(b, UID_V, bf, &s->qkv, 0);
	cudnnBackendDescriptor_t o = tensor(b, UID_O, bf, &s->o, 0);
	cudnnBackendDescriptor_t stats = tensor(b, UID_STATS, f, &s->row, 0);
	cudnnBackendDescriptor_t scale = tensor(b, UID_SCALE, f, &s->one, 1);
	cudnnBackendDescriptor_t mask = tensor(b, UID_MASK, f, &s->one, 1);
	struct mask_in m = mask_inputs(b, att, s, lo_before);

	cudnnBackendDescriptor_t sc = tensor(b, 0, f, &s->ss, 0);
	matmul(b, q, kt, sc, NULL, NULL, NULL, "fwd Q Kt");
	sc = pw_new(b, CUDNN_POINTWISE_MUL, sc, scale, f, &s->ss, "fwd scale");
	sc = score_mask(b, sc, mask, &m, &s->ss);
	cudnnBackendDescriptor_t mx = tensor(b, 0, f, &s->row, 0);
	reduce(b, CUDNN_REDUCE_TENSOR_MAX, sc, mx, "fwd row max");
	cudnnBackendDescriptor_t e = pw_new(b, CUDNN_POINTWISE_SUB, sc, mx, f, &s->ss, "fwd S - M");
	e = pw_new(b, CUDNN_POINTWISE_EXP, e, NULL, f, &s->ss, "fwd exp");
	cudnnBackendDescriptor_t sum = tensor(b, 0, f, &s->row, 0);
	reduce(b, CUDNN_REDUCE_TENSOR_ADD, e, sum, "fwd row sum");
	cudnnBackendDescriptor_t lg = pw_new(b, CUDNN_POINTWISE_LOG, sum, NULL, f, &s->row, "fwd log");
	pointwise(b, CUDNN_POINTWISE_ADD, f, mx, lg, NULL, stats, 0, "fwd stats");
	cudnnBackendDescriptor_t p = tensor(b, 0, bf, &s->ss, 0); /* bf16: P V needs equal types */
	pointwise(b, CUDNN_POINTWISE_DIV, f, e, sum, NULL, p, 0, "fwd P");
	matmul(b, p, v, o, NULL, NULL, NULL, "fwd P V");
}

/* seqlen: add the padding mask and GEMM size overrides of the cuDNN <= 9.15.0 workaround. */
static void build_bwd(struct builder *b, const struct shapes *s, const struct ng_attention *att,
		      int lo_before)
{
	int deterministic = att->deterministic, seqlen = att->bwd_seqlen;
	cudnnDataType_t bf = CUDNN_DATA_BFLOAT16, f = CUDNN_DATA_FLOAT;
	cudnnBackendDescriptor_t q = tensor(b, UID_Q, bf, &s->qkv, 0);
	cudnnBackendDescriptor_t kt = tensor(b, UID_K, bf, &s->kt, 0);
	cudnnBackendDescriptor_t vt = tensor(b, UID_V, bf, &s->kt, 0);
	cudnnBackendDescriptor_t o = tensor(b, UID_O, bf, &s->o, 0);
	cudnnBackendDescriptor_t dout = tensor(b, UID_DO, bf, &s->o, 0);
	cudnnBackendDescriptor_t stats = tensor(b, UID_STATS, f, &s->row, 0);
	cudnnBackendDescriptor_t scale = tensor(b, UID_SCALE, f, &s->one, 1);
	cudnnBackendDescriptor_t mask = tensor(b, UID_MASK, f, &s->one, 1);
	cudnnBackendDescriptor_t one = tensor(b, UID_ONE, f, &s->one, 1);
	cudnnBackendDescriptor_t dq = tensor(b, UID_DQ, bf, &s->qkv, 0);
	cudnnBackendDescriptor_t dk = tensor(b, UID_DK, bf, &s->qkv, 0);
	cudnnBackendDescriptor_t dv = tensor(b, UID_DV, bf, &s->qkv, 0);
	cudnnBackendDescriptor_t ssum = tensor(b, UID_SOFTMAX_SUM, f, &s->row, 0);
	cudnnBackendDescriptor_t sq = NULL, skv = NULL;
	if (seqlen) {
		sq = tensor(b, UID_SEQ_Q, CUDNN_DATA_INT32, &s->seq, 0);
		skv = tensor(b, UID_SEQ_KV, CUDNN_DATA_INT32, &s->seq, 0);
	}
	struct mask_in m = mask_inputs(b, att, s, lo_before);

	/* softmax_sum = sum_d dO * O (times the constant 1) */
	cudnnBackendDescriptor_t x = pw_new(b, CUDNN_POINTWISE_MUL, dout, o, f, &s->dodo, "bwd dO O");
	cudnnBackendDescriptor_t xs = tensor(b, 0, f, &s->row, 0);
	reduce(b, CUDNN_REDUCE_TENSOR_ADD, x, xs, "bwd sum dO O");
	pointwise(b, CUDNN_POINTWISE_MUL, f, xs, one, NULL, ssum, 0, "bwd softmax_sum");
	/* P = exp(mask(Q Kt * scale - Stats)) */
	cudnnBackendDescriptor_t sc = tensor(b, 0, f, &s->ss, 0);
	matmul(b, q, kt, sc, sq, skv, NULL, "bwd Q Kt");
	sc = pw_new(b, CUDNN_POINTWISE_MUL, sc, scale, f, &s->ss, "bwd scale");
	sc = pw_new(b, CUDNN_POINTWISE_SUB, sc, stats, f, &s->ss, "bwd S - Stats");
	if (seqlen)
		sc = padding_mask(b, sc, mask, sq, skv, &s->ss);
	sc = score_mask(b, sc, mask, &m, &s->ss);
	cudnnBackendDescriptor_t p = pw_new(b, CUDNN_POINTWISE_EXP, sc, NULL, f, &s->ss, "bwd P");
	/* dV = Pt dO */
	cudnnBackendDescriptor_t pt = tensor(b, 0, bf, &s->sst, 0);
	reshape(b, p, pt, "bwd Pt");
	matmul(b, pt, dout, dv, skv, NULL, sq, "bwd dV");
	/* dS = P (dO Vt - softmax_sum) scale */
	cudnnBackendDescriptor_t dp = tensor(b, 0, f, &s->ss, 0);
	matmul(b, dout, vt, dp, sq, skv, NULL, "bwd dO Vt");
	dp = pw_new(b, CUDNN_POINTWISE_SUB, dp, ssum, f, &s->ss, "bwd dP - sum");
	dp = pw_new(b, CUDNN_POINTWISE_MUL, dp, p, f, &s->ss, "bwd * P");
	cudnnBackendDescriptor_t ds = pw_new(b, CUDNN_POINTWISE_MUL, dp, scale, f, &s->ss, "bwd dS");
	/* dK = dSt Q */
	cudnnBackendDescriptor_t dst = tensor(b, 0, bf, &s->sst, 0);
	reshape(b, ds, dst, "bwd dSt");
	matmul(b, dst, q, dk, skv, NULL, sq, "bwd dK");
	/* dQ = dS K, K as the reshape of the Kt view back to K's own layout */
	cudnnBackendDescriptor_t kk = tensor(b, 0, f, &s->qkv, 0);
	reshape(b, kt, kk, "bwd K");
	if (deterministic) {
		matmul(b, ds, kk, dq, sq, NULL, skv, "bwd dQ");
	} else {
		cudnnBackendDescriptor_t acc = tensor(b, UID_DQ_ACCUM, f, &s->dense, 0);
		matmul(b, ds, kk, acc, sq, NULL, skv, "bwd dQ_accum");
		pointwise(b, CUDNN_POINTWISE_IDENTITY, f, acc, NULL, NULL, dq, 0, "bwd dQ");
	}
}

/* The operation graph, heuristics (mode A, then FALLBACK) and the first config whose plan
 * finalizes. */
static void build_plan(struct builder *b, cudnnHandle_t h)
{
	cudnnBackendDescriptor_t g = new_desc(b, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
	set(b, g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, b->n_ops, b->ops,
	    "graph ops");
	set(b, g, ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h, "graph handle");
	finalize(b, g, "operation graph finalize");
	cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
	for (int m = 0; m < 2 && !b->st && !b->p->plan; m++) {
		cudnnBackendDescriptor_t heur = new_desc(b, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
		set(b, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g,
		    "heuristics graph");
		set(b, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &modes[m],
		    "heuristics mode");
		finalize(b, heur, "heuristics finalize");
		int64_t n = 0;
		if (!b->st)
			fail_at(b, cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
							    CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, NULL),
				"heuristics result count");
		if (n > 8)
			n = 8;
		cudnnBackendDescriptor_t cfgs[8];
		for (int64_t i = 0; i < n; i++)
			cfgs[i] = new_desc(b, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
		int64_t got = 0;
		if (!b->st && n > 0)
			fail_at(b, cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
							    CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, cfgs),
				"heuristics results");
		for (int64_t i = 0; i < got && !b->st && !b->p->plan; i++) {
			cudnnBackendDescriptor_t plan = new_desc(b, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
			set(b, plan, ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h, "plan handle");
			set(b, plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
			    CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i], "plan config");
			if (b->st)
				break;
			if (cudnnBackendFinalize(plan) != CUDNN_STATUS_SUCCESS)
				continue; /* this engine cannot do it: try the next one */
			b->p->plan = plan;
			cudnnBackendDescriptor_t eng = new_desc(b, CUDNN_BACKEND_ENGINE_DESCRIPTOR);
			int64_t cnt = 0;
			if (!b->st &&
			    cudnnBackendGetAttribute(cfgs[i], CUDNN_ATTR_ENGINECFG_ENGINE,
						     CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cnt, &eng) ==
				    CUDNN_STATUS_SUCCESS)
				cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX,
							 CUDNN_TYPE_INT64, 1, &cnt, &b->p->engine);
			fail_at(b, cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
							    CUDNN_TYPE_INT64, 1, &cnt,
							    &b->p->workspace),
				"plan workspace size");
		}
	}
	if (!b->st && !b->p->plan)
		fail_at(b, CUDNN_STATUS_NOT_SUPPORTED, "no engine config finalized");
}

static void plan_release(struct ng_attention_cudnn_plan_ *p)
{
	for (int i = p->n_descs - 1; i >= 0; i--)
		cudnnBackendDestroyDescriptor(p->descs[i]);
	memset(p, 0, sizeof(*p));
	p->engine = -1;
}

static void add_reason(struct ng_attention *att, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
static void add_reason(struct ng_attention *att, const char *fmt, ...)
{
	size_t n = strlen(att->reason);
	va_list ap;
	va_start(ap, fmt);
	if (n < sizeof(att->reason) - 3) {
		if (n)
			att->reason[n++] = ';', att->reason[n++] = ' ';
		vsnprintf(att->reason + n, sizeof(att->reason) - n, fmt, ap);
	}
	va_end(ap);
}

/* The mask's words in messages: "" for GPT-2's causal mask. */
static void mask_text(char *buf, size_t n, const struct ng_attention *att, int lo_before)
{
	buf[0] = 0;
	if (!att->max_window && !att->lower_bound)
		return;
	char band[48] = "";
	if (att->max_window)
		snprintf(band, sizeof(band), " + %s band %d", att->band_on_device ? "device" : "by-value",
			 att->max_window);
	snprintf(buf, n, ", mask %scausal%s%s", att->lower_bound && lo_before ? "lower bound + " : "",
		 band, att->lower_bound && !lo_before ? " + lower bound" : "");
}

/* Builds one direction's cuDNN plan; on failure, records why and releases it (returns 0). */
static int try_cudnn(struct ng_attention *att, struct ng_attention_cudnn_plan_ *p, int backward,
		     int lo_before)
{
	struct shapes s;
	struct builder b = {.p = p, .next_uid = UID_VIRTUAL};
	fill_shapes(&s, att->B, att->H, att->T, att->D);
	p->engine = -1;
	if (backward)
		build_bwd(&b, &s, att, lo_before);
	else
		build_fwd(&b, &s, att, lo_before);
	build_plan(&b, att->handle);
	if (!b.st)
		return 1;
	char last[256] = "", mask[96];
	cudnnGetLastErrorString(last, sizeof(last));
	mask_text(mask, sizeof(mask), att, lo_before);
	add_reason(att, "cuDNN %zu has no %s engine for B=%d H=%d T=%d D=%d%s (%s: %s%s%s)",
		   att->cudnn_version, backward ? "backward" : "forward", att->B, att->H, att->T,
		   att->D, mask, b.what, cudnnGetErrorString(b.st), last[0] ? ", " : "", last);
	plan_release(p);
	return 0;
}

/* One direction with the lower-bound order the options ask for; under NG_ATTENTION_LO_AUTO
 * the select after the band first, then before the causal mask. Sets *lo_before to the order
 * that was built. */
static int try_cudnn_orders(struct ng_attention *att, struct ng_attention_cudnn_plan_ *p,
			    int backward, enum ng_attention_lo_order order, int *lo_before)
{
	*lo_before = order == NG_ATTENTION_LO_BEFORE;
	if (try_cudnn(att, p, backward, *lo_before))
		return 1;
	if (!att->lower_bound || order != NG_ATTENTION_LO_AUTO)
		return 0;
	*lo_before = 1;
	return try_cudnn(att, p, backward, 1);
}

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

enum ng_status ng_attention_plan(struct ng_attention *att, cudnnHandle_t h, int B, int H, int T,
				 int D, int deterministic, int force_naive)
{
	return ng_attention_plan_masked(att, h, B, H, T, D, deterministic, force_naive, NULL);
}

enum ng_status ng_attention_plan_masked(struct ng_attention *att, cudnnHandle_t h, int B, int H,
					int T, int D, int deterministic, int force_naive,
					const struct ng_attention_opts *opts)
{
	static const struct ng_attention_opts none;
	if (!opts)
		opts = &none;
	memset(att, 0, sizeof(*att));
	att->fwd.engine = att->bwd.engine = -1;
	if (B <= 0 || H <= 0 || T <= 0 || D <= 0 || D > 256) {
		ng_fail(NG_ERR_INPUT, "attention: shape B=%d H=%d T=%d D=%d not supported (need "
			"positive sizes and head size D <= 256)", B, H, T, D);
		ng_hint("choose --channels / --heads so that channels/heads is at most 256");
		return NG_ERR_INPUT;
	}
	if (opts->max_window < 0 || !(opts->scale >= 0.0f) || isinf(opts->scale) ||
	    (opts->band_on_device && opts->max_window <= 0) ||
	    (unsigned)opts->lo_order > NG_ATTENTION_LO_BEFORE)
		return ng_fail(NG_ERR_INPUT, "attention: bad mask options (max_window %d, scale %g, "
			       "band_on_device %d, lo_order %d): need max_window >= 0, a finite "
			       "scale >= 0, and max_window > 0 for a device band", opts->max_window,
			       (double)opts->scale, opts->band_on_device, (int)opts->lo_order);
	att->B = B, att->H = H, att->T = T, att->D = D;
	att->deterministic = deterministic != 0;
	att->max_window = opts->max_window;
	att->lower_bound = opts->lower_bound != 0;
	att->band_on_device = opts->band_on_device != 0;
	att->band = (float)opts->max_window;
	att->handle = h;
	att->cudnn_version = h ? cudnnGetVersion() : 0;
	att->scale = opts->scale > 0.0f ? opts->scale : 1.0f / sqrtf((float)D);
	/* Before 9.10 the mask value had to be finite. */
	att->mask_value = att->cudnn_version >= 91000 ? -INFINITY : -FLT_MAX;
	att->one = 1.0f;
	att->fwd_backend = att->bwd_backend = NG_ATTENTION_BACKEND_NAIVE;

	if (force_naive) {
		add_reason(att, "plain CUDA kernels requested");
	} else if (!h) {
		add_reason(att, "no cuDNN handle");
	} else if (D % 8 || (H * D) % 8) {
		add_reason(att, "cuDNN %zu needs D a multiple of 8, got B=%d H=%d T=%d D=%d",
			   att->cudnn_version, B, H, T, D);
	} else {
		if (try_cudnn_orders(att, &att->fwd, 0, opts->lo_order, &att->fwd_lo_before))
			att->fwd_backend = NG_ATTENTION_BACKEND_CUDNN;
		/* cuDNN <= 9.15.0 backward reads out of bounds under graph replay when T is not a
		 * multiple of 128 (docs/GPU.md). Like cudnn-frontend, describe the sequences as
		 * padded (lengths all T): a padding mask and GEMM size overrides. If that has no
		 * engine, the naive backward runs. */
		att->bwd_seqlen = att->cudnn_version < 91501 && T % 128;
		if (try_cudnn_orders(att, &att->bwd, 1, opts->lo_order, &att->bwd_lo_before))
			att->bwd_backend = NG_ATTENTION_BACKEND_CUDNN;
		else
			att->bwd_seqlen = 0;
	}

	att->fwd_ws = att->fwd_backend == NG_ATTENTION_BACKEND_CUDNN ? align256(att->fwd.workspace) : 0;
	size_t rows = align256((size_t)B * H * T * sizeof(float));
	att->bwd_sum_off = 0;
	if (att->bwd_backend == NG_ATTENTION_BACKEND_CUDNN) {
		size_t accum = att->deterministic ? 0 : align256((size_t)B * H * T * D * sizeof(float));
		size_t seq = att->bwd_seqlen ? align256((size_t)2 * B * sizeof(int)) : 0;
		att->bwd_accum_off = rows;
		att->bwd_seq_off = rows + accum;
		att->bwd_cudnn_off = rows + accum + seq;
		att->bwd_ws = att->bwd_cudnn_off + align256(att->bwd.workspace);
	} else {
		att->bwd_ws = rows;
	}

	const char *names[2] = {"cuDNN", "naive CUDA"};
	char ver[32] = "", mask[96];
	if (att->cudnn_version)
		snprintf(ver, sizeof(ver), " (cuDNN %zu)", att->cudnn_version);
	mask_text(mask, sizeof(mask), att, att->fwd_lo_before);
	int naive = att->fwd_backend == NG_ATTENTION_BACKEND_NAIVE ||
		    att->bwd_backend == NG_ATTENTION_BACKEND_NAIVE;
	snprintf(att->text, sizeof(att->text),
		 "attention B=%d H=%d T=%d D=%d%s, scale %.6g%s: forward %s engine %lld, backward %s "
		 "engine %lld%s%s%s, workspace fwd %zu B bwd %zu B%s%s",
		 B, H, T, D, ver, (double)att->scale, mask, names[att->fwd_backend],
		 (long long)att->fwd.engine, names[att->bwd_backend], (long long)att->bwd.engine,
		 att->deterministic ? " (deterministic)" : "",
		 att->bwd_seqlen ? " (padding-mask workaround: cuDNN <= 9.15.0, T not a multiple of "
				   "128)" : "",
		 att->lower_bound && att->bwd_lo_before != att->fwd_lo_before
			 ? (att->bwd_lo_before ? " (backward: lower bound first)"
					       : " (backward: lower bound last)") : "",
		 att->fwd_ws, att->bwd_ws, att->reason[0] ? (naive ? "; fallback: " : "; notes: ") : "",
		 att->reason);
	return NG_OK;
}

size_t ng_attention_fwd_workspace(const struct ng_attention *att) { return att->fwd_ws; }
size_t ng_attention_bwd_workspace(const struct ng_attention *att) { return att->bwd_ws; }
const char *ng_attention_describe(const struct ng_attention *att) { return att->text; }

/* Builds the variant pack for one call and executes the plan on stream s. */
static enum ng_status run_plan(const struct ng_attention *att, cudnnBackendDescriptor_t plan,
			       const int64_t *uids, void *const *ptrs, int n, void *workspace,
			       cudaStream_t s)
{
	cudnnBackendDescriptor_t vp = NULL;
	enum ng_status st;
	if ((st = NG_CUDNN_CHECK(cudnnSetStream(att->handle, s))))
		return st;
	if ((st = NG_CUDNN_CHECK(
		     cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp))))
		return st;
	if (!(st = NG_CUDNN_CHECK(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
							    CUDNN_TYPE_INT64, n, uids))) &&
	    !(st = NG_CUDNN_CHECK(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
							    CUDNN_TYPE_VOID_PTR, n, ptrs))) &&
	    !(st = NG_CUDNN_CHECK(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
							    CUDNN_TYPE_VOID_PTR, 1, &workspace))) &&
	    !(st = NG_CUDNN_CHECK(cudnnBackendFinalize(vp))))
		st = NG_CUDNN_CHECK(cudnnBackendExecute(att->handle, plan, vp));
	cudnnBackendDestroyDescriptor(vp);
	return st;
}

/* The mask inputs a call must bring, and the cuDNN tensors' 16-byte alignment. */
static enum ng_status check_mask_args(const struct ng_attention *att, const char *who,
				      enum ng_attention_backend backend, const int32_t *lo,
				      const int32_t *window)
{
	if (att->lower_bound && !lo)
		return ng_check_arg_fail(who, "the plan has a lower bound: lo (B=%d, T=%d) int32 is "
					 "required", att->B, att->T);
	if (att->band_on_device && !window)
		return ng_check_arg_fail(who, "the plan's band is on the device: the window "
					 "(int32 scalar) is required");
	if (backend == NG_ATTENTION_BACKEND_CUDNN &&
	    ((att->lower_bound && (uintptr_t)lo % 16) ||
	     (att->band_on_device && (uintptr_t)window % 16)))
		return ng_check_arg_fail(who, "lo %p and window %p must be 16-byte aligned for cuDNN",
					 (const void *)lo, (const void *)window);
	return NG_OK;
}

/* The naive kernels' view of the plan's mask. */
static struct ng_attention_naive_mask_ naive_mask(const struct ng_attention *att,
						  const int32_t *lo, const int32_t *window)
{
	struct ng_attention_naive_mask_ m = {
		.scale = att->scale,
		.window = att->max_window,
		.window_dev = att->band_on_device ? window : NULL,
		.lo = att->lower_bound ? lo : NULL,
	};
	return m;
}

/* Appends the mask's inputs (lo, the band's width) to a variant pack. */
static int add_mask_ptrs(const struct ng_attention *att, int64_t *uids, void **ptrs, int n,
			 const int32_t *lo, const int32_t *window)
{
	if (att->lower_bound)
		uids[n] = UID_LO, ptrs[n++] = (void *)lo;
	if (att->max_window > 0 && att->band_on_device)
		uids[n] = UID_WINDOW, ptrs[n++] = (void *)window;
	else if (att->max_window > 0)
		uids[n] = UID_BAND, ptrs[n++] = (void *)&att->band;
	return n;
}

enum ng_status ng_attention_fwd(const struct ng_attention *att, ng_bf16 *out, float *lse,
				const ng_bf16 *qkv, void *workspace, cudaStream_t s)
{
	return ng_attention_fwd_masked(att, out, lse, qkv, NULL, NULL, workspace, s);
}

enum ng_status ng_attention_fwd_masked(const struct ng_attention *att, ng_bf16 *out, float *lse,
				       const ng_bf16 *qkv, const int32_t *lo,
				       const int32_t *window, void *workspace, cudaStream_t s)
{
	size_t C = (size_t)att->H * att->D;
	enum ng_status st = check_mask_args(att, "ng_attention_fwd", att->fwd_backend, lo, window);
	if (st)
		return st;
	if (att->fwd_backend == NG_ATTENTION_BACKEND_NAIVE)
		return NG_CUDA_CHECK(ng_attention_naive_fwd_(out, lse, qkv, att->B, att->H, att->T,
							     att->D, naive_mask(att, lo, window), s));
	int64_t uids[10] = {UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_MASK};
	void *ptrs[10] = {(void *)qkv, (void *)(qkv + C), (void *)(qkv + 2 * C), out, lse,
			  (void *)&att->scale, (void *)&att->mask_value};
	int n = add_mask_ptrs(att, uids, ptrs, 7, lo, window);
	return run_plan(att, att->fwd.plan, uids, ptrs, n, workspace, s);
}

enum ng_status ng_attention_bwd(const struct ng_attention *att, ng_bf16 *dqkv, const ng_bf16 *dout,
				const ng_bf16 *qkv, const ng_bf16 *out, const float *lse,
				void *workspace, cudaStream_t s)
{
	return ng_attention_bwd_masked(att, dqkv, dout, qkv, out, lse, NULL, NULL, workspace, s);
}

enum ng_status ng_attention_bwd_masked(const struct ng_attention *att, ng_bf16 *dqkv,
				       const ng_bf16 *dout, const ng_bf16 *qkv, const ng_bf16 *out,
				       const float *lse, const int32_t *lo, const int32_t *window,
				       void *workspace, cudaStream_t s)
{
	size_t C = (size_t)att->H * att->D;
	char *ws = workspace;
	enum ng_status st = check_mask_args(att, "ng_attention_bwd", att->bwd_backend, lo, window);
	if (st)
		return st;
	if (att->bwd_backend == NG_ATTENTION_BACKEND_NAIVE)
		return NG_CUDA_CHECK(ng_attention_naive_bwd_(dqkv, (float *)(ws + att->bwd_sum_off),
							     dout, qkv, out, lse, att->B, att->H,
							     att->T, att->D,
							     naive_mask(att, lo, window), s));
	int *seq = (int *)(ws + att->bwd_seq_off);
	int64_t uids[20] = {UID_Q, UID_K, UID_V, UID_O, UID_DO, UID_STATS, UID_SCALE, UID_MASK,
			    UID_ONE, UID_DQ, UID_DK, UID_DV, UID_SOFTMAX_SUM, UID_DQ_ACCUM};
	void *ptrs[20] = {(void *)qkv, (void *)(qkv + C), (void *)(qkv + 2 * C), (void *)out,
			  (void *)dout, (void *)lse, (void *)&att->scale, (void *)&att->mask_value,
			  (void *)&att->one, dqkv, dqkv + C, dqkv + 2 * C, ws + att->bwd_sum_off,
			  ws + att->bwd_accum_off};
	int n = att->deterministic ? 13 : 14;
	if (att->bwd_seqlen) {
		/* every sequence has length T: written here so a captured graph holds it too */
		st = NG_CUDA_CHECK(ng_attention_fill_i32_(seq, 2 * att->B, att->T, s));
		if (st)
			return st;
		uids[n] = UID_SEQ_Q, ptrs[n++] = seq;
		uids[n] = UID_SEQ_KV, ptrs[n++] = seq + att->B;
	}
	n = add_mask_ptrs(att, uids, ptrs, n, lo, window);
	/* Before 9.6 the engine expected a zeroed dQ_accum (cudnn-frontend memsets it there). */
	if (!att->deterministic && att->cudnn_version < 90600) {
		st = NG_CUDA_CHECK(cudaMemsetAsync(
			ws + att->bwd_accum_off, 0,
			(size_t)att->B * att->H * att->T * att->D * sizeof(float), s));
		if (st)
			return st;
	}
	return run_plan(att, att->bwd.plan, uids, ptrs, n, ws + att->bwd_cudnn_off, s);
}

void ng_attention_free(struct ng_attention *att)
{
	plan_release(&att->fwd);
	plan_release(&att->bwd);
}
