/*
 * tests/test_step.c — the step builder (graph/step.c) and the IR bookkeeping (graph/ir.c):
 * op order as docs/DESIGN.md gives it, op counts per kind, dataflow (every tensor is written
 * before it is read; every training activation is read), shapes and bytes, the chunked classifier
 * (row ranges cover B*T exactly; no two logits chunks live at once), recompute (the stored tensor
 * dies in the forward and a recompute op feeds the backward; memory goes down), the persistent
 * region identical across train/eval/sample, parameter ids per `which`, and bad sizes as errors.
 * Random small shapes and options each run; the seed is in every message.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/exec.h"
#include "graph/step.h"
#include "util/rng.h"

static uint64_t seed_;
static struct ng_rng rng_;

static void setup_(void)
{
	seed_ = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
	ng_rng_seed(&rng_, seed_);
}

/* --fp8 needs C % 16 == 0: double C (H x 8 x m) when it is not. */
static void fp8_fit(struct ng_gpt_config *c)
{
	if (c->C % 16) {
		c->C *= 2;
		cr_assert_eq(ng_gpt_check(c), NG_OK, "%s", ng_error_message());
	}
}

/* A random small configuration and options. */
/* Whether layer l of L recomputes (its option on, not one of the last `keep`), and how many do. */
static int re_(int on, int keep, int L, int l)
{
	return on && l < L - keep;
}

static int n_re_(int on, int keep, int L)
{
	return on ? L - (keep < L ? keep : L) : 0;
}

static void random_case(struct ng_gpt_config *c, int *B, int *T, int *K,
			struct ng_step_options *o)
{
	static const int heads[] = { 1, 2, 3, 4 };
	memset(c, 0, sizeof(*c));
	c->L = 1 + (int)ng_rng_below(&rng_, 4);
	c->H = heads[ng_rng_below(&rng_, 4)];
	c->C = c->H * 8 * (1 + (int)ng_rng_below(&rng_, 4));
	c->T = 8 + (int)ng_rng_below(&rng_, 64);
	c->V = 2 + (int)ng_rng_below(&rng_, 1000);
	cr_assert_eq(ng_gpt_check(c), NG_OK, "seed %llu: %s", (unsigned long long)seed_,
		     ng_error_message());
	*B = 1 + (int)ng_rng_below(&rng_, 4);
	*T = 1 + (int)ng_rng_below(&rng_, (uint64_t)c->T);
	*K = 1 + (int)ng_rng_below(&rng_, 3);
	ng_step_default_options(o);
	o->recompute_gelu = (int)ng_rng_below(&rng_, 2);
	o->recompute_layernorm = (int)ng_rng_below(&rng_, 2);
	o->recompute_fp8 = (int)ng_rng_below(&rng_, 2);
	/* --recompute auto's finer steps: the last keep_* layers keep their outputs */
	o->keep_gelu = ng_rng_below(&rng_, 2) ? (int)ng_rng_below(&rng_, (uint64_t)c->L + 2) : 0;
	o->keep_layernorm = ng_rng_below(&rng_, 2) ? (int)ng_rng_below(&rng_, (uint64_t)c->L + 2)
						   : 0;
	o->fuse_gelu = (int)ng_rng_below(&rng_, 4);
	if ((o->fuse_gelu & NG_GELU_FUSE_BWD) && ng_rng_below(&rng_, 2))
		o->fuse_gelu |= NG_GELU_FUSE_OWN; /* the DGELU on our own GEMM */
	o->deterministic = (int)ng_rng_below(&rng_, 2);
	o->fp8 = (int)ng_rng_below(&rng_, 33); /* NG_FP8_* bits, 32 = AUTO alone: none */
	o->fp8 |= (int)ng_rng_below(&rng_, 16) << NG_FP8_DINP_SHIFT;
	o->fp8 |= (int)ng_rng_below(&rng_, 16) << NG_FP8_DW_SHIFT;
	if (o->fp8 & NG_FP8_EVERY)
		fp8_fit(c);
	o->head_chunk_rows = ng_rng_below(&rng_, 3) == 0 ? 0
							  : 1 + (int)ng_rng_below(&rng_, (uint64_t)(*B * *T));
}

static int count_kind(const struct ng_graph *g, enum ng_op_kind k)
{
	int n = 0;
	for (int i = 0; i < g->n_ops; i++)
		n += g->ops[i].kind == k;
	return n;
}

/* Every tensor's first touch writes it (inputs come from TOKENS_H2D; persistent tensors hold
 * state between steps and are exempt). */
static void check_dataflow(const struct ng_graph *g, const char *what)
{
	char *written = calloc((size_t)g->n_tensors, 1);
	cr_assert(written);
	for (int k = 0; k < g->n_ops; k++) {
		const struct ng_op *op = &g->ops[k];
		for (int j = 0; j < op->n_in; j++) {
			const struct ng_tensor *t = &g->tensors[op->in[j]];
			cr_assert(t->persistent || written[op->in[j]],
				  "seed %llu %s: op %d %s reads %s before any op writes it",
				  (unsigned long long)seed_, what, k, op->name, t->name);
		}
		for (int j = 0; j < op->n_out; j++)
			written[op->out[j]] = 1;
	}
	free(written);
}

static void check_shapes(const struct ng_graph *g, const char *what)
{
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		size_t numel = 1;
		for (int d = 0; d < 4; d++)
			numel *= t->shape[d];
		if (t->role != NG_ROLE_SCRATCH)
			cr_assert_eq(t->bytes, numel * ng_dtype_size(t->dtype),
				     "seed %llu %s: %s has %zu bytes for %zu elements",
				     (unsigned long long)seed_, what, t->name, t->bytes, numel);
		cr_assert_gt(t->bytes, 0, "seed %llu %s: %s is empty", (unsigned long long)seed_,
			     what, t->name);
		for (int j = 0; j < i && i < 400; j++)
			cr_assert_str_neq(t->name, g->tensors[j].name, "seed %llu %s: name %s twice",
					  (unsigned long long)seed_, what, t->name);
	}
}

/* Every parameter's gradient (each layer's slice) is first zeroed or overwritten by a dW matmul
 * marked `overwrite`, and only then added into; at the end every slice was defined. */
static void check_gradient_writes(const struct ng_graph *g, const char *what)
{
	int L = g->cfg.L;
	bool *ready = calloc((size_t)NG_P_COUNT * (size_t)L, sizeof(bool));
	for (int k = 0; k < g->n_ops; k++) {
		const struct ng_op *op = &g->ops[k];
		/* the fc bias: GELU_BWD's param[0], or our own GEMM's DINP's param[1] (its param[0]
		 * is the W it reads) */
		bool own = op->kind == NG_OP_MATMUL_DINP && op->own;
		bool sums = (op->kind == NG_OP_GELU_BWD && op->param[0] >= 0) || own;
		bool writes = op->kind == NG_OP_ZERO ? op->param[0] >= 0
			      : op->kind == NG_OP_MATMUL_DW || op->kind == NG_OP_LAYERNORM_BWD ||
					op->kind == NG_OP_ENCODER_BWD || sums;
		if (!writes)
			continue;
		for (int j = own ? 1 : 0; j < 2; j++) {
			int p = op->param[j];
			if (p < 0)
				continue;
			bool per_layer = g->lay.p[p].per_layer;
			int lo = per_layer && op->layer >= 0 ? op->layer : 0;
			int hi = per_layer && op->layer >= 0 ? op->layer + 1 : (per_layer ? L : 1);
			for (int l = lo; l < hi; l++) {
				bool *r = &ready[p * L + l];
				if (op->kind == NG_OP_ZERO ||
				    ((op->kind == NG_OP_MATMUL_DW || sums) && op->overwrite))
					*r = true;
				else
					cr_assert(*r, "seed %llu %s: %s adds into the %s gradient (layer %d) "
						  "before anything defined it", (unsigned long long)seed_,
						  what, op->name, g->lay.p[p].name, l);
			}
			if (op->kind == NG_OP_MATMUL_DW || sums)
				cr_assert_eq(op->overwrite, op->micro <= 0 && op->chunk <= 0,
					     "seed %llu %s: %s", (unsigned long long)seed_, what,
					     op->name);
		}
	}
	for (int p = 0; p < NG_P_COUNT; p++)
		for (int l = 0; ng_param_present(&g->lay.p[p]) && l < (g->lay.p[p].per_layer ? L : 1);
		     l++)
			cr_assert(ready[p * L + l], "seed %llu %s: the %s gradient (layer %d) is never "
				  "written", (unsigned long long)seed_, what, g->lay.p[p].name, l);
	free(ready);
}

Test(step, random_train_graphs_are_well_formed, .init = setup_)
{
	for (int rep = 0; rep < 200; rep++) {
		struct ng_gpt_config c;
		struct ng_step_options o;
		int B, T, K;
		random_case(&c, &B, &T, &K, &o);
		char what[160];
		snprintf(what, sizeof(what), "L=%d H=%d C=%d V=%d B=%d T=%d K=%d rg=%d/%d rl=%d/%d "
			 "fuse=%d chunk=%d", c.L, c.H, c.C, c.V, B, T, K, o.recompute_gelu,
			 o.keep_gelu, o.recompute_layernorm, o.keep_layernorm, o.fuse_gelu,
			 o.head_chunk_rows);
		struct ng_graph g;
		cr_assert_eq(ng_step_build_train(&g, &c, B, T, K, &o), NG_OK, "seed %llu %s: %s",
			     (unsigned long long)seed_, what, ng_error_message());
		cr_assert_eq(ng_graph_validate(&g), NG_OK, "seed %llu %s: %s",
			     (unsigned long long)seed_, what, ng_error_message());
		check_dataflow(&g, what);
		check_shapes(&g, what);
		int N = B * T, L = c.L, chunk = g.head_chunk_rows, nch = (N + chunk - 1) / chunk;
		cr_assert(chunk >= 1 && chunk <= N);
		/* order: h2d, zero the accumulated gradients, ..., norm, schedule, adamw, finish */
		cr_assert_eq(g.ops[0].kind, NG_OP_TOKENS_H2D);
		cr_assert_eq(g.ops[1].kind, NG_OP_ZERO);
		cr_assert_eq(g.ops[1].out[0], g.t_grads);
		check_gradient_writes(&g, what);
		cr_assert_eq(g.ops[g.n_ops - 4].kind, NG_OP_GRAD_NORM);
		cr_assert_eq(g.ops[g.n_ops - 3].kind, NG_OP_SCHEDULE);
		cr_assert_eq(g.ops[g.n_ops - 2].kind, NG_OP_ADAMW);
		cr_assert_eq(g.ops[g.n_ops - 1].kind, NG_OP_STEP_FINISH);
		/* counts per kind */
		cr_assert_eq(count_kind(&g, NG_OP_TOKENS_SPLIT), K, "seed %llu %s",
			     (unsigned long long)seed_, what);
		cr_assert_eq(count_kind(&g, NG_OP_MATMUL_FWD), K * (4 * L + nch), "seed %llu %s",
			     (unsigned long long)seed_, what);
		cr_assert_eq(count_kind(&g, NG_OP_MATMUL_DW), K * (4 * L + nch));
		cr_assert_eq(count_kind(&g, NG_OP_MATMUL_DINP), K * (4 * L + nch));
		cr_assert_eq(count_kind(&g, NG_OP_CROSSENTROPY), K * nch);
		cr_assert_eq(count_kind(&g, NG_OP_ATTENTION_FWD), K * L);
		cr_assert_eq(count_kind(&g, NG_OP_ATTENTION_BWD), K * L);
		cr_assert_eq(count_kind(&g, NG_OP_LAYERNORM_BWD), K * (2 * L + 1));
		/* the residual adds are in the attproj and fcproj epilogues: plain LayerNorms */
		cr_assert_eq(count_kind(&g, NG_OP_LAYERNORM_FWD),
			     K * (2 * L + 1 + 2 * n_re_(o.recompute_layernorm, o.keep_layernorm, L)),
			     "seed %llu %s", (unsigned long long)seed_, what);
		for (int i = 0; i < g.n_ops; i++) {
			const struct ng_op *op = &g.ops[i];
			int proj = op->kind == NG_OP_MATMUL_FWD &&
				   (op->which == NG_OP_WHICH_ATTPROJ || op->which == NG_OP_WHICH_FCPROJ);
			cr_assert_eq(op->residual, proj, "%s", op->name);
			if (!proj)
				continue;
			/* the residual: the block input (attproj) or resid1 (fcproj), read last; the
			 * output is the next residual stream, a different tensor */
			const struct ng_tensor *r = &g.tensors[op->in[op->n_in - 1]];
			const struct ng_tensor *o2 = &g.tensors[op->out[0]];
			cr_assert(op->in[op->n_in - 1] != op->out[0], "%s", op->name);
			cr_assert(r->bytes == o2->bytes && r->dtype == NG_DTYPE_BF16, "%s: %s", op->name,
				  r->name);
			cr_assert(strstr(o2->name, op->which == NG_OP_WHICH_ATTPROJ ? "resid1"
										    : "resid2"),
				  "%s writes %s", op->name, o2->name);
		}
		/* unfused DGELU: GELU_BWD recomputes the activation (--recompute gelu) and sums the
		 * fc bias gradient, which the fc dW then leaves out */
		const int fused_bwd = (o.fuse_gelu & NG_GELU_FUSE_BWD) != 0;
		const int own = (o.fuse_gelu & NG_GELU_FUSE_OWN) &&
				!(g.fp8 & ng_fp8_dinp_bit(NG_OP_WHICH_FCPROJ));
		cr_assert_eq(count_kind(&g, NG_OP_GELU_FWD),
			     K * (L * (o.fuse_gelu & NG_GELU_FUSE_FWD ? 0 : 1) +
				  (fused_bwd && !own ? n_re_(o.recompute_gelu, o.keep_gelu, L) : 0)),
			     "seed %llu %s", (unsigned long long)seed_, what);
		cr_assert_eq(count_kind(&g, NG_OP_GELU_BWD), fused_bwd ? 0 : K * L);
		cr_assert_eq(count_kind(&g, NG_OP_TRANSPOSE_W), own ? K : 0);
		for (int k = 0; k < g.n_ops; k++) {
			const struct ng_op *op = &g.ops[k];
			const int re = re_(o.recompute_gelu, o.keep_gelu, L, op->layer);
			if (op->kind == NG_OP_GELU_BWD) {
				cr_assert_eq(op->param[0], NG_P_FCB, "seed %llu %s",
					     (unsigned long long)seed_, what);
				cr_assert_eq(op->n_out, re ? 3 : 2, "seed %llu %s: %s",
					     (unsigned long long)seed_, what, op->name);
				cr_assert_gt(op->scratch, -1);
			}
			if (op->kind == NG_OP_MATMUL_DW && op->which == NG_OP_WHICH_FC)
				cr_assert_eq(op->param[1], fused_bwd && !own ? NG_P_FCB : -1);
			/* the fcproj dW reads the recomputed activation, or the forward's kept one */
			if (op->kind == NG_OP_MATMUL_DW && op->which == NG_OP_WHICH_FCPROJ) {
				const char *in = g.tensors[op->in[1]].name;
				cr_assert_eq(strstr(in, "fch_gelu.re") != NULL, re, "seed %llu %s: %s reads %s",
					     (unsigned long long)seed_, what, op->name, in);
			}
			/* the qkv and fc dW: a recomputed LayerNorm output, or the kept one */
			if (op->kind == NG_OP_MATMUL_DW &&
			    (op->which == NG_OP_WHICH_QKV || op->which == NG_OP_WHICH_FC)) {
				const char *in = g.tensors[op->in[1]].name;
				cr_assert_eq(strstr(in, ".re") != NULL,
					     re_(o.recompute_layernorm, o.keep_layernorm, L, op->layer),
					     "seed %llu %s: %s reads %s", (unsigned long long)seed_, what,
					     op->name, in);
			}
			/* own: the fcproj dinp on our GEMM (bf16), writing the recomputed
			 * activation that the fcproj dW right after it reads */
			if (op->kind == NG_OP_MATMUL_DINP) {
				const int mine = own && op->which == NG_OP_WHICH_FCPROJ;
				cr_assert_eq(op->own, mine, "seed %llu %s: %s",
					     (unsigned long long)seed_, what, op->name);
				if (mine) {
					cr_assert_eq(op->fp8, 0);
					cr_assert_eq(op->n_in, 3);
					/* W^T from the micro-batch's TRANSPOSE_W, long before */
					const struct ng_op *tw = &g.ops[g.tensors[op->in[1]].first_op];
					cr_assert(tw->kind == NG_OP_TRANSPOSE_W && tw->micro == op->micro &&
						  tw->param[0] == NG_P_FCPROJW, "seed %llu %s: %s reads %s",
						  (unsigned long long)seed_, what, op->name,
						  g.tensors[op->in[1]].name);
					cr_assert_eq(g.tensors[op->in[1]].shape[0], (size_t)L);
					/* dfch, the fc bias gradient (first writer: "="), post */
					cr_assert_eq(op->n_out, re ? 3 : 2, "seed %llu %s: %s",
						     (unsigned long long)seed_, what, op->name);
					cr_assert_eq(op->out[1], g.t_grads);
					cr_assert_eq(op->param[1], NG_P_FCB);
					cr_assert_eq(op->overwrite, op->micro == 0);
					const struct ng_op *dw = &g.ops[k + 1];
					cr_assert(dw->kind == NG_OP_MATMUL_DW &&
						  dw->which == NG_OP_WHICH_FCPROJ && dw->layer == op->layer);
					if (re)
						cr_assert_eq(dw->in[1], op->out[2]);
				}
			}
		}
		cr_assert_eq(count_kind(&g, NG_OP_LOSS_ACCUMULATE), K);
		cr_assert_eq(count_kind(&g, NG_OP_ENCODER_BWD), K);
		cr_assert_eq(count_kind(&g, NG_OP_ENCODER_SORT), K);
		/* ENCODER_SORT runs on a second stream until its micro-batch's ENCODER_BWD joins it:
		 * what it reads and writes must stay live (unshared) until that op */
		for (int k = 0; k < g.n_ops; k++) {
			const struct ng_op *so = &g.ops[k];
			if (so->kind != NG_OP_ENCODER_SORT)
				continue;
			int j = k + 1;
			while (j < g.n_ops && !(g.ops[j].kind == NG_OP_ENCODER_BWD &&
						g.ops[j].micro == so->micro))
				j++;
			cr_assert_lt(j, g.n_ops, "seed %llu %s: %s has no ENCODER_BWD after it",
				     (unsigned long long)seed_, what, so->name);
			cr_assert(g.ops[k - 1].kind == NG_OP_TOKENS_SPLIT, "seed %llu %s: %s not right "
				  "after the token split", (unsigned long long)seed_, what, so->name);
			const struct ng_tensor *in = &g.tensors[so->in[0]], *out = &g.tensors[so->out[0]];
			cr_assert(in->last_op >= j && out->last_op >= j,
				  "seed %llu %s: %s's input (last op %d) or output (last op %d) dies "
				  "before its join at op %d", (unsigned long long)seed_, what, so->name,
				  in->last_op, out->last_op, j);
		}
		cr_assert_eq(count_kind(&g, NG_OP_ZERO), 7 + K); /* 7 grad ranges, dresid per micro */
		/* per op: row ranges of the head cover [0, N) in order; params match which */
		int next_row = 0, logits_live = 0;
		for (int k = 0; k < g.n_ops; k++) {
			const struct ng_op *op = &g.ops[k];
			if (op->kind == NG_OP_MATMUL_FWD && op->which == NG_OP_WHICH_HEAD) {
				if (op->row_start == 0)
					next_row = 0;
				cr_assert_eq(op->row_start, next_row, "seed %llu %s: op %s",
					     (unsigned long long)seed_, what, op->name);
				cr_assert(op->row_count >= 1 && op->row_count <= chunk);
				next_row += op->row_count;
				const struct ng_tensor *lg = &g.tensors[op->out[0]];
				cr_assert_eq(lg->shape[0], (size_t)op->row_count);
				cr_assert_eq(lg->shape[1], (size_t)c.Vp);
				cr_assert_eq(op->param[0], NG_P_WTE);
				cr_assert_eq(op->param[1], -1);
			}
			if (op->kind == NG_OP_LOSS_ACCUMULATE)
				cr_assert_eq(next_row, N, "seed %llu %s: head rows %d of %d",
					     (unsigned long long)seed_, what, next_row, N);
			if (op->kind == NG_OP_MATMUL_FWD && op->which == NG_OP_WHICH_QKV)
				cr_assert(op->param[0] == NG_P_QKVW && op->param[1] == NG_P_QKVB);
			if (op->kind == NG_OP_MATMUL_DW && op->which == NG_OP_WHICH_FCPROJ)
				cr_assert(op->param[0] == NG_P_FCPROJW &&
					  op->param[1] == NG_P_FCPROJB);
			if (op->kind == NG_OP_LAYERNORM_BWD && op->which == NG_OP_WHICH_LNF)
				cr_assert(op->param[0] == NG_P_LNFW && op->layer == -1);
			if (op->kind == NG_OP_MATMUL_FWD)
				cr_assert_eq(op->gelu, op->which == NG_OP_WHICH_FC &&
							       (o.fuse_gelu & NG_GELU_FUSE_FWD));
			if (op->kind == NG_OP_MATMUL_DINP)
				cr_assert_eq(op->gelu, op->which == NG_OP_WHICH_FCPROJ &&
							       (o.fuse_gelu & NG_GELU_FUSE_BWD) != 0);
			/* logits chunks alive at op k */
			int live = 0;
			for (int i = 0; i < g.n_tensors && k % 7 == 0; i++) {
				const struct ng_tensor *t = &g.tensors[i];
				live += strstr(t->name, "logits.c") && t->first_op <= k &&
					k <= t->last_op;
			}
			if (live > logits_live)
				logits_live = live;
		}
		cr_assert_leq(logits_live, 1, "seed %llu %s: %d logits chunks alive at once",
			      (unsigned long long)seed_, what, logits_live);
		/* every training activation is read by some op */
		for (int i = 0; i < g.n_tensors; i++) {
			const struct ng_tensor *t = &g.tensors[i];
			if (t->role != NG_ROLE_ACTIVATION)
				continue;
			bool read = false;
			for (int k = t->first_op; k <= t->last_op && !read; k++)
				for (int j = 0; j < g.ops[k].n_in; j++)
					read |= g.ops[k].in[j] == i;
			cr_assert(read, "seed %llu %s: %s is written and never read",
				  (unsigned long long)seed_, what, t->name);
		}
		ng_graph_free(&g);
	}
}

Test(step, recompute_drops_stored_tensors_and_saves_memory, .init = setup_)
{
	struct ng_gpt_config c;
	cr_assert_eq(ng_gpt_preset(&c, "d12"), NG_OK);
	cr_assert_eq(ng_gpt_check(&c), NG_OK);
	int B = 1 + (int)ng_rng_below(&rng_, 8);
	struct ng_step_options o;
	ng_step_default_options(&o);
	struct ng_graph g0, g1, g2;
	cr_assert_eq(ng_step_build_train(&g0, &c, B, 1024, 1, &o), NG_OK);
	o.recompute_gelu = o.recompute_layernorm = 1;
	cr_assert_eq(ng_step_build_train(&g1, &c, B, 1024, 1, &o), NG_OK);
	o.head_chunk_rows = 256;
	cr_assert_eq(ng_step_build_train(&g2, &c, B, 1024, 1, &o), NG_OK);
	cr_assert_lt(g1.lower_bound_bytes, g0.lower_bound_bytes, "B=%d: %zu vs %zu", B,
		     g1.lower_bound_bytes, g0.lower_bound_bytes);
	cr_assert_lt(g2.lower_bound_bytes, g1.lower_bound_bytes, "B=%d: %zu vs %zu", B,
		     g2.lower_bound_bytes, g1.lower_bound_bytes);
	/* the forward's GELU output and LN outputs die before the classifier */
	int first_head = -1;
	for (int k = 0; k < g1.n_ops && first_head < 0; k++)
		if (g1.ops[k].kind == NG_OP_MATMUL_FWD && g1.ops[k].which == NG_OP_WHICH_HEAD)
			first_head = k;
	const char *dropped[] = { "L0.fch_gelu", "L5.ln1", "L11.ln2" };
	for (int i = 0; i < 3; i++) {
		int t = ng_graph_find_tensor(&g1, dropped[i]);
		cr_assert_geq(t, 0, "%s missing", dropped[i]);
		cr_assert_lt(g1.tensors[t].last_op, first_head, "%s lives to op %d (head at %d)",
			     dropped[i], g1.tensors[t].last_op, first_head);
		char re[64];
		snprintf(re, sizeof(re), "%s.re", dropped[i]);
		cr_assert_geq(ng_graph_find_tensor(&g1, re), 0, "%s missing", re);
	}
	/* without recompute the stored ones live into the backward */
	int t = ng_graph_find_tensor(&g0, "L0.fch_gelu");
	cr_assert_gt(g0.tensors[t].last_op, first_head);
	ng_graph_free(&g0);
	ng_graph_free(&g1);
	ng_graph_free(&g2);
}

Test(step, eval_and_sample_graphs, .init = setup_)
{
	struct ng_gpt_config c;
	struct ng_step_options o;
	int B, T, K;
	for (int rep = 0; rep < 50; rep++) {
		random_case(&c, &B, &T, &K, &o);
		struct ng_graph tr, ev, sa;
		cr_assert_eq(ng_step_build_train(&tr, &c, B, T, K, &o), NG_OK);
		cr_assert_eq(ng_step_build_eval(&ev, &c, B, T, K, &o), NG_OK, "seed %llu: %s",
			     (unsigned long long)seed_, ng_error_message());
		cr_assert_eq(ng_step_build_sample(&sa, &c, B, T, &o), NG_OK, "seed %llu: %s",
			     (unsigned long long)seed_, ng_error_message());
		check_dataflow(&ev, "eval");
		check_dataflow(&sa, "sample");
		/* the shared persistent tensors sit at the same offsets */
		const char *names[] = { "params_lo", "params_bf16", "grads", "adam_m", "adam_v",
					"step_state" };
		for (int i = 0; i < 6; i++) {
			int a = ng_graph_find_tensor(&tr, names[i]);
			int b = ng_graph_find_tensor(&ev, names[i]);
			int s = ng_graph_find_tensor(&sa, names[i]);
			cr_assert(a >= 0 && b >= 0 && s >= 0);
			cr_assert_eq(tr.tensors[a].offset, ev.tensors[b].offset, "%s", names[i]);
			cr_assert_eq(tr.tensors[a].offset, sa.tensors[s].offset, "%s", names[i]);
		}
		/* eval: no backward, no optimizer, losses into eval_loss */
		cr_assert_eq(count_kind(&ev, NG_OP_MATMUL_DW) + count_kind(&ev, NG_OP_ADAMW) +
				     count_kind(&ev, NG_OP_MATMUL_DINP), 0);
		cr_assert_eq(count_kind(&ev, NG_OP_LOSS_ACCUMULATE), K);
		for (int k = 0; k < ev.n_ops; k++)
			if (ev.ops[k].kind == NG_OP_CROSSENTROPY) {
				cr_assert_eq(ev.ops[k].no_grad, 1);
				cr_assert_eq(ev.ops[k].n_out, 1);
			} else if (ev.ops[k].kind == NG_OP_LOSS_ACCUMULATE) {
				cr_assert_eq(ev.ops[k].out[0], ev.t_eval_loss);
			}
		cr_assert_geq(ev.t_eval_loss, 0);
		cr_assert_eq(ev.tensors[ev.t_eval_loss].bytes, 4);
		/* sample: the head writes the persistent (B, Vp) logits */
		cr_assert_eq(count_kind(&sa, NG_OP_GATHER_ROWS), 1);
		cr_assert_eq(count_kind(&sa, NG_OP_CROSSENTROPY), 0);
		const struct ng_tensor *lo = &sa.tensors[sa.t_logits_out];
		cr_assert(lo->persistent && lo->shape[0] == (size_t)B &&
			  lo->shape[1] == (size_t)c.Vp);
		cr_assert_eq(sa.tensors[sa.t_tokens].shape[2], (size_t)T + 1);
		ng_graph_free(&tr);
		ng_graph_free(&ev);
		ng_graph_free(&sa);
	}
}

/* --fp8 with a random set of kinds: one FP8_PREP right after the gradient zeroing and before
 * any forward op; every forward matmul of a chosen kind (L per kind, every head chunk) is fp8,
 * with its E4M3 weights and scales as inputs 2 and 3 and room for its E4M3 input in front of
 * its workspace, and the others are not;
 * eval and sample graphs declare the same persistent tensors at the same offsets but stay bf16;
 * without --fp8 none of it exists. */
Test(step, fp8_graphs, .init = setup_)
{
	for (int rep = 0; rep < 50; rep++) {
		struct ng_gpt_config c;
		struct ng_step_options o;
		int B, T, K;
		random_case(&c, &B, &T, &K, &o);
		fp8_fit(&c);
		int mask = (int)ng_rng_below(&rng_, NG_FP8_ALL + 1) |
			   (int)ng_rng_below(&rng_, 16) << NG_FP8_DINP_SHIFT;
		if (!mask)
			mask = NG_FP8_DINP_FCPROJ;
		o.fp8 = mask | (rep % 2 ? NG_FP8_AUTO : 0); /* AUTO is the executor's business */
		struct ng_graph tr, ev, sa, plain;
		cr_assert_eq(ng_step_build_train(&tr, &c, B, T, K, &o), NG_OK, "%s",
			     ng_error_message());
		cr_assert_eq(ng_step_build_eval(&ev, &c, B, T, K, &o), NG_OK);
		cr_assert_eq(ng_step_build_sample(&sa, &c, B, T, &o), NG_OK);
		cr_assert_eq(count_kind(&tr, NG_OP_FP8_PREP), 1);
		int prep = -1, first_fwd = -1, n_fp8 = 0, chunks = 0, n_dinp8 = 0;
		const int rec8 = o.recompute_fp8; /* weights cast in each matmul's scratch */
		cr_assert_eq(tr.recompute_fp8, rec8);
		if (rec8)
			cr_assert(tr.t_params_fp8 < 0 && tr.t_params_fp8t < 0);
		for (int i = 0; i < tr.n_ops; i++) {
			const struct ng_op *op = &tr.ops[i];
			if (op->kind == NG_OP_FP8_PREP) {
				prep = i;
				cr_assert_eq(op->in[0], tr.t_params_bf16);
				cr_assert_eq(op->in[1], tr.t_fp8_state);
				cr_assert_eq(op->out[0], tr.t_fp8_state);
				/* the E4M3 copies it writes, unless the matmuls cast their own */
				int copies = rec8 ? 0 : 1 + !!(mask & NG_FP8_DINP_ALL);
				cr_assert_eq(op->n_out, 1 + copies);
				if (copies)
					cr_assert_eq(op->out[1], tr.t_params_fp8);
				if (copies > 1)
					cr_assert_eq(op->out[2], tr.t_params_fp8t);
			}
			if (op->phase == NG_PHASE_FORWARD && first_fwd < 0)
				first_fwd = i;
			if (op->kind == NG_OP_MATMUL_DINP) { /* E5M2 dout x E4M3 W^T */
				int want = (mask & ng_fp8_dinp_bit(op->which)) != 0;
				cr_assert_eq(op->fp8, want, "%s (mask %d)", op->name, mask);
				if (!want)
					continue;
				cr_assert_eq(op->in[op->n_in - 2], rec8 ? tr.t_params_bf16 : tr.t_params_fp8t,
					     "%s", op->name);
				cr_assert_eq(op->in[op->n_in - 1], tr.t_fp8_state, "%s", op->name);
				cr_assert_eq(op->n_in, op->gelu ? 5 : 4, "%s", op->name);
				cr_assert_geq(ng_fp8_dinp_slot(c.L, op->which, op->layer),
					      ng_fp8_fwd_slots(c.L), "%s", op->name);
				size_t oc = op->which == NG_OP_WHICH_QKV ? 3 * (size_t)c.C
					    : op->which == NG_OP_WHICH_FC ? 4 * (size_t)c.C
									  : (size_t)c.C;
				cr_assert_geq(tr.tensors[op->scratch].bytes,
					      ng_fp8_input_bytes((size_t)op->row_count, oc) +
						      (rec8 ? ng_fp8_weight_bytes(&c, op->which) : 0),
					      "%s", op->name);
				n_dinp8++;
				continue;
			}
			if (op->kind != NG_OP_MATMUL_FWD)
				continue;
			if (!(mask & ng_fp8_bit(op->which))) {
				cr_assert_eq(op->fp8, 0, "%s (mask %d)", op->name, mask);
				cr_assert_eq(op->n_in - op->residual, 2, "%s", op->name);
				continue;
			}
			chunks += op->which == NG_OP_WHICH_HEAD;
			cr_assert_eq(op->fp8, 1, "%s", op->name);
			cr_assert_eq(op->in[2], rec8 ? tr.t_params_bf16 : tr.t_params_fp8);
			cr_assert_eq(op->in[3], tr.t_fp8_state);
			size_t w8 = rec8 ? ng_fp8_weight_bytes(&c, op->which) : 0;
			cr_assert_geq(tr.tensors[op->scratch].bytes, w8, "%s", op->name);
			cr_assert_geq(ng_fp8_slot(c.L, op->which, op->layer), 0, "%s", op->name);
			/* LayerNorm inputs come as the LayerNorm's E4M3 copy, the others are cast */
			int from_ln = op->which == NG_OP_WHICH_QKV || op->which == NG_OP_WHICH_FC ||
				      op->which == NG_OP_WHICH_HEAD;
			cr_assert_eq(op->n_in - op->residual, from_ln ? 5 : 4, "%s", op->name);
			size_t ic = op->which == NG_OP_WHICH_FCPROJ ? 4 * (size_t)c.C : (size_t)c.C;
			if (from_ln) {
				const struct ng_tensor *t8 = &tr.tensors[op->in[4]];
				cr_assert(t8->dtype == NG_DTYPE_U8 && t8->bytes == (size_t)B * T * ic,
					  "%s: %s", op->name, t8->name);
				const struct ng_op *w = &tr.ops[t8->first_op]; /* its writer */
				cr_assert(w->fp8 && w->out[w->n_out - 1] == op->in[4] &&
					  w->in[w->n_in - 1] == tr.t_fp8_state &&
					  w->kind == NG_OP_LAYERNORM_FWD,
					  "%s: written by %s", op->name, w->name);
			} else {
				cr_assert_geq(tr.tensors[op->scratch].bytes,
					      ng_fp8_input_bytes((size_t)op->row_count, ic) + w8, "%s",
					      op->name);
			}
			n_fp8++;
		}
		cr_assert(prep >= 0 && prep < first_fwd, "FP8_PREP at %d, first forward op %d", prep,
			  first_fwd);
		int kinds = 0;
		for (int w = 0; w < 4; w++)
			kinds += (mask >> w) & 1;
		cr_assert_eq(n_fp8, K * kinds * c.L + chunks, "mask %d", mask);
		int dkinds = 0;
		for (int w = 0; w < 4; w++)
			dkinds += (mask >> (w + NG_FP8_DINP_SHIFT)) & 1;
		cr_assert_eq(n_dinp8, K * dkinds * c.L, "mask %d", mask);
		cr_assert_eq(chunks % K, 0);
		cr_assert_eq(chunks > 0, (mask & NG_FP8_HEAD) != 0);
		int ln8 = 0;
		for (int i = 0; i < tr.n_ops; i++)
			ln8 += tr.ops[i].fp8 && tr.ops[i].kind != NG_OP_MATMUL_FWD &&
			       tr.ops[i].kind != NG_OP_MATMUL_DINP;
		cr_assert_eq(ln8, K * (c.L * (!!(mask & NG_FP8_QKV) + !!(mask & NG_FP8_FC)) +
				       !!(mask & NG_FP8_HEAD)), "mask %d", mask);
		cr_assert(tr.fp8 == mask && !ev.fp8 && !sa.fp8);
		cr_assert_eq(tr.tensors[tr.t_fp8_state].bytes, ng_fp8_state_floats(c.L) * 4);
		if (!rec8)
			cr_assert_eq(tr.tensors[tr.t_params_fp8].bytes, tr.lay.total);
		if ((mask & NG_FP8_DINP_ALL) && !rec8) /* the fp8 dinp kinds' W^T, back to back */
			cr_assert_eq(tr.tensors[tr.t_params_fp8t].bytes,
				     ng_fp8t_at(&tr.lay, mask, 4));
		else
			cr_assert_eq(tr.t_params_fp8t, -1);
		const struct ng_graph *others[2] = { &ev, &sa };
		for (int j = 0; j < 2; j++) {
			const struct ng_graph *q = others[j];
			cr_assert_eq(count_kind(q, NG_OP_FP8_PREP), 0);
			for (int i = 0; i < q->n_ops; i++)
				cr_assert_eq(q->ops[i].fp8, 0);
			if (rec8)
				cr_assert_eq(q->t_params_fp8, -1);
			else
				cr_assert_eq(q->tensors[q->t_params_fp8].offset,
					     tr.tensors[tr.t_params_fp8].offset);
			cr_assert_eq(q->tensors[q->t_fp8_state].offset,
				     tr.tensors[tr.t_fp8_state].offset);
			if ((mask & NG_FP8_DINP_ALL) && !rec8)
				cr_assert_eq(q->tensors[q->t_params_fp8t].offset,
					     tr.tensors[tr.t_params_fp8t].offset);
		}
		o.fp8 = 0;
		cr_assert_eq(ng_step_build_train(&plain, &c, B, T, K, &o), NG_OK);
		cr_assert_eq(plain.t_params_fp8, -1);
		cr_assert_eq(count_kind(&plain, NG_OP_FP8_PREP), 0);
		ng_graph_free(&tr);
		ng_graph_free(&ev);
		ng_graph_free(&sa);
		ng_graph_free(&plain);
	}
}

/* --fp8-dw (NG_FP8_DW_*) with random kinds: a layer's dW matmul is fp8 exactly where its kind's
 * dW and forward bits are both set and the rows come in whole 16-row groups; then its inputs are
 * dout, inp and fp8_state, its scratch holds both transposes (and the bias's column sums) in
 * front of the workspace, and where the kind's fp8 dinp comes after it, the two share one cast:
 * the dW's out[1] is dout in E5M2 (u8, rows x OC) and that dinp's in[0]. The graph keeps only
 * the dW bits whose forward is fp8. */
Test(step, fp8_dw_graphs, .init = setup_)
{
	int shared = 0, fp8_dw = 0;
	for (int rep = 0; rep < 60; rep++) {
		struct ng_gpt_config c;
		struct ng_step_options o;
		int B, T, K;
		random_case(&c, &B, &T, &K, &o);
		fp8_fit(&c);
		if (rep % 3 == 0 && c.T >= 16) /* whole 16-row groups */
			T = 16 * (1 + (int)ng_rng_below(&rng_, (uint64_t)c.T / 16));
		int fwd = (int)ng_rng_below(&rng_, 16), dinp = (int)ng_rng_below(&rng_, 16),
		    dw = 1 + (int)ng_rng_below(&rng_, 15);
		o.fp8 = fwd | dinp << NG_FP8_DINP_SHIFT | dw << NG_FP8_DW_SHIFT;
		if (!(o.fp8 & NG_FP8_EVERY))
			o.fp8 |= NG_FP8_QKV;
		struct ng_graph g;
		cr_assert_eq(ng_step_build_train(&g, &c, B, T, K, &o), NG_OK, "seed %llu: %s",
			     (unsigned long long)seed_, ng_error_message());
		const int live = o.fp8 & NG_FP8_ALL & ~NG_FP8_HEAD;
		cr_assert_eq(g.fp8 & NG_FP8_DW_ALL, (dw & live) << NG_FP8_DW_SHIFT, "seed %llu",
			     (unsigned long long)seed_);
		for (int i = 0; i < g.n_ops; i++) {
			const struct ng_op *op = &g.ops[i];
			if (op->kind != NG_OP_MATMUL_DW || op->which == NG_OP_WHICH_HEAD)
				continue;
			const int want = (g.fp8 & ng_fp8_dw_bit(op->which)) && (B * T) % 16 == 0;
			cr_assert_eq(op->fp8, want, "seed %llu: %s (fp8 %d, %d rows)",
				     (unsigned long long)seed_, op->name, o.fp8, B * T);
			if (!want) {
				cr_assert_eq(op->n_in, 2, "%s", op->name);
				cr_assert_eq(op->n_out, 1, "%s", op->name);
				continue;
			}
			fp8_dw++;
			cr_assert_eq(op->n_in, 3, "%s", op->name);
			cr_assert_eq(op->in[2], g.t_fp8_state, "%s", op->name);
			int ic, oc;
			ng_linear_dims(&c, op->which, &ic, &oc);
			cr_assert_geq(g.tensors[op->scratch].bytes,
				      ng_fp8_dw_bytes((size_t)op->row_count, (size_t)ic, (size_t)oc,
						      op->param[1] >= 0),
				      "%s", op->name);
			/* the kind's dinp in the same micro-batch and layer, and whether it follows */
			int di = -1;
			for (int j = 0; j < g.n_ops; j++)
				if (g.ops[j].kind == NG_OP_MATMUL_DINP &&
				    g.ops[j].which == op->which && g.ops[j].layer == op->layer &&
				    g.ops[j].micro == op->micro)
					di = j;
			cr_assert_geq(di, 0, "%s has no dinp", op->name);
			const struct ng_op *d = &g.ops[di];
			const int share = d->fp8 && di > i;
			cr_assert_eq(op->n_out, share ? 2 : 1, "seed %llu: %s (dinp %s at %d, fp8 %d)",
				     (unsigned long long)seed_, op->name, d->name, di, d->fp8);
			if (!share) {
				cr_assert_neq(g.tensors[d->in[0]].dtype, NG_DTYPE_U8, "%s", d->name);
				continue;
			}
			shared++;
			const struct ng_tensor *t8 = &g.tensors[op->out[1]];
			cr_assert(t8->dtype == NG_DTYPE_U8 && t8->bytes == (size_t)B * T * oc,
				  "%s: %s", op->name, t8->name);
			cr_assert_eq(d->in[0], op->out[1], "%s reads %s", d->name,
				     g.tensors[d->in[0]].name);
			cr_assert_eq(t8->first_op, i);
			cr_assert_eq(t8->last_op, di, "%s: %s", op->name, t8->name);
		}
		ng_graph_free(&g);
	}
	cr_assert_gt(fp8_dw, 0, "seed %llu: no fp8 dW in 60 graphs", (unsigned long long)seed_);
	cr_assert_gt(shared, 0, "seed %llu: no shared cast in 60 graphs", (unsigned long long)seed_);
}

Test(step, bad_sizes_are_input_errors)
{
	struct ng_gpt_config c;
	cr_assert_eq(ng_gpt_preset(&c, "tiny"), NG_OK);
	cr_assert_eq(ng_gpt_check(&c), NG_OK);
	struct ng_graph g;
	ng_clear_error();
	cr_assert_eq(ng_step_build_train(&g, &c, 2, c.T + 1, 1, NULL), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "context"), "message: %s", ng_error_message());
	ng_clear_error();
	cr_assert_eq(ng_step_build_train(&g, &c, 0, 8, 1, NULL), NG_ERR_INPUT);
	ng_clear_error();
	cr_assert_eq(ng_step_build_eval(&g, &c, 2, 8, 0, NULL), NG_ERR_INPUT);
	ng_clear_error();
	struct ng_step_options o;
	ng_step_default_options(&o);
	o.align = 100;
	cr_assert_eq(ng_step_build_train(&g, &c, 2, 8, 1, &o), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "100"), "message: %s", ng_error_message());
	ng_clear_error();
	/* --fp8 with C = 24 (a legal model, head size 8): one line naming C, and a hint */
	ng_step_default_options(&o);
	o.fp8 = NG_FP8_EVERY | NG_FP8_AUTO;
	struct ng_gpt_config c24 = c;
	c24.H = 3;
	c24.C = 24;
	cr_assert_eq(ng_gpt_check(&c24), NG_OK, "%s", ng_error_message());
	cr_assert_eq(ng_step_build_train(&g, &c24, 2, 8, 1, &o), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "C = 24"), "message: %s", ng_error_message());
	cr_assert(strstr(ng_error_hint(), "drop --fp8"), "hint: %s", ng_error_hint());
	ng_clear_error();
	ng_graph_free(&g); /* safe on a failed build */
}

Test(step, plan_check_fit)
{
	ng_clear_error();
	cr_assert_eq(ng_plan_check_fit(10, 10), NG_OK);
	cr_assert_eq(ng_plan_check_fit((size_t)50 << 30, (size_t)40 << 30), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "50.00 GiB") && strstr(ng_error_message(), "40.00"),
		  "message: %s", ng_error_message());
	cr_assert(strstr(ng_error_hint(), "recompute"), "hint: %s", ng_error_hint());
	ng_clear_error();
}

/* --gelu-fusion: every accepted spelling, its bits and its name; "auto" keeps the fused backward
 * until the device has timed it; anything else is one error line. */
Test(step, gelu_fusion_names)
{
	const int F = NG_GELU_FUSE_FWD, B = NG_GELU_FUSE_BWD, O = NG_GELU_FUSE_OWN;
	const char *text[] = { "none", "fwd", "bwd", "fwd,bwd", "bwd,fwd", "auto", "own",
			       "fwd,own", "own,fwd" };
	int bits[] = { 0, F, B, F | B, F | B, F | B | NG_GELU_FUSE_AUTO, B | O, F | B | O,
		       F | B | O };
	const char *name[] = { "none", "fwd", "bwd", "fwd,bwd", "fwd,bwd", "auto: fwd,bwd", "own",
			       "fwd,own", "fwd,own" };
	for (int i = 0; i < 9; i++) {
		int m = -1;
		cr_assert_eq(ng_step_parse_gelu_fusion(text[i], &m), NG_OK, "%s", text[i]);
		cr_assert_eq(m, bits[i], "%s -> %d", text[i], m);
		cr_assert_str_eq(ng_step_gelu_fusion_name(m), name[i]);
	}
	cr_assert_str_eq(ng_step_gelu_fusion_name(NG_GELU_FUSE_FWD | NG_GELU_FUSE_AUTO), "auto: fwd");
	cr_assert_str_eq(ng_step_gelu_fusion_name(F | B | O | NG_GELU_FUSE_AUTO), "auto: fwd,own");
	struct ng_step_options o;
	ng_step_default_options(&o);
	cr_assert_eq(o.fuse_gelu, NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD | NG_GELU_FUSE_AUTO);
	int m = 5;
	ng_clear_error();
	cr_assert_eq(ng_step_parse_gelu_fusion("fused", &m), NG_ERR_INPUT);
	cr_assert_eq(m, 5);
	cr_assert(strstr(ng_error_message(), "--gelu-fusion 'fused'"), "%s", ng_error_message());
}

/* --gelu-fusion auto's FC-backward pick from the trial's times: the faster cuBLASLt form, and
 * ours only when it is at least 3% ahead of that (the d24 and d48 rows are trials measured on an
 * H200) */
Test(step, gelu_backward_pick)
{
	const int B = NG_GELU_FUSE_BWD, O = NG_GELU_FUSE_OWN;
	const float ms[][3] = {
		{ 1.0f, 1.1f, 0.0f },      /* two-way: the epilogue faster */
		{ 1.2f, 0.9f, 0.0f },      /* two-way: the unfused pair faster */
		{ 1.206f, 0.926f, 0.844f }, /* d24: ours 9% ahead */
		{ 1.029f, 0.989f, 0.974f }, /* d48: ours 1.5% ahead */
		{ 0.961f, 1.007f, 1.019f }, /* d12: cuBLASLt's epilogue */
		{ 1.0f, 2.0f, 0.969f },    /* just past the margin */
		{ 1.0f, 2.0f, 0.971f },    /* just short of it */
		{ 1.0f, 2.0f, -1.0f },     /* ours did not time: not taken */
	};
	const int nv[] = { 2, 2, 3, 3, 3, 3, 3, 3 };
	const int want[] = { B, 0, B | O, 0, B, B | O, B, B };
	for (int i = 0; i < 8; i++)
		cr_expect_eq(ng_exec_pick_dgelu(ms[i], nv[i]), want[i], "case %d: %d", i,
			     ng_exec_pick_dgelu(ms[i], nv[i]));
}

/* The init log's and plan's words for what a graph recomputes. */
Test(step, recompute_names)
{
	struct ng_gpt_config c = { .L = 4, .H = 2, .C = 32, .T = 64, .V = 100 };
	cr_assert_eq(ng_gpt_check(&c), NG_OK, "%s", ng_error_message());
	struct { int g, kg, l, kl; const char *want; } k[] = {
		{ 0, 0, 0, 0, "none" },
		{ 1, 0, 0, 0, "gelu" },
		{ 1, 1, 0, 0, "gelu (3 of 4 layers)" },
		{ 1, 4, 0, 0, "none" }, /* every layer keeps its GELU output */
		{ 1, 0, 1, 2, "gelu,layernorm (2 of 4 layers)" },
		{ 0, 0, 1, 0, "layernorm" },
	};
	for (size_t i = 0; i < sizeof(k) / sizeof(k[0]); i++) {
		struct ng_step_options o;
		ng_step_default_options(&o);
		o.recompute_gelu = k[i].g;
		o.keep_gelu = k[i].kg;
		o.recompute_layernorm = k[i].l;
		o.keep_layernorm = k[i].kl;
		struct ng_graph g;
		cr_assert_eq(ng_step_build_train(&g, &c, 2, 16, 1, &o), NG_OK, "%s", ng_error_message());
		char buf[96];
		cr_expect_str_eq(ng_step_recompute_name(&g, buf, sizeof(buf)), k[i].want, "case %zu", i);
		ng_graph_free(&g);
	}
}
