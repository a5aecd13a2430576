/*
 * graph/optim_muon.c — the MUON op on the GPU (see optim_muon.h): scratch layout, plan, launches.
 * Data parallelism: the gradient is already the mean over ranks when the op runs (GRAD_NORM's
 * all-reduce), so every rank computes the same momentum; each orthogonalises its share of every
 * group and ng_collective_allgather hands the shares round, inside the captured step.
 */
#include "graph/optim_muon.h"

#include <stdlib.h>
#include <string.h>

#include "graph/exec.h"
#include "graph/exec_internal.h"
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
	size_t x = 0, gram = 0;
	for (int k = 0; k < NG_MUON_GROUPS; k++) {
		int share = (grp[k].batch + world - 1) / world;
		size_t numel = (size_t)grp[k].rows * grp[k].cols;
		size_t n = (size_t)(grp[k].rows < grp[k].cols ? grp[k].rows : grp[k].cols);
		out->share[k] = share;
		if ((size_t)share * world * numel > x)
			x = (size_t)share * world * numel;
		if ((size_t)share * n * n > gram)
			gram = (size_t)share * n * n;
	}
	out->off_x0 = 256; /* after the scalars */
	out->off_x1 = out->off_x0 + UP256(x * 2);
	out->off_a = out->off_x1 + UP256(x * 2);
	out->off_b = out->off_a + UP256(gram * 2);
	out->off_ws = out->off_b + UP256(gram * 2);
	out->bytes = out->off_ws + NG_OPTIM_MUON_WS;
}

size_t ng_optim_muon_scratch_bytes(const struct ng_gpt_config *cfg, int world)
{
	struct ng_optim_muon_layout l;
	ng_optim_muon_layout(cfg, world, &l);
	return l.bytes;
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
	ng_bf16 *x0 = (ng_bf16 *)(sb + p->lay.off_x0), *x1 = (ng_bf16 *)(sb + p->lay.off_x1);
	ng_bf16 *a = (ng_bf16 *)(sb + p->lay.off_a), *b = (ng_bf16 *)(sb + p->lay.off_b);
	void *ws = sb + p->lay.off_ws;
	const struct ng_muon_config *c = &e->cfg.muon;
	enum ng_status r = ng_muon_schedule(sc, st, *c, s);
	for (int i = 0; i < NG_P_COUNT && !r; i++) {
		int group = ng_muon_adam_group_of((enum ng_param_id)i);
		if (group < 0 || !ng_param_present(&g->lay.p[i]))
			continue;
		r = ng_muon_adam(param_at(e, g, hi, i), param_at(e, g, lo, i), param_at(e, g, am, i),
				 param_at(e, g, av, i), param_at(e, g, grads, i), g->lay.p[i].numel,
				 group, c->beta1, c->beta2, c->eps, sc, st, s);
	}
	for (int k = 0; k < NG_MUON_GROUPS && !r; k++) {
		const struct ng_muon_group *gr = &p->grp[k];
		size_t numel = (size_t)gr->rows * gr->cols, all = numel * (size_t)gr->batch;
		r = ng_muon_momentum_update(x0, param_at(e, g, am, gr->param),
					    param_at(e, g, grads, gr->param), all, sc, st, s);
		ng_bf16 *res = x1 + (size_t)p->lo[k] * numel;
		if (!r && p->count[k]) {
			ng_bf16 *mine = x0 + (size_t)p->lo[k] * numel;
			r = ng_muon_normalize(mine, numel, numel, p->count[k], s);
			if (!r)
				r = ng_muon_ns_run(&p->ns[k], mine, res, a, b, ws, &res, s);
			if (!r && res != x1 + (size_t)p->lo[k] * numel)
				r = ng_fail(NG_ERR_RUNTIME, "muon: Newton-Schulz result not in x1");
		}
		if (!r && e->cfg.comm) /* every rank's share to every rank, in place */
			r = ng_collective_allgather(e->cfg.comm, x1, (size_t)p->lay.share[k] * numel,
						    2, e->cfg.world > 1 ? e->cfg.rank : 0, s);
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
	for (int k = 0; k < NG_MUON_GROUPS; k++)
		if (e->muon->count[k])
			ng_muon_ns_free(&e->muon->ns[k]);
	free(e->muon);
	e->muon = NULL;
}
