/*
 * src/cmd_plan.c — `nanograph plan` (the memory plan of a step, no GPU needed) and
 * `nanograph dump` (the step as Graphviz DOT and the arena as SVG). Both build the step with
 * graph/step.c from the [model] [batch] flags and the plan options, so what they show is what
 * the executor will allocate.
 *
 * plan prints parameters, gradients, optimizer state, activations and workspaces (live at the
 * peak op), the arena, its lower bound and the total, and the ten largest planned tensors; --json
 * prints one object with docs/DESIGN.md's fields. --gpu-mem GIB fails, with the numbers and a
 * hint, when the total does not fit (exit 2).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/dump.h"
#include "graph/step.h"
#include "graph/exec.h"
#include "kernels/check.h"
#include "src/cli.h"
#include "src/commands.h"

#define MIB (1024.0 * 1024.0)
#define GIB (1024.0 * 1024.0 * 1024.0)

/* Flags shared by plan and dump (besides [model] [batch]). */
struct plan_args {
	const char *recompute; /* comma list of gelu, layernorm, fp8; or "none" */
	long long head_chunk;  /* rows per classifier chunk, 0 = whole */
	const char *gelu;      /* --gelu-fusion: auto | fwd,bwd | fwd | bwd | none */
	bool deterministic;    /* deterministic reductions */
	long long align;       /* arena alignment, bytes */
	const char *step;      /* "train", "eval", "sample" */
	bool fp8;              /* --fp8: every kind of fp8 matmul (forward E4M3, dinp E5M2) */
	bool fp8_dw;           /* --fp8-dw: the layers' dW too */
	double gpu_gib;        /* plan's --gpu-mem (0: not given): --recompute auto's budget */
};

#define PLAN_NFLAGS 9

static void plan_flags(struct plan_args *a, struct ng_flag *f)
{
	memset(a, 0, sizeof(*a));
	a->recompute = "none";
	a->head_chunk = NG_HEAD_CHUNK_DEFAULT;
	a->align = 256;
	a->step = "train";
	struct ng_flag t[PLAN_NFLAGS] = {
		{ "--recompute", NG_FLAG_STRING, &a->recompute, 0, 0, "WHAT",
		  "recompute to save memory: a comma list of gelu, layernorm, fp8; none; or auto "
		  "(the least, layer by layer, that fits --gpu-mem)", false },
		{ "--head-chunk", NG_FLAG_INT, &a->head_chunk, 0, 1 << 30, "ROWS",
		  "classifier rows per chunk (0 = all B*T rows at once; 16384)", false },
		{ "--gelu-fusion", NG_FLAG_STRING, &a->gelu, 0, 0, "WHAT",
		  "GELU / DGELU as matmul epilogues: auto | fwd,bwd | fwd,own | fwd | bwd | own | "
		  "none (own: the DGELU on our own Hopper GEMM; auto: "
		  "planned as fwd,bwd here; the GPU times bwd)", false },
		{ "--deterministic", NG_FLAG_BOOL, &a->deterministic, 0, 0, NULL,
		  "deterministic reductions (bigger workspaces)", false },
		{ "--align", NG_FLAG_INT, &a->align, 1, 1 << 20, "BYTES",
		  "arena alignment, a power of two", false },
		{ "--step", NG_FLAG_STRING, &a->step, 0, 0, "KIND",
		  "which step to plan: train | eval | sample", false },
		{ "--fp8", NG_FLAG_BOOL, &a->fp8, 0, 0, NULL,
		  "fp8 matmuls, planned for every kind: the five forward (E4M3) and four layer "
		  "dinp (E5M2 x E4M3) ones (train --fp8 times them on the GPU and may keep fewer)",
		  false },
		{ "--fp8-dw", NG_FLAG_BOOL, &a->fp8_dw, 0, 0, NULL,
		  "with --fp8: the layers' weight-gradient matmuls in FP8 too, as train --fp8-dw",
		  false },
		{ "--gpu-mem", NG_FLAG_DOUBLE, &a->gpu_gib, 0, 1e6, "GIB",
		  "with --recompute auto the least recompute that fits this much (the step's own "
		  "bytes); plan also fails when the step needs more", false },
	};
	memcpy(f, t, sizeof(t));
}

/* Resolve the flags and build the planned step into g. */
static enum ng_status build(const struct ng_model_args *ma, const struct plan_args *pa,
			    struct ng_shape *shape, struct ng_graph *g)
{
	enum ng_status st = ng_cli_resolve_shape(ma, shape);
	if (st)
		return st;
	struct ng_step_options o;
	ng_step_default_options(&o);
	if ((st = ng_step_parse_recompute(pa->recompute, pa->fp8, &o)))
		return st;
	o.head_chunk_rows = (int)pa->head_chunk;
	if (pa->gelu && (st = ng_step_parse_gelu_fusion(pa->gelu, &o.fuse_gelu)))
		return st;
	o.deterministic = pa->deterministic;
	if (pa->fp8_dw && !pa->fp8) {
		ng_fail(NG_ERR_INPUT, "--fp8-dw: weight gradients in FP8 need --fp8");
		ng_hint("add --fp8");
		return NG_ERR_INPUT;
	}
	o.fp8 = pa->fp8 ? NG_FP8_EVERY | (pa->fp8_dw ? NG_FP8_DW_ALL : 0) : 0;
	/* the speedrun model's head is FP8 both ways by default, as train makes it */
	if (shape->model.arch == NG_ARCH_SPEEDRUN)
		o.fp8 |= NG_FP8_HEAD | NG_FP8_HEAD_BWD;
	o.align = (size_t)pa->align;
	if (pa->align & (pa->align - 1))
		return ng_fail(NG_ERR_INPUT, "--align %lld is not a power of two", pa->align);
	if (strcmp(pa->step, "train") == 0 && o.recompute_auto) {
		size_t budget = (size_t)(pa->gpu_gib * GIB), free_b = 0, total_b = 0;
		if (!budget && ng_cuda_device_count() > 0 &&
		    cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
			budget = free_b;
		if (!budget) {
			ng_fail(NG_ERR_INPUT, "plan --recompute auto: how much memory to fit?");
			ng_hint("give --gpu-mem GIB (here the step's own bytes: train's --gpu-mem "
				"also counts the CUDA context, ~0.5 GiB)");
			return NG_ERR_INPUT;
		}
		return ng_step_fit_memory(g, &shape->model, shape->B, shape->T, shape->K, &o, budget);
	}
	if (strcmp(pa->step, "train") == 0)
		return ng_step_build_train(g, &shape->model, shape->B, shape->T, shape->K, &o);
	if (strcmp(pa->step, "eval") == 0)
		return ng_step_build_eval(g, &shape->model, shape->B, shape->T, shape->K, &o);
	if (strcmp(pa->step, "sample") == 0)
		return ng_step_build_sample(g, &shape->model, shape->B, shape->T, &o);
	ng_fail(NG_ERR_INPUT, "--step '%s' is not train, eval or sample", pa->step);
	ng_hint("use --step train (the default), eval or sample");
	return NG_ERR_INPUT;
}

/* Parse the command line, then build the planned step; *help when --help was shown (g empty).
 * On an error g is empty too. */
static enum ng_status parse_and_build(struct ng_command_spec *spec, int argc, char **argv,
				      const struct ng_model_args *ma, const struct plan_args *pa,
				      struct ng_shape *shape, struct ng_graph *g, bool *help)
{
	char *pos[1];
	int npos;
	ng_graph_init(g);
	enum ng_status st = ng_cli_parse(spec, argc, argv, pos, &npos, help);
	if (st || *help)
		return st;
	st = build(ma, pa, shape, g);
	if (st) /* a build that failed part way (--recompute auto out of budget) holds memory */
		ng_graph_free(g);
	return st;
}

/* The numbers plan reports. */
struct plan_summary {
	size_t params, grads, optimizer, metrics;  /* persistent, by role (params: the fp32 master
	                                            * as its bf16 copy + low half [+ E4M3]) */
	size_t activations, workspace, inputs;     /* live at the peak op, aligned */
	size_t activations_unshared;               /* every activation summed, as if no reuse */
	int peak_op;
};

static void summarize(const struct ng_graph *g, struct plan_summary *s)
{
	size_t by_role[NG_ROLE_COUNT];
	memset(s, 0, sizeof(*s));
	s->peak_op = ng_graph_peak(g, by_role);
	s->activations = by_role[NG_ROLE_ACTIVATION];
	s->workspace = by_role[NG_ROLE_SCRATCH];
	s->inputs = by_role[NG_ROLE_INPUT] + by_role[NG_ROLE_METRIC];
	s->params = ng_graph_role_bytes(g, NG_ROLE_PARAM) + ng_graph_role_bytes(g,
										  NG_ROLE_PARAM_BF16);
	s->grads = ng_graph_role_bytes(g, NG_ROLE_GRAD);
	s->optimizer = ng_graph_role_bytes(g, NG_ROLE_OPT_STATE);
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (t->persistent && t->role == NG_ROLE_METRIC)
			s->metrics += t->bytes;
		if (t->role == NG_ROLE_ACTIVATION)
			s->activations_unshared += t->bytes;
	}
}

/* Indices of the (up to) ten largest planned tensors, largest first. */
static int largest(const struct ng_graph *g, int *top)
{
	int n = 0;
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (t->persistent || t->first_op < 0)
			continue;
		int k;
		if (n < 10) {
			k = n++;
		} else if (g->tensors[top[9]].bytes >= t->bytes) {
			continue;
		} else {
			k = 9;
		}
		while (k > 0 && g->tensors[top[k - 1]].bytes < t->bytes) {
			top[k] = top[k - 1];
			k--;
		}
		top[k] = i;
	}
	return n;
}

static void print_text(const struct ng_graph *g, const struct ng_shape *sh,
		       const struct plan_args *pa, const struct plan_summary *s)
{
	const struct ng_gpt_config *c = &g->cfg;
	printf("%s step: L=%d H=%d C=%d T=%d V=%d (Vp %d), %zu parameters\n", pa->step, c->L, c->H,
	       c->C, c->T, c->V, c->Vp, g->lay.n_params);
	printf("batch: B=%d T=%d K=%d (%lld tokens per step)\n", sh->B, sh->T, sh->K,
	       (long long)sh->B * sh->T * sh->K);
	char what[96];
	printf("options: recompute %s%s, classifier chunk %d rows%s, GELU fused %s, fp8 %s, align "
	       "%zu B\n\n", ng_step_recompute_name(g, what, sizeof(what)),
	       strcmp(pa->recompute, "auto") ? "" : " (auto)", g->head_chunk_rows,
	       g->head_chunk_rows == g->B * g->T ? " (whole)" : "",
	       ng_step_gelu_fusion_name(g->fuse_gelu),
	       pa->fp8_dw ? "every kind (forward, dinp, dW)"
	       : pa->fp8 ? "every kind (forward, dinp)"
	       : g->fp8 & NG_FP8_HEAD_BWD ? "the head (forward E4M3, backward E5M2)" : "off",
	       g->align);
	printf("  %-34s %10.1f MiB\n",
	       g->fp8 && !g->recompute_fp8 ? "parameters (bf16 + low half + E4M3, W^T)"
					    : "parameters (bf16 + low half)",
	       s->params / MIB);
	printf("  %-34s %10.1f MiB\n", "gradients (fp32)", s->grads / MIB);
	printf("  %-34s %10.1f MiB\n", "optimizer state (AdamW m, v)", s->optimizer / MIB);
	printf("  %-34s %10.1f MiB\n", "activations (live at the peak)", s->activations / MIB);
	printf("  %-34s %10.1f MiB\n", "workspaces (live at the peak)", s->workspace / MIB);
	printf("  %-34s %10.1f MiB   (every activation, no reuse: %.1f MiB)\n",
	       "arena (planned region)", g->arena_bytes / MIB, s->activations_unshared / MIB);
	printf("  %-34s %10.1f MiB   (arena / bound = %.4f, peak at op %d: %s)\n", "lower bound",
	       g->lower_bound_bytes / MIB,
	       g->lower_bound_bytes ? (double)g->arena_bytes / (double)g->lower_bound_bytes : 1.0,
	       s->peak_op, s->peak_op >= 0 ? g->ops[s->peak_op].name : "-");
	printf("  %-34s %10.1f MiB = %.2f GiB\n\n", "total device memory (one arena)",
	       g->total_bytes / MIB, g->total_bytes / GIB);
	int top[10], n = largest(g, top);
	printf("ten largest planned tensors:\n");
	for (int k = 0; k < n; k++) {
		const struct ng_tensor *t = &g->tensors[top[k]];
		char shp[96];
		ng_dump_format_tensor(t, shp, sizeof(shp));
		printf("  %-28s %-24s %-10s %10.1f MiB  ops %d..%d\n", t->name, shp,
		       ng_role_name(t->role), t->bytes / MIB, t->first_op, t->last_op);
	}
}

static void print_json(const struct ng_graph *g, const struct ng_shape *sh,
		       const struct plan_args *pa, const struct plan_summary *s)
{
	printf("{\"step\":\"%s\",\"layers\":%d,\"heads\":%d,\"channels\":%d,\"seq_len\":%d,"
	       "\"vocab\":%d,\"padded_vocab\":%d,\"batch\":%d,\"micro_batches\":%d,"
	       "\"n_params\":%zu,\"recompute_gelu\":%d,\"recompute_layernorm\":%d,"
	       "\"recompute_fp8\":%d,\"keep_gelu\":%d,\"keep_layernorm\":%d,"
	       "\"head_chunk_rows\":%d,\"fuse_gelu\":%d,\"fp8\":%d,\"align\":%zu,", pa->step,
	       g->cfg.L, g->cfg.H, g->cfg.C, sh->T, g->cfg.V, g->cfg.Vp, sh->B, sh->K,
	       g->lay.n_params, g->recompute_gelu, g->recompute_layernorm, g->recompute_fp8,
	       g->keep_gelu, g->keep_layernorm,
	       g->head_chunk_rows,
	       g->fuse_gelu, pa->fp8 ? NG_FP8_EVERY | (g->fp8 & NG_FP8_DW_ALL) : 0, g->align);
	printf("\"arena_bytes\":%zu,\"lower_bound_bytes\":%zu,\"params_bytes\":%zu,"
	       "\"grads_bytes\":%zu,\"optimizer_bytes\":%zu,\"activations_bytes\":%zu,"
	       "\"workspace_bytes\":%zu,\"persistent_bytes\":%zu,\"total_bytes\":%zu,"
	       "\"activations_unshared_bytes\":%zu,\"peak_op\":%d,\"n_ops\":%d,\"n_tensors\":%d,",
	       g->arena_bytes, g->lower_bound_bytes, s->params, s->grads, s->optimizer,
	       s->activations, s->workspace, g->persistent_bytes, g->total_bytes,
	       s->activations_unshared, s->peak_op, g->n_ops, g->n_tensors);
	int top[10], n = largest(g, top);
	printf("\"largest\":[");
	for (int k = 0; k < n; k++) {
		const struct ng_tensor *t = &g->tensors[top[k]];
		printf("%s{\"name\":\"%s\",\"dtype\":\"%s\",\"shape\":[", k ? "," : "", t->name,
		       ng_dtype_name(t->dtype));
		for (int d = 0; d < t->ndim; d++)
			printf("%s%zu", d ? "," : "", t->shape[d]);
		printf("],\"role\":\"%s\",\"bytes\":%zu,\"offset\":%zu,\"first_op\":%d,"
		       "\"last_op\":%d}", ng_role_name(t->role), t->bytes, t->offset, t->first_op,
		       t->last_op);
	}
	printf("]}\n");
}

enum ng_status ng_cmd_plan(int argc, char **argv)
{
	struct ng_model_args ma;
	struct plan_args pa;
	bool json = false;
	struct ng_flag flags[NG_MODEL_NFLAGS + PLAN_NFLAGS + 1];
	ng_cli_model_flags(&ma, flags, "d12", 0);
	plan_flags(&pa, flags + NG_MODEL_NFLAGS);
	flags[NG_MODEL_NFLAGS + PLAN_NFLAGS] = (struct ng_flag){
		"--json", NG_FLAG_BOOL, &json, 0, 0, NULL, "print one JSON object", false };
	struct ng_command_spec spec = { "plan", "print the memory plan of a step (no GPU needed)",
					"[model] [batch] [--json] [--gpu-mem GIB] [options]", flags,
					(int)(sizeof(flags) / sizeof(flags[0])), 0 };
	bool help;
	struct ng_shape shape;
	struct ng_graph g;
	enum ng_status st = parse_and_build(&spec, argc, argv, &ma, &pa, &shape, &g, &help);
	if (st || help)
		return st;
	struct plan_summary s;
	summarize(&g, &s);
	if (json)
		print_json(&g, &shape, &pa, &s);
	else
		print_text(&g, &shape, &pa, &s);
	if (ng_cli_seen(&spec, "--gpu-mem")) {
		st = ng_plan_check_fit(g.total_bytes, (size_t)(pa.gpu_gib * GIB));
	} else if (ng_cuda_device_count() > 0) {
		size_t free_b = 0, total_b = 0;
		if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
			st = ng_plan_check_fit(g.total_bytes, free_b);
	}
	ng_graph_free(&g);
	return st;
}

/* On a GPU: plan, warm up and capture the real step, then write cudaGraphDebugDotPrint's
 * cuda_graph.dot and count the captured nodes by kind. */
static enum ng_status dump_cuda_graph(const struct ng_shape *shape, const struct ng_graph *g,
				       const char *out)
{
	struct ng_exec *e = calloc(1, sizeof(*e));
	if (!e)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	struct ng_exec_config c = { 0 };
	c.model = shape->model;
	c.B = shape->B;
	c.T = shape->T;
	c.K = shape->K;
	/* the same step as step.dot: the options the graph was built with */
	ng_step_default_options(&c.step);
	c.step.recompute_gelu = g->recompute_gelu;
	c.step.recompute_layernorm = g->recompute_layernorm;
	c.step.recompute_fp8 = g->recompute_fp8;
	c.step.keep_gelu = g->keep_gelu;
	c.step.keep_layernorm = g->keep_layernorm;
	c.step.head_chunk_rows = g->head_chunk_rows;
	c.step.fuse_gelu = g->fuse_gelu & ~NG_GELU_FUSE_AUTO; /* as drawn, not re-timed */
	c.step.fp8 = g->fp8;
	c.deterministic = g->deterministic;
	c.sched = (struct ng_schedule){ 6e-4f, 0.1f, 1, 2, 1 };
	c.clip = 1.0f;
	c.beta1 = 0.9f;
	c.beta2 = 0.95f;
	c.eps = 1e-8f;
	c.seed = 1;
	char path[4096], text[256];
	snprintf(path, sizeof(path), "%s/cuda_graph.dot", out);
	enum ng_status st = ng_exec_init(e, &c, NULL);
	if (!st)
		st = ng_exec_dump_cuda_graph(e, path, text, sizeof(text));
	if (!st)
		fprintf(stderr, "dump: wrote %s: the captured step has %s\n", path, text);
	ng_exec_free(e);
	free(e);
	return st;
}

enum ng_status ng_cmd_dump(int argc, char **argv)
{
	struct ng_model_args ma;
	struct plan_args pa;
	const char *out = NULL;
	struct ng_flag flags[NG_MODEL_NFLAGS + PLAN_NFLAGS + 1];
	ng_cli_model_flags(&ma, flags, "d12", 0);
	plan_flags(&pa, flags + NG_MODEL_NFLAGS);
	flags[NG_MODEL_NFLAGS + PLAN_NFLAGS] = (struct ng_flag){
		"--out", NG_FLAG_STRING, &out, 0, 0, "DIR",
		"folder for step.dot and arena.svg (created if missing)", false };
	struct ng_command_spec spec = { "dump", "write the step as Graphviz DOT and the arena as SVG",
					"[model] [batch] --out DIR [options]", flags,
					(int)(sizeof(flags) / sizeof(flags[0])), 0 };
	bool help;
	struct ng_shape shape;
	struct ng_graph g;
	enum ng_status st = parse_and_build(&spec, argc, argv, &ma, &pa, &shape, &g, &help);
	if (st || help)
		return st;
	if (!out) {
		ng_graph_free(&g);
		ng_fail(NG_ERR_INPUT, "dump: --out DIR is required");
		ng_hint("nanograph dump --model tiny --batch 2 --out dump/");
		return NG_ERR_INPUT;
	}
	st = ng_dump_write_all(&g, out);
	if (!st)
		fprintf(stderr, "dump: wrote %s/step.dot (%d ops, %d tensors) and %s/arena.svg "
			"(arena %.1f MiB, lower bound %.1f MiB)\n", out, g.n_ops, g.n_tensors, out,
			g.arena_bytes / MIB, g.lower_bound_bytes / MIB);
	if (!st && ng_cuda_device_count() > 0)
		st = dump_cuda_graph(&shape, &g, out);
	ng_graph_free(&g);
	return st;
}
