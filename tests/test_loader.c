/*
 * tests/test_loader.c — the prefetching loader: ranks read disjoint windows that together cover
 * the epoch; shuffled orders are deterministic per seed and change per epoch; validation order is
 * sorted and repeatable; tell/seek resume exactly (also in a fresh loader, across epochs); the
 * caller's allocator is used; bad shards and too-small data fail with a line naming the file.
 *
 * Shard k's token i is k*20000 + i, so a window's first token says which shard and window it is
 * and every window must be T+1 consecutive values.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "data/loader.h"
#include "data/shard.h"
#include "util/rng.h"

static char dir[64], pattern[96];
static uint64_t seed;
static int sizes[4];

static void write_shard(int k, int n, uint16_t bad_at)
{
	uint16_t *t = malloc((size_t)n * 2);
	for (int i = 0; i < n; i++)
		t[i] = (uint16_t)(k * 20000 + i);
	if (bad_at)
		t[bad_at] = 65000;
	char p[128];
	snprintf(p, sizeof(p), "%s/train_%06d.bin", dir, k);
	cr_assert_eq(ng_shard_write(p, t, (size_t)n), NG_OK, "%s", ng_error_message());
	free(t);
}

static void setup(void)
{
	snprintf(dir, sizeof(dir), "/tmp/ng_loader_XXXXXX");
	cr_assert(mkdtemp(dir));
	snprintf(pattern, sizeof(pattern), "%s/train_*.bin", dir);
	seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	for (int k = 0; k < 3; k++) {
		sizes[k] = 2000 + (int)ng_rng_below(&r, 8000);
		write_shard(k, sizes[k], 0);
	}
}

static void teardown(void)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}

TestSuite(loader, .init = setup, .fini = teardown);

static struct ng_loader_config config(int B, int T, int rank, int world, bool shuffle)
{
	struct ng_loader_config c = { .pattern = pattern, .B = B, .T = T, .vocab = 60000,
				      .rank = rank, .world = world, .seed = seed,
				      .shuffle = shuffle, .prefetch = 3 };
	return c;
}

static void open_ok(struct ng_loader *ld, struct ng_loader_config c)
{
	ng_clear_error();
	cr_assert_eq(ng_loader_open(ld, &c), NG_OK, "seed %llu: %s", (unsigned long long)seed,
		     ng_error_message());
}

/* Window id (k*20000 + w*T) of each row, after checking the row is consecutive tokens. */
static void rows(const uint16_t *batch, int B, int T, int *ids)
{
	for (int b = 0; b < B; b++) {
		const uint16_t *r = batch + (size_t)b * (T + 1);
		for (int t = 0; t < T; t++)
			cr_assert_eq(r[t + 1], (uint16_t)(r[t] + 1), "seed %llu: row %d not contiguous "
				     "at %d", (unsigned long long)seed, b, t);
		cr_assert_eq((r[0] % 20000) % T, 0, "row %d starts off a window boundary", b);
		ids[b] = r[0];
	}
}

Test(loader, ranks_disjoint_and_cover_epoch)
{
	const int B = 3, T = 16, W = 2;
	long total = 0;
	for (int k = 0; k < 3; k++)
		total += (sizes[k] - 1) / T;
	long per_epoch = total / (B * W);
	char *seen = calloc(60000, 1);
	for (int r = 0; r < W; r++) {
		struct ng_loader ld;
		open_ok(&ld, config(B, T, r, W, true));
		cr_assert_eq((long)ld.batches_per_epoch, per_epoch);
		for (long i = 0; i < per_epoch; i++) {
			const uint16_t *batch;
			int ids[B];
			cr_assert_eq(ng_loader_next(&ld, &batch), NG_OK, "%s", ng_error_message());
			rows(batch, B, T, ids);
			for (int b = 0; b < B; b++) {
				cr_assert_eq(seen[ids[b]], 0, "seed %llu: window %d read twice",
					     (unsigned long long)seed, ids[b]);
				seen[ids[b]] = 1;
			}
		}
		struct ng_loader_pos p;
		ng_loader_tell(&ld, &p);
		cr_assert_eq(p.epoch, 1);
		cr_assert_eq(p.batch, 0);
		ng_loader_close(&ld);
	}
	long n = 0;
	for (int i = 0; i < 60000; i++)
		n += seen[i];
	cr_assert_eq(n, per_epoch * B * W); /* all but the tail of fewer than B*W windows */
	cr_assert_geq(n, total - B * W + 1);
	free(seen);
}

/* Read n batches' window ids into out (n*B). */
static void read_ids(struct ng_loader *ld, int n, int B, int T, int *out)
{
	for (int i = 0; i < n; i++) {
		const uint16_t *batch;
		ng_clear_error();
		cr_assert_eq(ng_loader_next(ld, &batch), NG_OK, "%s", ng_error_message());
		rows(batch, B, T, out + i * B);
	}
}

Test(loader, shuffle_is_seeded_and_per_epoch)
{
	const int B = 4, T = 8;
	struct ng_loader a, b, v;
	open_ok(&a, config(B, T, 0, 1, true));
	open_ok(&b, config(B, T, 0, 1, true));
	int n = (int)a.batches_per_epoch;
	int *e0 = malloc(sizeof(int) * n * B), *e1 = malloc(sizeof(int) * n * B);
	int *f0 = malloc(sizeof(int) * n * B), *sorted = malloc(sizeof(int) * n * B);
	read_ids(&a, n, B, T, e0);
	read_ids(&a, n, B, T, e1);
	read_ids(&b, n, B, T, f0);
	cr_assert_eq(memcmp(e0, f0, sizeof(int) * n * B), 0, "same seed, different order");
	cr_assert_neq(memcmp(e0, e1, sizeof(int) * n * B), 0, "epochs 0 and 1 in the same order");
	/* validation: sorted shards, windows in file order, the same after a rewind */
	open_ok(&v, config(B, T, 0, 1, false));
	read_ids(&v, n, B, T, sorted);
	for (int i = 1; i < n * B; i++)
		cr_assert_gt(sorted[i], sorted[i - 1], "validation order not sorted at %d", i);
	cr_assert_neq(memcmp(e0, sorted, sizeof(int) * n * B), 0, "shuffle did nothing");
	cr_assert_eq(ng_loader_rewind(&v), NG_OK);
	read_ids(&v, n, B, T, f0);
	cr_assert_eq(memcmp(f0, sorted, sizeof(int) * n * B), 0, "rewind differs");
	ng_loader_close(&a);
	ng_loader_close(&b);
	ng_loader_close(&v);
	free(e0);
	free(e1);
	free(f0);
	free(sorted);
}

static int allocs, frees;
static void *count_alloc(size_t n, void *ctx)
{
	cr_assert_eq(ctx, (void *)&allocs);
	allocs++;
	return malloc(n);
}
static void count_free(void *p, void *ctx)
{
	(void)ctx;
	frees++;
	free(p);
}

Test(loader, tell_seek_resume_exact)
{
	const int B = 2, T = 32;
	struct ng_loader ld, fresh;
	struct ng_loader_config c = config(B, T, 1, 3, true);
	c.alloc = count_alloc;
	c.free = count_free;
	c.alloc_ctx = &allocs;
	c.prefetch = 4;
	allocs = frees = 0;
	open_ok(&ld, c);
	cr_assert_eq(allocs, 4);
	int n = (int)ld.batches_per_epoch;
	int skip = n - 2; /* so the next reads cross into epoch 1 */
	int *tmp = malloc(sizeof(int) * (skip + 1) * B);
	read_ids(&ld, skip, B, T, tmp);
	struct ng_loader_pos p;
	ng_loader_tell(&ld, &p);
	int want[5 * B], got[5 * B];
	read_ids(&ld, 5, B, T, want);
	cr_assert_eq(ng_loader_seek(&ld, &p), NG_OK);
	read_ids(&ld, 5, B, T, got);
	cr_assert_eq(memcmp(want, got, sizeof(want)), 0, "seek back differs");
	open_ok(&fresh, c);
	read_ids(&fresh, 1, B, T, tmp);
	cr_assert_eq(ng_loader_seek(&fresh, &p), NG_OK);
	read_ids(&fresh, 5, B, T, got);
	cr_assert_eq(memcmp(want, got, sizeof(want)), 0, "resume in a fresh loader differs");
	struct ng_loader_pos bad = p;
	bad.seed ^= 1;
	ng_clear_error();
	cr_assert_eq(ng_loader_seek(&fresh, &bad), NG_ERR_INPUT);
	ng_loader_close(&ld);
	ng_loader_close(&fresh);
	cr_assert_eq(frees, 8);
	free(tmp);
}

static void expect_open_error(struct ng_loader_config c, const char *needle)
{
	struct ng_loader ld;
	ng_clear_error();
	enum ng_status st = ng_loader_open(&ld, &c);
	if (st == NG_OK)
		ng_loader_close(&ld);
	cr_assert_eq(st, NG_ERR_INPUT, "seed %llu: opened; expected '%s'",
		     (unsigned long long)seed, needle);
	cr_assert(strstr(ng_error_message(), needle), "error '%s' does not say '%s'",
		  ng_error_message(), needle);
}

Test(loader, bad_input)
{
	char p[128];
	struct ng_loader_config c = config(2, 16, 0, 1, true);
	c.pattern = "/nonexistent_ng/*.bin";
	expect_open_error(c, "no files match '/nonexistent_ng/*.bin'");
	c = config(2, 16, 0, 1, true);
	c.prefetch = 1;
	expect_open_error(c, "prefetch=1");
	/* one batch needs more windows than all shards hold */
	c = config(10000, 16, 0, 1, true); /* the shards hold < 30000/16 windows */
	expect_open_error(c, "fewer than one batch");
	expect_open_error(c, "train_00000"); /* names the largest file */
	/* every shard smaller than one window */
	c = config(1, 20000, 0, 1, true);
	expect_open_error(c, "3 smaller than one window");
	/* a single shard smaller than one window: the error names it */
	snprintf(p, sizeof(p), "%s/train_000001.bin", dir);
	c = config(1, 50000, 0, 1, true);
	c.pattern = p;
	expect_open_error(c, p);
	/* a shard with a bad header: open fails naming it */
	write_shard(3, 500, 0);
	snprintf(p, sizeof(p), "%s/train_000003.bin", dir);
	FILE *f = fopen(p, "r+b");
	int32_t magic = 7;
	fwrite(&magic, 4, 1, f);
	fclose(f);
	c = config(2, 16, 0, 1, true);
	expect_open_error(c, "train_000003.bin: bad magic");
}

Test(loader, small_shard_skipped_bad_token_reported)
{
	write_shard(3, 10, 0); /* smaller than one window of T+1 = 17: skipped */
	struct ng_loader ld;
	open_ok(&ld, config(2, 16, 0, 1, false));
	cr_assert_eq(ld.skipped, 1);
	ng_loader_close(&ld);
	/* a token >= vocab in shard 1, found when the thread first maps it (sorted order) */
	write_shard(1, sizes[1], 1234);
	open_ok(&ld, config(2, 16, 0, 1, false));
	const uint16_t *batch;
	enum ng_status st = NG_OK;
	for (uint64_t i = 0; i < ld.batches_per_epoch && st == NG_OK; i++) {
		ng_clear_error();
		st = ng_loader_next(&ld, &batch);
	}
	cr_assert_eq(st, NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "train_000001.bin") &&
		  strstr(ng_error_message(), "byte offset 3492"), "%s", ng_error_message());
	ng_loader_close(&ld);
}
