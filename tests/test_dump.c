/*
 * tests/test_dump.c — the graph dump (graph/dump.c) and the plan/dump commands
 * (src/cmd_plan.c): `dot -Tsvg` renders step.dot (when graphviz is installed), xmllint accepts
 * arena.svg (when installed), every planned tensor is drawn once with the planner's bytes,
 * offset and lifetime and at the height and position those imply, the DOT has one node per op,
 * and `nanograph plan --json` prints docs/DESIGN.md's fields equal to the builder's numbers; an
 * impossible --gpu-mem is exit 2 with the numbers. Random small shapes and options each run;
 * the seed is in every message.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "graph/dump.h"
#include "graph/step.h"
#include "src/commands.h"
#include "util/rng.h"

static uint64_t seed_;
static struct ng_rng rng_;

static void setup_(void)
{
	seed_ = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
	ng_rng_seed(&rng_, seed_);
}

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	cr_assert(f, "cannot read %s", path);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *s = malloc((size_t)n + 1);
	cr_assert(s);
	cr_assert_eq(fread(s, 1, (size_t)n, f), (size_t)n);
	s[n] = '\0';
	fclose(f);
	return s;
}

static bool have(const char *tool)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "command -v %s >/dev/null 2>&1", tool);
	return system(cmd) == 0;
}

/* The value of attribute `name="..."` inside [p, end) as a string in buf. */
static bool attr(const char *p, const char *end, const char *name, char *buf, size_t len)
{
	char key[64];
	snprintf(key, sizeof(key), " %s=\"", name);
	const char *a = strstr(p, key);
	if (!a || a >= end)
		return false;
	a += strlen(key);
	const char *b = strchr(a, '"');
	if (!b || (size_t)(b - a) >= len)
		return false;
	memcpy(buf, a, (size_t)(b - a));
	buf[b - a] = '\0';
	return true;
}

static void check_svg(const struct ng_graph *g, const char *svg, const char *what)
{
	char v[128];
	cr_assert(attr(svg, svg + strlen(svg), "data-arena-bytes", v, sizeof(v)));
	cr_assert_eq(strtoull(v, NULL, 10), g->arena_bytes, "%s: arena %s vs %zu", what, v,
		     g->arena_bytes);
	cr_assert(attr(svg, svg + strlen(svg), "data-lower-bound-bytes", v, sizeof(v)));
	cr_assert_eq(strtoull(v, NULL, 10), g->lower_bound_bytes, "%s", what);
	const char *grp = strstr(svg, "<g class=\"tensors\"");
	cr_assert(grp);
	const char *gend = strchr(grp, '>');
	cr_assert(attr(grp, gend, "data-y0", v, sizeof(v)));
	double y0 = strtod(v, NULL);
	cr_assert(attr(grp, gend, "data-px-per-byte", v, sizeof(v)));
	double sy = strtod(v, NULL);
	int n_planned = 0;
	for (int i = 0; i < g->n_tensors; i++)
		n_planned += !g->tensors[i].persistent && g->tensors[i].first_op >= 0;
	char *seen = calloc(g->n_tensors > 0 ? (size_t)g->n_tensors : 1, 1);
	int n_rect = 0;
	for (const char *p = strstr(grp, "<rect "); p; p = strstr(p + 1, "<rect ")) {
		const char *end = strchr(p, '>');
		char name[NG_TENSOR_NAME + 8];
		cr_assert(attr(p, end, "data-name", name, sizeof(name)), "%s: rect without name",
			  what);
		int t = ng_graph_find_tensor(g, name);
		cr_assert_geq(t, 0, "%s: rect for unknown tensor %s", what, name);
		const struct ng_tensor *x = &g->tensors[t];
		cr_assert(!seen[t], "%s: %s drawn twice", what, name);
		seen[t] = 1;
		cr_assert(attr(p, end, "data-bytes", v, sizeof(v)));
		cr_assert_eq(strtoull(v, NULL, 10), x->bytes, "%s: %s drawn with %s bytes, planned %zu",
			     what, name, v, x->bytes);
		cr_assert(attr(p, end, "data-offset", v, sizeof(v)));
		cr_assert_eq(strtoull(v, NULL, 10), x->offset, "%s: %s offset", what, name);
		cr_assert(attr(p, end, "data-first", v, sizeof(v)));
		cr_assert_eq(atoi(v), x->first_op);
		cr_assert(attr(p, end, "data-last", v, sizeof(v)));
		cr_assert_eq(atoi(v), x->last_op);
		cr_assert(attr(p, end, "height", v, sizeof(v)));
		double h = strtod(v, NULL), want_h = (double)x->bytes * sy;
		cr_assert(attr(p, end, "y", v, sizeof(v)));
		double y = strtod(v, NULL);
		double want_y = y0 - (double)(x->offset - g->persistent_bytes + x->bytes) * sy;
		cr_assert(fabs(h - (want_h < 0.2 ? 0.2 : want_h)) <= 1e-3 + 1e-6 * want_h,
			  "%s: %s height %g, bytes imply %g", what, name, h, want_h);
		cr_assert(fabs(y - want_y) <= 1e-3 + 1e-6 * fabs(want_y),
			  "%s: %s y %g, offset implies %g", what, name, y, want_y);
		n_rect++;
	}
	cr_assert_eq(n_rect, n_planned, "%s: %d rectangles for %d planned tensors", what, n_rect,
		     n_planned);
	cr_assert(strstr(svg, "class=\"lower-bound\""));
	free(seen);
}

Test(dump, dot_renders_and_svg_matches_the_plan, .init = setup_, .timeout = 120)
{
	char dir[] = "/tmp/ng_dump_XXXXXX";
	cr_assert(mkdtemp(dir));
	bool dot = have("dot"), xmllint = have("xmllint");
	if (!dot || !xmllint)
		cr_log_warn("graphviz dot %s, xmllint %s: those checks are skipped",
			    dot ? "found" : "missing", xmllint ? "found" : "missing");
	for (int rep = 0; rep < 6; rep++) {
		struct ng_gpt_config c;
		cr_assert_eq(ng_gpt_preset(&c, "tiny"), NG_OK);
		c.L = 1 + (int)ng_rng_below(&rng_, 3);
		cr_assert_eq(ng_gpt_check(&c), NG_OK);
		int B = 1 + (int)ng_rng_below(&rng_, 3), T = 1 + (int)ng_rng_below(&rng_, 64);
		int K = 1 + (int)ng_rng_below(&rng_, 2);
		struct ng_step_options o;
		ng_step_default_options(&o);
		o.recompute_gelu = (int)ng_rng_below(&rng_, 2);
		o.recompute_layernorm = (int)ng_rng_below(&rng_, 2);
		o.fuse_gelu = (int)ng_rng_below(&rng_, 4);
		o.head_chunk_rows = (int)ng_rng_below(&rng_, (uint64_t)(B * T));
		struct ng_graph g;
		enum ng_status st = rep % 3 == 0   ? ng_step_build_train(&g, &c, B, T, K, &o)
				    : rep % 3 == 1 ? ng_step_build_eval(&g, &c, B, T, K, &o)
						   : ng_step_build_sample(&g, &c, B, T, &o);
		cr_assert_eq(st, NG_OK, "%s", ng_error_message());
		char what[128];
		snprintf(what, sizeof(what), "seed %llu rep %d (L=%d B=%d T=%d K=%d)",
			 (unsigned long long)seed_, rep, c.L, B, T, K);
		cr_assert_eq(ng_dump_write_all(&g, dir), NG_OK, "%s: %s", what, ng_error_message());
		char path[256], cmd[600];
		snprintf(path, sizeof(path), "%s/arena.svg", dir);
		char *svg = slurp(path);
		check_svg(&g, svg, what);
		free(svg);
		snprintf(path, sizeof(path), "%s/step.dot", dir);
		char *dotsrc = slurp(path);
		for (int k = 0; k < g.n_ops; k++) {
			char node[64];
			snprintf(node, sizeof(node), "    op%d [label=\"%d: ", k, k);
			cr_assert(strstr(dotsrc, node), "%s: op %d has no node", what, k);
		}
		free(dotsrc);
		if (dot) {
			snprintf(cmd, sizeof(cmd), "dot -Tsvg %s/step.dot -o %s/step.svg 2>%s/dot.err",
				 dir, dir, dir);
			cr_assert_eq(system(cmd), 0, "%s: dot -Tsvg failed (see %s/dot.err)", what,
				     dir);
		}
		if (xmllint) {
			snprintf(cmd, sizeof(cmd), "xmllint --noout %s/arena.svg 2>%s/xml.err", dir,
				 dir);
			cr_assert_eq(system(cmd), 0, "%s: xmllint rejects arena.svg (see %s/xml.err)",
				     what, dir);
		}
		ng_graph_free(&g);
	}
	char cmd[300];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	cr_assert_eq(system(cmd), 0);
}

/* Run `nanograph argv...` in-process with stdout into `out`. */
static enum ng_status run_cli(const char *out, int argc, char **argv)
{
	fflush(stdout);
	int saved = dup(1);
	int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	cr_assert(saved >= 0 && fd >= 0);
	dup2(fd, 1);
	close(fd);
	enum ng_status st = ng_main(argc, argv);
	fflush(stdout);
	dup2(saved, 1);
	close(saved);
	return st;
}

Test(dump, plan_json_has_the_design_fields, .init = setup_)
{
	static const char *models[] = { "tiny", "d12", "d24" };
	const char *model = models[ng_rng_below(&rng_, 3)];
	char batch[16];
	snprintf(batch, sizeof(batch), "%d", 1 + (int)ng_rng_below(&rng_, 8));
	char out[] = "/tmp/ng_plan_XXXXXX";
	int fd = mkstemp(out);
	cr_assert(fd >= 0);
	close(fd);
	char *argv[] = { "nanograph", "plan", "--model", (char *)model, "--batch", batch,
			 "--recompute", "gelu", "--json", NULL };
	ng_clear_error();
	cr_assert_eq(run_cli(out, 9, argv), NG_OK, "%s", ng_error_message());
	char *txt = slurp(out);
	json_error_t err;
	json_t *j = json_loads(txt, 0, &err);
	cr_assert(j, "plan --json is not JSON (%s): %s", err.text, txt);
	struct ng_gpt_config c;
	cr_assert_eq(ng_gpt_preset(&c, model), NG_OK);
	cr_assert_eq(ng_gpt_check(&c), NG_OK);
	struct ng_step_options o;
	ng_step_default_options(&o);
	o.recompute_gelu = 1;
	struct ng_graph g;
	cr_assert_eq(ng_step_build_train(&g, &c, atoi(batch), c.T, 1, &o), NG_OK);
	const char *fields[] = { "arena_bytes", "lower_bound_bytes", "params_bytes", "grads_bytes",
				 "optimizer_bytes", "activations_bytes", "workspace_bytes",
				 "total_bytes" };
	for (int i = 0; i < 8; i++)
		cr_assert(json_is_integer(json_object_get(j, fields[i])), "%s missing: %s",
			  fields[i], txt);
	cr_assert_eq((size_t)json_integer_value(json_object_get(j, "arena_bytes")), g.arena_bytes);
	cr_assert_eq((size_t)json_integer_value(json_object_get(j, "lower_bound_bytes")),
		     g.lower_bound_bytes);
	cr_assert_eq((size_t)json_integer_value(json_object_get(j, "total_bytes")), g.total_bytes);
	size_t act = (size_t)json_integer_value(json_object_get(j, "activations_bytes"));
	size_t ws = (size_t)json_integer_value(json_object_get(j, "workspace_bytes"));
	cr_assert_leq(act + ws, g.lower_bound_bytes);
	/* the fp32 master as its bf16 copy and low half: 4 bytes a parameter, 2 x g->align slack */
	size_t pb = (size_t)json_integer_value(json_object_get(j, "params_bytes"));
	cr_assert(pb >= g.lay.total * 4 && pb <= g.lay.total * 4 + 2 * g.align,
		  "params_bytes %zu for %zu parameters: want 4 bytes each", pb, g.lay.total);
	cr_assert_eq(json_array_size(json_object_get(j, "largest")), 10);
	json_decref(j);
	free(txt);
	ng_graph_free(&g);

	/* --fp8: the same plan with the E4M3 weights (and W^T) and scales, every fp8 kind */
	char *argv5[] = { "nanograph", "plan", "--model", (char *)model, "--batch", batch,
			  "--recompute", "gelu", "--fp8", "--json", NULL };
	ng_clear_error();
	cr_assert_eq(run_cli(out, 10, argv5), NG_OK, "%s", ng_error_message());
	txt = slurp(out);
	j = json_loads(txt, 0, &err);
	cr_assert(j, "plan --fp8 --json is not JSON (%s): %s", err.text, txt);
	o.fp8 = NG_FP8_EVERY;
	cr_assert_eq(ng_step_build_train(&g, &c, atoi(batch), c.T, 1, &o), NG_OK);
	cr_assert_eq((size_t)json_integer_value(json_object_get(j, "total_bytes")), g.total_bytes);
	cr_assert_eq(json_integer_value(json_object_get(j, "fp8")), NG_FP8_EVERY);
	cr_assert_geq((size_t)json_integer_value(json_object_get(j, "params_bytes")),
		      g.lay.total * 5, "bf16 + low half + E4M3: 5 bytes a parameter");
	json_decref(j);
	free(txt);
	ng_graph_free(&g);

	/* an impossible plan: exit 2, the numbers and a hint */
	char *argv2[] = { "nanograph", "plan", "--model", "d48", "--batch", "16", "--gpu-mem",
			  "40", NULL };
	ng_clear_error();
	cr_assert_eq(run_cli(out, 8, argv2), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "GiB"), "message: %s", ng_error_message());
	cr_assert(strstr(ng_error_hint(), "recompute"), "hint: %s", ng_error_hint());
	ng_clear_error();
	char *argv3[] = { "nanograph", "plan", "--recompute", "nonsense", NULL };
	cr_assert_eq(run_cli(out, 4, argv3), NG_ERR_INPUT);
	ng_clear_error();
	/* an empty list, and fp8 weights to recast without --fp8: one line and a hint each */
	char *argv6[] = { "nanograph", "plan", "--recompute", "", NULL };
	cr_assert_eq(run_cli(out, 4, argv6), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "empty"), "message: %s", ng_error_message());
	ng_clear_error();
	char *argv7[] = { "nanograph", "plan", "--recompute", "gelu,fp8", NULL };
	cr_assert_eq(run_cli(out, 4, argv7), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_hint(), "--fp8"), "hint: %s", ng_error_hint());
	ng_clear_error();
	char *argv4[] = { "nanograph", "dump", "--model", "tiny", NULL };
	cr_assert_eq(run_cli(out, 4, argv4), NG_ERR_INPUT, "dump without --out");
	ng_clear_error();
	unlink(out);
}
