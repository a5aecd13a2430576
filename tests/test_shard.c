/*
 * tests/test_shard.c — the shard format: write/read round trip of random tokens, and every bad
 * file (missing, wrong magic, wrong version, truncated, header count larger than the file,
 * trailing bytes, a token >= vocab with its offset, a FIFO or a device) gives one line naming
 * the file, at once.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "data/shard.h"
#include "util/rng.h"

static char dir[64];
static uint64_t seed;

static void setup(void)
{
	snprintf(dir, sizeof(dir), "/tmp/ng_shard_XXXXXX");
	cr_assert(mkdtemp(dir));
	seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
}

static void teardown(void)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}

TestSuite(shard, .init = setup, .fini = teardown);

/* Write a raw file: the first header_bytes of a header h0..h2, then n tokens from tok. */
static void write_raw(const char *path, int h0, int h1, int h2, const uint16_t *tok, size_t n,
		      size_t header_bytes)
{
	int32_t h[256] = { h0, h1, h2 };
	FILE *f = fopen(path, "wb");
	cr_assert(f);
	fwrite(h, 1, header_bytes, f);
	fwrite(tok, 2, n, f);
	fclose(f);
}

static void expect_error(const char *path, int vocab, const char *needle)
{
	struct ng_shard s;
	ng_clear_error();
	enum ng_status st = ng_shard_open(&s, path, vocab);
	cr_assert_eq(st, NG_ERR_INPUT, "%s opened (%s expected)", path, needle);
	const char *m = ng_error_message();
	cr_assert(strstr(m, path), "error '%s' does not name the file", m);
	cr_assert(strstr(m, needle), "error '%s' does not say '%s'", m, needle);
	cr_assert_null(strchr(m, '\n'));
}

Test(shard, roundtrip_random)
{
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t sizes[] = { 1, 2, 1000, 1 + ng_rng_below(&r, 200000) };
	for (int k = 0; k < 4; k++) {
		size_t n = sizes[k];
		uint16_t *t = malloc(n * 2);
		for (size_t i = 0; i < n; i++)
			t[i] = (uint16_t)(1 + ng_rng_below(&r, 50256));
		char path[128];
		snprintf(path, sizeof(path), "%s/s%d.bin", dir, k);
		ng_clear_error();
		cr_assert_eq(ng_shard_write(path, t, n), NG_OK, "%s", ng_error_message());
		size_t count;
		cr_assert_eq(ng_shard_read_header(path, &count), NG_OK);
		cr_assert_eq(count, n);
		struct ng_shard s;
		cr_assert_eq(ng_shard_open(&s, path, 50257), NG_OK, "%s", ng_error_message());
		cr_assert_eq(s.count, n);
		size_t bad = n;
		for (size_t i = 0; i < n && bad == n; i++)
			if (s.tokens[i] != t[i])
				bad = i;
		cr_assert_eq(bad, n, "seed %llu: token %zu differs", (unsigned long long)seed, bad);
		ng_shard_close(&s);
		free(t);
	}
	/* no temporary files left behind */
	DIR *d = opendir(dir);
	struct dirent *e;
	while ((e = readdir(d)))
		cr_assert_null(strstr(e->d_name, ".tmp"), "left %s", e->d_name);
	closedir(d);
}

Test(shard, bad_files)
{
	uint16_t tok[100];
	for (int i = 0; i < 100; i++)
		tok[i] = (uint16_t)(i + 7);
	char p[128];

	snprintf(p, sizeof(p), "%s/missing.bin", dir);
	expect_error(p, 1000, "cannot open");

	static const struct {
		const char *name;  /* file name */
		int h0, h1, h2;    /* header: magic, version, count */
		size_t ntok;       /* tokens actually written */
		size_t hbytes;     /* header bytes actually written */
		const char *say;   /* the error must contain this */
	} cases[] = {
		{ "magic.bin", 20240521, 1, 100, 100, 1024, "bad magic" },
		{ "version.bin", NG_SHARD_MAGIC, 7, 100, 100, 1024, "version 7" },
		{ "short_header.bin", NG_SHARD_MAGIC, 1, 100, 0, 500, "truncated" },
		{ "truncated.bin", NG_SHARD_MAGIC, 1, 100, 60, 1024, "truncated" },
		{ "count_too_big.bin", NG_SHARD_MAGIC, 1, 1000000, 100, 1024, "1000000 tokens" },
		{ "trailing.bin", NG_SHARD_MAGIC, 1, 90, 100, 1024, "trailing" },
		{ "negative.bin", NG_SHARD_MAGIC, 1, -5, 100, 1024, "negative" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		snprintf(p, sizeof(p), "%s/%s", dir, cases[i].name);
		write_raw(p, cases[i].h0, cases[i].h1, cases[i].h2, tok, cases[i].ntok,
			  cases[i].hbytes);
		expect_error(p, 1000, cases[i].say);
	}

	snprintf(p, sizeof(p), "%s/dir.bin", dir);
	mkdir(p, 0755);
	expect_error(p, 1000, "not a regular file");

	/* token 57 at index 50: byte offset 1024 + 100 */
	snprintf(p, sizeof(p), "%s/bad_token.bin", dir);
	write_raw(p, NG_SHARD_MAGIC, 1, 100, tok, 100, 1024);
	expect_error(p, 57, "byte offset 1124");
	struct ng_shard s;
	cr_assert_eq(ng_shard_open(&s, p, 107), NG_OK); /* all < 107 */
	ng_shard_close(&s);
	cr_assert_eq(ng_shard_open(&s, p, 0), NG_OK); /* scan skipped */
	ng_shard_close(&s);
}

/* A FIFO (or a device) named as a shard is one error line at once: the file's type is looked
 * at before anything could block on it (a FIFO without a writer used to hang open forever). */
Test(shard, fifo_and_device_refused_without_blocking, .timeout = 20)
{
	char p[128];
	snprintf(p, sizeof(p), "%s/fifo.bin", dir);
	cr_assert_eq(mkfifo(p, 0644), 0);
	expect_error(p, 1000, "not a regular file (a FIFO)");
	size_t n;
	ng_clear_error();
	cr_assert_eq(ng_shard_read_header(p, &n), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "a FIFO"), "%s", ng_error_message());
	ng_clear_error();
	cr_assert_eq(ng_shard_open(&(struct ng_shard){ 0 }, "/dev/zero", 1000), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "a character device"), "%s", ng_error_message());
}

Test(shard, unwritable_directory_keeps_old_file)
{
	char sub[128], p[160];
	snprintf(sub, sizeof(sub), "%s/ro", dir);
	cr_assert_eq(mkdir(sub, 0755), 0);
	snprintf(p, sizeof(p), "%s/x.bin", sub);
	uint16_t t[10] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 };
	cr_assert_eq(ng_shard_write(p, t, 10), NG_OK);
	chmod(sub, 0555);
	ng_clear_error();
	uint16_t u[3] = { 9, 9, 9 };
	enum ng_status st = ng_shard_write(p, u, 3);
	chmod(sub, 0755);
	if (geteuid() != 0) { /* root ignores directory permissions */
		cr_assert_eq(st, NG_ERR_INPUT);
		cr_assert(strstr(ng_error_message(), p), "%s", ng_error_message());
		struct ng_shard s;
		cr_assert_eq(ng_shard_open(&s, p, 100), NG_OK);
		cr_assert_eq(s.count, 10); /* the old shard is intact */
		ng_shard_close(&s);
	}
	/* a regular file where the directory should be: refused even for root */
	snprintf(p, sizeof(p), "%s/x.bin/y.bin", sub);
	ng_clear_error();
	cr_assert_eq(ng_shard_write(p, u, 3), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), p), "%s", ng_error_message());
	snprintf(p, sizeof(p), "/nonexistent_dir_ng/x.bin");
	ng_clear_error();
	cr_assert_eq(ng_shard_write(p, u, 3), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), p));
}
