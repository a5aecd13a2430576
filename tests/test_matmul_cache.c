/*
 * tests/test_matmul_cache.c — autotune's choices kept between runs (kernels/matmul.h, "Choices
 * kept"; kernels/matmul_cache.c). The file tests need no GPU: a save read back, another device's
 * file, a missing one, corrupt ones (nothing loaded, the line named), a directory made on save.
 * The GPU test plans with autotune, saves, loads into a fresh context and plans again: the
 * second plan takes the same algorithm untimed.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/check.h"
#include "kernels/matmul.h"

static char dir_[64];

/* A fresh directory under /tmp for one test. */
static const char *tmpdir_(void)
{
	snprintf(dir_, sizeof(dir_), "/tmp/ng_mmcache_XXXXXX");
	cr_assert_not_null(mkdtemp(dir_));
	return dir_;
}

static struct ng_matmul_choice choice_(int kind, int N, int chosen, unsigned long long hash)
{
	struct ng_matmul_choice c;
	memset(&c, 0, sizeof(c));
	c.spec = (struct ng_matmul_spec){(enum ng_matmul_kind)kind, N, 768, 3072, 1, 1, 0, 1, 0, 0, 0};
	c.align_bytes = 16;
	c.workspace_bytes = 32u << 20;
	c.colsum = kind == NG_MATMUL_DW;
	c.candidates_hash = hash;
	c.n_candidates = 8;
	c.chosen = chosen;
	c.ms = 0.5f + (float)chosen;
	return c;
}

static void write_file_(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f);
	fputs(text, f);
	fclose(f);
}

Test(matmul_cache, save_then_load_gives_the_same_choices)
{
	char path[256];
	snprintf(path, sizeof(path), "%s/a/b/autotune.txt", tmpdir_()); /* a/b made on save */
	struct ng_matmul_ctx w, r;
	memset(&w, 0, sizeof(w));
	memset(&r, 0, sizeof(r));
	struct ng_matmul_choice c[3] = {choice_(0, 65536, 3, 0xfedcba9876543210ull),
					choice_(1, 1, 0, 1ull), choice_(2, 16384, 7, 0ull)};
	for (int i = 0; i < 3; i++)
		cr_assert_eq(ng_matmul_choice_add(&w, &c[i]), NG_OK);
	cr_assert_eq(ng_matmul_choice_add(&w, &c[0]), NG_OK, "same key: replaced, not added");
	cr_assert_eq(w.n_choices, 3);
	cr_assert_eq(ng_matmul_choices_save(&w, path, "GPU_X_sm_90"), NG_OK, "%s",
		     ng_error_message());
	int n = -1;
	cr_assert_eq(ng_matmul_choices_load(&r, path, "GPU_X_sm_90", &n), NG_OK, "%s",
		     ng_error_message());
	cr_assert_eq(n, 3);
	for (int i = 0; i < 3; i++) {
		const struct ng_matmul_choice *a = &c[i], *b = &r.choices[i];
		cr_assert(a->spec.kind == b->spec.kind && a->spec.N == b->spec.N &&
			  a->spec.IC == b->spec.IC && a->spec.OC == b->spec.OC &&
			  a->spec.gelu == b->spec.gelu && a->spec.bias == b->spec.bias &&
			  a->spec.fp8 == b->spec.fp8 && b->spec.autotune == 1 &&
			  a->align_bytes == b->align_bytes && a->workspace_bytes == b->workspace_bytes &&
			  a->colsum == b->colsum && a->candidates_hash == b->candidates_hash &&
			  a->n_candidates == b->n_candidates && a->chosen == b->chosen,
			  "choice %d read back differs", i);
	}
	ng_matmul_ctx_free(&w);
	ng_matmul_ctx_free(&r);
}

Test(matmul_cache, another_device_or_no_file_loads_nothing)
{
	char path[256];
	snprintf(path, sizeof(path), "%s/autotune.txt", tmpdir_());
	struct ng_matmul_ctx ctx;
	memset(&ctx, 0, sizeof(ctx));
	int n = -1;
	cr_assert_eq(ng_matmul_choices_load(&ctx, path, "GPU_X", &n), NG_OK, "missing: no error");
	cr_assert_eq(n, 0);
	struct ng_matmul_choice c = choice_(0, 64, 2, 5ull);
	cr_assert_eq(ng_matmul_choice_add(&ctx, &c), NG_OK);
	cr_assert_eq(ng_matmul_choices_save(&ctx, path, "GPU_X"), NG_OK);
	struct ng_matmul_ctx other;
	memset(&other, 0, sizeof(other));
	cr_assert_eq(ng_matmul_choices_load(&other, path, "GPU_Y", &n), NG_OK);
	cr_assert_eq(n, 0);
	cr_assert_eq(other.n_choices, 0);
	ng_matmul_ctx_free(&ctx);
	ng_matmul_ctx_free(&other);
}

Test(matmul_cache, corrupt_files_load_nothing_and_name_the_line)
{
	static const char *bad[] = {
		"not a cache\n",
		"nanograph-autotune 1\ndevice G\nchoice 0 64 768 3072 1 1 0 0 16 33554432 0 "
		"00000000000000ff 8 2 0.5\nchoice 0 64 768\n",
		"nanograph-autotune 1\ndevice G\nchoice 0 64 768 3072 1 1 0 0 16 33554432 0 "
		"00000000000000ff 8 9 0.5\n", /* chosen outside the candidates */
		"nanograph-autotune 1\ndevice G\nchoice 7 64 768 3072 1 1 0 0 16 33554432 0 "
		"00000000000000ff 8 1 0.5\n", /* no such kind */
		"nanograph-autotune 1\ndevice G\nchoice 0 64 768 3072 1 1 0 0 16 33554432 0 "
		"00000000000000ff 8 1 0.5 extra\n",
		"nanograph-autotune 1\ndevice G\nchoice 0 64 768 3072 1 1 0 0 16 33554432 0 "
		"00000000000000ff 8 1 0.5\nchoice 0 64 768 3072 1 1 0 0 16 33554432 0 "
		"00000000000000ff 8 2 0.5\nchoice\n", /* a key twice, then a bad line */
	};
	const int line[] = {1, 4, 3, 3, 3, 5};
	char path[256];
	snprintf(path, sizeof(path), "%s/autotune.txt", tmpdir_());
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		write_file_(path, bad[i]);
		struct ng_matmul_ctx ctx;
		memset(&ctx, 0, sizeof(ctx));
		int n = -1;
		ng_clear_error();
		cr_assert_eq(ng_matmul_choices_load(&ctx, path, "G", &n), NG_ERR_INPUT, "file %zu", i);
		cr_assert_eq(n, 0);
		cr_assert_eq(ctx.n_choices, 0, "file %zu: all or nothing", i);
		char want[32];
		snprintf(want, sizeof(want), "line %d", line[i]);
		cr_assert_not_null(strstr(ng_error_message(), want), "file %zu: \"%s\"", i,
				   ng_error_message());
		ng_clear_error();
		ng_matmul_ctx_free(&ctx);
	}
}

Test(matmul_cache, a_second_plan_takes_the_kept_choice_untimed)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	char path[256];
	snprintf(path, sizeof(path), "%s/autotune.txt", tmpdir_());
	struct ng_matmul_spec sp = {NG_MATMUL_FWD, 512, 768, 3072, 1, 1, 0, 1, 0, 0, 0};
	struct ng_matmul_ctx a, b;
	struct ng_matmul m1, m2, m3;
	cr_assert_eq(ng_matmul_ctx_init(&a, (size_t)32 << 20), NG_OK, "%s", ng_error_message());
	a.tune_sustained_ms = 5.0f; /* the test checks the bookkeeping, not the ranking */
	cr_assert_eq(ng_matmul_plan(&m1, &a, &sp), NG_OK, "%s", ng_error_message());
	cr_assert_eq(a.choices_made, 1);
	cr_assert_eq(a.choices_reused, 0);
	cr_assert_eq(ng_matmul_plan(&m2, &a, &sp), NG_OK, "%s", ng_error_message());
	cr_assert_eq(a.choices_made, 1, "the same shape is not timed twice");
	cr_assert_eq(a.choices_reused, 1);
	cr_assert_eq(m2.chosen, m1.chosen);
	cr_assert_eq(ng_matmul_choices_save(&a, path, "this_gpu"), NG_OK, "%s", ng_error_message());

	cr_assert_eq(ng_matmul_ctx_init(&b, (size_t)32 << 20), NG_OK, "%s", ng_error_message());
	int n = 0;
	cr_assert_eq(ng_matmul_choices_load(&b, path, "this_gpu", &n), NG_OK, "%s",
		     ng_error_message());
	cr_assert_eq(n, 1);
	cr_assert_eq(ng_matmul_plan(&m3, &b, &sp), NG_OK, "%s", ng_error_message());
	cr_assert_eq(b.choices_made, 0, "a fresh context with the file times nothing");
	cr_assert_eq(b.choices_reused, 1);
	cr_assert_eq(m3.chosen, m1.chosen);
	cr_assert_eq(memcmp(&m3.algo, &m1.algo, sizeof(m1.algo)), 0, "the same algorithm");
	cr_log_info("kept choice: candidate %d of %d", m1.chosen, m1.n_candidates);

	/* another shape in the same context is timed, not confused with the kept one */
	sp.N = 256;
	struct ng_matmul m4;
	cr_assert_eq(ng_matmul_plan(&m4, &b, &sp), NG_OK, "%s", ng_error_message());
	cr_assert_eq(b.choices_made, 1);
	ng_matmul_free(&m1);
	ng_matmul_free(&m2);
	ng_matmul_free(&m3);
	ng_matmul_free(&m4);
	ng_matmul_ctx_free(&a);
	ng_matmul_ctx_free(&b);
}
