/*
 * graph/exec_trials.c — what the executor measures while it plans (see exec.h): the timed
 * choices of --gelu-fusion auto (the FC forward and backward, each way the step can run it) and
 * of --fp8 auto (each fp8 matmul kind against its bf16 matmul), the ranks' vote on them, and
 * --recompute auto's memory budget. Each trial runs on scratch memory it frees again, before the
 * arena exists; its times go to the init log through struct ng_exec_report (graph/exec_plan.c
 * calls these in that order, docs/DESIGN.md says why the step is chosen by timing).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec_internal.h"
#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/fp8.h"
#include "kernels/gemm_sm90.h"

#define ALIGN_UP(x, a) (((x) + (a) - 1) / (a) * (a))

int ng_exec_cmp_float_(const void *a, const void *b)
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
 * --sustained, BENCHMARKS.md; a synchronised burst runs at the boost clock). One
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
		qsort(t[v], ROUNDS, sizeof(float), ng_exec_cmp_float_);
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
		st = ng_exec_plan_spec_(e, s, &plan[v]);
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
 * stay in e->plans; ms gets the times; the graph is built with the choice (*fuse: NG_GELU_FUSE_BWD, with
 * NG_GELU_FUSE_OWN, or 0). Measured on the H200: cuBLASLt's epilogue wins at d12 and d48,
 * loses at d24 (BENCHMARKS.md). Not with --deterministic: two runs must build the same step, so
 * the bits stay as given. */
enum ng_status ng_exec_choose_dgelu_(struct ng_exec *e, float ms[3], int *fuse)
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
		st = ng_exec_plan_spec_(e, w, &dw_plan[v]);
		if (!st && e->plans[dw_plan[v]].mm.workspace_need > ws)
			ws = e->plans[dw_plan[v]].mm.workspace_need;
	}
	if (!st && nv == 3) { /* own: the op's spec as op_spec makes it */
		s.gelu = 1;
		s.own = 1;
		s.bias = 1;
		st = ng_exec_plan_spec_(e, s, &dinp_plan[2]);
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
		ms[v] = -1.0f;
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
	st = time_on_scratch(e, buf, bytes, dgelu_run, &d, nv, ms);
	if (st)
		return st;
	*fuse = ng_exec_pick_dgelu(ms, nv);
	return NG_OK;
}

int ng_exec_pick_dgelu(const float *ms, int nv)
{
	/* ours needs W^T (more memory at d48) and wins the step only by a clear margin: at d24 its
	 * trial was 9% ahead and the step +0.3-0.5%; at d48 1% ahead and the step none
	 * (BENCHMARKS.md) */
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
 * H200 the two were within ~1% of a step (BENCHMARKS.md). */
enum ng_status ng_exec_choose_gelu_fwd_(struct ng_exec *e, float ms[2], int *fuse)
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
		ms[0] = ms[1] = -1.0f;
		return NG_OK;
	}
	struct gelu_fwd_trial d = { { &e->plans[plan[0]].mm, &e->plans[plan[1]].mm },
				    buf + at[0], buf + at[1], buf + at[2], buf + at[3], buf + at[4],
				    ws ? buf + at[5] : NULL, n_out };
	st = time_on_scratch(e, buf, bytes, gelu_fwd_run, &d, 2, ms);
	if (st)
		return st;
	*fuse = ms[0] <= ms[1];
	return NG_OK;
}

/* The NG_FP8_* bit of fp8 kind k (a row of the fp8 times): forward kinds 0-4, then the dinp
 * of kinds 0-3. */
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
enum ng_status ng_exec_choose_fp8_(struct ng_exec *e, int fuse_fwd, int fuse_bwd, int head_rows,
				   float ms[][2], int *mask)
{
	const struct ng_gpt_config *m = &e->cfg.model;
	static const enum ng_op_which kinds[5] = { NG_OP_WHICH_QKV, NG_OP_WHICH_ATTPROJ,
						   NG_OP_WHICH_FC, NG_OP_WHICH_FCPROJ,
						   NG_OP_WHICH_HEAD };
	enum ng_status st = NG_OK;
	for (int k = 0; k < NG_EXEC_FP8_KINDS && !st; k++) {
		ms[k][0] = ms[k][1] = -1.0f;
		const int dinp = k >= 5;
		const enum ng_op_which w = kinds[dinp ? k - 5 : k];
		const int bit = fp8_kind_bit(k);
		if (!(*mask & bit))
			continue;
		struct ng_matmul_spec s = { .kind = dinp ? NG_MATMUL_DINP : NG_MATMUL_FWD,
					    .autotune = e->cfg.autotune };
		ng_linear_dims(m, w, &s.IC, &s.OC);
		s.N = w == NG_OP_WHICH_HEAD ? head_rows : e->cfg.B * e->cfg.T;
		const int spr = m->arch == NG_ARCH_SPEEDRUN; /* bias-free; its norms cast nothing */
		s.bias = !dinp && w != NG_OP_WHICH_HEAD && !spr;
		s.gelu = dinp ? w == NG_OP_WHICH_FCPROJ && fuse_bwd : w == NG_OP_WHICH_FC && fuse_fwd;
		/* a LayerNorm writes the E4M3 input of these (1 more byte an element): no cast */
		int cast = dinp || spr || (w == NG_OP_WHICH_ATTPROJ || w == NG_OP_WHICH_FCPROJ);
		int plan[2] = { 0, 0 };
		st = ng_exec_plan_spec_(e, s, &plan[0]);
		s.fp8 = 1;
		if (!st)
			st = ng_exec_plan_spec_(e, s, &plan[1]);
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
			st = time_pair(e, fp8_run, &t, ms[k]);
		cudaFree(buf);
		if (st)
			break;
		if (ms[k][1] >= ms[k][0])
			*mask &= ~bit;
	}
	return st;
}

/* Data parallelism: every rank timed the choices on its own GPU and may have come out
 * differently (a toss-up like attproj at d24), which would mix precisions in the averaged
 * gradient and make runs unrepeatable. The ranks vote: the fused GELU, the fused DGELU and each
 * fp8 kind are kept only where every rank chose them (a sum of 0/1 votes over NCCL, at init, outside the step). */
enum ng_status ng_exec_agree_choices_(struct ng_exec *e, int *fuse, int *mask)
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

/* --recompute auto's budget for the training step's arena: --gpu-mem less what the device has
 * in use now (the context, the libraries' handles and workspaces: 0.53 GiB on the H200), less
 * 64 MiB for what comes after the arena (the captured graph: nothing measurable at d24);
 * without --gpu-mem, what is free now less 256 MiB, so that nothing else runs short. */
size_t ng_exec_fit_budget_(const struct ng_exec *e)
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
enum ng_status ng_exec_agree_budget_(struct ng_exec *e, size_t *budget, int *lowered)
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
		*lowered = 1;
	}
	return st;
}
