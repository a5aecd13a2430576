/*
 * tests/test_corpus.c — tools/corpus: the same files give the same shards byte for byte; the
 * documents go into the stream in the order of their SHA-256 (the manifest's third column
 * ascends), and --path-order takes the same files in path order (the first column ascends in
 * bytes). Runs the tool on 2 MB of this machine's text, from the source root (where
 * tools/run-tests and meson test run), with the nanograph binary of this build.
 */
#define _XOPEN_SOURCE 700
#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/test_tmpdir.h"

/* The whole of a file, NUL-terminated; *n its size. */
static char *slurp(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	cr_assert(f, "cannot open %s", path);
	fseek(f, 0, SEEK_END);
	*n = (size_t)ftell(f);
	fseek(f, 0, SEEK_SET);
	char *b = malloc(*n + 1);
	cr_assert(b && fread(b, 1, *n, f) == *n, "cannot read %s", path);
	b[*n] = '\0';
	fclose(f);
	return b;
}

/* Run tools/corpus into <test dir>/name with extra flags; fail on a non-zero exit. */
static void corpus(const char *bin, const char *name, const char *extra)
{
	char cmd[2048];
	snprintf(cmd, sizeof(cmd), "NANOGRAPH='%s' python3 tools/corpus '%s/%s' --max-mb 2 "
		 "--val-tokens 20000 %s >/dev/null 2>&1", bin, ng_test_dir, name, extra);
	cr_assert_eq(system(cmd), 0, "failed: %s", cmd);
}

/* Field k (0-based, tab-separated) of each manifest line, in order; returns the count. */
static int fields(char *text, int k, char **out, int max)
{
	int n = 0;
	for (char *line = strtok(text, "\n"); line && n < max; line = strtok(NULL, "\n")) {
		char *f = line;
		for (int i = 0; i < k && f; i++)
			f = strchr(f, '\t') ? strchr(f, '\t') + 1 : NULL;
		cr_assert(f, "manifest line without field %d: %s", k, line);
		out[n++] = f;
	}
	return n;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

Test(corpus, deterministic_and_ordered_by_content, .timeout = 300)
{
	if (access("tools/corpus", X_OK) != 0)
		cr_skip_test("tools/corpus not here: run from the source root");
	if (system("python3 -c pass >/dev/null 2>&1") != 0)
		cr_skip_test("no python3");
	char exe[PATH_MAX], bin[PATH_MAX + 16];
	ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	cr_assert(len > 0);
	exe[len] = '\0';
	*strrchr(exe, '/') = '\0'; /* <build>/tests */
	snprintf(bin, sizeof(bin), "%s/../nanograph", exe);
	cr_assert(access(bin, X_OK) == 0, "no nanograph binary at %s", bin);
	ng_test_dir_make("ng_corpus_");
	corpus(bin, "a", "");
	corpus(bin, "b", "");
	corpus(bin, "p", "--path-order");
	const char *files[] = { "train_000000.bin", "val_000000.bin", "manifest.tsv" };
	for (int i = 0; i < 3; i++) {
		char pa[512], pb[512];
		snprintf(pa, sizeof(pa), "%s/a/%s", ng_test_dir, files[i]);
		snprintf(pb, sizeof(pb), "%s/b/%s", ng_test_dir, files[i]);
		size_t na, nb;
		char *x = slurp(pa, &na), *y = slurp(pb, &nb);
		cr_expect(na == nb && memcmp(x, y, na) == 0, "two runs made different %s", files[i]);
		free(x);
		free(y);
	}
	enum { MAX = 100000 };
	char pa[512], pp[512];
	snprintf(pa, sizeof(pa), "%s/a/manifest.tsv", ng_test_dir);
	snprintf(pp, sizeof(pp), "%s/p/manifest.tsv", ng_test_dir);
	size_t na, np;
	char *ma = slurp(pa, &na), *mp = slurp(pp, &np), *ma2 = strdup(ma), *mp2 = strdup(mp);
	char **ha = malloc(MAX * sizeof(char *)), **pth = malloc(MAX * sizeof(char *));
	char **la = malloc(MAX * sizeof(char *)), **lp = malloc(MAX * sizeof(char *));
	int n = fields(ma, 2, ha, MAX), m = fields(mp, 0, pth, MAX);
	cr_assert(n > 1 && n == m, "%d files by content, %d by path", n, m);
	for (int i = 1; i < n; i++) {
		cr_expect(strcmp(ha[i - 1], ha[i]) < 0, "stream order: line %d's sha256 does not "
			  "ascend", i + 1);
		cr_expect(strcmp(pth[i - 1], pth[i]) < 0, "--path-order: line %d's path does not "
			  "ascend", i + 1);
	}
	/* the same files either way */
	fields(ma2, 0, la, MAX);
	fields(mp2, 0, lp, MAX);
	qsort(la, (size_t)n, sizeof(char *), cmp_str);
	qsort(lp, (size_t)n, sizeof(char *), cmp_str);
	for (int i = 0; i < n; i++)
		cr_expect_str_eq(la[i], lp[i], "line %d of the sorted manifests", i + 1);
	free(ma), free(mp), free(ma2), free(mp2), free(ha), free(pth), free(la), free(lp);
}
