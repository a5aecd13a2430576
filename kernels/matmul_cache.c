/*
 * kernels/matmul_cache.c — autotune's choices kept in a text file between runs (matmul.h,
 * "Choices kept"), so that only the first plan of a matmul on a GPU pays for its timing.
 *
 * The file, one record a line:
 *   nanograph-autotune 1
 *   device NVIDIA_H200_sm_90_cublasLt_130000
 *   choice KIND N IC OC GELU BIAS ACCUMULATE FP8 ALIGN WORKSPACE COLSUM HASH NCAND CHOSEN MS
 * KIND is 0 FWD, 1 DINP, 2 DW; HASH is 16 hex digits; MS the chosen candidate's time when it
 * was timed. Only the file's own device line's choices are read: another GPU's are ignored
 * (and replaced when this one saves).
 */
#include "kernels/matmul.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CACHE_MAGIC "nanograph-autotune 1"

enum ng_status ng_matmul_choices_load(struct ng_matmul_ctx *ctx, const char *path,
				      const char *device, int *loaded)
{
	*loaded = 0;
	FILE *f = fopen(path, "r");
	if (!f)
		return NG_OK; /* no file yet: nothing known */
	char line[512], want[300];
	snprintf(want, sizeof(want), "device %s", device);
	int lineno = 0;
	enum ng_status st = NG_OK;
	struct ng_matmul_ctx got; /* the file's choices, handed to ctx only if all of it reads */
	memset(&got, 0, sizeof(got));
	while (fgets(line, sizeof(line), f)) {
		lineno++;
		line[strcspn(line, "\r\n")] = '\0';
		if (lineno == 1 && strcmp(line, CACHE_MAGIC) != 0) {
			st = ng_fail(NG_ERR_INPUT, "autotune cache %s: line 1 is not \"%s\"", path,
				     CACHE_MAGIC);
			break;
		}
		if (lineno == 2 && strcmp(line, want) != 0)
			break; /* another GPU or cuBLASLt: its choices are not ours */
		if (lineno <= 2)
			continue;
		struct ng_matmul_choice c;
		int kind = -1, used = 0;
		memset(&c, 0, sizeof(c));
		if (sscanf(line, "choice %d %d %d %d %d %d %d %d %u %llu %d %llx %d %d %f%n", &kind,
			   &c.spec.N, &c.spec.IC, &c.spec.OC, &c.spec.gelu, &c.spec.bias,
			   &c.spec.accumulate, &c.spec.fp8, &c.align_bytes, &c.workspace_bytes,
			   &c.colsum, &c.candidates_hash, &c.n_candidates, &c.chosen, &c.ms,
			   &used) != 15 ||
		    line[used] != '\0' || kind < NG_MATMUL_FWD || kind > NG_MATMUL_DW ||
		    c.n_candidates < 1 || c.chosen < 0 || c.chosen >= c.n_candidates) {
			st = ng_fail(NG_ERR_INPUT, "autotune cache %s: line %d is not a choice: "
				     "\"%.80s\"", path, lineno, line);
			break;
		}
		c.spec.kind = (enum ng_matmul_kind)kind;
		c.spec.autotune = 1;
		if ((st = ng_matmul_choice_add(&got, &c)))
			break;
	}
	if (!st && ferror(f))
		st = ng_fail(NG_ERR_INPUT, "autotune cache %s: read error: %s", path,
			     strerror(errno));
	fclose(f);
	for (int i = 0; i < got.n_choices && !st; i++)
		st = ng_matmul_choice_add(ctx, &got.choices[i]);
	if (!st)
		*loaded = got.n_choices;
	free(got.choices);
	return st;
}

/* mkdir -p of path's directory part. */
static int make_parent_(const char *path)
{
	char dir[4096];
	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (!slash || slash == dir)
		return 0;
	*slash = '\0';
	for (char *p = dir + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(dir, 0755) != 0 && errno != EEXIST)
			return -1;
		*p = '/';
	}
	return mkdir(dir, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

enum ng_status ng_matmul_choices_save(const struct ng_matmul_ctx *ctx, const char *path,
				      const char *device)
{
	char tmp[4200];
	snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
	if (make_parent_(path))
		return ng_fail(NG_ERR_INPUT, "autotune cache %s: cannot create its directory: %s",
			       path, strerror(errno));
	FILE *f = fopen(tmp, "w");
	if (!f)
		return ng_fail(NG_ERR_INPUT, "autotune cache %s: cannot write %s: %s", path, tmp,
			       strerror(errno));
	fprintf(f, "%s\ndevice %s\n", CACHE_MAGIC, device);
	for (int i = 0; i < ctx->n_choices; i++) {
		const struct ng_matmul_choice *c = &ctx->choices[i];
		fprintf(f, "choice %d %d %d %d %d %d %d %d %u %llu %d %016llx %d %d %.4f\n",
			(int)c->spec.kind, c->spec.N, c->spec.IC, c->spec.OC, c->spec.gelu,
			c->spec.bias, c->spec.accumulate, c->spec.fp8, c->align_bytes,
			c->workspace_bytes, c->colsum, c->candidates_hash, c->n_candidates,
			c->chosen, c->ms);
	}
	int bad = ferror(f);
	if (fclose(f) != 0 || bad) {
		remove(tmp);
		return ng_fail(NG_ERR_INPUT, "autotune cache %s: write failed: %s", path,
			       strerror(errno));
	}
	if (rename(tmp, path) != 0) {
		int e = errno;
		remove(tmp);
		return ng_fail(NG_ERR_INPUT, "autotune cache %s: cannot replace it: %s", path,
			       strerror(e));
	}
	return NG_OK;
}
