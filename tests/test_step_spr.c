/*
 * tests/test_step_spr.c — the speedrun model's step graphs (graph/step_spr.c): they validate
 * (no two live tensors overlap), every tensor is written before it is read, every parameter's
 * gradient is defined before anything adds into it and at the end, the per-block structure
 * (which blocks have attention, value embeddings, U-net skips) is the one graph/gpt.h states,
 * the real preset's step fits an H200 with room to spare, and the window schedule.
 */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "graph/step.h"
#include "graph/step_spr.h"

static struct ng_gpt_config preset(const char *name)
{
	struct ng_gpt_config c;
	cr_assert_eq(ng_gpt_preset(&c, name), NG_OK);
	cr_assert_eq(ng_gpt_check(&c), NG_OK, "%s", ng_error_message());
	return c;
}

/* Every tensor an op reads was written by an earlier op (or is persistent, or the tokens). */
static void check_dataflow(const struct ng_graph *g)
{
	bool *written = calloc((size_t)g->n_tensors, 1);
	cr_assert(written);
	for (int t = 0; t < g->n_tensors; t++)
		written[t] = g->tensors[t].persistent;
	for (int i = 0; i < g->n_ops; i++) {
		const struct ng_op *op = &g->ops[i];
		for (int k = 0; k < op->n_in; k++) {
			int t = op->in[k];
			cr_assert(t >= 0 && t < g->n_tensors, "%s: input %d is %d", op->name, k, t);
			cr_assert(written[t], "%s reads %s before anything wrote it", op->name,
				  g->tensors[t].name);
		}
		for (int k = 0; k < op->n_out; k++) {
			cr_assert(op->out[k] >= 0 && op->out[k] < g->n_tensors, "%s: output %d",
				  op->name, k);
			written[op->out[k]] = true;
		}
	}
	free(written);
}

/* Gradients: the accumulated ones are zeroed first (ZERO with the parameter); the matrices'
 * first dW overwrites; every present tensor's gradient is defined by the end. */
static void check_gradients(const struct ng_graph *g)
{
	const int L = g->cfg.L;
	bool ready[NG_P_COUNT][64] = { { false } };
	cr_assert(L <= 64);
	for (int i = 0; i < g->n_ops; i++) {
		const struct ng_op *op = &g->ops[i];
		int p = op->param[0];
		if (p < 0)
			continue;
		int slots = g->lay.p[p].per_layer ? (int)g->lay.p[p].shape[0] : 1;
		if (op->kind == NG_OP_ZERO) {
			for (int l = 0; l < slots; l++)
				ready[p][l] = true;
			continue;
		}
		int writes_grads = 0;
		for (int k = 0; k < op->n_out; k++)
			writes_grads |= op->out[k] == g->t_grads;
		if (!writes_grads)
			continue;
		int l = 0;
		if (op->kind == NG_OP_MATMUL_DW && g->lay.p[p].per_layer)
			l = p == NG_P_QKVW || p == NG_P_ATTPROJW ? ng_spr_attn_slot(&g->cfg, op->layer)
								   : op->layer;
		cr_assert(l >= 0 && l < slots, "%s: slot %d of %d", op->name, l, slots);
		if (op->kind == NG_OP_MATMUL_DW && op->overwrite)
			ready[p][l] = true;
		else
			cr_assert(ready[p][l], "%s adds into the %s gradient (slot %d) before anything "
				  "defined it", op->name, g->lay.p[p].name, l);
	}
	for (int p = 0; p < NG_P_COUNT; p++) {
		if (!ng_param_present(&g->lay.p[p]))
			continue;
		int slots = g->lay.p[p].per_layer ? (int)g->lay.p[p].shape[0] : 1;
		for (int l = 0; l < slots; l++)
			cr_assert(ready[p][l], "the %s gradient (slot %d) is never written",
				  g->lay.p[p].name, l);
	}
}

static int count(const struct ng_graph *g, enum ng_op_kind k, int micro)
{
	int n = 0;
	for (int i = 0; i < g->n_ops; i++)
		n += g->ops[i].kind == k && (micro < 0 || g->ops[i].micro == micro);
	return n;
}

Test(step_spr, train_graphs_are_well_formed)
{
	struct ng_gpt_config c = preset("speedrun-tiny");
	static const struct { int B, T, K, chunk; } cases[] = {
		{ 2, 300, 1, 0 }, { 1, 512, 2, 0 }, { 3, 77, 1, 100 }, { 2, 129, 3, 64 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct ng_step_options o;
		ng_step_default_options(&o);
		o.head_chunk_rows = cases[i].chunk;
		struct ng_graph g;
		cr_assert_eq(ng_step_build_train(&g, &c, cases[i].B, cases[i].T, cases[i].K, &o),
			     NG_OK, "B=%d T=%d K=%d: %s", cases[i].B, cases[i].T, cases[i].K,
			     ng_error_message());
		cr_assert_eq(ng_graph_validate(&g), NG_OK, "%s", ng_error_message());
		check_dataflow(&g);
		check_gradients(&g);
		const int L = c.L, K = cases[i].K;
		cr_expect_eq(count(&g, NG_OP_ATTENTION_FWD, -1), K * (L - 1));
		cr_expect_eq(count(&g, NG_OP_ATTENTION_BWD, -1), K * (L - 1));
		cr_expect_eq(count(&g, NG_OP_RELU2_FWD, -1), K * L);
		cr_expect_eq(count(&g, NG_OP_EMBED_FWD, 0), 1 + NG_SPR_VE);
		cr_expect_eq(count(&g, NG_OP_EMBED_BWD, 0), 1 + NG_SPR_VE);
		cr_expect_eq(count(&g, NG_OP_SCALARS, -1), 1);
		cr_expect_eq(count(&g, NG_OP_CROSSENTROPY, -1), 0);
		cr_expect_eq(count(&g, NG_OP_ADAMW, -1), 1);
		/* per micro-batch: L x-mixes, L/2 skips, (L-1) value mixes, each with its backward */
		int xmix = 0, skip = 0, vmix = 0, vmix_ve = 0;
		for (int k = 0; k < g.n_ops; k++) {
			const struct ng_op *op = &g.ops[k];
			if (op->kind != NG_OP_MIX_FWD || op->micro != 0)
				continue;
			xmix += op->which == NG_OP_WHICH_XMIX;
			skip += op->which == NG_OP_WHICH_SKIP;
			vmix += op->which == NG_OP_WHICH_VMIX;
			vmix_ve += op->which == NG_OP_WHICH_VMIX && op->n_in == 3;
			if (op->which == NG_OP_WHICH_VMIX)
				cr_expect_eq(op->n_in == 3, ng_spr_ve(&c, op->layer) >= 0, "%s",
					     op->name);
		}
		cr_expect_eq(xmix, L);
		cr_expect_eq(skip, L / 2);
		cr_expect_eq(vmix, L - 1);
		int want_ve = 0;
		for (int l = 0; l < L; l++)
			want_ve += ng_spr_has_attn(&c, l) && ng_spr_ve(&c, l) >= 0;
		cr_expect_eq(vmix_ve, want_ve);
		cr_expect_eq(ng_graph_find_tensor(&g, K > 1 ? "m0.L3.qkv" : "L3.qkv"), -1,
			     "block %d has no attention", ng_spr_no_attn(&c));
		ng_graph_free(&g);
	}
}

Test(step_spr, structure_of_the_reference_model)
{
	struct ng_gpt_config c = preset("speedrun");
	cr_expect_eq(c.L, 12);
	cr_expect_eq(c.C / c.H, 128);
	cr_expect_eq(c.Vp, 50304);
	cr_expect_eq(ng_spr_no_attn(&c), 7);
	static const int ve[12] = { 0, 1, 2, -1, -1, -1, -1, -1, -1, 0, 1, 2 };
	for (int l = 0; l < 12; l++) {
		cr_expect_eq(ng_spr_ve(&c, l), ve[l], "block %d", l);
		cr_expect_eq(ng_spr_long_window(&c, l), l == 0 || l == 4 || l == 11, "block %d", l);
	}
	struct ng_gpt_layout lay;
	ng_gpt_layout(&c, &lay);
	cr_expect_eq(lay.p[NG_P_QKVW].shape[0], 11);
	cr_expect_eq(lay.p[NG_P_SKIPW].numel, 6);
	cr_expect_eq(lay.p[NG_P_WPE].numel, 0);
	cr_expect_eq(lay.p[NG_P_LN1W].numel, 0);
	/* the real step: one sequence of 48 x 1024 tokens; the reference allocates 32.7 GiB */
	struct ng_graph g;
	cr_assert_eq(ng_step_build_train(&g, &c, 1, 49152, 1, NULL), NG_OK, "%s",
		     ng_error_message());
	cr_expect_lt(g.total_bytes, (size_t)26 << 30, "%zu bytes", g.total_bytes);
	ng_graph_free(&g);
	cr_assert_eq(ng_step_build_eval(&g, &c, 1, 49152, 2, NULL), NG_OK, "%s",
		     ng_error_message());
	ng_graph_free(&g);
	cr_expect_eq(ng_step_build_sample(&g, &c, 1, 1024, NULL), NG_ERR_INPUT);
}

Test(step_spr, window_schedule)
{
	/* W(s) = max(1, ceil(13.5 s / S)): 1 at the start, 14 at the end, never falling */
	cr_expect_eq(ng_spr_window_blocks(0, 1770), 1);
	cr_expect_eq(ng_spr_window_blocks(1770, 1770), 14);
	cr_expect_eq(ng_spr_window_blocks(1, 120), 1);
	cr_expect_eq(ng_spr_window_blocks(60, 120), 7); /* 6.75 -> 7 */
	for (int s = 1, prev = 1; s <= 1770; s++) {
		int w = ng_spr_window_blocks(s, 1770);
		cr_expect(w >= prev && w <= 14, "step %d: %d after %d", s, w, prev);
		double exact = 13.5 * s / 1770;
		cr_expect(w >= exact && w < exact + 1, "step %d: %d for %.4f", s, w, exact);
		prev = w;
	}
}

Test(step_spr, gpt2_options_are_refused)
{
	struct ng_gpt_config c = preset("speedrun-tiny");
	struct ng_step_options o;
	ng_step_default_options(&o);
	o.recompute_gelu = 1;
	struct ng_graph g;
	cr_expect_eq(ng_step_build_train(&g, &c, 1, 64, 1, &o), NG_ERR_INPUT);
	ng_step_default_options(&o);
	o.recompute_layernorm = 1;
	cr_expect_eq(ng_step_build_train(&g, &c, 1, 64, 1, &o), NG_ERR_INPUT);
	c.L = 7;
	cr_expect_eq(ng_gpt_check(&c), NG_ERR_INPUT);
}

/* --fp8 (graph/step.h "FP8"): every layer matmul's forward and dinp is an fp8 op reading the
 * E4M3 weights (dinp: W^T) and the scales, the residual input last; the dW stay bf16 but with
 * --fp8-dw, where each is fp8 with the scales as its third input and writes the E5M2 dout
 * that the dinp right after it reads; FP8_PREP comes before the first matmul; with --recompute
 * fp8 there are no weight copies and the matmuls read the bf16 weights. Eval graphs stay
 * bf16. */
Test(step_spr, fp8_layers)
{
	struct ng_gpt_config c = preset("speedrun-tiny");
	for (int v = 0; v < 4; v++) {
		const int rc = v & 1, dw = v >> 1;
		struct ng_step_options o;
		ng_step_default_options(&o);
		o.fp8 = NG_FP8_EVERY | (dw ? NG_FP8_DW_ALL : 0);
		o.recompute_fp8 = rc;
		struct ng_graph g;
		cr_assert_eq(ng_step_build_train(&g, &c, 2, 200, 1, &o), NG_OK, "%s",
			     ng_error_message());
		cr_assert_eq(ng_graph_validate(&g), NG_OK, "%s", ng_error_message());
		check_dataflow(&g);
		check_gradients(&g);
		cr_expect_eq(g.fp8, o.fp8);
		cr_expect_eq(g.t_params_fp8 < 0, rc);
		cr_expect_eq(g.t_params_fp8t < 0, rc);
		cr_assert_eq(count(&g, NG_OP_FP8_PREP, -1), 1);
		int prep = -1, fwd = 0, dinp = 0, first_mm = -1;
		for (int k = 0; k < g.n_ops; k++) {
			const struct ng_op *op = &g.ops[k];
			if (op->kind == NG_OP_FP8_PREP)
				prep = k;
			if (op->kind != NG_OP_MATMUL_FWD && op->kind != NG_OP_MATMUL_DINP &&
			    op->kind != NG_OP_MATMUL_DW)
				continue;
			if (first_mm < 0)
				first_mm = k;
			if (op->kind == NG_OP_MATMUL_DW) {
				const int mine = dw && op->which != NG_OP_WHICH_HEAD;
				cr_expect_eq(op->fp8, mine, "%s", op->name);
				if (!mine)
					continue;
				cr_expect_eq(op->n_in, 3, "%s", op->name);
				cr_expect_eq(op->in[2], g.t_fp8_state, "%s", op->name);
				cr_assert_eq(op->n_out, 2, "%s", op->name);
				const struct ng_op *d = &g.ops[k + 1];
				cr_expect(d->kind == NG_OP_MATMUL_DINP && d->which == op->which &&
					  d->in[0] == op->out[1] &&
					  g.tensors[op->out[1]].dtype == NG_DTYPE_U8,
					  "%s: the next op %s reads %s", op->name, d->name,
					  g.tensors[d->in[0]].name);
				continue;
			}
			if (op->which == NG_OP_WHICH_HEAD) {
				cr_expect_eq(op->fp8, op->kind == NG_OP_MATMUL_FWD, "%s", op->name);
				continue;
			}
			cr_expect_eq(op->fp8, 1, "%s", op->name);
			int want = rc ? g.t_params_bf16
				      : op->kind == NG_OP_MATMUL_FWD ? g.t_params_fp8 : g.t_params_fp8t;
			cr_expect_eq(op->in[2], want, "%s: the weights", op->name);
			cr_expect_eq(op->in[3], g.t_fp8_state, "%s: the scales", op->name);
			cr_expect_eq(op->n_in, 4 + op->residual, "%s", op->name);
			fwd += op->kind == NG_OP_MATMUL_FWD;
			dinp += op->kind == NG_OP_MATMUL_DINP;
		}
		cr_expect(prep >= 0 && prep < first_mm, "FP8_PREP at %d, first matmul at %d", prep,
			  first_mm);
		int attn = c.L - 1; /* qkv + attproj in the blocks with attention, fc + fcproj in all */
		cr_expect_eq(fwd, 2 * attn + 2 * c.L);
		cr_expect_eq(dinp, 2 * attn + 2 * c.L);
		ng_graph_free(&g);
		cr_assert_eq(ng_step_build_eval(&g, &c, 2, 200, 1, &o), NG_OK, "%s",
			     ng_error_message());
		cr_expect_eq(g.fp8, 0, "eval graphs stay bf16");
		ng_graph_free(&g);
	}
}
