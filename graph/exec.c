/*
 * graph/exec.c — the GPU executor (see exec.h): one arena, planned kernels, one captured graph.
 * run_op() is the only place that maps an IR op to kernel launches; the same function runs the
 * nodes eagerly (--no-graph, and the warm-up) and inside stream capture, so graph and eager
 * execution cannot drift apart.
 */
#include "graph/exec.h"
#include "graph/exec_internal.h"
#include "graph/optim_muon.h"

#include <ctype.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/encoder.h"
#include "kernels/fp8.h"
#include "kernels/gemm_sm90.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/optim.h"
#include "util/rng.h"

#define ALIGN_UP(x, a) (((x) + (a) - 1) / (a) * (a))

/* Device address of tensor t of graph g. */
void *ng_exec_tensor_(const struct ng_exec *e, const struct ng_graph *g, int t)
{
	return e->arena + g->tensors[t].offset;
}

/* Device address of parameter `id` (layer `layer`) inside the flat buffer tensor `base`. */
static void *pp(const struct ng_exec *e, const struct ng_graph *g, int base, int id, int layer)
{
	const struct ng_param_spec *p = &g->lay.p[id];
	size_t el = ng_dtype_size(g->tensors[base].dtype);
	size_t off = p->offset + (p->per_layer && layer > 0 ? (size_t)layer * (p->numel / p->shape[0])
							    : 0);
	return (char *)ng_exec_tensor_(e, g, base) + off * el;
}

static bool is_matmul(enum ng_op_kind k)
{
	return k == NG_OP_MATMUL_FWD || k == NG_OP_MATMUL_DINP || k == NG_OP_MATMUL_DW;
}

static struct ng_matmul_spec op_spec(const struct ng_exec *e, const struct ng_op *op)
{
	struct ng_matmul_spec s = { 0 };
	ng_linear_dims(&e->cfg.model, op->which, &s.IC, &s.OC);
	s.N = op->row_count;
	s.gelu = op->gelu;
	s.autotune = e->cfg.autotune;
	if (op->kind == NG_OP_MATMUL_FWD) {
		s.kind = NG_MATMUL_FWD;
		s.bias = op->param[1] >= 0;
		s.fp8 = op->fp8;
		s.accumulate = op->residual;
	} else if (op->kind == NG_OP_MATMUL_DINP) {
		s.kind = NG_MATMUL_DINP;
		s.fp8 = op->fp8;
		s.own = op->own;
		s.bias = op->own; /* ours sums the fc bias gradient too */
	} else {
		s.kind = NG_MATMUL_DW;
		s.gelu = 0;
		s.bias = op->param[1] >= 0;
		s.accumulate = !op->overwrite;
	}
	return s;
}

/* Find or make the plan of this shape. */
static enum ng_status plan_spec(struct ng_exec *e, struct ng_matmul_spec s, int *idx)
{
	for (int i = 0; i < e->n_plans; i++) {
		if (memcmp(&e->plans[i].spec, &s, sizeof(s)) == 0) {
			*idx = i;
			return NG_OK;
		}
	}
	if (e->n_plans == NG_EXEC_MAX_PLANS)
		return ng_fail(NG_ERR_RUNTIME, "more than %d distinct matmul shapes",
			       NG_EXEC_MAX_PLANS);
	struct ng_exec_matmul *p = &e->plans[e->n_plans];
	memset(p, 0, sizeof(*p));
	p->spec = s;
	enum ng_status st = ng_matmul_plan(&p->mm, &e->mmctx, &s);
	if (st)
		return st;
	*idx = e->n_plans++;
	return NG_OK;
}

static enum ng_status plan_matmul(struct ng_exec *e, const struct ng_op *op, int *idx)
{
	return plan_spec(e, op_spec(e, op), idx);
}

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

/* One iteration of variant v (0 or 1) of a plan-time choice, enqueued on e->stream. */
typedef enum ng_status (*pair_run_fn)(struct ng_exec *e, void *arg, int v);

/* *ms = the time an iteration of variant v over k of them back to back between ev[0] and ev[1]. */
static enum ng_status time_batch(struct ng_exec *e, pair_run_fn run, void *arg, int v, int k,
				 cudaEvent_t *ev, float *ms)
{
	enum ng_status st = NG_CUDA_CHECK(cudaEventRecord(ev[0], e->stream));
	for (int i = 0; i < k && !st; i++)
		st = run(e, arg, v);
	if (!st)
		st = NG_CUDA_CHECK(cudaEventRecord(ev[1], e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaEventSynchronize(ev[1]));
	if (!st)
		st = NG_CUDA_CHECK(cudaEventElapsedTime(ms, ev[0], ev[1]));
	if (!st)
		*ms /= (float)k;
	return st;
}

/* Times the nv variants (2 or 3) of a plan-time choice as the step runs them: on a GPU held at
 * its power cap, where the clock drops and what spends less energy wins (bench_matmul
 * --sustained, BENCHMARKS.md session 17; a synchronised burst runs at the boost clock). One
 * synchronised iteration of each sizes the batches; all alternate for ~HEAT_MS; then ROUNDS
 * rounds run each variant ~BATCH_MS of iterations back to back between two events. ms[v]: the
 * median over the rounds of the time an iteration. ~0.2 s a variant. */
#define TIME_MAX_VARIANTS 3
static enum ng_status time_variants(struct ng_exec *e, pair_run_fn run, void *arg, int nv,
				    float *ms)
{
	enum { ROUNDS = 5 };
	const float HEAT_MS = 150.0f, BATCH_MS = 25.0f;
	cudaEvent_t ev[2] = { 0 };
	float est[TIME_MAX_VARIANTS] = { 0 }, t[TIME_MAX_VARIANTS][ROUNDS];
	int k[TIME_MAX_VARIANTS];
	enum ng_status st = NG_OK;
	if (nv < 1 || nv > TIME_MAX_VARIANTS)
		return ng_fail(NG_ERR_RUNTIME, "time_variants: %d variants (1..%d)", nv,
			       TIME_MAX_VARIANTS);
	for (int i = 0; i < 2 && !st; i++)
		st = NG_CUDA_CHECK(cudaEventCreate(&ev[i]));
	for (int r = 0; r < 2 && !st; r++) /* r = 0: warm-up (first launches load modules) */
		for (int v = 0; v < nv && !st; v++)
			st = time_batch(e, run, arg, v, 1, ev, &est[v]);
	float all = 0.0f;
	for (int v = 0; v < nv; v++) {
		float n = est[v] > 0.0f ? BATCH_MS / est[v] : 1.0f;
		k[v] = n < 1.0f ? 1 : n > 10000.0f ? 10000 : (int)n;
		all += est[v];
	}
	int heat = all > 0.0f ? (int)(HEAT_MS / all) : 1;
	heat = heat < 1 ? 1 : heat > 10000 ? 10000 : heat;
	for (int i = 0; i < heat && !st; i++)
		for (int v = 0; v < nv && !st; v++)
			st = run(e, arg, v);
	for (int r = 0; r < ROUNDS && !st; r++)
		for (int v = 0; v < nv && !st; v++)
			st = time_batch(e, run, arg, v, k[v], ev, &t[v][r]);
	for (int i = 0; i < 2; i++)
		if (ev[i])
			cudaEventDestroy(ev[i]);
	if (st)
		return st;
	for (int v = 0; v < nv; v++) {
		qsort(t[v], ROUNDS, sizeof(float), cmp_float);
		ms[v] = t[v][ROUNDS / 2];
	}
	return NG_OK;
}

static enum ng_status time_pair(struct ng_exec *e, pair_run_fn run, void *arg, float ms[2])
{
	return time_variants(e, run, arg, 2, ms);
}

/* The two plans of a GELU choice: s with the epilogue (plan[0]) and without (plan[1]); *ws the
 * larger workspace of the two. */
static enum ng_status plan_gelu_pair(struct ng_exec *e, struct ng_matmul_spec s, int plan[2],
				     size_t *ws)
{
	enum ng_status st = NG_OK;
	for (int v = 0; v < 2 && !st; v++) {
		s.gelu = v == 0;
		st = plan_spec(e, s, &plan[v]);
	}
	if (st)
		return st;
	*ws = e->plans[plan[0]].mm.workspace_need;
	if (e->plans[plan[1]].mm.workspace_need > *ws)
		*ws = e->plans[plan[1]].mm.workspace_need;
	return NG_OK;
}

/* Offsets of n regions of the given sizes in one buffer, each 256-byte aligned; the total. */
static size_t lay_out(const size_t *sizes, int n, size_t *at)
{
	size_t bytes = 0;
	for (int i = 0; i < n; i++) {
		at[i] = bytes;
		bytes += ALIGN_UP(sizes[i], 256);
	}
	return bytes;
}

/* time_variants on a scratch buffer of `bytes` filled with a constant (bf16 0x3c3c = 0.0115),
 * freed after. */
static enum ng_status time_on_scratch(struct ng_exec *e, char *buf, size_t bytes, pair_run_fn run,
				      void *arg, int nv, float *ms)
{
	enum ng_status st = NG_CUDA_CHECK(cudaMemsetAsync(buf, 0x3c, bytes, e->stream));
	if (!st)
		st = time_variants(e, run, arg, nv, ms);
	cudaFree(buf);
	return st;
}

/* choose_dgelu's scratch and plans: the FC backward as the step runs it each way.
 * Variant 0 (DGELU fused, cuBLASLt): with --recompute gelu the GELU kernel recomputes the
 * activation first; the FC-proj dinp matmul with the DGELU epilogue; the fc dW matmul with its
 * bias gradient (the column-sum matmul). Variant 1: the plain FC-proj dinp matmul;
 * ng_gelu_bwd_bias in place (the fc bias gradient, and the activation with --recompute gelu);
 * the fc dW matmul without bias. Variant 2 (own): our own GEMM's DINP with DGELU, the fc bias
 * gradient from its column sums, and with --recompute gelu the activation; the fc dW without
 * bias. W^T is made once (the step makes it at the backward's start). */
struct dgelu_trial {
	const struct ng_matmul *dinp_mm[3], *dw_mm[3];
	char *dfch, *fch, *dresid, *w, *wt, *ln2, *dw, *dbias, *gelu_out, *part, *ws;
	int N, C;
};

static enum ng_status dgelu_run(struct ng_exec *e, void *arg, int v)
{
	const struct dgelu_trial *d = arg;
	enum ng_status st = NG_OK;
	size_t n = (size_t)d->N * 4 * d->C;
	if (v == 0 && d->gelu_out)
		st = ng_gelu_fwd((ng_bf16 *)d->gelu_out, (const ng_bf16 *)d->fch, n, e->stream);
	if (!st && v == 2)
		st = ng_matmul_run_dgelu(d->dinp_mm[v], d->dfch, d->dresid, d->wt, d->fch,
					 d->gelu_out, (float *)d->dbias, 0, d->ws, e->stream);
	else if (!st)
		st = ng_matmul_run(d->dinp_mm[v], d->dfch, d->dresid, d->w, NULL,
				   v == 0 ? d->fch : NULL, NULL, d->ws, e->stream);
	if (!st && v == 1)
		st = ng_gelu_bwd_bias((ng_bf16 *)d->dfch, (ng_bf16 *)d->gelu_out, (float *)d->dbias,
				      0, (const ng_bf16 *)d->fch, (const ng_bf16 *)d->dfch, d->N,
				      4 * d->C, d->part, e->stream);
	if (!st)
		st = ng_matmul_run(d->dw_mm[v], d->dw, d->dfch, d->ln2, NULL, NULL,
				   v == 0 ? d->dbias : NULL, d->ws, e->stream);
	return st;
}

/* --gelu-fusion auto: the FC backward with the DGELU epilogue fused into the FC-proj dinp
 * matmul (cuBLASLt's, or, on an sm_90 GPU in a bf16 run, our own GEMM's), or unfused
 * (dgelu_trial above), whichever is fastest here at the step's shape (time_variants: under
 * sustained load, on scratch filled with a constant). The trial times everything that differs
 * between them: the fc bias gradient, the recomputed activation, the fc dW matmul. The plans
 * stay in e->plans; the graph is built with the choice (*fuse: NG_GELU_FUSE_BWD, with
 * NG_GELU_FUSE_OWN, or 0). Measured on the H200: cuBLASLt's epilogue wins at d12 and d48,
 * loses at d24 (BENCHMARKS.md). Not with --deterministic: two runs must build the same step, so
 * the bits stay as given. */
static enum ng_status choose_dgelu(struct ng_exec *e, int *fuse)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	const int N = e->cfg.B * e->cfg.T, C = m->C;
	const int recompute = e->train.recompute_gelu && e->train.keep_gelu < m->L;
	const int nv = !e->train.fp8 && ng_gemm_sm90_available() ? 3 : 2;
	struct ng_matmul_spec s = { .kind = NG_MATMUL_DINP, .N = N, .IC = 4 * C, .OC = C,
				    .autotune = e->cfg.autotune };
	struct ng_matmul_spec w = { .kind = NG_MATMUL_DW, .N = N, .IC = C, .OC = 4 * C,
				    .autotune = e->cfg.autotune };
	int dinp_plan[3] = { 0, 0, 0 }, dw_plan[3] = { 0, 0, 0 };
	size_t ws = 0;
	enum ng_status st = plan_gelu_pair(e, s, dinp_plan, &ws);
	for (int v = 0; v < 2 && !st; v++) { /* the fc dW: with its bias gradient when fused */
		w.bias = v == 0;
		st = plan_spec(e, w, &dw_plan[v]);
		if (!st && e->plans[dw_plan[v]].mm.workspace_need > ws)
			ws = e->plans[dw_plan[v]].mm.workspace_need;
	}
	if (!st && nv == 3) { /* own: the op's spec as op_spec makes it */
		s.gelu = 1;
		s.own = 1;
		s.bias = 1;
		st = plan_spec(e, s, &dinp_plan[2]);
		dw_plan[2] = dw_plan[1];
		if (!st && e->plans[dinp_plan[2]].mm.workspace_need > ws)
			ws = e->plans[dinp_plan[2]].mm.workspace_need;
	}
	if (st)
		return st;
	size_t n4 = (size_t)N * 4 * C, n1 = (size_t)N * C, nw = (size_t)4 * C * C;
	/* dfch, fch, dresid, W, W^T, ln2, dW, dbias, gelu_out, partials, workspace */
	size_t sizes[11] = { n4 * 2, n4 * 2, n1 * 2, nw * 2, nv == 3 ? nw * 2 : 0, n1 * 2, nw * 4,
			     (size_t)4 * C * 4, recompute ? n4 * 2 : 0,
			     ng_bias_grad_scratch_bytes(N, 4 * C), ws };
	size_t at[11];
	size_t bytes = lay_out(sizes, 11, at);
	char *buf = NULL;
	for (int v = 0; v < 3; v++)
		e->dgelu_ms[v] = -1.0f;
	if (cudaMalloc((void **)&buf, bytes) != cudaSuccess) {
		/* no room to time it: keep the bits as given; if the step itself does not fit,
		 * the arena check below says so in its own words */
		(void)cudaGetLastError();
		return NG_OK;
	}
	struct dgelu_trial d = { { &e->plans[dinp_plan[0]].mm, &e->plans[dinp_plan[1]].mm,
				   &e->plans[dinp_plan[2]].mm },
				 { &e->plans[dw_plan[0]].mm, &e->plans[dw_plan[1]].mm,
				   &e->plans[dw_plan[2]].mm },
				 buf + at[0], buf + at[1], buf + at[2], buf + at[3], buf + at[4],
				 buf + at[5], buf + at[6], buf + at[7],
				 recompute ? buf + at[8] : NULL, buf + at[9],
				 ws ? buf + at[10] : NULL, N, C };
	st = time_on_scratch(e, buf, bytes, dgelu_run, &d, nv, e->dgelu_ms);
	if (st)
		return st;
	*fuse = ng_exec_pick_dgelu(e->dgelu_ms, nv);
	return NG_OK;
}

int ng_exec_pick_dgelu(const float *ms, int nv)
{
	/* ours needs W^T (more memory at d48) and wins the step only by a clear margin: at d24 its
	 * trial was 9% ahead and the step +0.3-0.5%; at d48 1% ahead and the step none
	 * (BENCHMARKS.md, session 27) */
	const float OWN_MARGIN = 0.97f;
	int best = ms[1] < ms[0];
	if (nv == 3 && ms[2] > 0.0f && ms[2] < OWN_MARGIN * ms[best])
		best = 2;
	return best == 0 ? NG_GELU_FUSE_BWD : best == 2 ? NG_GELU_FUSE_BWD | NG_GELU_FUSE_OWN : 0;
}

/* choose_gelu_fwd's scratch and plans: variant 0 the FC matmul with the GELU epilogue (the
 * pre-activation as its aux output), 1 the plain matmul (bias) and the GELU kernel. */
struct gelu_fwd_trial {
	const struct ng_matmul *mm[2];
	char *out, *pre, *inp, *w, *bias, *ws;
	size_t n_out;
};

static enum ng_status gelu_fwd_run(struct ng_exec *e, void *arg, int v)
{
	const struct gelu_fwd_trial *d = arg;
	if (v == 0)
		return ng_matmul_run(d->mm[0], d->out, d->inp, d->w, d->bias, d->pre, NULL, d->ws,
				     e->stream);
	enum ng_status st = ng_matmul_run(d->mm[1], d->pre, d->inp, d->w, d->bias, NULL, NULL,
					  d->ws, e->stream);
	if (!st)
		st = ng_gelu_fwd((ng_bf16 *)d->out, (const ng_bf16 *)d->pre, d->n_out, e->stream);
	return st;
}

/* --gelu-fusion auto, forward: the FC matmul with the GELU epilogue, or the plain matmul and the
 * GELU kernel, timed like choose_dgelu (in bf16, also under --fp8). The epilogue writes two
 * outputs where the plain matmul writes one, and the kernel reads and writes one more: on the
 * H200 the two were within ~1% of a step (BENCHMARKS.md session 19). */
static enum ng_status choose_gelu_fwd(struct ng_exec *e, int *fuse)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	struct ng_matmul_spec s = { .kind = NG_MATMUL_FWD, .N = e->cfg.B * e->cfg.T, .IC = m->C,
				    .OC = 4 * m->C, .bias = 1, .autotune = e->cfg.autotune };
	int plan[2] = { 0, 0 };
	size_t ws = 0;
	enum ng_status st = plan_gelu_pair(e, s, plan, &ws);
	if (st)
		return st;
	size_t n_in = (size_t)s.N * s.IC, n_out = (size_t)s.N * s.OC, n_w = (size_t)s.OC * s.IC;
	size_t at[6]; /* out, pre-activation, inp, W, bias, workspace */
	size_t sizes[6] = { n_out * 2, n_out * 2, n_in * 2, n_w * 2, (size_t)s.OC * 2, ws };
	size_t bytes = lay_out(sizes, 6, at);
	char *buf = NULL;
	if (cudaMalloc((void **)&buf, bytes) != cudaSuccess) {
		(void)cudaGetLastError(); /* no room to time it: keep the bits as given */
		e->gelu_fwd_ms[0] = e->gelu_fwd_ms[1] = -1.0f;
		return NG_OK;
	}
	struct gelu_fwd_trial d = { { &e->plans[plan[0]].mm, &e->plans[plan[1]].mm },
				    buf + at[0], buf + at[1], buf + at[2], buf + at[3], buf + at[4],
				    ws ? buf + at[5] : NULL, n_out };
	st = time_on_scratch(e, buf, bytes, gelu_fwd_run, &d, 2, e->gelu_fwd_ms);
	if (st)
		return st;
	*fuse = e->gelu_fwd_ms[0] <= e->gelu_fwd_ms[1];
	return NG_OK;
}

/* The NG_FP8_* bit of e->fp8_ms's row k: forward kinds 0-4, then the dinp of kinds 0-3. */
static int fp8_kind_bit(int k)
{
	return k < 5 ? 1 << k : 1 << (k - 5 + NG_FP8_DINP_SHIFT);
}

/* choose_fp8's scratch and plans: variant 0 the bf16 matmul, 1 the casts and the fp8 matmul.
 * at: inp, inp8, W, W8, out, aux, bias, scales (scale, amax, 2 descales), workspace. */
struct fp8_trial {
	const struct ng_matmul *mm[2];
	char *buf;
	size_t at[9];
	void *ws, *aux, *bias;
	float *sc;
	int dinp, cast, OC, IC;
	size_t n_in, n_w;
};

static enum ng_status fp8_run(struct ng_exec *e, void *arg, int v)
{
	const struct fp8_trial *t = arg;
	char *buf = t->buf;
	const size_t *at = t->at;
	if (v == 0)
		return ng_matmul_run(t->mm[0], buf + at[4], buf + at[0], buf + at[2], t->bias, t->aux,
				     NULL, t->ws, e->stream);
	enum ng_status st = NG_OK;
	if (e->train.recompute_fp8) /* W cast at its use */
		st = t->dinp ? ng_fp8_cast_e4m3_wt_seg(NULL, (uint8_t *)(buf + at[3]),
						       (const ng_bf16 *)(buf + at[2]), t->sc, t->OC,
						       t->IC, 1, e->stream)
			     : ng_fp8_cast_e4m3_seg((uint8_t *)(buf + at[3]),
						    (const ng_bf16 *)(buf + at[2]), t->sc, NULL,
						    t->n_w, 1, e->stream);
	if (!st && t->cast)
		st = ng_fp8_cast_seg(t->dinp ? NG_FP8_E5M2 : NG_FP8_E4M3, (uint8_t *)(buf + at[1]),
				     (const ng_bf16 *)(buf + at[0]), t->sc, t->sc + 1, t->n_in, 1,
				     e->stream);
	if (!st)
		st = ng_matmul_run_fp8(t->mm[1], buf + at[4], buf + at[1], buf + at[3], t->bias,
				       t->aux, t->sc + 4, t->sc + 8, t->ws, e->stream);
	return st;
}

/* --fp8 (AUTO): for each kind of fp8 matmul in *mask (graph/step.h: the five forward kinds,
 * then the four layer dinp kinds), at the step's shape, the bf16 matmul against the fp8 matmul
 * plus the cast of its input where the step casts it (forward attproj and fcproj to E4M3; every
 * dinp's dout to E5M2; a LayerNorm writes the other forward inputs), timed by time_pair (under
 * sustained load) on scratch filled with a constant; a kind stays fp8 only where that is
 * faster (with --recompute fp8, the cast of W, or W^T, counts too). The cast costs 3 bytes an
 * input element, so an output narrower than about C = 800 loses what the fp8 rate wins
 * (kernels of GPU.md's rates). Plans stay in e->plans. */
static enum ng_status choose_fp8(struct ng_exec *e, int fuse_fwd, int fuse_bwd, int head_rows,
				 int *mask)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	static const enum ng_op_which kinds[5] = { NG_OP_WHICH_QKV, NG_OP_WHICH_ATTPROJ,
						   NG_OP_WHICH_FC, NG_OP_WHICH_FCPROJ,
						   NG_OP_WHICH_HEAD };
	enum ng_status st = NG_OK;
	for (int k = 0; k < NG_EXEC_FP8_KINDS && !st; k++) {
		e->fp8_ms[k][0] = e->fp8_ms[k][1] = -1.0f;
		const int dinp = k >= 5;
		const enum ng_op_which w = kinds[dinp ? k - 5 : k];
		const int bit = fp8_kind_bit(k);
		if (!(*mask & bit))
			continue;
		struct ng_matmul_spec s = { .kind = dinp ? NG_MATMUL_DINP : NG_MATMUL_FWD,
					    .autotune = e->cfg.autotune };
		ng_linear_dims(m, w, &s.IC, &s.OC);
		s.N = w == NG_OP_WHICH_HEAD ? head_rows : e->cfg.B * e->cfg.T;
		s.bias = !dinp && w != NG_OP_WHICH_HEAD;
		s.gelu = dinp ? w == NG_OP_WHICH_FCPROJ && fuse_bwd : w == NG_OP_WHICH_FC && fuse_fwd;
		/* a LayerNorm writes the E4M3 input of these (1 more byte an element): no cast */
		int cast = dinp || (w == NG_OP_WHICH_ATTPROJ || w == NG_OP_WHICH_FCPROJ);
		int plan[2] = { 0, 0 };
		st = plan_spec(e, s, &plan[0]);
		s.fp8 = 1;
		if (!st)
			st = plan_spec(e, s, &plan[1]);
		if (st)
			break;
		size_t n_in = (size_t)s.N * (dinp ? s.OC : s.IC);
		size_t n_out = (size_t)s.N * (dinp ? s.IC : s.OC), n_w = (size_t)s.OC * s.IC;
		size_t ws = e->plans[plan[0]].mm.workspace_need;
		if (e->plans[plan[1]].mm.workspace_need > ws)
			ws = e->plans[plan[1]].mm.workspace_need;
		/* inp, inp8, W, W8, out, aux, bias, scales (scale, amax, 2 descales), workspace */
		size_t sizes[9] = { n_in * 2, n_in, n_w * 2, n_w, n_out * 2, s.gelu ? n_out * 2 : 0,
				    (size_t)s.OC * 2, 64, ws };
		size_t at[9], bytes = 0;
		for (int i = 0; i < 9; i++) {
			at[i] = bytes;
			bytes += ALIGN_UP(sizes[i], 256);
		}
		char *buf = NULL;
		if (cudaMalloc((void **)&buf, bytes) != cudaSuccess) {
			(void)cudaGetLastError(); /* no room to time: keep the kind as asked */
			continue;
		}
		float one[16] = { 1.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0, 0, 0, 1.0f };
		float *sc = (float *)(buf + at[7]);
		struct fp8_trial t = { { &e->plans[plan[0]].mm, &e->plans[plan[1]].mm }, buf, {0},
				       ws ? buf + at[8] : NULL, s.gelu ? buf + at[5] : NULL,
				       s.bias ? buf + at[6] : NULL, sc, dinp, cast, s.OC, s.IC, n_in,
				       n_w };
		memcpy(t.at, at, sizeof(at));
		st = NG_CUDA_CHECK(cudaMemsetAsync(buf, 0x3c, at[7], e->stream)); /* 0.0115 */
		if (!st)
			st = NG_CUDA_CHECK(cudaMemcpyAsync(sc, one, sizeof(one), cudaMemcpyHostToDevice,
							   e->stream));
		if (!st)
			st = time_pair(e, fp8_run, &t, e->fp8_ms[k]);
		cudaFree(buf);
		if (st)
			break;
		if (e->fp8_ms[k][1] >= e->fp8_ms[k][0])
			*mask &= ~bit;
	}
	return st;
}

/* Data parallelism: every rank timed the choices on its own GPU and may have come out
 * differently (a toss-up like attproj at d24), which would mix precisions in the averaged
 * gradient and make runs unrepeatable. The ranks vote: the fused GELU, the fused DGELU and each
 * fp8 kind are kept only where every rank chose them (a sum of 0/1 votes over NCCL, at init, outside the step). */
static enum ng_status agree_choices(struct ng_exec *e, int *fuse, int *mask)
{
	if (!e->cfg.comm || e->cfg.world < 2)
		return NG_OK;
	enum { NV = 3 + NG_EXEC_FP8_KINDS };
	float v[NV], *d = NULL;
	v[0] = *fuse & NG_GELU_FUSE_FWD ? 1.0f : 0.0f;
	v[1] = *fuse & NG_GELU_FUSE_BWD ? 1.0f : 0.0f;
	v[2] = *fuse & NG_GELU_FUSE_OWN ? 1.0f : 0.0f;
	for (int k = 0; k < NG_EXEC_FP8_KINDS; k++)
		v[3 + k] = *mask & fp8_kind_bit(k) ? 1.0f : 0.0f;
	enum ng_status st = NG_CUDA_CHECK(cudaMalloc((void **)&d, sizeof(v)));
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpyAsync(d, v, sizeof(v), cudaMemcpyHostToDevice, e->stream));
	if (!st)
		st = ng_collective_allreduce_sum_f32(e->cfg.comm, d, NV, e->stream);
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpyAsync(v, d, sizeof(v), cudaMemcpyDeviceToHost, e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	if (d)
		cudaFree(d);
	if (st)
		return st;
	float all = (float)e->cfg.world - 0.5f; /* sums of 0/1 are exact */
	*fuse = (v[0] > all ? NG_GELU_FUSE_FWD : 0) | (v[1] > all ? NG_GELU_FUSE_BWD : 0) |
		(v[1] > all && v[2] > all ? NG_GELU_FUSE_OWN : 0);
	for (int k = 0; k < NG_EXEC_FP8_KINDS; k++)
		if (!(v[3 + k] > all))
			*mask &= ~fp8_kind_bit(k);
	return NG_OK;
}

/* The bytes op's scratch tensor must have, from the real plans. */
static size_t scratch_need(const struct ng_exec *e, const struct ng_graph *g, const struct ng_op *op,
			   int plan)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	int N = g->B * g->T;
	switch (op->kind) {
	case NG_OP_MATMUL_FWD: case NG_OP_MATMUL_DINP: case NG_OP_MATMUL_DW:
	{
		/* fp8: the input's copy in front (dout's E5M2 for dinp, the E4M3 input for a forward
		 * no LayerNorm wrote it for), then with --recompute fp8 this layer's W or W^T */
		size_t w8 = op->fp8 && g->recompute_fp8 ? ng_fp8_weight_bytes(m, op->which) : 0;
		if (op->fp8 && op->kind == NG_OP_MATMUL_DINP)
			return e->plans[plan].mm.workspace_need + w8 +
			       ng_fp8_input_bytes((size_t)op->row_count,
						  (size_t)e->plans[plan].spec.OC);
		return e->plans[plan].mm.workspace_need + w8 +
		       (op->fp8 && op->n_in < 5 ? ng_fp8_input_bytes((size_t)op->row_count,
								     (size_t)e->plans[plan].spec.IC)
						 : 0);
	}
	case NG_OP_ATTENTION_FWD:
		return ng_attention_fwd_workspace(&e->att);
	case NG_OP_ATTENTION_BWD:
		return ng_attention_bwd_workspace(&e->att);
	case NG_OP_LAYERNORM_BWD:
		return ng_layernorm_bwd_scratch_bytes(N, m->C);
	case NG_OP_GELU_BWD:
		return op->param[0] >= 0 ? ng_bias_grad_scratch_bytes(op->row_count, 4 * m->C) : 0;
	case NG_OP_ENCODER_BWD:
		return ng_encoder_bwd_work_bytes(g->B, g->T, m->C);
	case NG_OP_GRAD_NORM:
		return ng_grad_norm_scratch_bytes(g->lay.total);
	case NG_OP_MUON:
		return ng_optim_muon_scratch_bytes(m, e->cfg.world);
	default:
		return 0;
	}
}

/* Plan every matmul of g, raise scratch tensors to the real needs, re-plan the arena. */
static enum ng_status plan_graph(struct ng_exec *e, struct ng_graph *g, int **plan_of_op)
{
	int *pl = malloc(sizeof(int) * (size_t)g->n_ops);
	if (!pl)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	*plan_of_op = pl;
	bool raised = false;
	for (int i = 0; i < g->n_ops; i++) {
		const struct ng_op *op = &g->ops[i];
		pl[i] = -1;
		if (is_matmul(op->kind)) {
			enum ng_status st = plan_matmul(e, op, &pl[i]);
			if (st)
				return st;
		}
		if (op->kind == NG_OP_MUON) {
			enum ng_status st = ng_optim_muon_plan_(e, g);
			if (st)
				return st;
		}
		if (op->kind == NG_OP_ENCODER_SORT) { /* its output holds all it writes (ir.h) */
			struct ng_tensor *t = &g->tensors[op->out[0]];
			size_t sb = ng_encoder_bwd_sorted_bytes(g->B, g->T);
			if (t->bytes < sb) {
				t->bytes = sb;
				raised = true;
			}
		}
		size_t need = scratch_need(e, g, op, pl[i]);
		if (need == 0)
			continue;
		if (op->scratch < 0)
			return ng_fail(NG_ERR_RUNTIME, "op %s needs %zu bytes of workspace but the "
				       "step builder gave it none", op->name, need);
		struct ng_tensor *t = &g->tensors[op->scratch];
		if (t->bytes < need) {
			t->bytes = need;
			raised = true;
		}
	}
	if (raised)
		return ng_graph_plan(g, g->align);
	return NG_OK;
}

/* ---- data parallelism (cfg.comm): see exec.h ---- */

/* A LayerNorm that writes the E4M3 input of the next fp8 matmul (graph/step.h "FP8"): that
 * matmul's slot (LN1 -> qkv, LN2 -> fc, LNF -> head); fp8_state is its last input. */
static int ln_fp8_slot(const struct ng_graph *g, const struct ng_op *op)
{
	enum ng_op_which w = op->which == NG_OP_WHICH_LN1 ? NG_OP_WHICH_QKV
			     : op->which == NG_OP_WHICH_LN2 ? NG_OP_WHICH_FC : NG_OP_WHICH_HEAD;
	return ng_fp8_slot(g->cfg.L, w, op->layer);
}

/* That slot's scale or maximum (NG_FP8_ACT_SCALE / NG_FP8_ACT_AMAX). */
static float *ln_fp8_field(const struct ng_exec *e, const struct ng_graph *g,
			   const struct ng_op *op, enum ng_fp8_field f)
{
	float *st = ng_exec_tensor_(e, g, op->in[op->n_in - 1]);
	size_t slot = (size_t)ln_fp8_slot(g, op);
	return st + ng_fp8_field_at(g->cfg.L, f) +
	       (f == NG_FP8_ACT_AMAX ? (size_t)NG_FP8_AMAX_FLOATS * slot : slot);
}

/* --fp8 (graph/step.h "FP8"): roll the activation (E4M3) and gradient (E5M2) scales; cast every
 * fp8 weight matrix with its own current scale, and W^T for the fp8 dinp kinds. At most 18
 * launches whatever the depth: each parameter block's L layers are consecutive segments. */
static enum ng_status run_fp8_prep(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, cudaStream_t s)
{
	const int L = g->cfg.L, S = ng_fp8_slots(L), S4 = ng_fp8_fwd_slots(L);
	float *f = ng_exec_tensor_(e, g, op->in[1]);
	float *w_amax = f + ng_fp8_field_at(L, NG_FP8_W_AMAX);
	float *w_scale = f + ng_fp8_field_at(L, NG_FP8_W_SCALE);
	static const int ids[5] = { NG_P_QKVW, NG_P_ATTPROJW, NG_P_FCW, NG_P_FCPROJW, NG_P_WTE };
	_Static_assert(NG_FP8_ACT_AMAX_SUB == NG_FP8_AMAX_SUB &&
			       NG_FP8_ACT_AMAX_STRIDE == NG_FP8_AMAX_STRIDE,
		       "graph/step.h and kernels/fp8.h");
	/* with several ranks the maxima arrive here reduced over them (ng_exec_dp_fp8_maxima_) */
	enum ng_status st = NG_OK;
	for (int r = 0; r < 2 && !st; r++) { /* slots [0, S4) E4M3, [S4, S) E5M2 */
		size_t at = r ? (size_t)S4 : 0;
		st = ng_fp8_roll_scales_fmt(r ? NG_FP8_E5M2 : NG_FP8_E4M3,
					    f + ng_fp8_field_at(L, NG_FP8_HIST) + at * NG_FP8_HISTORY,
					    f + ng_fp8_field_at(L, NG_FP8_ACT_AMAX) +
						    at * NG_FP8_AMAX_FLOATS,
					    NG_FP8_AMAX_SUB, NG_FP8_AMAX_STRIDE,
					    f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + at,
					    f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) +
						    at * NG_FP8_DESCALE_STRIDE,
					    r ? S - S4 : S4, NG_FP8_HISTORY, NG_FP8_ACT_MARGIN, s);
	}
	if (!st)
		st = NG_CUDA_CHECK(cudaMemsetAsync(w_amax, 0, (size_t)S4 * sizeof(float), s));
	/* NG_FP8_* bit i: forward kind i; bit i + NG_FP8_DINP_SHIFT: its dinp */
	int wanted = (g->fp8 | g->fp8 >> NG_FP8_DINP_SHIFT) & NG_FP8_ALL;
	for (int i = 0; i < 5 && !st; i++) {
		const struct ng_param_spec *p = &g->lay.p[ids[i]];
		int nseg = i < 4 ? L : 1;
		if (!(wanted & (1 << i)))
			continue;
		st = ng_fp8_amax_seg(w_amax + i * L, pp(e, g, op->in[0], ids[i], 0), p->numel / nseg,
				     nseg, s);
	}
	if (!st)
		st = ng_fp8_scale_seg(w_scale, f + ng_fp8_field_at(L, NG_FP8_W_DESCALE), w_amax, S4,
				      0, s);
	for (int i = 0; i < 5 && !st && !g->recompute_fp8; i++) { /* else each matmul casts */
		const struct ng_param_spec *p = &g->lay.p[ids[i]];
		int nseg = i < 4 ? L : 1, fwd = g->fp8 & (1 << i);
		uint8_t *w8 = fwd ? pp(e, g, g->t_params_fp8, ids[i], 0) : NULL;
		if (i < 4 && (g->fp8 & (1 << (i + NG_FP8_DINP_SHIFT)))) /* W and W^T, one read */
			st = ng_fp8_cast_e4m3_wt_seg(w8,
						     (uint8_t *)ng_exec_tensor_(e, g, g->t_params_fp8t) +
							     ng_fp8t_at(&g->lay, g->fp8, i),
						     pp(e, g, op->in[0], ids[i], 0), w_scale + i * L,
						     (int)p->shape[1], (int)p->shape[2], nseg, s);
		else if (fwd)
			st = ng_fp8_cast_e4m3_seg(w8, pp(e, g, op->in[0], ids[i], 0), w_scale + i * L,
						  NULL, p->numel / nseg, nseg, s);
	}
	return st;
}

/* An fp8 forward matmul: the input rows to E4M3 at the front of the scratch (recording their
 * maximum in the slot), then the matmul with the E4M3 weights and both descales. */
static enum ng_status run_matmul_fwd_fp8(struct ng_exec *e, const struct ng_graph *g,
					 const struct ng_op *op, const struct ng_matmul *mm,
					 const ng_bf16 *inp, void *scratch, cudaStream_t s)
{
	const int L = g->cfg.L, slot = ng_fp8_slot(L, op->which, op->layer);
	const int n_in = op->n_in - op->residual; /* the residual comes last */
	if (slot < 0 || n_in < 4)
		return ng_fail(NG_ERR_RUNTIME, "op %s: not an fp8 matmul of the step", op->name);
	size_t rows = (size_t)op->row_count, ic = (size_t)mm->spec.IC, front = 0;
	float *f = ng_exec_tensor_(e, g, op->in[3]);
	uint8_t *in8;
	if (n_in >= 5) { /* the LayerNorm before wrote the E4M3 copy */
		in8 = (uint8_t *)ng_exec_tensor_(e, g, op->in[4]) + (size_t)op->row_start * ic;
	} else {
		in8 = scratch;
		front = ng_fp8_input_bytes(rows, ic);
		enum ng_status st = ng_fp8_cast_e4m3_seg(
			in8, inp, f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + slot,
			f + ng_fp8_field_at(L, NG_FP8_ACT_AMAX) + (size_t)NG_FP8_AMAX_FLOATS * slot,
			rows * ic, 1, s);
		if (st)
			return st;
	}
	int pb = op->in[1];
	void *w8 = pp(e, g, op->in[2], op->param[0], op->layer);
	if (g->recompute_fp8) { /* in[2] is params_bf16: this layer's W to E4M3 after the input */
		const void *w = w8;
		w8 = (char *)scratch + front;
		front += ng_fp8_weight_bytes(&g->cfg, op->which);
		enum ng_status st = ng_fp8_cast_e4m3_seg(
			w8, w, f + ng_fp8_field_at(L, NG_FP8_W_SCALE) + slot, NULL,
			(size_t)mm->spec.OC * ic, 1, s);
		if (st)
			return st;
	}
	const float *ad = f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) + NG_FP8_DESCALE_STRIDE * slot;
	const float *wd = f + ng_fp8_field_at(L, NG_FP8_W_DESCALE) + NG_FP8_DESCALE_STRIDE * slot;
	const void *bias = op->param[1] >= 0 ? pp(e, g, pb, op->param[1], op->layer) : NULL;
	if (op->residual)
		return ng_matmul_run_residual(mm, ng_exec_tensor_(e, g, op->out[0]), in8, w8, bias,
					      ng_exec_tensor_(e, g, op->in[op->n_in - 1]), ad, wd,
					      (char *)scratch + front, s);
	return ng_matmul_run_fp8(mm, ng_exec_tensor_(e, g, op->out[0]), in8, w8, bias,
				 op->gelu ? ng_exec_tensor_(e, g, op->out[1]) : NULL, ad, wd,
				 (char *)scratch + front, s);
}

/* An fp8 dinp matmul: dout to E5M2 at the front of the scratch (recording its maximum in the
 * slot), then dinp = dout8 @ (W^T)8^T with both descales (the weight's is the forward slot's:
 * FP8_PREP casts W and W^T with one scale). */
static enum ng_status run_matmul_dinp_fp8(struct ng_exec *e, const struct ng_graph *g,
					  const struct ng_op *op, const struct ng_matmul *mm,
					  ng_bf16 *dinp, void *scratch, cudaStream_t s)
{
	const int L = g->cfg.L, slot = ng_fp8_dinp_slot(L, op->which, op->layer);
	if (slot < 0 || op->n_in < 4 || (g->t_params_fp8t < 0 && !g->recompute_fp8))
		return ng_fail(NG_ERR_RUNTIME, "op %s: not an fp8 dinp matmul of the step", op->name);
	const int wslot = ng_fp8_slot(L, op->which, op->layer), k = op->which - NG_OP_WHICH_QKV;
	size_t rows = (size_t)op->row_count, oc = (size_t)mm->spec.OC, ic = (size_t)mm->spec.IC;
	float *f = ng_exec_tensor_(e, g, op->in[op->n_in - 1]);
	uint8_t *d8 = scratch;
	enum ng_status st = ng_fp8_cast_seg(
		NG_FP8_E5M2, d8, ng_exec_tensor_(e, g, op->in[0]),
		f + ng_fp8_field_at(L, NG_FP8_ACT_SCALE) + slot,
		f + ng_fp8_field_at(L, NG_FP8_ACT_AMAX) + (size_t)NG_FP8_AMAX_FLOATS * slot, rows * oc,
		1, s);
	if (st)
		return st;
	size_t front = ng_fp8_input_bytes(rows, oc);
	uint8_t *wt;
	if (g->recompute_fp8) { /* in[n-2] is params_bf16: this layer's W^T to E4M3 after dout8 */
		wt = (uint8_t *)scratch + front;
		front += ng_fp8_weight_bytes(&g->cfg, op->which);
		st = ng_fp8_cast_e4m3_wt_seg(NULL, wt,
					     pp(e, g, op->in[op->n_in - 2], op->param[0], op->layer),
					     f + ng_fp8_field_at(L, NG_FP8_W_SCALE) + wslot, (int)oc,
					     (int)ic, 1, s);
		if (st)
			return st;
	} else {
		wt = (uint8_t *)ng_exec_tensor_(e, g, op->in[op->n_in - 2]) +
		     ng_fp8t_at(&g->lay, g->fp8, k) + (size_t)op->layer * ic * oc;
	}
	return ng_matmul_run_fp8(mm, dinp, d8, wt, NULL,
				 op->gelu ? ng_exec_tensor_(e, g, op->in[2]) : NULL,
				 f + ng_fp8_field_at(L, NG_FP8_ACT_DESCALE) + NG_FP8_DESCALE_STRIDE * slot,
				 f + ng_fp8_field_at(L, NG_FP8_W_DESCALE) + NG_FP8_DESCALE_STRIDE * wslot,
				 (char *)scratch + front, s);
}

/* Enqueue one op on e->stream. */
static enum ng_status run_op(struct ng_exec *e, const struct ng_graph *g, const struct ng_op *op,
			     int plan)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	cudaStream_t s = e->stream;
	int B = g->B, T = g->T, C = m->C, N = B * T;
	void *scratch = op->scratch >= 0 ? ng_exec_tensor_(e, g, op->scratch) : NULL;
	ng_check_set_node(op->name);
	switch (op->kind) {
	case NG_OP_TOKENS_H2D: {
		const struct ng_tensor *t = &g->tensors[op->out[0]];
		const uint16_t *src = g->kind == NG_GRAPH_EVAL ? e->h_eval_tokens : e->h_tokens;
		if (NG_CUDA_CHECK(cudaMemcpyAsync(ng_exec_tensor_(e, g, op->out[0]), src, t->bytes,
						  cudaMemcpyHostToDevice, s)))
			return NG_ERR_RUNTIME;
		if (g->kind != NG_GRAPH_TRAIN)
			return NG_OK;
		struct ng_step_state *sst = ng_exec_tensor_(e, g, g->t_step_state);
		if (NG_CUDA_CHECK(cudaMemcpyAsync(&sst->stop, e->h_stop, sizeof(float),
						  cudaMemcpyHostToDevice, s)))
			return NG_ERR_RUNTIME;
		/* inside capture the record must be an external event node, so that the host can
		 * wait on it after each replay; outside capture it is a plain record */
		enum cudaStreamCaptureStatus cs;
		if (NG_CUDA_CHECK(cudaStreamIsCapturing(s, &cs)))
			return NG_ERR_RUNTIME;
		unsigned flags = cs == cudaStreamCaptureStatusActive ? cudaEventRecordExternal
								      : cudaEventRecordDefault;
		if (NG_CUDA_CHECK(cudaEventRecordWithFlags(e->h2d_done, s, flags)))
			return NG_ERR_RUNTIME;
		return NG_OK;
	}
	case NG_OP_TOKENS_SPLIT: {
		const uint16_t *w = (const uint16_t *)ng_exec_tensor_(e, g, op->in[0]) +
				    (size_t)op->micro * B * (T + 1);
		return ng_tokens_split(ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->out[1]), w, B, T, s);
	}
	case NG_OP_ZERO:
		if (op->param[0] >= 0) /* one parameter's range of a flat buffer, all layers */
			return NG_CUDA_CHECK(cudaMemsetAsync(
				pp(e, g, op->out[0], op->param[0], -1), 0,
				g->lay.p[op->param[0]].numel * ng_dtype_size(g->tensors[op->out[0]].dtype),
				s));
		return NG_CUDA_CHECK(cudaMemsetAsync(ng_exec_tensor_(e, g, op->out[0]), 0,
						     g->tensors[op->out[0]].bytes, s));
	case NG_OP_ENCODER_FWD:
		return ng_encoder_fwd(ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->in[0]),
				      pp(e, g, op->in[1], NG_P_WTE, -1),
				      pp(e, g, op->in[1], NG_P_WPE, -1), B, T, C, s);
	case NG_OP_LAYERNORM_FWD: {
		int pb = op->in[1];
		if (op->fp8)
			return ng_layernorm_fwd_fp8(ng_exec_tensor_(e, g, op->out[0]),
						    ng_exec_tensor_(e, g, op->out[3]),
						    ln_fp8_field(e, g, op, NG_FP8_ACT_SCALE), ln_fp8_field(e, g, op, NG_FP8_ACT_AMAX),
						    ng_exec_tensor_(e, g, op->out[1]),
						    ng_exec_tensor_(e, g, op->out[2]),
						    ng_exec_tensor_(e, g, op->in[0]),
						    pp(e, g, pb, op->param[0], op->layer),
						    pp(e, g, pb, op->param[1], op->layer), N, C, s);
		return ng_layernorm_fwd(ng_exec_tensor_(e, g, op->out[0]),
					op->recompute ? NULL : ng_exec_tensor_(e, g, op->out[1]),
					op->recompute ? NULL : ng_exec_tensor_(e, g, op->out[2]), ng_exec_tensor_(e, g, op->in[0]),
					pp(e, g, pb, op->param[0], op->layer),
					pp(e, g, pb, op->param[1], op->layer), N, C, s);
	}
	case NG_OP_MATMUL_FWD: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		int ic = mm->spec.IC;
		const ng_bf16 *inp = (const ng_bf16 *)ng_exec_tensor_(e, g, op->in[0]) + (size_t)op->row_start * ic;
		int pb = op->in[1];
		if (op->fp8)
			return run_matmul_fwd_fp8(e, g, op, mm, inp, scratch, s);
		if (op->residual)
			return ng_matmul_run_residual(
				mm, ng_exec_tensor_(e, g, op->out[0]), inp,
				pp(e, g, pb, op->param[0], op->layer),
				op->param[1] >= 0 ? pp(e, g, pb, op->param[1], op->layer) : NULL,
				ng_exec_tensor_(e, g, op->in[op->n_in - 1]), NULL, NULL, scratch, s);
		return ng_matmul_run(mm, ng_exec_tensor_(e, g, op->out[0]), inp,
				     pp(e, g, pb, op->param[0], op->layer),
				     op->param[1] >= 0 ? pp(e, g, pb, op->param[1], op->layer) : NULL,
				     op->gelu ? ng_exec_tensor_(e, g, op->out[1]) : NULL, NULL, scratch, s);
	}
	case NG_OP_GELU_FWD:
		return ng_gelu_fwd(ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->in[0]),
				   g->tensors[op->in[0]].bytes / 2, s);
	case NG_OP_ATTENTION_FWD:
		return ng_attention_fwd(&e->att, ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->out[1]),
					ng_exec_tensor_(e, g, op->in[0]), scratch, s);
	case NG_OP_CROSSENTROPY: {
		const int32_t *tg = (const int32_t *)ng_exec_tensor_(e, g, op->in[1]) + op->row_start;
		float *losses = (float *)ng_exec_tensor_(e, g, op->out[op->no_grad ? 0 : 1]) + op->row_start;
		if (op->no_grad)
			return ng_crossentropy_fwd(losses, ng_exec_tensor_(e, g, op->in[0]), tg, op->row_count,
						   m->V, m->Vp, s);
		return ng_crossentropy(losses, ng_exec_tensor_(e, g, op->in[0]), tg, op->row_count, m->V, m->Vp,
				       1.0f / ((float)N * g->K), s);
	}
	case NG_OP_LOSS_ACCUMULATE: {
		float *dst = g->kind == NG_GRAPH_TRAIN
				     ? (float *)((char *)ng_exec_tensor_(e, g, op->out[0]) +
						 offsetof(struct ng_step_state, loss_sum))
				     : (float *)ng_exec_tensor_(e, g, op->out[0]);
		return ng_loss_accumulate(dst, ng_exec_tensor_(e, g, op->in[0]), N, 1.0f / ((float)N * g->K),
					  scratch, s);
	}
	case NG_OP_MATMUL_DINP: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		ng_bf16 *dinp = (ng_bf16 *)ng_exec_tensor_(e, g, op->out[0]) + (size_t)op->row_start * mm->spec.IC;
		if (op->fp8)
			return run_matmul_dinp_fp8(e, g, op, mm, dinp, scratch, s);
		if (op->own) /* this layer's W^T of TRANSPOSE_W's; the fc bias gradient */
			return ng_matmul_run_dgelu(mm, dinp, ng_exec_tensor_(e, g, op->in[0]),
						   (ng_bf16 *)ng_exec_tensor_(e, g, op->in[1]) +
							   (size_t)op->layer * mm->spec.IC * mm->spec.OC,
						   ng_exec_tensor_(e, g, op->in[2]),
						   op->n_out > 2 ? ng_exec_tensor_(e, g, op->out[2]) : NULL,
						   pp(e, g, op->out[1], op->param[1], op->layer),
						   !op->overwrite, scratch, s);
		return ng_matmul_run(mm, dinp, ng_exec_tensor_(e, g, op->in[0]),
				     pp(e, g, op->in[1], op->param[0], op->layer), NULL,
				     op->gelu ? ng_exec_tensor_(e, g, op->in[2]) : NULL, NULL, scratch, s);
	}
	case NG_OP_MATMUL_DW: {
		const struct ng_matmul *mm = &e->plans[plan].mm;
		const ng_bf16 *inp = (const ng_bf16 *)ng_exec_tensor_(e, g, op->in[1]) +
				     (size_t)op->row_start * mm->spec.IC;
		int gb = op->out[0];
		return ng_matmul_run(mm, pp(e, g, gb, op->param[0], op->layer), ng_exec_tensor_(e, g, op->in[0]),
				     inp, NULL, NULL,
				     op->param[1] >= 0 ? pp(e, g, gb, op->param[1], op->layer) : NULL,
				     scratch, s);
	}
	case NG_OP_GELU_BWD:
		if (op->param[0] >= 0) /* with the fc bias gradient (and the recomputed GELU) */
			return ng_gelu_bwd_bias(ng_exec_tensor_(e, g, op->out[0]),
						op->n_out > 2 ? ng_exec_tensor_(e, g, op->out[2]) : NULL,
						pp(e, g, op->out[1], op->param[0], op->layer),
						!op->overwrite, ng_exec_tensor_(e, g, op->in[0]),
						ng_exec_tensor_(e, g, op->in[1]), op->row_count,
						4 * m->C, scratch, s);
		return ng_gelu_bwd(ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->in[0]), ng_exec_tensor_(e, g, op->in[1]),
				   g->tensors[op->in[0]].bytes / 2, s);
	case NG_OP_ATTENTION_BWD:
		return ng_attention_bwd(&e->att, ng_exec_tensor_(e, g, op->out[0]), ng_exec_tensor_(e, g, op->in[0]),
					ng_exec_tensor_(e, g, op->in[1]), ng_exec_tensor_(e, g, op->in[2]), ng_exec_tensor_(e, g, op->in[3]),
					scratch, s);
	case NG_OP_LAYERNORM_BWD: {
		int pb = op->in[2], gb = op->out[1];
		return ng_layernorm_bwd(ng_exec_tensor_(e, g, op->out[0]), pp(e, g, gb, op->param[0], op->layer),
					pp(e, g, gb, op->param[1], op->layer), ng_exec_tensor_(e, g, op->in[0]),
					ng_exec_tensor_(e, g, op->in[1]), pp(e, g, pb, op->param[0], op->layer),
					ng_exec_tensor_(e, g, op->in[3]), ng_exec_tensor_(e, g, op->in[4]), N, C, scratch, s);
	}
	case NG_OP_ENCODER_SORT: { /* on side_stream, forked here, joined by ENCODER_BWD */
		cudaStream_t side = e->side_stream;
		if (NG_CUDA_CHECK(cudaEventRecord(e->side_fork, s)) ||
		    NG_CUDA_CHECK(cudaStreamWaitEvent(side, e->side_fork, 0)))
			return NG_ERR_RUNTIME;
		enum ng_status st = ng_encoder_bwd_sort(ng_exec_tensor_(e, g, op->out[0]),
							g->tensors[op->out[0]].bytes,
							ng_exec_tensor_(e, g, op->in[0]), B, T, m->Vp, side);
		if (st)
			return st;
		return NG_CUDA_CHECK(cudaEventRecord(e->side_join, side));
	}
	case NG_OP_ENCODER_BWD: {
		int gb = op->out[0];
		if (NG_CUDA_CHECK(cudaStreamWaitEvent(s, e->side_join, 0)))
			return NG_ERR_RUNTIME;
		return ng_encoder_bwd_sorted(pp(e, g, gb, NG_P_WTE, -1), pp(e, g, gb, NG_P_WPE, -1),
					     ng_exec_tensor_(e, g, op->in[0]),
					     ng_exec_tensor_(e, g, op->in[1]), B, T, C, m->Vp, scratch,
					     g->tensors[op->scratch].bytes, s);
	}
	case NG_OP_GRAD_NORM: {
		struct ng_step_state *st = ng_exec_tensor_(e, g, op->out[0]);
		if (e->cfg.comm)
			return ng_exec_dp_grad_norm_(e, g, op, scratch, s);
		return ng_grad_norm_squared(&st->grad_norm, ng_exec_tensor_(e, g, op->in[0]), g->lay.total,
					    scratch, s);
	}
	case NG_OP_SCHEDULE: {
		struct ng_step_state *st = ng_exec_tensor_(e, g, op->out[0]);
		return ng_schedule_update(st, &st->grad_norm, e->cfg.sched, e->cfg.clip, s);
	}
	case NG_OP_ADAMW: {
		const struct ng_step_state *st = ng_exec_tensor_(e, g, op->in[1]);
		if (e->cfg.comm && e->cfg.zero1)
			return ng_exec_dp_adamw_shard_(e, g, op, s);
		for (int i = 0; i < NG_P_COUNT; i++) {
			const struct ng_param_spec *p = &g->lay.p[i];
			enum ng_status r = ng_adamw(pp(e, g, op->out[0], i, 0), /* hi, lo */
						    pp(e, g, op->out[1], i, 0),
						    pp(e, g, op->in[0], i, 0),
						    pp(e, g, op->out[2], i, 0),
						    pp(e, g, op->out[3], i, 0), p->numel,
						    p->decay ? e->cfg.wd : 0.0f, e->cfg.beta1,
						    e->cfg.beta2, e->cfg.eps, st, s);
			if (r)
				return r;
		}
		return NG_OK;
	}
	case NG_OP_MUON:
		return ng_optim_muon_run_(e, g, op, scratch, s);
	case NG_OP_STEP_FINISH:
		return ng_step_finish(ng_exec_tensor_(e, g, op->in[0]), e->d_ring, NG_EXEC_RING, s);
	case NG_OP_FP8_PREP:
		return run_fp8_prep(e, g, op, s);
	case NG_OP_TRANSPOSE_W: { /* W (OC, IC) of every layer -> W^T (IC, OC) */
		int ic, oc;
		ng_linear_dims(m, op->which, &ic, &oc);
		return ng_transpose_bf16(ng_exec_tensor_(e, g, op->out[0]),
					 pp(e, g, op->in[0], op->param[0], 0), oc, ic, m->L, s);
	}
	default:
		return ng_fail(NG_ERR_RUNTIME, "op %s (%s) has no GPU implementation", op->name,
			       ng_op_kind_name(op->kind));
	}
}

enum ng_status ng_exec_run_eager_(struct ng_exec *e, const struct ng_graph *g, const int *pl)
{
	for (int i = 0; i < g->n_ops; i++) {
		enum ng_status st = run_op(e, g, &g->ops[i], pl[i]);
		if (!st)
			st = ng_exec_dp_after_op_(e, g, i);
		if (st)
			return st;
	}
	ng_check_set_node(NULL);
	return NG_OK;
}

/* --profile: each op's device time in one step. With graphs (the default) the step is captured
 * a second time with an event record node after every op and replayed PROFILE_REPLAYS times
 * (the first warms up; each op gets the median of the others), so the figures are those of a
 * replay: no launch gaps, the GPU as busy (and as power-limited) as in training. With
 * --no-graph the ops are timed as launched. Tokens: a fixed pseudo-random batch (the all-zero
 * warm-up batch makes the embedding backward one long run). Runs before reset_state(). */
enum { PROFILE_REPLAYS = 5 };

static enum ng_status profile_step(struct ng_exec *e)
{
	const struct ng_graph *g = &e->train;
	int n = g->n_ops, reps = e->cfg.no_graph ? 2 : PROFILE_REPLAYS;
	size_t tok = (size_t)e->cfg.K * e->cfg.B * (e->cfg.T + 1);
	for (size_t i = 0; i < tok; i++)
		e->h_tokens[i] = (uint16_t)(ng_rng_mix64(0x9e3779b97f4a7c15ull + i) % (uint64_t)g->cfg.V);
	cudaEvent_t *ev = calloc((size_t)n + 1, sizeof(*ev));
	float *ms = calloc((size_t)n * reps, sizeof(float));
	e->op_ms = calloc((size_t)n, sizeof(float));
	if (!ev || !ms || !e->op_ms) {
		free(ev);
		free(ms);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	}
	cudaGraph_t gr = NULL;
	cudaGraphExec_t ex = NULL;
	unsigned flags = e->cfg.no_graph ? cudaEventRecordDefault : cudaEventRecordExternal;
	enum ng_status st = NG_OK;
	for (int i = 0; i <= n && !st; i++)
		st = NG_CUDA_CHECK(cudaEventCreate(&ev[i]));
	if (!st && !e->cfg.no_graph)
		st = NG_CUDA_CHECK(cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeGlobal));
	for (int r = 0; r < (e->cfg.no_graph ? reps : 1) && !st; r++) {
		st = NG_CUDA_CHECK(cudaEventRecordWithFlags(ev[0], e->stream, flags));
		for (int i = 0; i < n && !st; i++) {
			st = run_op(e, g, &g->ops[i], e->train_plan[i]);
			if (!st)
				st = NG_CUDA_CHECK(cudaEventRecordWithFlags(ev[i + 1], e->stream, flags));
		}
		if (!e->cfg.no_graph)
			break; /* captured: timed by the replays below */
		if (!st)
			st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
		for (int i = 0; i < n && !st; i++)
			st = NG_CUDA_CHECK(cudaEventElapsedTime(&ms[(size_t)i * reps + r], ev[i],
								ev[i + 1]));
	}
	ng_check_set_node(NULL);
	if (!e->cfg.no_graph) {
		cudaError_t ce = cudaStreamEndCapture(e->stream, &gr);
		if (!st)
			st = NG_CUDA_CHECK(ce);
		if (!st)
			st = NG_CUDA_CHECK(cudaGraphInstantiate(&ex, gr, 0));
		for (int r = 0; r < reps && !st; r++) {
			st = NG_CUDA_CHECK(cudaGraphLaunch(ex, e->stream));
			if (!st)
				st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
			for (int i = 0; i < n && !st; i++)
				st = NG_CUDA_CHECK(cudaEventElapsedTime(&ms[(size_t)i * reps + r],
									ev[i], ev[i + 1]));
		}
	}
	for (int i = 0; i < n && !st; i++) { /* median of replays 1..reps-1 */
		float *v = ms + (size_t)i * reps + 1;
		qsort(v, (size_t)reps - 1, sizeof(float), cmp_float);
		e->op_ms[i] = (reps - 1) % 2 ? v[(reps - 1) / 2]
					     : 0.5f * (v[(reps - 1) / 2 - 1] + v[(reps - 1) / 2]);
	}
	e->profile_replayed = !e->cfg.no_graph;
	if (ex)
		cudaGraphExecDestroy(ex);
	if (gr)
		cudaGraphDestroy(gr);
	for (int i = 0; i <= n; i++)
		if (ev[i])
			cudaEventDestroy(ev[i]);
	free(ev);
	free(ms);
	memset(e->h_tokens, 0, tok * sizeof(uint16_t));
	return st;
}

static enum ng_status capture(struct ng_exec *e, const struct ng_graph *g, const int *pl,
			      cudaGraph_t *graph, cudaGraphExec_t *exec)
{
	if (NG_CUDA_CHECK(cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeGlobal)))
		return NG_ERR_RUNTIME;
	enum ng_status st = ng_exec_run_eager_(e, g, pl);
	cudaGraph_t gr = NULL;
	cudaError_t ce = cudaStreamEndCapture(e->stream, &gr);
	if (st) {
		if (gr)
			cudaGraphDestroy(gr);
		return st;
	}
	if (NG_CUDA_CHECK(ce))
		return NG_ERR_RUNTIME;
	*graph = gr;
	return NG_CUDA_CHECK(cudaGraphInstantiate(exec, gr, 0));
}

/* --fp8 dinp: before any step has recorded a gradient maximum, an E5M2 scale of 1 would flush
 * the first steps' gradients to zero (the loss is a mean over the N*K tokens of a step, so they
 * are ~1/(N*K) small; E5M2's smallest is 2^-16). Each gradient slot's history starts with the
 * maximum that gives the scale N*K (undoing the mean) instead; the real maxima replace it as it
 * leaves the window (NG_FP8_HISTORY steps). Fields as graph/step.h "FP8". */
enum ng_status ng_exec_seed_grad_scales_(struct ng_exec *e, const struct ng_graph *g)
{
	const int L = g->cfg.L, S4 = ng_fp8_fwd_slots(L), n = ng_fp8_slots(L) - S4;
	float *h = calloc((size_t)n * NG_FP8_HISTORY, sizeof(float));
	if (!h)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	double tokens = (double)g->B * g->T * g->K;
	for (int k = 0; k < n; k++)
		h[(size_t)k * NG_FP8_HISTORY] =
			(float)(NG_FP8_E5M2_MAX / (ldexp(1.0, NG_FP8_ACT_MARGIN) * tokens));
	float *f = ng_exec_tensor_(e, g, g->t_fp8_state);
	/* on e->stream, after the memset that zeroed the state (a plain cudaMemcpy would run on
	 * the legacy stream, unordered with this non-blocking one), and waited for before h goes */
	enum ng_status st = NG_CUDA_CHECK(cudaMemcpyAsync(
		f + ng_fp8_field_at(L, NG_FP8_HIST) + (size_t)S4 * NG_FP8_HISTORY, h,
		(size_t)n * NG_FP8_HISTORY * sizeof(float), cudaMemcpyHostToDevice, e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	free(h);
	return st;
}

/* Parameters from the seeded init (split into the bf16 copy and the low half); zero grads,
 * moments and the step state. */
static enum ng_status reset_state(struct ng_exec *e)
{
	const struct ng_graph *g = &e->train;
	size_t n = g->lay.total;
	float *h = malloc(n * sizeof(float));
	if (!h)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for %zu parameters", n);
	ng_gpt_init(&g->cfg, &g->lay, e->cfg.seed, h);
	enum ng_status st = ng_exec_upload_params_(e, h);
	free(h);
	int zero[] = { g->t_grads, g->t_adam_m, g->t_adam_v, g->t_step_state, g->t_fp8_state };
	for (int i = 0; i < 5 && !st && zero[i] >= 0; i++)
		st = NG_CUDA_CHECK(cudaMemsetAsync(ng_exec_tensor_(e, g, zero[i]), 0, g->tensors[zero[i]].bytes,
						   e->stream));
	if (!st && (g->fp8 & NG_FP8_DINP_ALL))
		st = ng_exec_seed_grad_scales_(e, g);
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	return st;
}

static double peak_for(const char *name)
{
	if (strstr(name, "H100") || strstr(name, "H200") || strstr(name, "H800") ||
	    strstr(name, "GH200"))
		return 989e12;
	if (strstr(name, "A100") || strstr(name, "A800"))
		return 312e12;
	return 0;
}

/* The device word of the autotune cache: GPU name, compute capability and cuBLASLt version. */
static void tune_device(const struct cudaDeviceProp *prop, char *out, size_t n)
{
	snprintf(out, n, "%s_sm_%d%d_cublasLt_%zu", prop->name, prop->major, prop->minor,
		 cublasLtGetVersion());
	for (char *p = out; *p; p++)
		if (!isalnum((unsigned char)*p) && *p != '.' && *p != '-')
			*p = '_';
}

/* --autotune with a cache directory: read the choices an earlier run kept for this GPU. The
 * cache is only a cache: a file it cannot read leaves a warning (printed by the backend) and
 * every matmul timed again, then the file rewritten. */
static void open_tune_cache(struct ng_exec *e, const struct cudaDeviceProp *prop)
{
	e->tune_cache_path[0] = e->tune_warning[0] = '\0';
	const char *dir = e->cfg.autotune_cache;
	if (!e->cfg.autotune || !dir || !dir[0])
		return;
	tune_device(prop, e->tune_device, sizeof(e->tune_device));
	snprintf(e->tune_cache_path, sizeof(e->tune_cache_path), "%s/autotune-%s.txt", dir,
		 e->tune_device);
	if (ng_matmul_choices_load(&e->mmctx, e->tune_cache_path, e->tune_device,
				   &e->tune_loaded)) {
		snprintf(e->tune_warning, sizeof(e->tune_warning), "%s", ng_error_message());
		ng_clear_error();
	}
}

/* After planning: keep what was timed (rank 0 only: the ranks time the same shapes). */
static void save_tune_cache(struct ng_exec *e)
{
	if (!e->tune_cache_path[0] || e->mmctx.choices_made == 0 || e->cfg.rank != 0)
		return;
	if (ng_matmul_choices_save(&e->mmctx, e->tune_cache_path, e->tune_device)) {
		snprintf(e->tune_warning, sizeof(e->tune_warning), "%s", ng_error_message());
		ng_clear_error();
	}
}

/* --recompute auto's budget for the training step's arena: --gpu-mem less what the device has
 * in use now (the context, the libraries' handles and workspaces: 0.53 GiB on the H200), less
 * 64 MiB for what comes after the arena (the captured graph: nothing measurable at d24, session
 * 29); without --gpu-mem, what is free now less 256 MiB, so that nothing else runs short. */
static size_t fit_budget(const struct ng_exec *e)
{
	size_t free_b = 0, total_b = 0;
	cudaMemGetInfo(&free_b, &total_b);
	const size_t used = total_b - free_b;
	size_t room = free_b, margin = (size_t)256 << 20;
	if (e->cfg.gpu_mem) {
		room = e->cfg.gpu_mem > used ? e->cfg.gpu_mem - used : 0;
		margin = (size_t)64 << 20;
	}
	return room > margin ? room - margin : 0;
}

/* With data parallelism every rank must build the same step: the smallest budget of all ranks
 * (their free memory may differ), in MiB through a u32 maximum of its complement. */
static enum ng_status agree_budget(struct ng_exec *e, size_t *budget)
{
	unsigned *d = NULL, v = UINT32_MAX - (unsigned)(*budget >> 20);
	enum ng_status st = NG_CUDA_CHECK(cudaMalloc((void **)&d, sizeof(v)));
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpy(d, &v, sizeof(v), cudaMemcpyHostToDevice));
	if (!st)
		st = ng_collective_allreduce_max_u32(e->cfg.comm, d, 1, e->stream);
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpyAsync(&v, d, sizeof(v), cudaMemcpyDeviceToHost, e->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	cudaFree(d);
	if (!st && ((size_t)(UINT32_MAX - v) << 20) < (*budget >> 20 << 20)) {
		*budget = (size_t)(UINT32_MAX - v) << 20;
		e->fit_lowered = 1;
	}
	return st;
}

enum ng_status ng_exec_init(struct ng_exec *e, const struct ng_exec_config *cfg)
{
	memset(e, 0, sizeof(*e));
	e->cfg = *cfg;
	if (cfg->deterministic) /* a timed choice could differ between two runs */
		e->cfg.autotune = 0;
	e->inited = true;
	ng_graph_init(&e->train);
	ng_graph_init(&e->eval);
	struct cudaDeviceProp prop;
	int dev = 0;
	if (NG_CUDA_CHECK(cudaGetDevice(&dev)) || NG_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev)))
		return NG_ERR_RUNTIME;
	snprintf(e->device_name, sizeof(e->device_name), "%s", prop.name);
	e->device_total_bytes = prop.totalGlobalMem;
	e->peak_flops = peak_for(prop.name);
	if (cfg->step.fp8 && prop.major * 10 + prop.minor < 89) {
		ng_fail(NG_ERR_INPUT, "--fp8: %s (sm_%d%d) has no FP8 tensor cores (sm_89 and newer "
			"have)", prop.name, prop.major, prop.minor);
		ng_hint("drop --fp8: the bf16 step runs on this GPU");
		return NG_ERR_INPUT;
	}

	if (NG_CUDA_CHECK(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking)) ||
	    NG_CUDA_CHECK(cudaStreamCreateWithFlags(&e->side_stream, cudaStreamNonBlocking)) ||
	    NG_CUDA_CHECK(cudaEventCreateWithFlags(&e->side_fork, cudaEventDisableTiming)) ||
	    NG_CUDA_CHECK(cudaEventCreateWithFlags(&e->side_join, cudaEventDisableTiming)) ||
	    NG_CUDNN_CHECK(cudnnCreate(&e->cudnn)))
		return NG_ERR_RUNTIME;
	enum ng_status st = ng_matmul_ctx_init(&e->mmctx, 32u << 20);
	if (!st)
		open_tune_cache(e, &prop);
	struct ng_step_options opt = cfg->step;
	opt.deterministic = cfg->deterministic;
	if (opt.deterministic) /* a timed choice could differ between two runs */
		opt.fuse_gelu &= ~NG_GELU_FUSE_AUTO;
	if (opt.deterministic && (opt.fp8 & NG_FP8_AUTO)) /* untimed: the kinds that widen */
		opt.fp8 = (opt.fp8 & (NG_FP8_QKV | NG_FP8_FC | NG_FP8_HEAD | NG_FP8_DINP_FCPROJ)) |
			  NG_FP8_AUTO;
	/* built first, so that a bad shape gets the builder's message before anything is timed */
	if (!st)
		st = ng_step_build_train(&e->train, &cfg->model, cfg->B, cfg->T, cfg->K, &opt);
	size_t budget = 0;
	if (!st && opt.recompute_auto) {
		/* with ranks, one collective first: NCCL allocates its buffers at its first
		 * connection (~0.85 GiB of a rank of two H200s, session 29), which would otherwise
		 * come after the budget was measured */
		size_t warm = 0;
		if (cfg->comm)
			st = agree_budget(e, &warm);
		budget = fit_budget(e);
		if (!st && cfg->comm)
			st = agree_budget(e, &budget);
		if (!st)
			st = ng_step_fit_memory(&e->train, &cfg->model, cfg->B, cfg->T, cfg->K, &opt, budget);
	}
	struct ng_step_options built = opt;
	e->gelu_fwd_ms[0] = e->gelu_fwd_ms[1] = -1.0f;
	if (!st && (opt.fuse_gelu & NG_GELU_FUSE_AUTO)) {
		int fwd = (opt.fuse_gelu & NG_GELU_FUSE_FWD) != 0;
		int bwd = opt.fuse_gelu & (NG_GELU_FUSE_BWD | NG_GELU_FUSE_OWN);
		st = choose_gelu_fwd(e, &fwd);
		if (!st)
			st = choose_dgelu(e, &bwd);
		opt.fuse_gelu = NG_GELU_FUSE_AUTO | (fwd ? NG_GELU_FUSE_FWD : 0) | bwd;
	}
	for (int k = 0; k < NG_EXEC_FP8_KINDS; k++)
		e->fp8_ms[k][0] = e->fp8_ms[k][1] = -1.0f;
	if (!st && (opt.fp8 & NG_FP8_AUTO) && !opt.deterministic) {
		int mask = opt.fp8 & NG_FP8_EVERY;
		st = choose_fp8(e, (opt.fuse_gelu & NG_GELU_FUSE_FWD) != 0,
				(opt.fuse_gelu & NG_GELU_FUSE_BWD) != 0, e->train.head_chunk_rows,
				&mask);
		opt.fp8 = mask | NG_FP8_AUTO;
	}
	if (!st && !opt.deterministic &&
	    ((opt.fuse_gelu & NG_GELU_FUSE_AUTO) || (opt.fp8 & NG_FP8_AUTO))) {
		int fuse = opt.fuse_gelu & (NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD | NG_GELU_FUSE_OWN);
		int mask = opt.fp8 & NG_FP8_EVERY;
		st = agree_choices(e, &fuse, &mask);
		opt.fuse_gelu = (opt.fuse_gelu & NG_GELU_FUSE_AUTO) | fuse;
		opt.fp8 = (opt.fp8 & ~NG_FP8_EVERY) | mask;
	}
	if (!st && (opt.fuse_gelu != built.fuse_gelu || opt.fp8 != built.fp8)) {
		ng_graph_free(&e->train);
		st = ng_step_build_train(&e->train, &cfg->model, cfg->B, cfg->T, cfg->K, &opt);
		/* the chosen forms may need other bytes (our DGELU's W^T): fit again with them */
		if (!st && opt.recompute_auto && e->train.total_bytes > budget)
			st = ng_step_fit_memory(&e->train, &cfg->model, cfg->B, cfg->T, cfg->K, &opt,
						budget);
	}
	if (!st && cfg->eval_batches > 0)
		st = ng_step_build_eval(&e->eval, &cfg->model, cfg->B, cfg->T, cfg->eval_batches,
					&opt);
	if (st)
		return st;
	if (e->cfg.world < 1) /* 0: a config that predates data parallelism, one process */
		e->cfg.world = 1;
	if (cfg->rank < 0 || cfg->rank >= e->cfg.world || (e->cfg.world > 1 && !cfg->comm) ||
	    (cfg->zero1 && !cfg->comm))
		return ng_fail(NG_ERR_RUNTIME, "exec: rank %d of world %d%s is not a valid "
			       "data-parallel setup", cfg->rank, e->cfg.world,
			       cfg->comm ? "" : " without a communicator");
	if (cfg->zero1) {
		e->shard_len = ng_collective_shard_len(e->train.lay.total, e->cfg.world);
		e->shard_off = e->shard_len * (size_t)cfg->rank;
		st = ng_exec_dp_shard_layout_(e, &e->train);
		if (!st && cfg->eval_batches > 0)
			st = ng_exec_dp_shard_layout_(e, &e->eval);
		if (st)
			return st;
	}
	if (cfg->comm && !cfg->zero1 && !cfg->dp_no_overlap && (st = ng_exec_dp_plan_overlap_(e)))
		return st;

	st = ng_attention_plan(&e->att, e->cudnn, cfg->B, cfg->model.H, cfg->T,
				       cfg->model.C / cfg->model.H, cfg->deterministic,
				       cfg->force_naive_attention);
	if (!st)
		st = plan_graph(e, &e->train, &e->train_plan);
	if (!st && cfg->eval_batches > 0)
		st = plan_graph(e, &e->eval, &e->eval_plan);
	if (st)
		return st;
	save_tune_cache(e);

	e->arena_bytes = e->train.total_bytes;
	if (cfg->eval_batches > 0 && e->eval.total_bytes > e->arena_bytes)
		e->arena_bytes = e->eval.total_bytes;
	size_t free_b = 0, total_b = 0;
	cudaMemGetInfo(&free_b, &total_b);
	if (e->arena_bytes > free_b) {
		ng_fail(NG_ERR_INPUT, "the step needs %.2f GiB of device memory but %s has %.2f GiB "
			"free (of %.2f GiB)", e->arena_bytes / 1073741824.0, e->device_name,
			free_b / 1073741824.0, total_b / 1073741824.0);
		ng_hint("--recompute auto recomputes as little as fits; or use a smaller --batch "
			"with --total-batch to keep the tokens per step, or --recompute "
			"gelu,layernorm (with --fp8 also fp8) and a smaller --head-chunk: `nanograph "
			"plan` shows what each saves");
		return NG_ERR_INPUT;
	}
	if (NG_CUDA_CHECK(cudaMalloc((void **)&e->arena, e->arena_bytes)))
		return NG_ERR_RUNTIME;
	size_t tok = (size_t)cfg->K * cfg->B * (cfg->T + 1) * sizeof(uint16_t);
	size_t etok = (size_t)cfg->eval_batches * cfg->B * (cfg->T + 1) * sizeof(uint16_t);
	if (NG_CUDA_CHECK(cudaHostAlloc((void **)&e->h_stop, sizeof(float), cudaHostAllocDefault)) ||
	    NG_CUDA_CHECK(cudaHostAlloc((void **)&e->h_tokens, tok, cudaHostAllocDefault)) ||
	    (etok && NG_CUDA_CHECK(cudaHostAlloc((void **)&e->h_eval_tokens, etok,
						 cudaHostAllocDefault))) ||
	    NG_CUDA_CHECK(cudaHostAlloc((void **)&e->ring, sizeof(*e->ring) * NG_EXEC_RING,
					cudaHostAllocMapped)) ||
	    NG_CUDA_CHECK(cudaHostGetDevicePointer((void **)&e->d_ring, e->ring, 0)) ||
	    NG_CUDA_CHECK(cudaEventCreateWithFlags(&e->h2d_done, cudaEventDisableTiming)))
		return NG_ERR_RUNTIME;
	for (int i = 0; i < NG_EXEC_RING; i++)
		if (NG_CUDA_CHECK(cudaEventCreate(&e->done[i])))
			return NG_ERR_RUNTIME;
	if (NG_CUDA_CHECK(cudaEventCreate(&e->start)))
		return NG_ERR_RUNTIME;
	memset(e->h_tokens, 0, tok);
	*e->h_stop = 0.0f;
	memset(e->ring, 0, sizeof(*e->ring) * NG_EXEC_RING);

	/* Warm-up: one eager step (loads modules; errors name their node), then the real init. */
	st = reset_state(e);
	if (!st)
		st = ng_exec_run_eager_(e, &e->train, e->train_plan);
	if (!st && cfg->eval_batches > 0) {
		memset(e->h_eval_tokens, 0, etok);
		st = ng_exec_run_eager_(e, &e->eval, e->eval_plan);
	}
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	if (!st && cfg->profile)
		st = profile_step(e);
	if (!st)
		st = reset_state(e);
	if (!st && !cfg->no_graph)
		st = capture(e, &e->train, e->train_plan, &e->train_graph, &e->train_exec);
	if (!st && !cfg->no_graph && cfg->eval_batches > 0)
		st = capture(e, &e->eval, e->eval_plan, &e->eval_graph, &e->eval_exec);
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(e->stream));
	memset(e->ring, 0, sizeof(*e->ring) * NG_EXEC_RING);
	return st;
}

void ng_exec_free(struct ng_exec *e)
{
	if (!e->inited)
		return;
	if (e->stream)
		cudaStreamSynchronize(e->stream);
	if (e->dp_stream) {
		cudaStreamSynchronize(e->dp_stream);
		cudaStreamDestroy(e->dp_stream);
	}
	for (int l = 0; e->dp_ready && l < e->train.cfg.L; l++)
		if (e->dp_ready[l])
			cudaEventDestroy(e->dp_ready[l]);
	if (e->dp_join)
		cudaEventDestroy(e->dp_join);
	free(e->dp_ready);
	free(e->dp_bucket);
	free(e->dp_sent);
	if (e->train_exec)
		cudaGraphExecDestroy(e->train_exec);
	if (e->train_graph)
		cudaGraphDestroy(e->train_graph);
	if (e->eval_exec)
		cudaGraphExecDestroy(e->eval_exec);
	if (e->eval_graph)
		cudaGraphDestroy(e->eval_graph);
	ng_optim_muon_free_(e);
	for (int i = 0; i < e->n_plans; i++)
		ng_matmul_free(&e->plans[i].mm);
	if (e->mmctx.lt)
		ng_matmul_ctx_free(&e->mmctx);
	ng_attention_free(&e->att);
	if (e->cudnn)
		cudnnDestroy(e->cudnn);
	for (int i = 0; i < NG_EXEC_RING; i++)
		if (e->done[i])
			cudaEventDestroy(e->done[i]);
	if (e->h2d_done)
		cudaEventDestroy(e->h2d_done);
	if (e->start)
		cudaEventDestroy(e->start);
	cudaFreeHost(e->h_tokens);
	cudaFreeHost(e->h_stop);
	cudaFreeHost(e->h_eval_tokens);
	cudaFreeHost(e->ring);
	cudaFree(e->arena);
	if (e->stream)
		cudaStreamDestroy(e->stream);
	if (e->side_stream)
		cudaStreamDestroy(e->side_stream);
	if (e->side_fork)
		cudaEventDestroy(e->side_fork);
	if (e->side_join)
		cudaEventDestroy(e->side_join);
	free(e->train_plan);
	free(e->eval_plan);
	free(e->op_ms);
	ng_graph_free(&e->train);
	ng_graph_free(&e->eval);
	e->inited = false;
}
