/*
 * src/dispatch.c — the subcommand table, --help and --version (main.c only calls ng_main).
 */
#include <stdio.h>
#include <string.h>

#include "ng_config.h"
#include "src/commands.h"

static const struct {
	const char *name;
	enum ng_status (*run)(int argc, char **argv);
	const char *summary;
} commands[] = {
	{ "train", ng_cmd_train, "train a GPT (GPU: one CUDA Graph per step; --device cpu: reference)" },
	{ "plan", ng_cmd_plan, "print the memory plan of a training step (no GPU needed)" },
	{ "dump", ng_cmd_dump, "write the step as Graphviz DOT and the arena as SVG" },
	{ "prepare", ng_cmd_prepare, "turn text files into GPT-2 token shards" },
	{ "sample", ng_cmd_sample, "generate text from a checkpoint" },
	{ "eval", ng_cmd_eval, "validation loss and perplexity of a checkpoint" },
};

static void usage(FILE *f)
{
	fprintf(f, "usage: nanograph <command> [flags]   (nanograph <command> --help for its flags)\n\n");
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].summary);
	fprintf(f, "\n  --version      print the version\n");
}

enum ng_status ng_main(int argc, char **argv)
{
	if (argc < 2) {
		usage(stderr);
		ng_fail(NG_ERR_INPUT, "no command given");
		ng_hint("nanograph train --model d12 trains GPT-2 124M; nanograph --help lists the commands");
		return NG_ERR_INPUT;
	}
	if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
	    strcmp(argv[1], "help") == 0) {
		usage(stdout);
		return NG_OK;
	}
	if (strcmp(argv[1], "--version") == 0) {
		printf("nanograph %s\n", NG_VERSION);
		return NG_OK;
	}
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		if (strcmp(argv[1], commands[i].name) == 0)
			return commands[i].run(argc - 1, argv + 1);
	ng_fail(NG_ERR_INPUT, "unknown command '%s'", argv[1]);
	ng_hint("nanograph --help lists the commands");
	return NG_ERR_INPUT;
}
