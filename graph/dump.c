/*
 * graph/dump.c — DOT and SVG writers for a planned step (see dump.h for what is drawn and the
 * attributes tests read back). Graphviz DOT language: https://graphviz.org/doc/info/lang.html;
 * SVG 1.1 <title> children give hover tooltips.
 */
#include "graph/dump.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *role_colour(enum ng_role r)
{
	static const char *c[NG_ROLE_COUNT] = {
		"#1f4e9c", /* param: dark blue */
		"#4a90d9", /* param_bf16: blue */
		"#c0392b", /* grad: red */
		"#8e44ad", /* opt_state: purple */
		"#555555", /* activation: grey */
		"#e67e22", /* scratch: orange */
		"#27ae60", /* input: green */
		"#b7950b", /* metric: gold */
	};
	return (unsigned)r < NG_ROLE_COUNT ? c[r] : "#000000";
}

void ng_dump_format_tensor(const struct ng_tensor *t, char *buf, size_t len)
{
	int n = snprintf(buf, len, "%s[", ng_dtype_name(t->dtype));
	for (int i = 0; i < t->ndim && n > 0 && (size_t)n < len; i++)
		n += snprintf(buf + n, len - (size_t)n, "%s%zu", i ? "," : "", t->shape[i]);
	if (n > 0 && (size_t)n < len)
		snprintf(buf + n, len - (size_t)n, "]");
}

static FILE *open_out(const char *path)
{
	FILE *f = fopen(path, "w");
	if (!f) {
		ng_fail(NG_ERR_INPUT, "dump: cannot write %s: %s", path, strerror(errno));
		ng_hint("check that the --out folder exists and is writable");
	}
	return f;
}

static enum ng_status close_out(FILE *f, const char *path)
{
	int bad = ferror(f);
	if (fclose(f) != 0 || bad)
		return ng_fail(NG_ERR_RUNTIME, "dump: writing %s failed: %s", path, strerror(errno));
	return NG_OK;
}

/* The node id of op k / of persistent tensor t. */
#define OP_ID "op%d"
#define TENSOR_ID "t%d"

static void dot_op_node(FILE *f, const struct ng_graph *g, int k)
{
	const struct ng_op *op = &g->ops[k];
	fprintf(f, "    " OP_ID " [label=\"%d: %s", k, k, op->name);
	for (int j = 0; j < op->n_out; j++) {
		char sh[96];
		ng_dump_format_tensor(&g->tensors[op->out[j]], sh, sizeof(sh));
		fprintf(f, "\\n%s %s", g->tensors[op->out[j]].name, sh);
	}
	if (op->param[0] >= 0) {
		/* parameters are named in the label, not drawn as edges: hundreds of edges from
		 * one params node make dot's layout impractically slow */
		fprintf(f, "\\nparams %s", g->lay.p[op->param[0]].name);
		if (op->param[1] >= 0)
			fprintf(f, ", %s", g->lay.p[op->param[1]].name);
		if (op->layer >= 0)
			fprintf(f, " [L%d]", op->layer);
	}
	if (op->scratch >= 0)
		fprintf(f, "\\nworkspace %zu B", g->tensors[op->scratch].bytes);
	fprintf(f, "\"%s];\n", op->recompute ? ", style=\"dashed\"" : "");
}

enum ng_status ng_dump_write_dot(const struct ng_graph *g, const char *path)
{
	FILE *f = open_out(path);
	if (!f)
		return NG_ERR_INPUT;
	int *writer = malloc(sizeof(int) * (size_t)(g->n_tensors ? g->n_tensors : 1));
	if (!writer) {
		fclose(f);
		return ng_fail(NG_ERR_RUNTIME, "dump: out of host memory");
	}
	for (int i = 0; i < g->n_tensors; i++)
		writer[i] = -1;
	/* newrank: without it dot fails ("trouble in init_rank") on some clustered steps. The
	 * crossing-minimisation limits and edge xlabels (placed after layout) keep dot -Tsvg of
	 * a d12 step at seconds instead of many minutes. */
	fprintf(f, "digraph step {\n  rankdir=TB;\n  newrank=true;\n  mclimit=0.05;\n"
		"  nslimit=2;\n  searchsize=10;\n  remincross=false;\n"
		"  node [shape=box, fontname=\"Helvetica\", fontsize=10];\n"
		"  edge [fontname=\"Helvetica\", fontsize=8];\n");
	fprintf(f, "  label=\"%s step: L=%d C=%d H=%d Vp=%d, B=%d T=%d K=%d; arena %zu B, lower "
		"bound %zu B, total %zu B\";\n",
		g->kind == NG_GRAPH_TRAIN ? "train" : g->kind == NG_GRAPH_EVAL ? "eval" : "sample",
		g->cfg.L, g->cfg.C, g->cfg.H, g->cfg.Vp, g->B, g->T, g->K, g->arena_bytes,
		g->lower_bound_bytes, g->total_bytes);
	/* persistent tensors: one node each */
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (!t->persistent)
			continue;
		char sh[96];
		ng_dump_format_tensor(t, sh, sizeof(sh));
		fprintf(f, "  " TENSOR_ID " [shape=cylinder, color=\"%s\", fontcolor=\"%s\", "
			"label=\"%s\\n%s\\n%s\"];\n", i, role_colour(t->role), role_colour(t->role),
			t->name, sh, ng_role_name(t->role));
	}
	/* ops, clustered by (micro-batch, phase) runs */
	int open_micro = -2, open_phase = -1, n_cluster = 0;
	for (int k = 0; k < g->n_ops; k++) {
		const struct ng_op *op = &g->ops[k];
		if (op->micro != open_micro || (int)op->phase != open_phase) {
			if (open_phase >= 0)
				fprintf(f, "  }\n");
			fprintf(f, "  subgraph cluster_%d {\n    label=\"", n_cluster++);
			if (op->micro >= 0)
				fprintf(f, "micro-batch %d ", op->micro);
			fprintf(f, "%s\";\n    style=rounded;\n", ng_phase_name(op->phase));
			open_micro = op->micro;
			open_phase = (int)op->phase;
		}
		dot_op_node(f, g, k);
	}
	if (open_phase >= 0)
		fprintf(f, "  }\n");
	/* edges: tensors from their last writer (or persistent node) to each reader */
	for (int k = 0; k < g->n_ops; k++) {
		const struct ng_op *op = &g->ops[k];
		for (int j = 0; j < op->n_in; j++) {
			int t = op->in[j];
			const struct ng_tensor *x = &g->tensors[t];
			if (writer[t] >= 0)
				fprintf(f, "  " OP_ID " -> " OP_ID, writer[t], k);
			else if (x->persistent && op->phase == NG_PHASE_OPTIMIZER)
				fprintf(f, "  " TENSOR_ID " -> " OP_ID, t, k);
			else
				continue; /* parameter reads: named in the op's label */
			fprintf(f, " [xlabel=\"%s\", tooltip=\"%s\", color=\"%s\", "
				"fontcolor=\"%s\"];\n", x->name, x->name, role_colour(x->role),
				role_colour(x->role));
		}
		for (int j = 0; j < op->n_out; j++) {
			int t = op->out[j];
			writer[t] = k;
			if (g->tensors[t].persistent && op->phase == NG_PHASE_OPTIMIZER)
				fprintf(f, "  " OP_ID " -> " TENSOR_ID " [style=dashed, color=\"%s\", "
					"constraint=false];\n", k, t, role_colour(g->tensors[t].role));
		}
	}
	fprintf(f, "}\n");
	free(writer);
	return close_out(f, path);
}

/* Write s with XML's five special characters escaped. */
static void xml_text(FILE *f, const char *s)
{
	for (; *s; s++) {
		switch (*s) {
		case '<': fputs("&lt;", f); break;
		case '>': fputs("&gt;", f); break;
		case '&': fputs("&amp;", f); break;
		case '"': fputs("&quot;", f); break;
		case '\'': fputs("&apos;", f); break;
		default: fputc(*s, f);
		}
	}
}

enum ng_status ng_dump_write_arena_svg(const struct ng_graph *g, const char *path)
{
	FILE *f = open_out(path);
	if (!f)
		return NG_ERR_INPUT;
	const double W = 1600, H = 900, ml = 90, mr = 20, mt = 50, mb = 40;
	const double pw = W - ml - mr, ph = H - mt - mb;
	const double MiB = 1024.0 * 1024.0;
	size_t ymax = g->arena_bytes > g->lower_bound_bytes ? g->arena_bytes : g->lower_bound_bytes;
	double sx = pw / (g->n_ops ? g->n_ops : 1), sy = ph / (double)(ymax ? ymax : 1);
	fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
		"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
		"viewBox=\"0 0 %.0f %.0f\" data-arena-bytes=\"%zu\" data-lower-bound-bytes=\"%zu\" "
		"data-persistent-bytes=\"%zu\" data-ops=\"%d\">\n", W, H, W, H, g->arena_bytes,
		g->lower_bound_bytes, g->persistent_bytes, g->n_ops);
	fprintf(f, "<title>arena over time: %zu bytes planned (%.1f MiB), lower bound %zu bytes "
		"(%.1f MiB), persistent %zu bytes (%.1f MiB) below it</title>\n", g->arena_bytes,
		g->arena_bytes / MiB, g->lower_bound_bytes, g->lower_bound_bytes / MiB,
		g->persistent_bytes, g->persistent_bytes / MiB);
	fprintf(f, "<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n", W, H);
	fprintf(f, "<text x=\"%.0f\" y=\"20\" font-family=\"Helvetica\" font-size=\"14\">"
		"arena %.1f MiB, lower bound %.1f MiB (ratio %.4f), persistent %.1f MiB, %d ops, "
		"B=%d T=%d K=%d</text>\n", ml, g->arena_bytes / MiB, g->lower_bound_bytes / MiB,
		g->lower_bound_bytes ? (double)g->arena_bytes / (double)g->lower_bound_bytes : 1.0,
		g->persistent_bytes / MiB, g->n_ops, g->B, g->T, g->K);
	fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
		"stroke=\"black\"/>\n", ml, mt, pw, ph);
	fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" font-family=\"Helvetica\" font-size=\"12\">op "
		"index (0 .. %d)</text>\n", ml + pw / 2 - 40, H - 12, g->n_ops - 1);
	fprintf(f, "<text x=\"10\" y=\"%.0f\" font-family=\"Helvetica\" font-size=\"12\">"
		"%.0f MiB</text>\n<text x=\"10\" y=\"%.0f\" font-family=\"Helvetica\" "
		"font-size=\"12\">0</text>\n", mt + 10, ymax / MiB, mt + ph);
	fprintf(f, "<g class=\"tensors\" data-y0=\"%.3f\" data-px-per-byte=\"%.9e\">\n",
		mt + ph, sy);
	for (int i = 0; i < g->n_tensors; i++) {
		const struct ng_tensor *t = &g->tensors[i];
		if (t->persistent || t->first_op < 0)
			continue;
		size_t rel = t->offset - g->persistent_bytes;
		double x = ml + t->first_op * sx, w = (t->last_op - t->first_op + 1) * sx;
		double h = t->bytes * sy, y = mt + ph - (double)(rel + t->bytes) * sy;
		char sh[96];
		ng_dump_format_tensor(t, sh, sizeof(sh));
		fprintf(f, "<rect x=\"%.3f\" y=\"%.3f\" width=\"%.3f\" height=\"%.3f\" fill=\"%s\" "
			"fill-opacity=\"0.55\" stroke=\"%s\" stroke-width=\"0.3\" data-name=\"", x, y,
			w, h < 0.2 ? 0.2 : h, role_colour(t->role), role_colour(t->role));
		xml_text(f, t->name);
		fprintf(f, "\" data-bytes=\"%zu\" data-offset=\"%zu\" data-first=\"%d\" "
			"data-last=\"%d\"><title>", t->bytes, t->offset, t->first_op, t->last_op);
		xml_text(f, t->name);
		fprintf(f, " %s %s: %zu bytes (%.2f MiB) at offset %zu, ops %d..%d</title></rect>\n",
			sh, ng_role_name(t->role), t->bytes, t->bytes / MiB, rel, t->first_op,
			t->last_op);
	}
	fprintf(f, "</g>\n");
	double ylb = mt + ph - (double)g->lower_bound_bytes * sy;
	fprintf(f, "<line class=\"lower-bound\" x1=\"%.1f\" y1=\"%.3f\" x2=\"%.1f\" y2=\"%.3f\" "
		"stroke=\"red\" stroke-width=\"1.5\" stroke-dasharray=\"6,4\"><title>lower bound "
		"%zu bytes (%.1f MiB)</title></line>\n", ml, ylb, ml + pw, ylb,
		g->lower_bound_bytes, g->lower_bound_bytes / MiB);
	fprintf(f, "</svg>\n");
	return close_out(f, path);
}

enum ng_status ng_dump_write_all(const struct ng_graph *g, const char *dir)
{
	if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
		ng_fail(NG_ERR_INPUT, "dump: cannot create folder %s: %s", dir, strerror(errno));
		ng_hint("create its parent folder first");
		return NG_ERR_INPUT;
	}
	size_t n = strlen(dir) + 16;
	char *p = malloc(n);
	if (!p)
		return ng_fail(NG_ERR_RUNTIME, "dump: out of host memory");
	snprintf(p, n, "%s/step.dot", dir);
	enum ng_status st = ng_dump_write_dot(g, p);
	if (!st) {
		snprintf(p, n, "%s/arena.svg", dir);
		st = ng_dump_write_arena_svg(g, p);
	}
	free(p);
	return st;
}
