/*
 * tools/export_init.c — write the seeded initial parameters of a model preset as a flat float32
 * file in graph/gpt.h's layout, for the PyTorch peer (tools/peer/gpt_peer.py) to load, so both
 * start from the same weights. Usage: export_init MODEL SEED OUT [--layers N] [--heads N]
 * [--channels N] [--seq-len T] [--vocab V]: the flags change the preset's shape as train's do.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/gpt.h"

int main(int argc, char **argv)
{
	if (argc < 4 || argc % 2 != 0) {
		fprintf(stderr, "usage: export_init tiny|d12|d24|d36|d48|speedrun|speedrun-tiny SEED "
			"OUT [--layers N] [--heads N] [--channels N] [--seq-len T] [--vocab V]\n");
		return 2;
	}
	struct ng_gpt_config cfg;
	if (ng_gpt_preset(&cfg, argv[1]) != NG_OK) {
		ng_print_error();
		return 2;
	}
	for (int i = 4; i < argc; i += 2) {
		static const char *names[] = { "--layers", "--heads", "--channels", "--seq-len",
					       "--vocab" };
		int *dst[] = { &cfg.L, &cfg.H, &cfg.C, &cfg.T, &cfg.V };
		char *end;
		long v = strtol(argv[i + 1], &end, 10);
		int k = 0;
		while (k < 5 && strcmp(argv[i], names[k]) != 0)
			k++;
		if (k == 5 || *end != '\0' || end == argv[i + 1] || v < 1 || v > 1 << 20) {
			fprintf(stderr, "export_init: bad flag '%s %s' (hint: --layers, --heads, "
				"--channels, --seq-len or --vocab, each with a positive count)\n",
				argv[i], argv[i + 1]);
			return 2;
		}
		*dst[k] = (int)v;
	}
	if (ng_gpt_check(&cfg) != NG_OK) {
		ng_print_error();
		return 2;
	}
	struct ng_gpt_layout lay;
	ng_gpt_layout(&cfg, &lay);
	float *p = malloc(lay.total * sizeof(float));
	if (!p)
		return 1;
	ng_gpt_init(&cfg, &lay, strtoull(argv[2], NULL, 10), p);
	FILE *f = fopen(argv[3], "wb");
	if (!f || fwrite(p, sizeof(float), lay.total, f) != lay.total || fclose(f) != 0) {
		fprintf(stderr, "export_init: cannot write %s\n", argv[3]);
		return 1;
	}
	printf("export_init: %s seed %s: %zu floats (%zu parameters) -> %s\n", argv[1], argv[2],
	       lay.total, lay.n_params, argv[3]);
	free(p);
	return 0;
}
