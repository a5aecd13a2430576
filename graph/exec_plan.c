/*
 * graph/exec_plan.c — planning the step before anything is allocated (see exec.h): the train
 * and eval graphs built with the forms graph/exec_trials.c timed (and refitted to memory for
 * --recompute auto), the data-parallel layout, one cuBLASLt plan per distinct matmul shape
 * (autotune's choices read from and kept in the cache file), the attention plan, and every
 * scratch tensor raised to what the real plans need before the arena is laid out again.
 */
#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec_internal.h"
#include "graph/optim_muon.h"
#include "graph/step_spr.h"
#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/encoder.h"
#include "kernels/fp8.h"
#include "kernels/gemm_sm90.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/mix.h"
#include "kernels/optim.h"

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
	s.relu2 = op->relu2;
	if (op->kind == NG_OP_MATMUL_FWD) {
		s.kind = NG_MATMUL_FWD;
		s.bias = op->param[1] >= 0;
		s.fp8 = op->fp8;
		s.accumulate = op->residual;
		s.own = op->own && op->relu2; /* our relu^2 epilogue, untimed */
		if (s.own)
			s.autotune = 0;
	} else if (op->kind == NG_OP_MATMUL_DINP) {
		s.kind = NG_MATMUL_DINP;
		s.fp8 = op->fp8;
		s.own = op->own;
		s.bias = op->own; /* ours sums the fc bias gradient too */
	} else {
		s.kind = NG_MATMUL_DW;
		s.gelu = 0;
		/* fp8 (the speedrun head, NG_FP8_DW_*): no bias epilogue; the cast sums it */
		s.bias = op->param[1] >= 0 && !op->fp8;
		s.accumulate = !op->overwrite;
		s.fp8 = op->fp8;
	}
	return s;
}

/* Find or make the plan of this shape. */
enum ng_status ng_exec_plan_spec_(struct ng_exec *e, struct ng_matmul_spec s, int *idx)
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
	return ng_exec_plan_spec_(e, op_spec(e, op), idx);
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
		size_t ws = e->plans[plan].mm.workspace_need;
		if (op->fp8 && op->which == NG_OP_WHICH_HEAD && op->kind == NG_OP_MATMUL_DINP)
			return ws + w8; /* g8 is the loss's output */
		if (op->fp8 && op->kind == NG_OP_MATMUL_DW && op->which == NG_OP_WHICH_HEAD)
			return ws + ng_fp8_head_dw_bytes((size_t)op->row_count, (size_t)m->Vp,
							 (size_t)m->C);
		if (op->fp8 && op->kind == NG_OP_MATMUL_DW) /* a layer's: both transposes (+ sums) */
			return ws + ng_fp8_dw_bytes((size_t)op->row_count,
						    (size_t)e->plans[plan].spec.IC,
						    (size_t)e->plans[plan].spec.OC, op->param[1] >= 0);
		if (op->fp8 && op->kind == NG_OP_MATMUL_DINP)
			return ws + w8 +
			       (g->tensors[op->in[0]].dtype == NG_DTYPE_U8 /* dout in E5M2 already */
					? 0
					: ng_fp8_input_bytes((size_t)op->row_count,
							     (size_t)e->plans[plan].spec.OC));
		return ws + w8 +
		       (op->fp8 && op->n_in - op->residual < 5
				? ng_fp8_input_bytes((size_t)op->row_count,
						     (size_t)e->plans[plan].spec.IC)
				: 0);
	}
	case NG_OP_ATTENTION_FWD: case NG_OP_ATTENTION_BWD: {
		int fwd = op->kind == NG_OP_ATTENTION_FWD;
		size_t w = fwd ? ng_attention_fwd_workspace(&e->att)
			       : ng_attention_bwd_workspace(&e->att);
		for (int k = 0; m->arch == NG_ARCH_SPEEDRUN && k < NG_EXEC_SPR_BANDS; k++) {
			size_t b = fwd ? ng_attention_fwd_workspace(&e->att_band[k])
				       : ng_attention_bwd_workspace(&e->att_band[k]);
			w = b > w ? b : w;
		}
		return w;
	}
	case NG_OP_MIX_BWD:
		return ng_mix2_bwd_scratch_bytes(N, m->C);
	case NG_OP_EMBED_BWD:
		return ng_encoder_bwd_work_bytes(g->B, g->T, m->C);
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
static void open_tune_cache(struct ng_exec *e, const struct cudaDeviceProp *prop,
			    struct ng_exec_report *rep, char *word, size_t n)
{
	rep->tune_cache_path[0] = rep->tune_warning[0] = '\0';
	const char *dir = e->cfg.autotune_cache;
	if (!e->cfg.autotune || !dir || !dir[0])
		return;
	tune_device(prop, word, n);
	snprintf(rep->tune_cache_path, sizeof(rep->tune_cache_path), "%s/autotune-%s.txt", dir,
		 word);
	if (ng_matmul_choices_load(&e->mmctx, rep->tune_cache_path, word, &rep->tune_loaded)) {
		snprintf(rep->tune_warning, sizeof(rep->tune_warning), "%s", ng_error_message());
		ng_clear_error();
	}
}

/* After planning: keep what was timed (rank 0 only: the ranks time the same shapes). */
static void save_tune_cache(struct ng_exec *e, struct ng_exec_report *rep, const char *word)
{
	if (!rep->tune_cache_path[0] || e->mmctx.choices_made == 0 || e->cfg.rank != 0)
		return;
	if (ng_matmul_choices_save(&e->mmctx, rep->tune_cache_path, word)) {
		snprintf(rep->tune_warning, sizeof(rep->tune_warning), "%s", ng_error_message());
		ng_clear_error();
	}
}

/* The options the step is built with: the configuration's, less what --deterministic rules
 * out (a timed choice could differ between two runs). */
static struct ng_step_options step_options(const struct ng_exec_config *cfg)
{
	struct ng_step_options opt = cfg->step;
	opt.deterministic = cfg->deterministic;
	if (opt.deterministic)
		opt.fuse_gelu &= ~NG_GELU_FUSE_AUTO;
	if (cfg->model.arch == NG_ARCH_SPEEDRUN) /* relu^2 is its own op: no GELU to time */
		opt.fuse_gelu = 0;
	/* relu^2 in our GEMM's epilogue where it runs; the fc forward then stays bf16, so
	 * --fp8 auto does not time it */
	if (cfg->model.arch != NG_ARCH_SPEEDRUN || cfg->no_own_gemm || !ng_gemm_sm90_available())
		opt.fuse_relu2 = 0;
	if (opt.fuse_relu2)
		opt.fp8 &= ~NG_FP8_FC;
	if (opt.deterministic && (opt.fp8 & NG_FP8_AUTO)) /* untimed: the kinds that widen */
		opt.fp8 = (opt.fp8 & (NG_FP8_QKV | NG_FP8_FC | NG_FP8_HEAD | NG_FP8_DINP_FCPROJ |
				      NG_FP8_HEAD_BWD | NG_FP8_DW_ALL)) |
			  NG_FP8_AUTO;
	return opt;
}

/* --recompute auto: the train graph refitted to recompute as little as fits *budget (which it
 * sets; graph/exec_trials.c measures it); *opt gets the recompute chosen. */
static enum ng_status fit_memory(struct ng_exec *e, struct ng_step_options *opt,
				 size_t *budget, int *lowered)
{
	const struct ng_exec_config *c = &e->cfg;
	/* with ranks, one collective first: NCCL allocates its buffers at its first connection
	 * (~0.85 GiB of a rank of two H200s), which would otherwise come after the budget was
	 * measured */
	size_t warm = 0;
	enum ng_status st = NG_OK;
	if (c->comm)
		st = ng_exec_agree_budget_(e, &warm, lowered);
	*budget = ng_exec_fit_budget_(e);
	if (!st && c->comm)
		st = ng_exec_agree_budget_(e, budget, lowered);
	if (!st)
		st = ng_step_fit_memory(&e->train, &c->model, c->B, c->T, c->K, opt, *budget);
	return st;
}

/* --gelu-fusion auto and --fp8 auto: the forms that time faster here (graph/exec_trials.c),
 * agreed by every rank; *opt gets them. */
static enum ng_status choose_forms(struct ng_exec *e, struct ng_step_options *opt,
				   struct ng_exec_report *rep)
{
	enum ng_status st = NG_OK;
	if (opt->fuse_gelu & NG_GELU_FUSE_AUTO) {
		int fwd = (opt->fuse_gelu & NG_GELU_FUSE_FWD) != 0;
		int bwd = opt->fuse_gelu & (NG_GELU_FUSE_BWD | NG_GELU_FUSE_OWN);
		st = ng_exec_choose_gelu_fwd_(e, rep->gelu_fwd_ms, &fwd);
		if (!st)
			st = ng_exec_choose_dgelu_(e, rep->dgelu_ms, &bwd);
		opt->fuse_gelu = NG_GELU_FUSE_AUTO | (fwd ? NG_GELU_FUSE_FWD : 0) | bwd;
	}
	if (!st && (opt->fp8 & NG_FP8_AUTO) && !opt->deterministic) {
		/* the speedrun model's FP8 head is its recipe: kept, not timed */
		int keep = e->cfg.model.arch == NG_ARCH_SPEEDRUN
				   ? opt->fp8 & (NG_FP8_HEAD | NG_FP8_HEAD_BWD) : 0;
		int mask = opt->fp8 & NG_FP8_EVERY & ~keep;
		st = ng_exec_choose_fp8_(e, (opt->fuse_gelu & NG_GELU_FUSE_FWD) != 0,
					 (opt->fuse_gelu & NG_GELU_FUSE_BWD) != 0,
					 e->train.head_chunk_rows, rep->fp8_ms, &mask);
		/* --fp8-dw is not timed: its kinds follow their forward's choice */
		opt->fp8 = mask | keep | NG_FP8_AUTO | (opt->fp8 & NG_FP8_DW_ALL);
	}
	if (!st && !opt->deterministic &&
	    ((opt->fuse_gelu & NG_GELU_FUSE_AUTO) || (opt->fp8 & NG_FP8_AUTO))) {
		int fuse = opt->fuse_gelu & (NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD | NG_GELU_FUSE_OWN);
		int mask = opt->fp8 & NG_FP8_EVERY;
		st = ng_exec_agree_choices_(e, &fuse, &mask);
		opt->fuse_gelu = (opt->fuse_gelu & NG_GELU_FUSE_AUTO) | fuse;
		opt->fp8 = (opt->fp8 & ~NG_FP8_EVERY) | mask;
	}
	return st;
}

/* The train graph (and the eval graph) as the step will run: built, fitted to memory, built
 * again with the timed forms when they differ from the first build's. */
static enum ng_status build_step(struct ng_exec *e, struct ng_exec_report *rep)
{
	const struct ng_exec_config *c = &e->cfg;
	struct ng_step_options opt = step_options(c);
	size_t budget = 0;
	/* built first, so that a bad shape gets the builder's message before anything is timed */
	enum ng_status st = ng_step_build_train(&e->train, &c->model, c->B, c->T, c->K, &opt);
	if (!st && opt.recompute_auto)
		st = fit_memory(e, &opt, &budget, &rep->fit_lowered);
	struct ng_step_options built = opt;
	if (!st)
		st = choose_forms(e, &opt, rep);
	if (!st && (opt.fuse_gelu != built.fuse_gelu || opt.fp8 != built.fp8)) {
		ng_graph_free(&e->train);
		st = ng_step_build_train(&e->train, &c->model, c->B, c->T, c->K, &opt);
		/* the chosen forms may need other bytes (our DGELU's W^T): fit again with them */
		if (!st && opt.recompute_auto && e->train.total_bytes > budget)
			st = ng_step_fit_memory(&e->train, &c->model, c->B, c->T, c->K, &opt, budget);
	}
	if (!st && c->eval_batches > 0)
		st = ng_step_build_eval(&e->eval, &c->model, c->B, c->T, c->eval_batches, &opt);
	return st;
}

/* Data parallelism (graph/exec_dp.c): the ranks checked, ZeRO-1's shard layout in every graph,
 * the per-layer all-reduce overlap. */
static enum ng_status plan_data_parallel(struct ng_exec *e)
{
	struct ng_exec_config *c = &e->cfg;
	enum ng_status st = NG_OK;
	if (c->world < 1) /* 0: a config that predates data parallelism, one process */
		c->world = 1;
	if (c->rank < 0 || c->rank >= c->world || (c->world > 1 && !c->comm) ||
	    (c->zero1 && !c->comm))
		return ng_fail(NG_ERR_RUNTIME, "exec: rank %d of world %d%s is not a valid "
			       "data-parallel setup", c->rank, c->world,
			       c->comm ? "" : " without a communicator");
	if (c->zero1) {
		e->shard_len = ng_collective_shard_len(e->train.lay.total, c->world);
		e->shard_off = e->shard_len * (size_t)c->rank;
		st = ng_exec_dp_shard_layout_(e, &e->train);
		if (!st && c->eval_batches > 0)
			st = ng_exec_dp_shard_layout_(e, &e->eval);
		if (st)
			return st;
	}
	if (c->comm && !c->zero1 && !c->dp_no_overlap)
		st = ng_exec_dp_plan_overlap_(e);
	return st;
}

/* GPT-2: one causal plan. The speedrun model: a plan per band of k = 1 .. 14 blocks of 128
 * tokens (graph/exec.h att_band), scale 0.12, causal within documents and the window through
 * the per-query lower bounds of ATTN_BOUNDS. */
static enum ng_status plan_attention(struct ng_exec *e)
{
	const struct ng_exec_config *c = &e->cfg;
	const int D = c->model.C / c->model.H;
	if (c->model.arch != NG_ARCH_SPEEDRUN)
		return ng_attention_plan(&e->att, e->cudnn, c->B, c->model.H, c->T, D,
					 c->deterministic, c->force_naive_attention);
	if (ng_spr_window_blocks(1, 1) != NG_EXEC_SPR_BANDS) /* W at the last step */
		return ng_fail(NG_ERR_RUNTIME, "speedrun: %d window variants for a largest W of %d",
			       NG_EXEC_SPR_BANDS, ng_spr_window_blocks(1, 1));
	enum ng_status st = NG_OK;
	for (int k = 1; k <= NG_EXEC_SPR_BANDS && !st; k++) {
		struct ng_attention_opts o = { .scale = (float)NG_SPR_ATTN_SCALE, .lower_bound = 1,
					       .max_window = k * NG_SPR_WINDOW_BLOCK };
		st = ng_attention_plan_masked(&e->att_band[k - 1], e->cudnn, c->B, c->model.H, c->T,
					      D, c->deterministic, c->force_naive_attention, &o);
	}
	return st;
}

enum ng_status ng_exec_plan_(struct ng_exec *e, const struct cudaDeviceProp *prop,
			     struct ng_exec_report *rep)
{
	const struct ng_exec_config *c = &e->cfg;
	char word[300] = "";
	open_tune_cache(e, prop, rep, word, sizeof(word));
	enum ng_status st = build_step(e, rep);
	if (!st)
		st = plan_data_parallel(e);
	if (!st)
		st = plan_attention(e);
	if (!st)
		st = plan_graph(e, &e->train, &e->train_plan);
	if (!st && c->eval_batches > 0)
		st = plan_graph(e, &e->eval, &e->eval_plan);
	if (!st)
		save_tune_cache(e, rep, word);
	return st;
}
