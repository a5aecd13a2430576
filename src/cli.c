/*
 * src/cli.c — flag parsing and the shared [model] [batch] flags (see cli.h).
 */
#include "src/cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct ng_flag *find_flag(struct ng_command_spec *spec, const char *name, size_t len)
{
	for (int i = 0; i < spec->nflags; i++) {
		const char *f = spec->flags[i].name;
		if (strlen(f) == len && strncmp(f, name, len) == 0)
			return &spec->flags[i];
	}
	return NULL;
}

static enum ng_status set_value(struct ng_command_spec *spec, struct ng_flag *f, const char *v)
{
	char *end;
	switch (f->kind) {
	case NG_FLAG_INT: {
		errno = 0;
		long long x = strtoll(v, &end, 10);
		/* accept 1e6-style and 2^k-free integers written as floats ("524288", "5e5") */
		if (*end == 'e' || *end == 'E' || *end == '.') {
			double d = strtod(v, &end);
			if (*end || d != floor(d) || fabs(d) > 9e18)
				goto bad;
			x = (long long)d;
		}
		if (errno || *end || end == v)
			goto bad;
		if ((double)x < f->min || (double)x > f->max)
			return ng_fail(NG_ERR_INPUT, "%s %s: %s %lld is out of range (%.0f..%.0f)",
				       spec->name, f->name, f->name, x, f->min, f->max);
		*(long long *)f->dest = x;
		return NG_OK;
	}
	case NG_FLAG_DOUBLE: {
		errno = 0;
		double x = strtod(v, &end);
		if (errno || *end || end == v || !isfinite(x))
			goto bad;
		if (x < f->min || x > f->max)
			return ng_fail(NG_ERR_INPUT, "%s %s: %s %g is out of range (%g..%g)",
				       spec->name, f->name, f->name, x, f->min, f->max);
		*(double *)f->dest = x;
		return NG_OK;
	}
	case NG_FLAG_STRING:
		*(const char **)f->dest = v;
		return NG_OK;
	case NG_FLAG_BOOL:
		break;
	}
bad:
	ng_fail(NG_ERR_INPUT, "%s %s: '%s' is not a valid %s", spec->name, f->name, v,
		f->kind == NG_FLAG_INT ? "integer" : "number");
	ng_hint("see nanograph %s --help", spec->name);
	return NG_ERR_INPUT;
}

enum ng_status ng_cli_parse(struct ng_command_spec *spec, int argc, char **argv,
			    char **positional, int *npositional, bool *help_shown)
{
	*help_shown = false;
	*npositional = 0;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
			ng_cli_print_help(spec);
			*help_shown = true;
			return NG_OK;
		}
		if (strncmp(a, "--", 2) != 0 || strcmp(a, "--") == 0 || a[2] == '\0') {
			if (*npositional >= spec->max_positional) {
				ng_fail(NG_ERR_INPUT, "%s: unexpected argument '%s'", spec->name, a);
				ng_hint("see nanograph %s --help", spec->name);
				return NG_ERR_INPUT;
			}
			positional[(*npositional)++] = argv[i];
			continue;
		}
		const char *eq = strchr(a, '=');
		size_t len = eq ? (size_t)(eq - a) : strlen(a);
		struct ng_flag *f = find_flag(spec, a, len);
		if (!f) {
			ng_fail(NG_ERR_INPUT, "%s: unknown flag '%.*s'", spec->name, (int)len, a);
			ng_hint("see nanograph %s --help", spec->name);
			return NG_ERR_INPUT;
		}
		f->seen = true;
		if (f->kind == NG_FLAG_BOOL) {
			if (eq)
				return ng_fail(NG_ERR_INPUT, "%s: %s takes no value", spec->name,
					       f->name);
			*(bool *)f->dest = true;
			continue;
		}
		const char *v = eq ? eq + 1 : NULL;
		if (!v) {
			if (i + 1 >= argc)
				return ng_fail(NG_ERR_INPUT, "%s: %s needs a value (%s)", spec->name,
					       f->name, f->metavar ? f->metavar : "VALUE");
			v = argv[++i];
		}
		enum ng_status st = set_value(spec, f, v);
		if (st)
			return st;
	}
	return NG_OK;
}

void ng_cli_print_help(const struct ng_command_spec *spec)
{
	printf("usage: nanograph %s %s\n\n%s\n\n", spec->name, spec->usage, spec->summary);
	for (int i = 0; i < spec->nflags; i++) {
		const struct ng_flag *f = &spec->flags[i];
		char left[64];
		snprintf(left, sizeof(left), "%s%s%s", f->name, f->kind == NG_FLAG_BOOL ? "" : " ",
			 f->kind == NG_FLAG_BOOL ? "" : (f->metavar ? f->metavar : "VALUE"));
		printf("  %-24s %s\n", left, f->help);
	}
}

bool ng_cli_seen(const struct ng_command_spec *spec, const char *name)
{
	for (int i = 0; i < spec->nflags; i++)
		if (strcmp(spec->flags[i].name, name) == 0)
			return spec->flags[i].seen;
	return false;
}

void ng_cli_model_flags(struct ng_model_args *a, struct ng_flag *f, const char *default_model,
			long long default_batch)
{
	memset(a, 0, sizeof(*a));
	a->model = default_model;
	a->batch = default_batch;
	struct ng_flag t[NG_MODEL_NFLAGS] = {
		{ "--model", NG_FLAG_STRING, &a->model, 0, 0, "NAME",
		  "preset: tiny|d12|d24|d36|d48 (GPT-2 124M/350M/774M/1558M), speedrun|"
		  "speedrun-tiny (the NanoGPT speedrun model, docs/DESIGN.md)", false },
		{ "--layers", NG_FLAG_INT, &a->layers, 1, 1024, "N", "transformer blocks", false },
		{ "--heads", NG_FLAG_INT, &a->heads, 1, 1024, "N", "attention heads", false },
		{ "--channels", NG_FLAG_INT, &a->channels, 8, 65536, "N", "model width C", false },
		{ "--seq-len", NG_FLAG_INT, &a->seq_len, 1, 131072, "T", "sequence length", false },
		{ "--vocab", NG_FLAG_INT, &a->vocab, 2, 65536, "V", "vocabulary size", false },
		{ "--batch", NG_FLAG_INT, &a->batch, 1, 1 << 20, "B", "micro-batch, sequences",
		  false },
		{ "--total-batch", NG_FLAG_INT, &a->total_batch, 1, 1e12, "TOKENS",
		  "tokens per optimizer step (a multiple of B*T; adds gradient accumulation)", false },
	};
	memcpy(f, t, sizeof(t));
}

enum ng_status ng_cli_resolve_shape(const struct ng_model_args *a, struct ng_shape *s)
{
	memset(s, 0, sizeof(*s));
	enum ng_status st = ng_gpt_preset(&s->model, a->model ? a->model : "d12");
	if (st)
		return st;
	if (a->layers)
		s->model.L = (int)a->layers;
	if (a->heads)
		s->model.H = (int)a->heads;
	if (a->channels)
		s->model.C = (int)a->channels;
	if (a->seq_len)
		s->model.T = (int)a->seq_len;
	if (a->vocab)
		s->model.V = (int)a->vocab;
	st = ng_gpt_check(&s->model);
	if (st)
		return st;
	/* batch 0: the family's default, one long sequence for the speedrun model */
	s->B = a->batch ? (int)a->batch : s->model.arch == NG_ARCH_SPEEDRUN ? 1 : 64;
	s->T = s->model.T;
	long long bt = (long long)s->B * s->T;
	if (a->total_batch == 0) {
		s->K = 1;
	} else if (a->total_batch % bt != 0) {
		ng_fail(NG_ERR_INPUT, "--total-batch %lld is not a multiple of batch x seq-len = %lld",
			a->total_batch, bt);
		ng_hint("use --total-batch %lld (K=%lld micro-batches)",
			(a->total_batch / bt + 1) * bt, a->total_batch / bt + 1);
		return NG_ERR_INPUT;
	} else {
		s->K = (int)(a->total_batch / bt);
	}
	if (s->K > 1 << 16)
		return ng_fail(NG_ERR_INPUT, "--total-batch %lld needs %d micro-batches; at most 65536",
			       a->total_batch, s->K);
	return NG_OK;
}
