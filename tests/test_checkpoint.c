/*
 * tests/test_checkpoint.c — checkpoints (src/checkpoint.h): model and state files round-trip
 * bit-exactly with the HF GPT-2 names and Conv1D transposes; corrupt, truncated and wrong-shape
 * files are refused with a clear error; and on the CPU reference, a --deterministic run stopped
 * at N/2 and resumed ends in the same bytes (params, moments, step, loader position) and the
 * same losses as the run uninterrupted; a writer killed mid-write leaves a loadable checkpoint,
 * and so does one whose write fails (a file-size limit, a full tmpfs); an edited header,
 * metadata or state invariant is refused, files without our checksum (Hugging Face's) still
 * load; `eval` equals the reference loss. Fresh random values every run (seed printed).
 */
#define _XOPEN_SOURCE 700
#define _DEFAULT_SOURCE
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <glob.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "graph/cpu_ref.h"
#include "src/checkpoint.h"
#include "src/commands.h"
#include "tests/ckpt_testing.h"
#include "tests/test_tmpdir.h"
#include "util/rng.h"

static uint64_t seed_now(void)
{
	return (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
}

static void make_tmpdir(void) { ng_test_dir_make("ng_ckpt_test_"); }

/* Random params in the flat layout, padding (between tensors, wte rows V..Vp-1) zero. */
static float *random_params(const struct ng_gpt_config *cfg, struct ng_gpt_layout *lay,
			    struct ng_rng *r)
{
	ng_gpt_layout(cfg, lay);
	float *p = calloc(lay->total, sizeof(float));
	for (int i = 0; i < NG_P_COUNT; i++) {
		size_t n = lay->p[i].numel;
		if (i == NG_P_WTE)
			n = (size_t)cfg->V * cfg->C;
		for (size_t k = 0; k < n; k++)
			p[lay->p[i].offset + k] = (float)ng_rng_normal(r);
	}
	return p;
}

static struct ng_gpt_config small_cfg(struct ng_rng *r)
{
	struct ng_gpt_config c = { 2 + (int)ng_rng_below(r, 2), 2, 64, 32,
				     300 + (int)ng_rng_below(r, 200), 0, NG_ARCH_GPT2 };
	cr_assert_eq(ng_gpt_check(&c), NG_OK);
	return c;
}

/* Rename the checksum entry in place ("checksum" -> "checksuX"): a file as another writer
 * (Hugging Face) would write it, without our checksum. */
static void strip_checksum(unsigned char *b, uint64_t hl)
{
	char *h = strndup((char *)b + 8, hl), *at = strstr(h, "\"checksum\":");
	cr_assert(at, "no checksum entry");
	b[8 + (at - h) + 8] = 'X';
	free(h);
}

Test(checkpoint, model_round_trip_bit_exact)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	make_tmpdir();
	struct ng_gpt_config cfg = small_cfg(&r), got;
	struct ng_gpt_layout lay;
	float *p = random_params(&cfg, &lay, &r), *q;
	char path[512];
	snprintf(path, sizeof(path), "%s/m.safetensors", ng_test_dir);
	cr_assert_eq(ng_ckpt_write_model(path, &cfg, p), NG_OK, "seed %llu: %s",
		     (unsigned long long)seed, ng_error_message());
	cr_assert_eq(ng_ckpt_read_model(path, &got, &q), NG_OK, "%s", ng_error_message());
	cr_assert(got.L == cfg.L && got.H == cfg.H && got.C == cfg.C && got.T == cfg.T &&
		  got.V == cfg.V && got.Vp == cfg.Vp, "config differs (seed %llu)",
		  (unsigned long long)seed);
	size_t bad = 0, first = 0;
	for (size_t i = 0; i < lay.total; i++)
		if (memcmp(&p[i], &q[i], 4) != 0 && bad++ == 0)
			first = i;
	cr_assert_eq(bad, 0, "seed %llu: %zu elements differ, first at %zu (%g vs %g)",
		     (unsigned long long)seed, bad, first, p[first], q[first]);

	/* the HF layout: c_attn.weight of layer 1 is (C, 3C) and holds qkvw[1]^T */
	size_t n;
	unsigned char *b = read_file(path, &n);
	uint64_t hl = header_len(b);
	char *hdr = strndup((char *)b + 8, hl);
	char key[64];
	snprintf(key, sizeof(key), "\"transformer.h.1.attn.c_attn.weight\"");
	char *at = strstr(hdr, key);
	cr_assert(at, "no c_attn.weight in the header");
	char want[64];
	snprintf(want, sizeof(want), "\"shape\":[%d,%d]", cfg.C, 3 * cfg.C);
	cr_assert(strstr(at, want) && strstr(at, want) < strstr(at, "data_offsets"),
		  "c_attn.weight is not (C, 3C)");
	size_t begin = strtoull(strstr(at, "data_offsets") + 15, NULL, 10);
	const float *hf = (const float *)(b + 8 + hl + begin);
	size_t C = (size_t)cfg.C, base = lay.p[NG_P_QKVW].offset + 3 * C * C;
	for (int k = 0; k < 50; k++) {
		size_t o = ng_rng_below(&r, 3 * C), i = ng_rng_below(&r, C);
		cr_assert(hf[i * 3 * C + o] == p[base + o * C + i], "c_attn[%zu][%zu] != qkvw[%zu][%zu]",
			  i, o, o, i);
	}
	free(hdr);
	free(b);
	free(p);
	free(q);
}

Test(checkpoint, state_round_trip_bit_exact)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	make_tmpdir();
	struct ng_gpt_config cfg = small_cfg(&r);
	struct ng_gpt_layout lay;
	ng_gpt_layout(&cfg, &lay);
	for (int elem = 4; elem <= 8; elem += 4) {
		struct ng_train_state s = { 0 }, t;
		cr_assert_eq(ng_ckpt_state_alloc(&s, elem, lay.total), NG_OK);
		s.cfg = cfg;
		s.B = 3;
		s.T = 16;
		s.K = 2;
		s.step = 3 + (long long)ng_rng_below(&r, 100000);
		s.n_skipped = 3;
		s.seed = ng_rng_u64(&r);
		s.has_pos = true;
		s.shuffle = 1;
		/* where step steps of K = 2 batches lead: 1234 windows / B = 3 is 411 batches an
		 * epoch (the reader checks it) */
		s.pos = (struct ng_loader_pos){ s.seed, 1234, (uint64_t)(2 * s.step / 411),
						(uint64_t)(2 * s.step % 411) };
		void *buf[3] = { s.params, s.m, s.v };
		for (int k = 0; k < 3; k++)
			for (size_t i = 0; i < lay.total; i++) {
				double x = ng_rng_normal(&r);
				if (elem == 8)
					((double *)buf[k])[i] = x;
				else
					((float *)buf[k])[i] = (float)x;
			}
		if (elem == 4) { /* a --fp8 run's scales travel as the optional "fp8_state" */
			s.n_fp8 = 1 + ng_rng_below(&r, 5000);
			s.fp8 = malloc(s.n_fp8 * sizeof(float));
			for (size_t i = 0; i < s.n_fp8; i++)
				s.fp8[i] = (float)ng_rng_normal(&r);
		}
		char path[512];
		snprintf(path, sizeof(path), "%s/s%d.safetensors", ng_test_dir, elem);
		cr_assert_eq(ng_ckpt_write_state(path, &s), NG_OK, "%s", ng_error_message());
		cr_assert_eq(ng_ckpt_read_state(path, &t), NG_OK, "%s", ng_error_message());
		cr_assert(t.step == s.step && t.n_skipped == 3 && t.seed == s.seed && t.B == 3 &&
			  t.T == 16 && t.K == 2 && t.has_pos && t.pos.windows == 1234 &&
			  t.pos.epoch == s.pos.epoch && t.pos.batch == s.pos.batch &&
			  t.pos.seed == s.seed && t.shuffle == 1 &&
			  t.elem_size == elem && t.cfg.V == cfg.V && t.cfg.L == cfg.L,
			  "metadata differs (seed %llu)", (unsigned long long)seed);
		cr_assert(memcmp(t.params, s.params, lay.total * elem) == 0 &&
			  memcmp(t.m, s.m, lay.total * elem) == 0 &&
			  memcmp(t.v, s.v, lay.total * elem) == 0,
			  "state buffers differ (elem %d, seed %llu)", elem,
			  (unsigned long long)seed);
		cr_assert_eq(t.n_fp8, s.n_fp8, "fp8_state: %zu floats read, %zu written", t.n_fp8,
			     s.n_fp8);
		cr_assert(s.fp8 ? t.fp8 && memcmp(t.fp8, s.fp8, s.n_fp8 * sizeof(float)) == 0
				: t.fp8 == NULL, "fp8_state differs (elem %d)", elem);
		ng_ckpt_state_free(&s);
		ng_ckpt_state_free(&t);
	}
}

/* Reading `bytes` (a damaged copy) must fail with NG_ERR_INPUT and a message containing `want`. */
static void expect_refused(const char *path, const void *bytes, size_t n, const char *want,
			   const char *what)
{
	if (bytes) /* NULL: the damaged file is already there */
		write_file(path, bytes, n);
	ng_clear_error();
	struct ng_gpt_config cfg;
	float *p = NULL;
	enum ng_status st = ng_ckpt_read_model(path, &cfg, &p);
	cr_assert_eq(st, NG_ERR_INPUT, "%s: accepted (status %d)", what, st);
	cr_assert(strstr(ng_error_message(), want) && strstr(ng_error_message(), path),
		  "%s: message '%s' lacks '%s' or the path", what, ng_error_message(), want);
	cr_assert_null(p);
}

Test(checkpoint, corrupt_truncated_wrong_shape_refused)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	make_tmpdir();
	struct ng_gpt_config cfg = small_cfg(&r);
	struct ng_gpt_layout lay;
	float *p = random_params(&cfg, &lay, &r);
	char path[512], bad[512];
	snprintf(path, sizeof(path), "%s/m.safetensors", ng_test_dir);
	snprintf(bad, sizeof(bad), "%s/bad.safetensors", ng_test_dir);
	cr_assert_eq(ng_ckpt_write_model(path, &cfg, p), NG_OK);
	size_t n;
	unsigned char *b = read_file(path, &n);
	uint64_t hl = header_len(b);
	unsigned char *c = malloc(n);

	/* one flipped bit anywhere in the data */
	memcpy(c, b, n);
	size_t at = 8 + hl + ng_rng_below(&r, n - 8 - hl);
	c[at] ^= (unsigned char)(1u << ng_rng_below(&r, 8));
	expect_refused(bad, c, n, "checksum mismatch", "flipped data bit");
	/* truncated at a random point of the data, and inside the header */
	expect_refused(bad, b, 8 + hl + ng_rng_below(&r, n - 8 - hl), "truncated", "cut data");
	expect_refused(bad, b, 8 + ng_rng_below(&r, hl), "truncated", "cut header");
	expect_refused(bad, b, 5, "shorter than", "5 bytes");
	/* a header that is not JSON */
	memcpy(c, b, n);
	c[8] = '#';
	expect_refused(bad, c, n, "JSON header", "broken JSON");
	/* c_attn.weight stored (3C, C) instead of Conv1D (C, 3C): same bytes, wrong shape (in a
	 * file without our checksum, which would refuse any edit first) */
	memcpy(c, b, n);
	strip_checksum(c, hl);
	char from[64], to[64];
	snprintf(from, sizeof(from), "\"shape\":[%d,%d]", cfg.C, 3 * cfg.C);
	snprintf(to, sizeof(to), "\"shape\":[%d,%d]", 3 * cfg.C, cfg.C);
	char *h = strndup((char *)c + 8, hl);
	char *s = strstr(h, from);
	cr_assert(s);
	memcpy(c + 8 + (s - h), to, strlen(to));
	free(h);
	expect_refused(bad, c, n, "c_attn.weight has shape", "transposed c_attn");

	/* a state file is not a model file, and a model file is not a state file */
	struct ng_train_state st;
	ng_clear_error();
	cr_assert_eq(ng_ckpt_read_state(path, &st), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "not a nanograph training-state"), "%s",
		  ng_error_message());
	free(c);
	free(b);
	free(p);
}

/* ---- edits of a file's header (rewrite's callbacks) ---- */

struct meta_edit {
	const char *key, *value; /* set __metadata__[key] = value (NULL: remove it) */
};

static void edit_meta(json_t *root, void *ctx)
{
	const struct meta_edit *m = ctx;
	json_t *meta = json_object_get(root, "__metadata__");
	if (m->value)
		json_object_set_new(meta, m->key, json_string(m->value));
	else
		json_object_del(meta, m->key);
}

/* Swap the data_offsets of the two tensors named in ctx[0], ctx[1]. */
static void edit_swap(json_t *root, void *ctx)
{
	const char **names = ctx;
	json_t *a = json_object_get(root, names[0]), *b = json_object_get(root, names[1]);
	cr_assert(a && b);
	json_t *oa = json_incref(json_object_get(a, "data_offsets"));
	json_object_set(a, "data_offsets", json_object_get(b, "data_offsets"));
	json_object_set_new(b, "data_offsets", oa);
}

/* Give tensor fp8_state the shape [2^62 + 4]: 2^64 + 16 bytes, wrapping to 16 in size_t. */
static void edit_fp8_shape(json_t *root, void *ctx)
{
	(void)ctx;
	json_t *t = json_object_get(root, "fp8_state");
	cr_assert(t);
	json_t *shape = json_array();
	json_array_append_new(shape, json_integer((json_int_t)((1ull << 62) + 4)));
	json_object_set_new(t, "shape", shape);
}

static void edit_nothing(json_t *root, void *ctx) { (void)root, (void)ctx; }

static void expect_state_refused(const char *path, const char *want, const char *what)
{
	struct ng_train_state t;
	ng_clear_error();
	enum ng_status st = ng_ckpt_read_state(path, &t);
	cr_assert_eq(st, NG_ERR_INPUT, "%s: accepted (status %d)", what, st);
	cr_assert(strstr(ng_error_message(), want) && strstr(ng_error_message(), path),
		  "%s: message '%s' lacks '%s' or the path", what, ng_error_message(), want);
	cr_assert_null(t.params);
}

/* Our model files verify their header as well as their data: swapped data_offsets or an edited
 * n_layer / n_head load a different model, and are refused; a file without our checksum (as
 * Hugging Face writes them) still loads, its metadata checked against its tensors; metadata
 * that overflows is an error, not "absent". */
Test(checkpoint, model_header_edits_refused)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	make_tmpdir();
	struct ng_gpt_config cfg = small_cfg(&r), got;
	struct ng_gpt_layout lay;
	float *p = random_params(&cfg, &lay, &r), *q;
	char path[512], bad[512];
	snprintf(path, sizeof(path), "%s/m.safetensors", ng_test_dir);
	snprintf(bad, sizeof(bad), "%s/bad.safetensors", ng_test_dir);
	cr_assert_eq(ng_ckpt_write_model(path, &cfg, p), NG_OK);
	size_t n;
	unsigned char *b = read_file(path, &n);

	/* the same header re-serialised (keys in the same order) is the same file: it loads */
	rewrite(b, n, bad, edit_nothing, NULL, KEEP);
	cr_assert_eq(ng_ckpt_read_model(bad, &got, &q), NG_OK, "%s", ng_error_message());
	free(q);
	/* two same-shaped tensors' data swapped by their offsets */
	const char *pair[2] = { "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias" };
	rewrite(b, n, bad, edit_swap, pair, KEEP);
	expect_refused(bad, NULL, 0, "checksum mismatch", "swapped data_offsets");
	/* n_layer / n_head edited, the checksum left as it was */
	char more[16];
	snprintf(more, sizeof(more), "%d", cfg.L + 1);
	struct meta_edit e1 = { "n_layer", more }, e2 = { "n_head", "1" };
	rewrite(b, n, bad, edit_meta, &e1, KEEP);
	expect_refused(bad, NULL, 0, "checksum mismatch", "n_layer edited");
	rewrite(b, n, bad, edit_meta, &e2, KEEP);
	expect_refused(bad, NULL, 0, "checksum mismatch", "n_head edited");
	/* ... and with a matching checksum: the metadata must agree with the tensors */
	rewrite(b, n, bad, edit_meta, &e1, STAMP);
	expect_refused(bad, NULL, 0, "n_layer", "n_layer edited, restamped");
	struct meta_edit e3 = { "n_head", "99999999999999999999" };
	rewrite(b, n, bad, edit_meta, &e3, STAMP);
	expect_refused(bad, NULL, 0, "is not an integer in [1, 1024]", "n_head overflowing");
	/* the checksum itself malformed */
	struct meta_edit e4 = { "checksum", "header+data:xyz" };
	rewrite(b, n, bad, edit_meta, &e4, KEEP);
	expect_refused(bad, NULL, 0, "checksum", "malformed checksum");

	/* no checksum (another writer's file): loads, and equals the original */
	rewrite(b, n, bad, edit_nothing, NULL, NONE);
	cr_assert_eq(ng_ckpt_read_model(bad, &got, &q), NG_OK, "%s", ng_error_message());
	cr_assert(got.L == cfg.L && got.H == cfg.H && memcmp(p, q, lay.total * 4) == 0);
	free(q);
	/* ... but its metadata is still checked against its tensors */
	rewrite(b, n, bad, edit_meta, &e1, NONE);
	expect_refused(bad, NULL, 0, "metadata n_layer", "foreign file, n_layer wrong");
	rewrite(b, n, bad, edit_meta, &e3, NONE);
	expect_refused(bad, NULL, 0, "n_head", "foreign file, n_head overflowing");
	struct meta_edit e5 = { "vocab_size", "50257" };
	rewrite(b, n, bad, edit_meta, &e5, NONE);
	expect_refused(bad, NULL, 0, "vocab_size", "foreign file, vocab_size wrong");

	/* files of earlier versions: a checksum of the data section only, still read */
	char legacy[24];
	snprintf(legacy, sizeof(legacy), "%016llx", (unsigned long long)ng_ckpt_checksum(
		 b + 8 + header_len(b), n - 8 - header_len(b)));
	struct meta_edit e6 = { "checksum", legacy };
	rewrite(b, n, bad, edit_meta, &e6, KEEP);
	cr_assert_eq(ng_ckpt_read_model(bad, &got, &q), NG_OK, "%s", ng_error_message());
	free(q);
	free(b);
	free(p);
}

/* A state file is refused when its header was edited (step, n_skipped, the loader position),
 * when it breaks a run's invariants even with a matching checksum (n_skipped > step would give
 * AdamW a negative step count; a position that step does not lead to), when a shape's byte
 * count overflows, and when it carries no checksum. */
Test(checkpoint, state_edits_and_broken_invariants_refused)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	make_tmpdir();
	struct ng_gpt_config cfg = small_cfg(&r);
	struct ng_gpt_layout lay;
	ng_gpt_layout(&cfg, &lay);
	struct ng_train_state s = { 0 }, t;
	cr_assert_eq(ng_ckpt_state_alloc(&s, 8, lay.total), NG_OK);
	s.cfg = cfg;
	s.B = 3;
	s.T = 16;
	s.K = 2;
	s.step = 3;
	s.n_skipped = 1;
	s.seed = 77;
	s.world = 1;
	s.shuffle = 1;
	s.has_pos = true;
	s.pos = (struct ng_loader_pos){ 77, 1234, 0, 6 }; /* 3 steps x 2 batches */
	s.n_fp8 = 4;
	s.fp8 = calloc(4, sizeof(float));
	char path[512], bad[512];
	snprintf(path, sizeof(path), "%s/state.safetensors", ng_test_dir);
	snprintf(bad, sizeof(bad), "%s/bad.safetensors", ng_test_dir);
	cr_assert_eq(ng_ckpt_write_state(path, &s), NG_OK, "%s", ng_error_message());
	ng_ckpt_state_free(&s);
	cr_assert_eq(ng_ckpt_read_state(path, &t), NG_OK, "%s", ng_error_message());
	ng_ckpt_state_free(&t);
	size_t n;
	unsigned char *b = read_file(path, &n);

	struct meta_edit step = { "step", "4" }, skipped = { "n_skipped", "9" },
			 epoch = { "pos_epoch", "1" }, neg = { "step", "-1" },
			 big = { "n_skipped", "99999999999999999999" };
	rewrite(b, n, bad, edit_meta, &step, KEEP);
	expect_state_refused(bad, "checksum mismatch", "step edited");
	rewrite(b, n, bad, edit_meta, &skipped, KEEP);
	expect_state_refused(bad, "checksum mismatch", "n_skipped edited");
	rewrite(b, n, bad, edit_meta, &epoch, KEEP);
	expect_state_refused(bad, "checksum mismatch", "pos_epoch edited");
	/* restamped: the invariants */
	rewrite(b, n, bad, edit_meta, &skipped, STAMP);
	expect_state_refused(bad, "n_skipped 9 exceeds step 3", "n_skipped > step");
	rewrite(b, n, bad, edit_meta, &epoch, STAMP);
	expect_state_refused(bad, "loader position", "pos_epoch moved");
	rewrite(b, n, bad, edit_meta, &step, STAMP);
	expect_state_refused(bad, "loader position", "step moved alone");
	rewrite(b, n, bad, edit_meta, &neg, STAMP);
	expect_state_refused(bad, "metadata step = \"-1\" is not an integer", "negative step");
	rewrite(b, n, bad, edit_meta, &big, STAMP);
	expect_state_refused(bad, "metadata n_skipped", "overflowing n_skipped");
	/* fp8_state claiming 2^62 + 4 floats over its 16 bytes */
	rewrite(b, n, bad, edit_fp8_shape, NULL, STAMP);
	expect_state_refused(bad, "fp8_state: its shape needs more than 2^64 bytes", "fp8 shape");
	/* no checksum at all */
	rewrite(b, n, bad, edit_nothing, NULL, NONE);
	expect_state_refused(bad, "no checksum", "checksum removed");
	free(b);
}

/* `latest` is digits and a newline: garbage, an overflowing number or a FIFO are refused. */
Test(checkpoint, latest_must_be_a_step_number, .timeout = 20)
{
	make_tmpdir();
	char p[512];
	snprintf(p, sizeof(p), "%s/latest", ng_test_dir);
	const char *bad[] = { "", "x\n", "12x\n", "-3\n", "99999999999999999999\n", "5\n6\n" };
	long long step;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		write_file(p, bad[i], strlen(bad[i]));
		ng_clear_error();
		cr_assert_eq(ng_ckpt_latest(ng_test_dir, &step), NG_ERR_INPUT, "'%s' accepted", bad[i]);
	}
	write_file(p, "42\n", 3);
	cr_assert_eq(ng_ckpt_latest(ng_test_dir, &step), NG_OK);
	cr_assert_eq(step, 42);
	unlink(p);
	cr_assert_eq(mkfifo(p, 0644), 0);
	ng_clear_error();
	cr_assert_eq(ng_ckpt_latest(ng_test_dir, &step), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "a FIFO"), "%s", ng_error_message());
}

/* A fresh test directory and the paths of two runs' folders in it, <dir>/a and <dir>/b. */
static void two_run_dirs(char *a, char *b, size_t n)
{
	make_tmpdir();
	snprintf(a, n, "%s/a", ng_test_dir);
	snprintf(b, n, "%s/b", ng_test_dir);
}

static enum ng_status train(const char *out, const char *extra1, const char *extra2,
			    const char *metrics, long long seed)
{
	char sd[32];
	snprintf(sd, sizeof(sd), "%lld", seed);
	char *argv[] = { "train", "--device", "cpu", "--model", "tiny", "--batch", "2",
			   "--seq-len", "32", "--steps", "6", "--deterministic", "--seed", sd,
			   "--val-batches", "1", "--ckpt-every", "3", "--out", (char *)out,
			   "--metrics", (char *)metrics };
	return train_with(argv, (int)(sizeof(argv) / sizeof(argv[0])), extra1, extra2);
}

Test(checkpoint, cpu_resume_is_bit_identical)
{
	long long seed = (long long)(seed_now() % 1000000);
	char a[512], bdir[512], ma[512], mb[512];
	two_run_dirs(a, bdir, sizeof(a));
	snprintf(ma, sizeof(ma), "%s/a.jsonl", ng_test_dir);
	snprintf(mb, sizeof(mb), "%s/b.jsonl", ng_test_dir);
	cr_assert_eq(train(a, NULL, NULL, ma, seed), NG_OK, "%s", ng_error_message());
	cr_assert_eq(train(bdir, "--stop-after", "3", mb, seed), NG_OK, "%s", ng_error_message());
	char latest[600];
	snprintf(latest, sizeof(latest), "%s/model_00000006.safetensors", bdir);
	cr_assert(access(latest, F_OK) != 0, "the stopped run went past step 3");
	cr_assert_eq(train(bdir, "--resume", NULL, mb, seed), NG_OK, "%s", ng_error_message());

	char la[8][32], lb[8][32];
	int na = losses(ma, la, 8), nb = losses(mb, lb, 8);
	cr_assert_eq(na, 6);
	cr_assert_eq(nb, 6, "resumed metrics hold %d steps", nb);
	for (int i = 0; i < 6; i++)
		cr_assert_str_eq(la[i], lb[i], "seed %lld: step %d loss %s uninterrupted, %s resumed",
				 seed, i + 1, la[i], lb[i]);
	/* the final state (params, moments, step, data position) byte for byte */
	char pa[600], pb[600];
	ng_ckpt_path(pa, sizeof(pa), a, "state", 6);
	ng_ckpt_path(pb, sizeof(pb), bdir, "state", 6);
	cr_assert(same_state_but_time(pa, pb), "seed %lld: final state files differ", seed);
	ng_ckpt_path(pa, sizeof(pa), a, "state", 3);
	cr_assert(!same_state_but_time(pa, pb), "step 3's state passes for step 6's");

	/* resuming with another shape is refused with a clear error */
	char *argv[] = { "train", "--device", "cpu", "--model", "tiny", "--batch", "3",
			 "--seq-len", "32", "--steps", "6", "--out", bdir, "--resume" };
	ng_clear_error();
	cr_assert_eq(ng_cmd_train(14, argv), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "written by another run"), "%s", ng_error_message());

	/* ... and so is resuming a state written by another number of processes */
	struct ng_train_state st;
	cr_assert_eq(ng_ckpt_read_state(pb, &st), NG_OK, "%s", ng_error_message());
	cr_assert_eq(st.world, 1);
	cr_assert_eq(st.elem_size, 8);
	float *p32 = malloc(st.n * sizeof(float));
	for (size_t i = 0; i < st.n; i++)
		p32[i] = (float)((const double *)st.params)[i];
	st.world = 2;
	cr_assert_eq(ng_ckpt_save(bdir, &st, p32), NG_OK, "%s", ng_error_message());
	free(p32);
	ng_ckpt_state_free(&st);
	cr_assert_eq(ng_ckpt_read_state(pb, &st), NG_OK, "%s", ng_error_message());
	cr_assert_eq(st.world, 2);
	ng_ckpt_state_free(&st);
	ng_clear_error();
	cr_assert_eq(train(bdir, "--resume", NULL, mb, seed), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "2 processes, this one has 1"), "%s",
		  ng_error_message());
}

/* A run stopped at a validation step and resumed validates at the same steps as the straight
 * run, with the same losses: the stopped run validates before it checkpoints. */
Test(checkpoint, cpu_resume_keeps_the_validations)
{
	long long seed = (long long)(seed_now() % 1000000);
	char a[512], bdir[512], ma[512], mb[512], sd[32];
	two_run_dirs(a, bdir, sizeof(a));
	snprintf(ma, sizeof(ma), "%s/a.jsonl", ng_test_dir);
	snprintf(mb, sizeof(mb), "%s/b.jsonl", ng_test_dir);
	snprintf(sd, sizeof(sd), "%lld", seed);
	char *argv[2][22];
	for (int r = 0; r < 2; r++) {
		char *v[] = { "train", "--device", "cpu", "--model", "tiny", "--batch", "2",
			      "--seq-len", "32", "--steps", "6", "--deterministic", "--seed", sd,
			      "--val-batches", "2", "--val-every", "2", "--out", r ? bdir : a,
			      "--metrics", r ? mb : ma };
		memcpy(argv[r], v, sizeof(v));
	}
	cr_assert_eq(train_with(argv[0], 22, NULL, NULL), NG_OK, "%s", ng_error_message());
	cr_assert_eq(train_with(argv[1], 22, "--stop-after", "4"), NG_OK, "%s",
		     ng_error_message());
	cr_assert_eq(train_with(argv[1], 22, "--resume", NULL), NG_OK, "%s", ng_error_message());
	char va[8][32], vb[8][32];
	int sa[8], sb[8];
	int na = metric_texts(ma, "val_loss", va, sa, 8);
	int nb = metric_texts(mb, "val_loss", vb, sb, 8);
	cr_assert_eq(na, 3, "the straight run validated %d times", na);
	cr_assert_eq(nb, 3, "stopped + resumed validated %d times", nb);
	for (int i = 0; i < 3; i++) {
		cr_expect_eq(sa[i], 2 * (i + 1), "validation %d at step %d", i, sa[i]);
		cr_expect_eq(sb[i], sa[i], "validation %d at step %d, resumed at %d", i, sa[i], sb[i]);
		cr_expect_str_eq(va[i], vb[i], "seed %lld: step %d val loss %s straight, %s resumed",
				 seed, sa[i], va[i], vb[i]);
	}
}

/* train ARGV (22 of them) plus extra1/extra2, its stderr (the step and target lines) into a file,
 * then read back as one string (freed by the caller). */
static char *train_stderr(char **argv, const char *extra1, const char *extra2, const char *log,
			  enum ng_status *st)
{
	fflush(stderr);
	int saved = dup(2), fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	cr_assert(saved >= 0 && fd >= 0, "cannot redirect stderr to %s", log);
	dup2(fd, 2);
	close(fd);
	*st = train_with(argv, 22, extra1, extra2);
	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	size_t n;
	return read_text(log, &n);
}

/* --target-val-loss over a stopped and resumed run: the state file carries the training time
 * (train_us), and the resumed part reports the target at the straight run's step, with the
 * tokens since step 0 and the time of both parts. */
Test(checkpoint, target_over_a_resumed_run, .timeout = 300)
{
	char a[512], bdir[512], log[512];
	two_run_dirs(a, bdir, sizeof(a));
	snprintf(log, sizeof(log), "%s/log.txt", ng_test_dir);
	char *argv[2][22];
	for (int r = 0; r < 2; r++) {
		char *v[] = { "train", "--device", "cpu", "--model", "tiny", "--steps", "60",
			      "--deterministic", "--seed", "11", "--val-every", "5", "--val-batches",
			      "2", "--target-val-loss", "5.5", "--out", r ? bdir : a, "--metrics",
			      "/dev/null", "--log-every", "100" };
		memcpy(argv[r], v, sizeof(v));
	}
	enum ng_status st;
	char *t1 = train_stderr(argv[0], NULL, NULL, log, &st);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	long long at = 0;
	double tok = 0, secs = 0;
	const char *p = strstr(t1, "target: val loss <= 5.5 reached after step ");
	cr_assert(p && sscanf(p, "target: val loss <= 5.5 reached after step %lld: %lf s", &at,
			      &secs) == 2, "no target line in:\n%s", t1);
	cr_assert(sscanf(strstr(p, "excluded), ") + 11, "%lf tokens", &tok) == 1, "%s", p);
	free(t1);
	if (at < 10)
		cr_skip_test("the target came at step %lld, too early to split the run", at);
	char stop[24];
	snprintf(stop, sizeof(stop), "%lld", at - 5);
	char *t2 = train_stderr(argv[1], "--stop-after", stop, log, &st);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	free(t2);
	char path[600];
	ng_ckpt_path(path, sizeof(path), bdir, "state", at - 5);
	struct ng_train_state s;
	cr_assert_eq(ng_ckpt_read_state(path, &s), NG_OK, "%s", ng_error_message());
	long long us1 = s.train_us;
	ng_ckpt_state_free(&s);
	cr_expect(us1 > 0, "the stopped part's state holds train_us %lld", us1);
	char *t3 = train_stderr(argv[1], "--resume", NULL, log, &st);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	long long at2 = 0;
	double tok2 = 0, secs2 = 0;
	p = strstr(t3, "target: val loss <= 5.5 reached after step ");
	cr_assert(p && sscanf(p, "target: val loss <= 5.5 reached after step %lld: %lf s", &at2,
			      &secs2) == 2, "no target line in:\n%s", t3);
	cr_expect_eq(at2, at, "resumed: target at step %lld, straight at %lld", at2, at);
	cr_expect(strstr(p, "over all the run's parts") != NULL, "%s", p);
	cr_assert(sscanf(strstr(p, "excluded), ") + 11, "%lf tokens", &tok2) == 1, "%s", p);
	cr_expect(tok2 == tok, "tokens %.0f resumed, %.0f straight", tok2, tok);
	cr_expect(secs2 >= (double)us1 * 1e-6, "total %.3f s, below the first part's %.3f s",
		  secs2, (double)us1 * 1e-6);
	free(t3);
}

/* A writer killed with SIGKILL at a random moment leaves `latest` naming a checkpoint that loads
 * (the temporary-fsync-rename order: model, state, then latest). */
Test(checkpoint, sigkill_while_writing_leaves_a_loadable_checkpoint)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	make_tmpdir();
	struct ng_gpt_config cfg = small_cfg(&r);
	struct ng_gpt_layout lay;
	float *p = random_params(&cfg, &lay, &r);
	struct ng_train_state s = { 0 };
	cr_assert_eq(ng_ckpt_state_alloc(&s, 4, lay.total), NG_OK);
	s.cfg = cfg;
	s.B = 1;
	s.T = 8;
	s.K = 1;
	memcpy(s.params, p, lay.total * sizeof(float));
	cr_assert_eq(ng_ckpt_save(ng_test_dir, &s, p), NG_OK, "%s", ng_error_message());
	long long from = 0;
	for (int round = 0; round < 3; round++) {
		pid_t child = fork();
		cr_assert(child >= 0);
		if (child == 0) { /* write checkpoints 1, 2, ... until killed */
			for (long long k = from + 1;; k++) {
				s.step = k;
				((float *)s.params)[0] = (float)k;
				p[0] = (float)k;
				if (ng_ckpt_save(ng_test_dir, &s, p))
					_exit(3);
			}
		}
		usleep((useconds_t)(1000 + ng_rng_below(&r, 30000)));
		kill(child, SIGKILL);
		int status;
		waitpid(child, &status, 0);
		cr_assert(WIFSIGNALED(status), "seed %llu: the writer exited (status %d) before the "
			  "kill", (unsigned long long)seed, status);
		long long step;
		cr_assert_eq(ng_ckpt_latest(ng_test_dir, &step), NG_OK, "%s", ng_error_message());
		char path[600];
		struct ng_train_state t;
		ng_ckpt_path(path, sizeof(path), ng_test_dir, "state", step);
		cr_assert_eq(ng_ckpt_read_state(path, &t), NG_OK, "seed %llu round %d: latest = %lld "
			     "does not load: %s", (unsigned long long)seed, round, step,
			     ng_error_message());
		cr_assert(t.step == step, "state %lld holds step %lld", step, t.step);
		if (step > 0)
			cr_assert(((float *)t.params)[0] == (float)step, "state %lld holds params "
				  "of another step", step);
		ng_ckpt_state_free(&t);
		struct ng_gpt_config c;
		float *q;
		ng_ckpt_path(path, sizeof(path), ng_test_dir, "model", step);
		cr_assert_eq(ng_ckpt_read_model(path, &c, &q), NG_OK, "%s", ng_error_message());
		free(q);
		cr_log_info("round %d: killed after checkpoint %lld", round, step);
		from = step;
	}
	ng_ckpt_state_free(&s);
	free(p);
}

/* Write checkpoint 1 into dir, then in a child limited to `fsize` bytes a file (RLIMIT_FSIZE;
 * 0: no limit) checkpoint 2, which must fail with exit status 1 and a message containing
 * `want`; checkpoint 1 must still be `latest` and load, with no temporary left beside it. */
static void second_checkpoint_fails(const char *dir, rlim_t fsize, const char *want)
{
	struct ng_rng r;
	ng_rng_seed(&r, seed_now());
	struct ng_gpt_config cfg = { 2, 2, 64, 32, 400, 0, NG_ARCH_GPT2 }; /* a checkpoint of about 2.1 MB */
	cr_assert_eq(ng_gpt_check(&cfg), NG_OK);
	struct ng_gpt_layout lay;
	float *p = random_params(&cfg, &lay, &r);
	struct ng_train_state s = { 0 };
	cr_assert_eq(ng_ckpt_state_alloc(&s, 4, lay.total), NG_OK);
	s.cfg = cfg;
	s.B = 1;
	s.T = 8;
	s.K = 1;
	s.step = 1;
	s.shuffle = -1;
	memcpy(s.params, p, lay.total * sizeof(float));
	cr_assert_eq(ng_ckpt_save(dir, &s, p), NG_OK, "%s", ng_error_message());
	int fds[2];
	cr_assert_eq(pipe(fds), 0);
	pid_t child = fork();
	cr_assert(child >= 0);
	if (child == 0) {
		signal(SIGXFSZ, SIG_IGN); /* a write past the limit fails with EFBIG instead */
		struct rlimit rl = { fsize, fsize };
		if (fsize && setrlimit(RLIMIT_FSIZE, &rl) != 0)
			_exit(9);
		s.step = 2;
		((float *)s.params)[0] += 1;
		enum ng_status st = ng_ckpt_save(dir, &s, p);
		const char *m = ng_error_message();
		if (write(fds[1], m, strlen(m)) < 0)
			_exit(8);
		_exit((int)st);
	}
	close(fds[1]);
	char msg[1100] = "";
	ssize_t got = read(fds[0], msg, sizeof(msg) - 1);
	msg[got > 0 ? got : 0] = '\0';
	close(fds[0]);
	int status;
	waitpid(child, &status, 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == NG_ERR_RUNTIME,
		  "checkpoint 2 did not fail with status 1 (wait status %d): %s", status, msg);
	cr_assert(strstr(msg, want), "message '%s' lacks '%s'", msg, want);
	long long step;
	cr_assert_eq(ng_ckpt_latest(dir, &step), NG_OK, "%s", ng_error_message());
	cr_assert_eq(step, 1);
	char path[600];
	struct ng_train_state t;
	ng_ckpt_path(path, sizeof(path), dir, "state", 1);
	cr_assert_eq(ng_ckpt_read_state(path, &t), NG_OK, "%s", ng_error_message());
	cr_assert(memcmp(t.params, p, lay.total * sizeof(float)) == 0);
	ng_ckpt_state_free(&t);
	struct ng_gpt_config c;
	float *q;
	ng_ckpt_path(path, sizeof(path), dir, "model", 1);
	cr_assert_eq(ng_ckpt_read_model(path, &c, &q), NG_OK, "%s", ng_error_message());
	free(q);
	glob_t g;
	snprintf(path, sizeof(path), "%s/*tmp*", dir);
	cr_assert_eq(glob(path, GLOB_PERIOD, NULL, &g), GLOB_NOMATCH, "left %s",
		     g.gl_pathc ? g.gl_pathv[0] : "");
	ng_ckpt_state_free(&s);
	free(p);
}

/* A file-size limit hit in the middle of a checkpoint (the write fails as on a full disk)
 * leaves the previous checkpoint `latest`, loadable, and no temporary file. */
Test(checkpoint, write_failure_keeps_the_previous_checkpoint)
{
	make_tmpdir();
	second_checkpoint_fails(ng_test_dir, 64 << 10, "File too large");
}

/* The same on a filesystem that really fills up: a 3 MB tmpfs takes one checkpoint of this
 * model (about 2 MB), not two (needs root to mount; skipped otherwise). */
Test(checkpoint, disk_full_keeps_the_previous_checkpoint)
{
	make_tmpdir();
	char mnt[300];
	snprintf(mnt, sizeof(mnt), "%s/small", ng_test_dir);
	cr_assert_eq(mkdir(mnt, 0755), 0);
	/* in a mount namespace of this test's process: the tmpfs goes with it, whatever happens */
	if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
	    mount("tmpfs", mnt, "tmpfs", 0, "size=3m") != 0)
		cr_skip_test("cannot mount a tmpfs here (%s): needs root", strerror(errno));
	second_checkpoint_fails(mnt, 0, "No space left on device");
	umount2(mnt, MNT_DETACH);
}

/* `nanograph eval --device cpu` on a model file and a shard = the CPU reference's mean loss over
 * the same windows (file order, B consecutive windows per batch). */
Test(checkpoint, eval_matches_the_reference_loss)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	make_tmpdir();
	struct ng_gpt_config cfg = { 2, 2, 64, 16, 300 + (int)ng_rng_below(&r, 200), 0,
				      NG_ARCH_GPT2 };
	cr_assert_eq(ng_gpt_check(&cfg), NG_OK);
	struct ng_gpt_layout lay;
	float *p = random_params(&cfg, &lay, &r);
	for (size_t i = 0; i < lay.total; i++)
		p[i] *= 0.1f;
	char model[512], shard[512], out[512];
	snprintf(model, sizeof(model), "%s/m.safetensors", ng_test_dir);
	snprintf(shard, sizeof(shard), "%s/val_000000.bin", ng_test_dir);
	snprintf(out, sizeof(out), "%s/eval.out", ng_test_dir);
	cr_assert_eq(ng_ckpt_write_model(model, &cfg, p), NG_OK, "%s", ng_error_message());
	int B = 2, nb = 3, T = cfg.T, ntok = nb * B * T + 1;
	int32_t hdr[256] = { 20240520, 1, ntok };
	uint16_t *tok = malloc(sizeof(uint16_t) * ntok);
	for (int i = 0; i < ntok; i++)
		tok[i] = (uint16_t)ng_rng_below(&r, (uint64_t)cfg.V);
	FILE *f = fopen(shard, "wb");
	cr_assert(f);
	fwrite(hdr, sizeof(hdr), 1, f);
	fwrite(tok, sizeof(uint16_t), ntok, f);
	fclose(f);

	struct ng_cpu_model m;
	cr_assert_eq(ng_cpu_model_init(&m, &cfg, B, T, 0), NG_OK);
	ng_cpu_model_load_params(&m, p);
	int32_t in[64], tg[64];
	double want = 0;
	for (int k = 0; k < nb; k++) {
		for (int b = 0; b < B; b++)
			for (int t = 0; t < T; t++) { /* window w = tokens [w T, w T + T] */
				in[b * T + t] = tok[(k * B + b) * T + t];
				tg[b * T + t] = tok[(k * B + b) * T + t + 1];
			}
		double l;
		cr_assert_eq(ng_cpu_forward(&m, in, tg, &l), NG_OK);
		want += l / nb;
	}
	ng_cpu_model_free(&m);

	double got = eval_cpu_loss(model, shard, out, NULL);
	cr_assert(fabs(got - want) <= 2e-6, "seed %llu: eval %.6f, reference %.8f (abs err %.3g)",
		  (unsigned long long)seed, got, want, fabs(got - want));
	free(tok);
	free(p);
}
