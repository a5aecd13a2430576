/*
 * graph/ir.c — the step IR's bookkeeping: adding tensors and ops, names, lifetimes, placing the
 * persistent tensors and handing the rest to the arena planner, and validating the result.
 * See graph/ir.h for the meaning of every field and op kind.
 */
#include "graph/ir.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc/planner.h"

size_t ng_dtype_size(enum ng_dtype dt)
{
	static const size_t sz[NG_DTYPE_COUNT] = { 2, 4, 4, 2, 1 };
	return (unsigned)dt < NG_DTYPE_COUNT ? sz[dt] : 0;
}

const char *ng_dtype_name(enum ng_dtype dt)
{
	static const char *n[NG_DTYPE_COUNT] = { "bf16", "f32", "i32", "u16", "u8" };
	return (unsigned)dt < NG_DTYPE_COUNT ? n[dt] : "?";
}

const char *ng_role_name(enum ng_role role)
{
	static const char *n[NG_ROLE_COUNT] = { "param", "param_bf16", "grad", "opt_state",
						"activation", "scratch", "input", "metric" };
	return (unsigned)role < NG_ROLE_COUNT ? n[role] : "?";
}

const char *ng_op_kind_name(enum ng_op_kind kind)
{
	static const char *n[NG_OP_KIND_COUNT] = {
		"tokens_h2d", "tokens_split", "zero", "encoder_fwd", "layernorm_fwd",
		"matmul_fwd", "gelu_fwd", "attention_fwd",
		"crossentropy", "loss_accumulate", "matmul_dinp", "matmul_dw", "gelu_bwd",
		"attention_bwd", "layernorm_bwd", "encoder_bwd", "grad_norm", "schedule", "adamw",
		"step_finish", "gather_rows", "logits_out", "fp8_prep",
		"encoder_sort", "transpose_w", "muon", "scalars", "attn_bounds", "embed_fwd",
		"embed_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "qk_rotary_fwd", "qk_rotary_bwd",
		"mix_fwd", "mix_bwd", "add", "relu2_fwd", "relu2_bwd", "softcap_ce",
	};
	return (unsigned)kind < NG_OP_KIND_COUNT ? n[kind] : "?";
}

const char *ng_op_which_name(enum ng_op_which which)
{
	static const char *n[NG_OP_WHICH_COUNT] = { "", "ln1", "ln2", "lnf", "qkv", "attproj",
						    "fc", "fcproj", "head", "xmix", "vmix",
						    "skip" };
	return (unsigned)which < NG_OP_WHICH_COUNT ? n[which] : "?";
}

const char *ng_phase_name(enum ng_phase phase)
{
	static const char *n[NG_PHASE_COUNT] = { "input", "forward", "loss", "backward",
						 "optimizer" };
	return (unsigned)phase < NG_PHASE_COUNT ? n[phase] : "?";
}

void ng_graph_init(struct ng_graph *g)
{
	memset(g, 0, sizeof(*g));
	g->t_params_lo = g->t_params_bf16 = g->t_grads = g->t_adam_m = g->t_adam_v = -1;
	g->t_step_state = g->t_tokens = g->t_eval_loss = g->t_eval_window = g->t_logits_out = -1;
	g->t_params_fp8 = g->t_fp8_state = g->t_params_fp8t = -1;
	g->align = NG_ARENA_ALIGN;
}

void ng_graph_free(struct ng_graph *g)
{
	free(g->tensors);
	free(g->ops);
	ng_graph_init(g);
}

/* Grow an array of `elem`-byte entries to hold at least `need`; false when out of memory. */
static bool grow(void **arr, int *cap, int need, size_t elem)
{
	if (need <= *cap)
		return true;
	int ncap = *cap ? *cap * 2 : 256;
	while (ncap < need)
		ncap *= 2;
	void *p = realloc(*arr, (size_t)ncap * elem);
	if (!p)
		return false;
	*arr = p;
	*cap = ncap;
	return true;
}

int ng_graph_add_tensor(struct ng_graph *g, const char *name, enum ng_dtype dt, enum ng_role role,
			bool persistent, int ndim, const size_t *shape, size_t bytes)
{
	if (g->status)
		return -1;
	if (ndim < 1 || ndim > 4) {
		g->status = ng_fail(NG_ERR_RUNTIME, "graph: tensor %s has %d dimensions (1..4)", name,
				    ndim);
		return -1;
	}
	if (!grow((void **)&g->tensors, &g->cap_tensors, g->n_tensors + 1, sizeof(*g->tensors))) {
		g->status = ng_fail(NG_ERR_RUNTIME, "graph: out of host memory adding tensor %s",
				    name);
		return -1;
	}
	struct ng_tensor *t = &g->tensors[g->n_tensors];
	memset(t, 0, sizeof(*t));
	snprintf(t->name, sizeof(t->name), "%s", name);
	t->dtype = dt;
	t->ndim = ndim;
	size_t numel = 1;
	for (int i = 0; i < 4; i++) {
		t->shape[i] = i < ndim ? shape[i] : 1;
		numel *= t->shape[i];
	}
	t->bytes = bytes ? bytes : numel * ng_dtype_size(dt);
	t->role = role;
	t->persistent = persistent;
	t->first_op = t->last_op = -1;
	return g->n_tensors++;
}

struct ng_op ng_op_blank(enum ng_op_kind kind)
{
	struct ng_op op;
	memset(&op, 0, sizeof(op));
	op.kind = kind;
	op.scratch = -1;
	op.param[0] = op.param[1] = -1;
	op.layer = op.micro = op.chunk = -1;
	return op;
}

int ng_graph_add_op(struct ng_graph *g, const struct ng_op *op)
{
	if (g->status)
		return -1;
	if (!grow((void **)&g->ops, &g->cap_ops, g->n_ops + 1, sizeof(*g->ops))) {
		g->status = ng_fail(NG_ERR_RUNTIME, "graph: out of host memory adding op %s",
				    op->name);
		return -1;
	}
	g->ops[g->n_ops] = *op;
	return g->n_ops++;
}

int ng_graph_find_tensor(const struct ng_graph *g, const char *name)
{
	for (int i = 0; i < g->n_tensors; i++)
		if (strcmp(g->tensors[i].name, name) == 0)
			return i;
	return -1;
}

static void touch(struct ng_graph *g, int t, int op)
{
	if (t < 0 || t >= g->n_tensors)
		return;
	struct ng_tensor *x = &g->tensors[t];
	if (x->first_op < 0 || op < x->first_op)
		x->first_op = op;
	if (op > x->last_op)
		x->last_op = op;
}

void ng_graph_compute_lifetimes(struct ng_graph *g)
{
	for (int i = 0; i < g->n_tensors; i++)
		g->tensors[i].first_op = g->tensors[i].last_op = -1;
	for (int k = 0; k < g->n_ops; k++) {
		const struct ng_op *op = &g->ops[k];
		for (int j = 0; j < op->n_in; j++)
			touch(g, op->in[j], k);
		for (int j = 0; j < op->n_out; j++)
			touch(g, op->out[j], k);
		touch(g, op->scratch, k);
	}
}

static size_t align_up(size_t x, size_t a)
{
	return (x + a - 1) / a * a;
}

enum ng_status ng_graph_plan(struct ng_graph *g, size_t align)
{
	if (g->status)
		return g->status;
	if (align == 0)
		align = NG_ARENA_ALIGN;
	if (align & (align - 1))
		return ng_fail(NG_ERR_INPUT, "arena alignment %zu is not a power of two", align);
	g->align = align;
	ng_graph_compute_lifetimes(g);

	/* persistent tensors first, in declaration order, never reused */
	size_t off = 0;
	int n_planned = 0;
	for (int i = 0; i < g->n_tensors; i++) {
		struct ng_tensor *t = &g->tensors[i];
		if (t->persistent) {
			t->offset = off;
			off += align_up(t->bytes, align);
		} else if (t->first_op >= 0) {
			n_planned++;
		}
	}
	g->persistent_bytes = off;

	struct ng_interval *iv = malloc(sizeof(*iv) * (size_t)(n_planned ? n_planned : 1));
	int *idx = malloc(sizeof(*idx) * (size_t)(n_planned ? n_planned : 1));
	if (!iv || !idx) {
		free(iv);
		free(idx);
		return ng_fail(NG_ERR_RUNTIME, "graph: out of host memory planning %d tensors",
			       n_planned);
	}
	int n = 0;
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (t->persistent || t->first_op < 0)
			continue;
		iv[n] = (struct ng_interval){ t->bytes, t->first_op, t->last_op, 0 };
		idx[n++] = i;
	}
	size_t arena = 0;
	enum ng_status st = ng_arena_plan(iv, n, align, &arena);
	if (st == NG_OK) {
		for (int j = 0; j < n; j++)
			g->tensors[idx[j]].offset = g->persistent_bytes + iv[j].offset;
		/* tensors no op touches get no memory; park them at the region start, size 0 use */
		for (int i = 0; i < g->n_tensors; i++)
			if (!g->tensors[i].persistent && g->tensors[i].first_op < 0)
				g->tensors[i].offset = g->persistent_bytes;
		g->arena_bytes = arena;
		g->lower_bound_bytes = ng_arena_lower_bound(iv, n, align);
		g->total_bytes = g->persistent_bytes + arena;
	}
	free(iv);
	free(idx);
	return st;
}

enum ng_status ng_graph_validate(const struct ng_graph *g)
{
	for (int k = 0; k < g->n_ops; k++) {
		const struct ng_op *op = &g->ops[k];
		if (op->n_in < 0 || op->n_in > NG_OP_MAX_IO || op->n_out < 0 ||
		    op->n_out > NG_OP_MAX_IO)
			return ng_fail(NG_ERR_RUNTIME, "graph: op %d (%s) has %d inputs, %d outputs",
				       k, op->name, op->n_in, op->n_out);
		for (int j = 0; j < op->n_in + op->n_out; j++) {
			int t = j < op->n_in ? op->in[j] : op->out[j - op->n_in];
			if (t < 0 || t >= g->n_tensors)
				return ng_fail(NG_ERR_RUNTIME, "graph: op %d (%s) names tensor %d "
					       "of %d", k, op->name, t, g->n_tensors);
		}
		if (op->scratch >= g->n_tensors)
			return ng_fail(NG_ERR_RUNTIME, "graph: op %d (%s) scratch %d of %d", k,
				       op->name, op->scratch, g->n_tensors);
	}
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (t->first_op >= 0 && t->offset + t->bytes > g->total_bytes)
			return ng_fail(NG_ERR_RUNTIME, "graph: tensor %s [%zu, +%zu) ends past the "
				       "arena (%zu bytes)", t->name, t->offset, t->bytes,
				       g->total_bytes);
		if (t->persistent && t->offset + t->bytes > g->persistent_bytes)
			return ng_fail(NG_ERR_RUNTIME, "graph: persistent tensor %s leaves the "
				       "persistent region", t->name);
		if (!t->persistent && t->first_op >= 0 && t->offset < g->persistent_bytes)
			return ng_fail(NG_ERR_RUNTIME, "graph: tensor %s is placed inside the "
				       "persistent region", t->name);
	}
	/* the planned region: re-check overlaps with the planner's validator */
	int n = 0;
	for (int i = 0; i < g->n_tensors; i++)
		n += !g->tensors[i].persistent && g->tensors[i].first_op >= 0;
	struct ng_interval *iv = malloc(sizeof(*iv) * (size_t)(n ? n : 1));
	if (!iv)
		return ng_fail(NG_ERR_RUNTIME, "graph: out of host memory validating");
	n = 0;
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (t->persistent || t->first_op < 0)
			continue;
		iv[n++] = (struct ng_interval){ t->bytes, t->first_op, t->last_op,
						t->offset - g->persistent_bytes };
	}
	enum ng_status st = ng_arena_validate(iv, n, g->align, g->arena_bytes);
	free(iv);
	return st;
}

size_t ng_graph_role_bytes(const struct ng_graph *g, enum ng_role role)
{
	size_t s = 0;
	for (int i = 0; i < g->n_tensors; i++)
		if (g->tensors[i].role == role)
			s += g->tensors[i].bytes;
	return s;
}

int ng_graph_peak(const struct ng_graph *g, size_t *by_role)
{
	for (int r = 0; r < NG_ROLE_COUNT; r++)
		by_role[r] = 0;
	if (g->n_ops == 0)
		return -1;
	size_t align = g->align ? g->align : NG_ARENA_ALIGN;
	/* difference array of live aligned bytes per op */
	long long *d = calloc((size_t)g->n_ops + 1, sizeof(long long));
	if (!d)
		return -1;
	bool any = false;
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (t->persistent || t->first_op < 0)
			continue;
		long long s = (long long)align_up(t->bytes, align);
		d[t->first_op] += s;
		d[t->last_op + 1] -= s;
		any = true;
	}
	int peak_op = 0;
	long long live = 0, peak = -1;
	for (int k = 0; k < g->n_ops; k++) {
		live += d[k];
		if (live > peak) {
			peak = live;
			peak_op = k;
		}
	}
	free(d);
	if (!any)
		return -1;
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (!t->persistent && t->first_op >= 0 && t->first_op <= peak_op &&
		    peak_op <= t->last_op)
			by_role[t->role] += align_up(t->bytes, align);
	}
	return peak_op;
}

enum ng_status ng_plan_check_fit(size_t total_bytes, size_t gpu_bytes)
{
	if (total_bytes <= gpu_bytes)
		return NG_OK;
	const double gib = 1024.0 * 1024.0 * 1024.0;
	ng_fail(NG_ERR_INPUT, "the step needs %.2f GiB of device memory but the GPU has %.2f GiB "
		"(%.2f GiB short)", total_bytes / gib, gpu_bytes / gib,
		(total_bytes - gpu_bytes) / gib);
	ng_hint("recompute (--recompute auto: as little as fits; or gelu,layernorm, and with "
		"--fp8 also fp8), chunk the classifier more finely (--head-chunk 4096), or halve "
		"--batch and keep the tokens per step with --total-batch; nanograph plan shows each "
		"effect");
	return NG_ERR_INPUT;
}
