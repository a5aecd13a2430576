/*
 * src/backend_cuda.c — the training backend on the GPU: graph/exec.c's planned, captured step
 * behind the loop's backend table. Prints the plan's memory and the attention backend at start.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/exec.h"
#include "kernels/check.h"
#include "src/dist.h"
#include "src/train.h"

static enum ng_status cu_input(void *ctx, uint16_t **buf) { return ng_exec_input(ctx, buf); }
static enum ng_status cu_submit(void *ctx) { return ng_exec_submit(ctx); }

static enum ng_status cu_collect(void *ctx, struct ng_step_result *out, int max, bool wait, int *n)
{
	struct ng_metrics_record rec[NG_EXEC_RING];
	float ms[NG_EXEC_RING];
	if (max > NG_EXEC_RING)
		max = NG_EXEC_RING;
	enum ng_status st = ng_exec_collect(ctx, rec, ms, max, wait, n);
	for (int i = 0; i < *n; i++)
		out[i] = (struct ng_step_result){ rec[i].step, rec[i].loss, rec[i].grad_norm,
						  rec[i].lr, rec[i].skipped != 0, rec[i].stop > 0,
						  ms[i] };
	return st;
}

static enum ng_status cu_evaluate(void *ctx, const uint16_t *tokens, int n, int window,
				  double *loss)
{
	struct ng_exec *e = ctx;
	if (n != e->cfg.eval_batches)
		return ng_fail(NG_ERR_RUNTIME, "evaluation planned for %d batches, asked for %d",
			       e->cfg.eval_batches, n);
	return ng_exec_evaluate(e, tokens, window, loss);
}

/* Rank 0 gets the whole state; with ZeRO-1 the other ranks only take part in gathering the
 * moments (s stays empty, *params32 NULL). */
static enum ng_status cu_save_state(void *ctx, struct ng_train_state *s, float **params32)
{
	struct ng_exec *e = ctx;
	const struct ng_graph *g = &e->train;
	*params32 = NULL;
	if (e->cfg.rank != 0)
		return ng_exec_snapshot(e, NULL, NULL, NULL, &s->step, &s->n_skipped);
	enum ng_status st = ng_ckpt_state_alloc(s, 4, g->lay.total);
	if (st) { /* ZeRO-1: the other ranks wait in the gather; join it, then fail */
		if (e->cfg.zero1 && e->cfg.world > 1)
			ng_exec_snapshot(e, NULL, NULL, NULL, &s->step, &s->n_skipped);
		return st;
	}
	st = ng_exec_snapshot(e, s->params, s->m, s->v, &s->step, &s->n_skipped);
	if (!st && !(*params32 = malloc(g->lay.total * sizeof(float))))
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory for a checkpoint");
	if (st) {
		ng_ckpt_state_free(s);
		return st;
	}
	memcpy(*params32, s->params, g->lay.total * sizeof(float));
	if (g->t_fp8_state >= 0) { /* --fp8: the scales and their history, for an exact resume */
		s->n_fp8 = g->tensors[g->t_fp8_state].bytes / sizeof(float);
		s->fp8 = malloc(s->n_fp8 * sizeof(float));
		st = s->fp8 ? ng_exec_download(e, g->t_fp8_state, s->fp8)
			    : ng_fail(NG_ERR_RUNTIME, "out of host memory for a checkpoint");
		if (st) {
			free(*params32);
			*params32 = NULL;
			ng_ckpt_state_free(s);
			return st;
		}
	}
	return NG_OK;
}

static enum ng_status cu_load_state(void *ctx, const struct ng_train_state *s)
{
	struct ng_exec *e = ctx;
	size_t n = e->train.lay.total;
	if (s->n != n)
		return ng_fail(NG_ERR_INPUT, "training state has %zu parameters, the model %zu",
			       s->n, n);
	const struct ng_graph *g = &e->train;
	int fp8_same = g->t_fp8_state >= 0 && s->fp8 &&
		       s->n_fp8 * sizeof(float) == g->tensors[g->t_fp8_state].bytes;
	if (g->fp8 && !fp8_same && e->cfg.rank == 0)
		fprintf(stderr, "note: --fp8: the FP8 scales restart from this step (the checkpoint "
			"has none for this model), so the resumed run follows an uninterrupted one "
			"within FP8 rounding, not bit for bit\n");
	if (s->elem_size == 4) {
		enum ng_status st = ng_exec_restore(e, s->params, s->m, s->v, s->step, s->n_skipped);
		if (!st && fp8_same) /* restore zeroed them; the checkpoint's continue the run */
			st = ng_exec_upload(e, g->t_fp8_state, s->fp8);
		return st;
	}
	/* a state from the CPU reference (double): narrowed to the GPU's fp32 master copy */
	float *f = malloc(3 * n * sizeof(float));
	if (!f)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	const double *src[3] = { s->params, s->m, s->v };
	for (int k = 0; k < 3; k++)
		for (size_t i = 0; i < n; i++)
			f[k * n + i] = (float)src[k][i];
	enum ng_status st = ng_exec_restore(e, f, f + n, f + 2 * n, s->step, s->n_skipped);
	free(f);
	return st;
}

static void cu_request_stop(void *ctx)
{
	ng_exec_request_stop(ctx);
}

static void cu_free(void *ctx)
{
	ng_exec_free(ctx);
	free(ctx);
}

/* --autotune-cache: the directory; "none" or "": none; not given: $XDG_CACHE_HOME/nanograph,
 * else $HOME/.cache/nanograph, else none. */
static const char *autotune_cache_dir(const char *flag)
{
	static char dir[4096];
	if (flag)
		return flag[0] && strcmp(flag, "none") != 0 ? flag : NULL;
	const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
	if (xdg && xdg[0])
		snprintf(dir, sizeof(dir), "%s/nanograph", xdg);
	else if (home && home[0])
		snprintf(dir, sizeof(dir), "%s/.cache/nanograph", home);
	else
		return NULL;
	return dir;
}

void ng_exec_config_from_opts(struct ng_exec_config *c, const struct ng_train_opts *o)
{
	memset(c, 0, sizeof(*c));
	c->model = o->shape.model;
	c->B = o->shape.B;
	c->T = o->shape.T;
	c->K = o->shape.K;
	c->eval_batches = (int)o->val_batches;
	ng_step_default_options(&c->step);
	c->sched = (struct ng_schedule){ (float)o->lr, (float)o->lr_final_frac, (int)o->warmup,
					 (int)o->steps, strcmp(o->schedule, "cosine") == 0 };
	c->clip = (float)o->clip;
	c->wd = (float)o->weight_decay;
	c->beta1 = (float)o->beta1;
	c->beta2 = (float)o->beta2;
	c->eps = (float)o->eps;
	c->seed = (uint64_t)o->seed;
	c->deterministic = o->deterministic;
	c->no_graph = o->no_graph;
	c->world = o->world > 1 ? o->world : 1;
	c->rank = c->world > 1 ? o->rank : 0;
	c->comm = o->dist ? o->dist->comm : NULL;
	c->zero1 = o->zero1;
	c->dp_no_overlap = o->no_overlap;
	c->profile = o->profile;
	c->autotune = o->autotune;
	c->no_own_gemm = o->own_gemm && strcmp(o->own_gemm, "off") == 0;
	c->autotune_cache = autotune_cache_dir(o->autotune_cache);
	if (o->recompute)
		ng_step_parse_recompute(o->recompute, o->fp8, &c->step); /* checked by train */
	c->step.head_chunk_rows = (int)o->head_chunk;
	c->gpu_mem = (size_t)(o->gpu_mem_gib * 1073741824.0);
	c->step.fp8 = o->fp8 ? NG_FP8_EVERY | NG_FP8_AUTO | (o->fp8_dw ? NG_FP8_DW_ALL : 0) : 0;
	/* the speedrun model's head is FP8 as its reference's (on GPUs that have it: exec.c) */
	if (o->shape.model.arch == NG_ARCH_SPEEDRUN && !o->fp8 && !o->head_bf16)
		c->step.fp8 = NG_FP8_HEAD;
	if (o->shape.model.arch == NG_ARCH_SPEEDRUN && o->head_bf16)
		c->step.fp8 &= ~NG_FP8_HEAD; /* --fp8 --head-bf16: the layers only */
	/* and its backward: the E5M2 gradient as the reference's (graph/step.h "FP8") */
	if (o->shape.model.arch == NG_ARCH_SPEEDRUN && (c->step.fp8 & NG_FP8_HEAD))
		c->step.fp8 |= NG_FP8_HEAD_BWD;
	if (o->gelu_fusion)
		ng_step_parse_gelu_fusion(o->gelu_fusion, &c->step.fuse_gelu); /* checked by train */
	c->step.muon = ng_train_is_muon(o);
	/* the speedrun model's relu^2 in our GEMM's epilogues, where that GEMM runs and --own-gemm
	 * is not off (the executor checks) */
	c->step.fuse_relu2 = o->shape.model.arch == NG_ARCH_SPEEDRUN;
	c->muon = o->muon;
}

enum ng_status ng_backend_cuda_init(struct ng_backend *be, const struct ng_train_opts *o)
{
	struct ng_exec *e = calloc(1, sizeof(*e));
	if (!e)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	struct ng_exec_config c;
	ng_exec_config_from_opts(&c, o);
	if (!o->val_glob && o->train_glob)
		c.eval_batches = 0;
	struct ng_exec_report rep;
	enum ng_status st = ng_exec_init(e, &c, &rep);
	if (st) {
		ng_exec_free(e);
		free(e);
		return st;
	}
	const struct ng_graph *g = &e->train;
	FILE *log = c.rank == 0 ? stderr : fopen("/dev/null", "w"); /* rank 0 speaks */
	if (!log)
		log = stderr;
	size_t free_b = 0, total_b = 0;
	cudaMemGetInfo(&free_b, &total_b);
	fprintf(log, "gpu: %s | arena %.2f GiB (params+grads+adam %.2f GiB, planned %.2f GiB, "
		"lower bound %.2f GiB) | device memory in use %.2f of %.2f GiB\n", e->device_name,
		e->arena_bytes / 1073741824.0, g->persistent_bytes / 1073741824.0,
		g->arena_bytes / 1073741824.0, g->lower_bound_bytes / 1073741824.0,
		(total_b - free_b) / 1073741824.0, total_b / 1073741824.0);
	if (e->cfg.model.arch == NG_ARCH_SPEEDRUN) /* the widest band; the others alike */
		fprintf(log, "attention (%d bands): %s\n", NG_EXEC_SPR_BANDS,
			ng_attention_describe(&e->att_band[NG_EXEC_SPR_BANDS - 1]));
	else
		fprintf(log, "attention: %s\n", ng_attention_describe(&e->att));
	if (c.step.recompute_auto) {
		char what[96];
		fprintf(log, "recompute: %s (auto: the least that fits ",
			ng_step_recompute_name(g, what, sizeof(what)));
		if (c.gpu_mem)
			fprintf(log, "--gpu-mem %.2f GiB", c.gpu_mem / 1073741824.0);
		else
			fprintf(log, "the memory free at start");
		fprintf(log, "%s)\n", rep.fit_lowered ? "; fitted to another rank's smaller budget, "
			"so that every rank runs the same step" : "");
	}
	if (c.autotune && !e->cfg.autotune)
		fprintf(log, "autotune: off (--deterministic: a timed choice could differ between "
			"two runs)\n");
	if (e->cfg.autotune) {
		int own = 0;
		for (int i = 0; i < e->n_plans; i++)
			own += e->plans[i].mm.own != 0;
		fprintf(log, "autotune: %d matmul shape(s) timed, %d choice(s) reused, %d of %d "
			"plans on our own GEMM", e->mmctx.choices_made, e->mmctx.choices_reused, own,
			e->n_plans);
		if (rep.tune_cache_path[0])
			fprintf(log, " | kept in %s", rep.tune_cache_path);
		fprintf(log, "\n");
		if (rep.tune_warning[0])
			fprintf(log, "warning: %s (the choices were timed again)\n", rep.tune_warning);
	}
	if (g->fuse_gelu & NG_GELU_FUSE_AUTO) {
		const float *ms[2] = { rep.gelu_fwd_ms, rep.dgelu_ms };
		static const char *what[2] = { "FC forward", "FC backward" };
		fprintf(log, "gelu fusion: %s (epilogue against matmul + GELU kernel:",
			ng_step_gelu_fusion_name(g->fuse_gelu));
		for (int i = 0; i < 2; i++) {
			if (ms[i][0] < 0)
				fprintf(log, "%s %s not timed, no device memory to spare", i ? ";" : "",
					what[i]);
			else
				fprintf(log, "%s %s %.3f / %.3f ms", i ? ";" : "", what[i], ms[i][0],
					ms[i][1]);
			if (i == 1 && ms[i][0] >= 0 && ms[i][2] >= 0)
				fprintf(log, ", our own GEMM's DGELU %.3f ms", ms[i][2]);
		}
		fprintf(log, ")\n");
	}
	if (c.step.fp8) {
		static const char *kind[NG_EXEC_FP8_KINDS] = { "qkv",	  "attproj",	  "fc",
							       "fcproj",  "head",	  "dqkv",
							       "dattproj", "dfc",	  "dfcproj" };
		fprintf(log, "fp8: forward matmuls in E4M3 (x E4M3 weights):");
		int any = 0, timed = 0;
		for (int k = 0; k < NG_EXEC_FP8_KINDS; k++) {
			int bit = k < 5 ? 1 << k : 1 << (k - 5 + NG_FP8_DINP_SHIFT);
			if (k == 5) {
				fprintf(log, "%s; input gradients (dinp) in E5M2:", any ? "" : " none");
				any = 0;
			}
			if (g->fp8 & bit)
				fprintf(log, "%s %s", any++ ? "," : "", kind[k]);
			timed |= rep.fp8_ms[k][0] >= 0;
		}
		fprintf(log, "%s", any ? "" : " none");
		if (g->fp8 & NG_FP8_DW_ALL) { /* --fp8-dw: where the kind's forward is fp8 */
			fprintf(log, "; weight gradients (dW) in E5M2 x E4M3:");
			any = 0;
			for (int k = 0; k < 4; k++)
				if ((g->fp8 & 1 << (k + NG_FP8_DW_SHIFT)) && (g->fp8 & 1 << k) &&
				    (g->B * g->T) % 16 == 0)
					fprintf(log, "%s %s", any++ ? "," : "", kind[k]);
			fprintf(log, "%s", any ? "" : " none (their forward matmuls are bf16)");
		}
		if (timed) {
			fprintf(log, " (timed bf16 / fp8 ms:");
			for (int k = 0; k < NG_EXEC_FP8_KINDS; k++)
				if (rep.fp8_ms[k][0] >= 0)
					fprintf(log, " %s %.3f/%.3f", kind[k], rep.fp8_ms[k][0],
						rep.fp8_ms[k][1]);
			fprintf(log, ")");
		} else if (c.deterministic) {
			fprintf(log, " (--deterministic: not timed)");
		}
		fprintf(log, "\n");
	}
	if (c.comm)
		fprintf(log, "data parallel: %d rank(s) through NCCL (%s bootstrap), gradient %s "
			"inside the captured step%s\n", c.world,
			ng_dist_method_name(o->dist->plan.method),
			c.zero1 ? "reduce-scatter + parameter all-gather" : "all-reduce (mean)",
			c.zero1 ? ", ZeRO-1 AdamW moments sharded"
			: e->dp_bucket ? ", per layer as the backward finishes it" : "");
	ng_exec_print_profile(e, log);
	fprintf(log, "step: %d ops, %s\n", g->n_ops,
		c.no_graph ? "launched eagerly (--no-graph)" : "captured as one CUDA Graph");
	if (log != stderr)
		fclose(log);
	*be = (struct ng_backend){
		.name = "cuda", .ctx = e, .peak_flops = e->peak_flops, .input_buffer = cu_input,
		.submit = cu_submit, .collect = cu_collect, .evaluate = cu_evaluate,
		.save_state = cu_save_state, .load_state = cu_load_state, .free = cu_free,
		.request_stop = c.comm ? cu_request_stop : NULL,
	};
	return NG_OK;
}
