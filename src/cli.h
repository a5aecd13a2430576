/*
 * src/cli.h — the table-driven flag parser every subcommand uses, and the shared [model] [batch]
 * flags of the docs/DESIGN.md contract. One table per command gives each flag's name, type, range
 * and help; the parser rejects unknown flags, missing values and out-of-range values with one
 * line naming the flag (status NG_ERR_INPUT, exit 2), and prints the table for --help.
 */
#ifndef NG_SRC_CLI_H
#define NG_SRC_CLI_H

#include <stdbool.h>
#include <stdint.h>

#include "graph/gpt.h"
#include "util/status.h"

enum ng_flag_kind {
	NG_FLAG_INT,    /* long long *dest, range [min, max] */
	NG_FLAG_DOUBLE, /* double *dest, range [min, max] */
	NG_FLAG_STRING, /* const char **dest */
	NG_FLAG_BOOL,   /* bool *dest; takes no value */
};

struct ng_flag {
	const char *name;       /* "--steps" */
	enum ng_flag_kind kind;
	void *dest;             /* see the kinds */
	double min, max;        /* inclusive range for numbers */
	const char *metavar;    /* "N", "X", "GLOB" ... for --help */
	const char *help;       /* one line */
	bool seen;              /* set by the parser */
};

struct ng_command_spec {
	const char *name;     /* "train" */
	const char *summary;  /* one line */
	const char *usage;    /* the synopsis after "nanograph <name> " */
	struct ng_flag *flags;
	int nflags;
	int max_positional;   /* 0: none allowed */
};

/* Parse argv (argv[0] is the subcommand). Positional arguments are collected into
 * positional[0..*npositional-1] (pointers into argv). Returns NG_OK, NG_ERR_INPUT with the error
 * recorded, or NG_OK with *help_shown = true when --help was given (help already printed). */
enum ng_status ng_cli_parse(struct ng_command_spec *spec, int argc, char **argv,
			    char **positional, int *npositional, bool *help_shown);
void ng_cli_print_help(const struct ng_command_spec *spec);
/* The flag named `name` was given on the command line. */
bool ng_cli_seen(const struct ng_command_spec *spec, const char *name);

/* The [model] [batch] flags, shared by train, plan, dump, bench. */
struct ng_model_args {
	const char *model;      /* preset name or NULL */
	long long layers, heads, channels, seq_len, vocab; /* 0 = from the preset */
	long long batch;        /* micro-batch B, sequences */
	long long total_batch;  /* tokens per optimizer step; 0 = B*T (no accumulation) */
};

#define NG_MODEL_NFLAGS 8
/* Write the 8 [model] [batch] flags into flags[0..7], pointing at args. `default_model` and
 * `default_batch` set the starting values (batch 0: 64, or 1 for the speedrun presets, whose
 * sequence holds the step's tokens). */
void ng_cli_model_flags(struct ng_model_args *args, struct ng_flag *flags,
			const char *default_model, long long default_batch);

struct ng_shape {
	struct ng_gpt_config model;
	int B;  /* micro-batch, sequences */
	int T;  /* sequence length used for training (== model.T unless --seq-len given) */
	int K;  /* micro-batches per optimizer step (gradient accumulation) */
};

/* Resolve presets and free flags into a checked shape: total_batch must be a multiple of B*T. */
enum ng_status ng_cli_resolve_shape(const struct ng_model_args *args, struct ng_shape *shape);

#endif
