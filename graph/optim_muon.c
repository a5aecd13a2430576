/*
 * graph/optim_muon.c — the MUON op on the GPU (see optim_muon.h): scratch layout, plan, launches.
 * Data parallelism: the gradient is already the mean over ranks when the op runs (GRAD_NORM's
 * all-reduce), so every rank computes the same momentum; each orthogonalises its share of every
 * group and ng_collective_allgather hands the shares round, inside the captured step.
 */
#include "graph/optim_muon.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec.h"
#include "graph/exec_internal.h"
#include "kernels/check.h"
#include "kernels/collective.h"
#include "kernels/muon.h"

#define UP256(x) (((x) + 255) / 256 * 256)

void ng_optim_muon_layout(const struct ng_gpt_config *cfg, int world,
			  struct ng_optim_muon_layout *out)
{
	struct ng_muon_group grp[NG_MUON_GROUPS];
	ng_muon_groups(cfg, grp);
	if (world < 1)
		world = 1;
	size_t off = 256; /* after the scalars */
	for (int k = 0; k < NG_MUON_GROUPS; k++) {
		int share = (grp[k].batch + world - 1) / world;
		size_t numel = (size_t)grp[k].rows * grp[k].cols;
		size_t n = (size_t)(grp[k].rows < grp[k].cols ? grp[k].rows : grp[k].cols);
		size_t x = (size_t)share * world * numel, gram = (size_t)share * n * n;
		out->share[k] = share;
		out->off_x0[k] = off;
		out->off_x1[k] = out->off_x0[k] + UP256(x * 2);
		out->off_a[k] = out->off_x1[k] + UP256(x * 2);
		out->off_b[k] = out->off_a[k] + UP256(gram * 2);
		out->off_part[k] = out->off_b[k] + UP256(gram * 2);
		out->off_ws[k] = out->off_part[k] + UP256(ng_muon_normalize_scratch_bytes(numel,
											   share));
		off = out->off_ws[k] + NG_OPTIM_MUON_WS;
	}
	out->bytes = off;
}

size_t ng_optim_muon_scratch_bytes(const struct ng_gpt_config *cfg, int world)
{
	struct ng_optim_muon_layout l;
	ng_optim_muon_layout(cfg, world, &l);
	return l.bytes;
}

/* --autotune: the fastest offered algorithm of each Newton-Schulz GEMM of a group, timed on
 * buffers of its size holding a normalised random-looking batch, freed again. */
static enum ng_status tune_group(struct ng_muon_ns *ns, size_t numel, int count, cudaStream_t s)
{
	size_t x = numel * (size_t)count * 2, gram = (size_t)ns->n * ns->n * (size_t)count * 2;
	char *buf = NULL;
	size_t part = ng_muon_normalize_scratch_bytes(numel, count);
	size_t bytes = UP256(x) * 2 + UP256(gram) * 2 + UP256(part) + NG_OPTIM_MUON_WS;
	if (NG_CUDA_CHECK(cudaMalloc((void **)&buf, bytes)))
		return NG_ERR_RUNTIME;
	ng_bf16 *x0 = (ng_bf16 *)buf, *x1 = (ng_bf16 *)(buf + UP256(x));
	ng_bf16 *a = (ng_bf16 *)(buf + 2 * UP256(x)), *b = (ng_bf16 *)(buf + 2 * UP256(x) +
								    UP256(gram));
	double *pt = (double *)(buf + 2 * UP256(x) + 2 * UP256(gram));
	void *ws = buf + 2 * UP256(x) + 2 * UP256(gram) + UP256(part);
	/* 0x3c3c...: bf16 1.15 everywhere, a matrix whose normalised form keeps the iteration
	 * finite; the values do not change which algorithm is fastest */
	enum ng_status st = NG_CUDA_CHECK(cudaMemsetAsync(x0, 0x3c, x, s));
	if (!st)
		st = ng_muon_normalize(x0, pt, numel, numel, count, s);
	if (!st)
		st = ng_muon_ns_tune(ns, x0, x1, a, b, ws, s, NULL);
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(s));
	cudaFree(buf);
	return st;
}

enum ng_status ng_optim_muon_plan_(struct ng_exec *e, const struct ng_graph *g)
{
	if (e->muon)
		return NG_OK;
	if (e->cfg.zero1)
		return ng_fail(NG_ERR_INPUT, "--optimizer muon does not combine with --zero1 (which "
			       "shards AdamW's moments)");
	if (NG_MUON_NS_STEPS % 2 == 0)
		return ng_fail(NG_ERR_RUNTIME, "muon: the all-gather expects the result in x1");
	struct ng_optim_muon *p = calloc(1, sizeof(*p));
	if (!p)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	e->muon = p;
	for (int k = 0; k <= NG_MUON_GROUPS; k++)
		if (NG_CUDA_CHECK(cudaStreamCreateWithFlags(&p->stream[k], cudaStreamNonBlocking)) ||
		    NG_CUDA_CHECK(cudaEventCreateWithFlags(&p->join[k], cudaEventDisableTiming)))
			return NG_ERR_RUNTIME;
	if (NG_CUDA_CHECK(cudaEventCreateWithFlags(&p->fork, cudaEventDisableTiming)))
		return NG_ERR_RUNTIME;
	int world = e->cfg.world > 1 ? e->cfg.world : 1, rank = world > 1 ? e->cfg.rank : 0;
	ng_optim_muon_layout(&g->cfg, world, &p->lay);
	ng_muon_groups(&g->cfg, p->grp);
	for (int k = 0; k < NG_MUON_GROUPS; k++) {
		int lo = rank * p->lay.share[k], hi = lo + p->lay.share[k];
		if (hi > p->grp[k].batch)
			hi = p->grp[k].batch;
		p->lo[k] = lo;
		p->count[k] = hi > lo ? hi - lo : 0;
		if (!p->count[k])
			continue;
		size_t numel = (size_t)p->grp[k].rows * p->grp[k].cols;
		enum ng_status st = ng_muon_ns_plan(&p->ns[k], e->mmctx.lt, p->count[k],
						    p->grp[k].rows, p->grp[k].cols, numel,
						    NG_MUON_NS_STEPS, NG_OPTIM_MUON_WS);
		if (!st && e->cfg.autotune)
			st = tune_group(&p->ns[k], numel, p->count[k], e->stream);
		if (st)
			return st;
	}
	return NG_OK;
}

/* Parameter `id` of flat buffer tensor t. */
static void *param_at(struct ng_exec *e, const struct ng_graph *g, int t, int id)
{
	return (char *)ng_exec_tensor_(e, g, t) +
	       g->lay.p[id].offset * ng_dtype_size(g->tensors[t].dtype);
}

enum ng_status ng_optim_muon_run_(struct ng_exec *e, const struct ng_graph *g,
				  const struct ng_op *op, void *scratch, cudaStream_t s)
{
	struct ng_optim_muon *p = e->muon;
	if (!p)
		return ng_fail(NG_ERR_RUNTIME, "muon: the op was not planned");
	if (!scratch || g->tensors[op->scratch].bytes < p->lay.bytes)
		return ng_fail(NG_ERR_RUNTIME, "muon: scratch of %zu bytes, the plan needs %zu",
			       scratch ? g->tensors[op->scratch].bytes : 0, p->lay.bytes);
	int grads = op->in[0], hi = op->out[0], lo = op->out[1], am = op->out[2], av = op->out[3];
	struct ng_step_state *st = ng_exec_tensor_(e, g, op->in[1]);
	char *sb = scratch;
	struct ng_muon_scalars *sc = (struct ng_muon_scalars *)sb;
	const struct ng_muon_config *c = &e->cfg.muon;
	int comm = e->cfg.comm != NULL;
	enum ng_status r = ng_muon_schedule(sc, st, *c, s);
	if (!r)
		r = NG_CUDA_CHECK(cudaEventRecord(p->fork, s));
	cudaStream_t sa = p->stream[NG_MUON_GROUPS];
	if (!r)
		r = NG_CUDA_CHECK(cudaStreamWaitEvent(sa, p->fork, 0));
	for (int i = 0; i < NG_P_COUNT && !r; i++) {
		int group = ng_muon_adam_group_of((enum ng_param_id)i);
		if (group < 0 || !ng_param_present(&g->lay.p[i]))
			continue;
		r = ng_muon_adam(param_at(e, g, hi, i), param_at(e, g, lo, i), param_at(e, g, am, i),
				 param_at(e, g, av, i), param_at(e, g, grads, i), g->lay.p[i].numel,
				 group, c->beta1, c->beta2, c->eps, sc, st, sa);
	}
	/* each stream's recorded end is joined again, whatever failed after it */
	bool ended[NG_MUON_GROUPS + 1] = { false };
	if (!r)
		r = NG_CUDA_CHECK(cudaEventRecord(p->join[NG_MUON_GROUPS], sa));
	ended[NG_MUON_GROUPS] = !r;
	for (int k = 0; k < NG_MUON_GROUPS && !r; k++) {
		const struct ng_muon_group *gr = &p->grp[k];
		cudaStream_t gs = p->stream[k];
		size_t numel = (size_t)gr->rows * gr->cols, all = numel * (size_t)gr->batch;
		ng_bf16 *x0 = (ng_bf16 *)(sb + p->lay.off_x0[k]);
		ng_bf16 *x1 = (ng_bf16 *)(sb + p->lay.off_x1[k]);
		r = NG_CUDA_CHECK(cudaStreamWaitEvent(gs, p->fork, 0));
		if (!r)
			r = ng_muon_momentum_update(x0, param_at(e, g, am, gr->param),
						    param_at(e, g, grads, gr->param), all, sc, st, gs);
		ng_bf16 *res = x1 + (size_t)p->lo[k] * numel;
		if (!r && p->count[k]) {
			ng_bf16 *mine = x0 + (size_t)p->lo[k] * numel;
			r = ng_muon_normalize(mine, (double *)(sb + p->lay.off_part[k]), numel, numel,
					      p->count[k], gs);
			if (!r)
				r = ng_muon_ns_run(&p->ns[k], mine, res, (ng_bf16 *)(sb + p->lay.off_a[k]),
						   (ng_bf16 *)(sb + p->lay.off_b[k]),
						   sb + p->lay.off_ws[k], &res, gs);
			if (!r && res != x1 + (size_t)p->lo[k] * numel)
				r = ng_fail(NG_ERR_RUNTIME, "muon: Newton-Schulz result not in x1");
		}
		if (!r && !comm)
			r = ng_muon_apply(param_at(e, g, hi, gr->param), param_at(e, g, lo, gr->param),
					  x1, all, (float)gr->scale, sc, st, gs);
		if (!r)
			r = NG_CUDA_CHECK(cudaEventRecord(p->join[k], gs));
		ended[k] = !r;
	}
	for (int k = 0; k <= NG_MUON_GROUPS; k++) {
		if (!ended[k])
			continue;
		enum ng_status j = NG_CUDA_CHECK(cudaStreamWaitEvent(s, p->join[k], 0));
		if (!r)
			r = j;
	}
	for (int k = 0; k < NG_MUON_GROUPS && !r && comm; k++) {
		const struct ng_muon_group *gr = &p->grp[k];
		size_t numel = (size_t)gr->rows * gr->cols, all = numel * (size_t)gr->batch;
		ng_bf16 *x1 = (ng_bf16 *)(sb + p->lay.off_x1[k]);
		/* every rank's share to every rank, in place */
		r = ng_collective_allgather(e->cfg.comm, x1, (size_t)p->lay.share[k] * numel, 2,
					    e->cfg.world > 1 ? e->cfg.rank : 0, s);
		if (!r)
			r = ng_muon_apply(param_at(e, g, hi, gr->param), param_at(e, g, lo, gr->param),
					  x1, all, (float)gr->scale, sc, st, s);
	}
	return r;
}

void ng_optim_muon_free_(struct ng_exec *e)
{
	if (!e->muon)
		return;
	struct ng_optim_muon *p = e->muon;
	for (int k = 0; k < NG_MUON_GROUPS; k++)
		if (p->count[k])
			ng_muon_ns_free(&p->ns[k]);
	for (int k = 0; k <= NG_MUON_GROUPS; k++) {
		if (p->stream[k])
			cudaStreamDestroy(p->stream[k]);
		if (p->join[k])
			cudaEventDestroy(p->join[k]);
	}
	if (p->fork)
		cudaEventDestroy(p->fork);
	free(p);
	e->muon = NULL;
}
