/*
 * tests/test_spr_cpu.c — the speedrun model (arch NG_ARCH_SPEEDRUN) outside the GPU step: its
 * model files (src/checkpoint.c's format nanograph-speedrun) round-trip bit for bit through
 * ng_ckpt_read_model, and missing, misshapen, extra, mis-typed, truncated or edited tensors and
 * metadata are refused with one line naming the problem; `train --device cpu` runs it on its
 * double-precision reference (graph/cpu_spr.h) at the GPU's window schedule, and 6 steps
 * straight equal 3 + --resume + 3 bit for bit (losses, state file) under Muon and AdamW;
 * `--init` starts from its file and refuses another model's; `eval --device cpu` equals the
 * reference's mean loss at the widest window (at W blocks with --window W), a validation during
 * training at the window of its step; `sample` reads and decodes it (a GPU test); with PyTorch
 * present, the whole recipe trains as tools/peer/speedrun_peer.py's float64 implementation of
 * it does (--check-train). Fresh random values every run (seed printed).
 * Losses read from a metrics file carry 6 significant digits (%.6g): they are compared with
 * the reference to 2e-6 relative, and a window test asks the other window to miss by 10x that.
 */
#define _XOPEN_SOURCE 700
#define _DEFAULT_SOURCE
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "data/synth.h"
#include "graph/cpu_spr.h"
#include "graph/step_spr.h"
#include "kernels/check.h"
#include "src/checkpoint.h"
#include "src/commands.h"
#include "tests/ckpt_testing.h"
#include "tests/test_tmpdir.h"
#include "util/rng.h"

static uint64_t seed_now(void)
{
	return (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
}

/* speedrun-tiny with T tokens and a random vocabulary (V - 1 starts a document). */
static struct ng_gpt_config spr_cfg(struct ng_rng *r, int L, int T)
{
	struct ng_gpt_config c;
	cr_assert_eq(ng_gpt_preset(&c, "speedrun-tiny"), NG_OK);
	c.L = L;
	c.T = T;
	c.V = 300 + (int)ng_rng_below(r, 200);
	cr_assert_eq(ng_gpt_check(&c), NG_OK, "%s", ng_error_message());
	return c;
}

/* Random values (std `std`) in every tensor the model has; the padding and the rows V..Vp-1 of
 * wte and ve (never looked up, not in the file) zero. */
static float *random_params(const struct ng_gpt_config *cfg, struct ng_gpt_layout *lay,
			    struct ng_rng *r, double std)
{
	ng_gpt_layout(cfg, lay);
	float *p = calloc(lay->total, sizeof(float));
	cr_assert(p);
	size_t VC = (size_t)cfg->V * cfg->C, VpC = (size_t)cfg->Vp * cfg->C;
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *s = &lay->p[i];
		for (size_t k = 0; k < s->numel; k++) {
			bool pad = (i == NG_P_WTE || i == NG_P_VE) && k % VpC >= VC;
			if (!pad)
				p[s->offset + k] = (float)(std * ng_rng_normal(r));
		}
	}
	return p;
}

/* Weights under which every output depends on the attention window: the seeded init with the
 * zero-initialised matrices and the scalars given random values (ng_cpu_spr_randomize), as
 * floats in the flat layout. */
static float *signal_params(const struct ng_gpt_config *cfg, struct ng_gpt_layout *lay,
			    uint64_t seed)
{
	struct ng_cpu_spr_model m;
	cr_assert_eq(ng_cpu_spr_init(&m, cfg, 1, 1, seed), NG_OK, "%s", ng_error_message());
	ng_cpu_spr_randomize(&m, seed + 1);
	*lay = m.lay;
	float *p = malloc(lay->total * sizeof(float));
	cr_assert(p);
	for (size_t i = 0; i < lay->total; i++)
		p[i] = (float)m.params[i];
	ng_cpu_spr_free(&m);
	return p;
}

/* The reference's mean loss over B sequences of tokens w (B windows of T + 1) at window W. */
static double ref_loss(const struct ng_gpt_config *cfg, const float *params, const uint16_t *w,
		       int B, int T, int W)
{
	struct ng_cpu_spr_model m;
	cr_assert_eq(ng_cpu_spr_init(&m, cfg, B, T, 0), NG_OK, "%s", ng_error_message());
	ng_cpu_spr_load_params(&m, params);
	int32_t *in = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
	cr_assert(in && tg);
	for (int b = 0; b < B; b++)
		for (int t = 0; t < T; t++) {
			in[b * T + t] = w[b * (T + 1) + t];
			tg[b * T + t] = w[b * (T + 1) + t + 1];
		}
	double sum;
	cr_assert_eq(ng_cpu_spr_forward(&m, in, tg, W, &sum), NG_OK, "%s", ng_error_message());
	ng_cpu_spr_free(&m);
	free(in);
	free(tg);
	return sum / ((double)B * T);
}

/* Tokens for the window tests: random, with a document start (V - 1) about every 300 tokens,
 * so that most documents reach past the 128-token blocks. */
static void long_documents(uint16_t *tok, int n, int V, struct ng_rng *r)
{
	for (int i = 0; i < n; i++)
		tok[i] = (uint16_t)(ng_rng_below(r, 300) == 0 ? (uint64_t)V - 1
							       : ng_rng_below(r, (uint64_t)V - 1));
}

/* A shard file (the speedrun format's header) of n tokens. */
static void write_shard(const char *path, const uint16_t *tok, int n)
{
	int32_t hdr[256] = { 20240520, 1, n };
	FILE *f = fopen(path, "wb");
	cr_assert(f, "cannot write %s", path);
	fwrite(hdr, sizeof(hdr), 1, f);
	fwrite(tok, sizeof(uint16_t), (size_t)n, f);
	fclose(f);
}

/* One error line naming `needle`, NG_ERR_INPUT, nothing handed back. */
static void expect_refused(const char *path, const char *needle, uint64_t seed)
{
	struct ng_gpt_config got;
	float *q = NULL;
	ng_clear_error();
	enum ng_status st = ng_ckpt_read_model(path, &got, &q);
	cr_expect_eq(st, NG_ERR_INPUT, "seed %llu: status %d for '%s' (%s)",
		     (unsigned long long)seed, st, needle, ng_error_message());
	cr_expect(q == NULL, "a refused file handed back parameters");
	cr_expect(strstr(ng_error_message(), needle) != NULL, "message '%s' lacks '%s'",
		  ng_error_message(), needle);
	cr_expect(strchr(ng_error_message(), '\n') == NULL, "more than one line: '%s'",
		  ng_error_message());
	free(q);
}

Test(spr_cpu, model_round_trip_bit_exact)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	ng_test_dir_make("ng_spr_test_");
	static const int Ls[] = { 6, 8, 12 };
	for (int i = 0; i < 3; i++) {
		struct ng_gpt_config cfg = spr_cfg(&r, Ls[i], 64 + (int)ng_rng_below(&r, 500)), got;
		struct ng_gpt_layout lay;
		float *p = random_params(&cfg, &lay, &r, 1.0), *q;
		char path[512];
		snprintf(path, sizeof(path), "%s/m%d.safetensors", ng_test_dir, i);
		cr_assert_eq(ng_ckpt_write_model(path, &cfg, p), NG_OK, "%s", ng_error_message());
		cr_assert_eq(ng_ckpt_read_model(path, &got, &q), NG_OK, "seed %llu: %s",
			     (unsigned long long)seed, ng_error_message());
		cr_assert(got.arch == NG_ARCH_SPEEDRUN && got.L == cfg.L && got.H == cfg.H &&
			  got.C == cfg.C && got.T == cfg.T && got.V == cfg.V && got.Vp == cfg.Vp,
			  "seed %llu: config L=%d H=%d C=%d T=%d V=%d arch %d read back as L=%d H=%d "
			  "C=%d T=%d V=%d arch %d", (unsigned long long)seed, cfg.L, cfg.H, cfg.C,
			  cfg.T, cfg.V, cfg.arch, got.L, got.H, got.C, got.T, got.V, got.arch);
		size_t bad = 0, first = 0;
		for (size_t k = 0; k < lay.total; k++)
			if (memcmp(&p[k], &q[k], 4) != 0 && bad++ == 0)
				first = k;
		cr_assert_eq(bad, 0, "seed %llu, L=%d: %zu elements differ, first at %zu (%g vs %g)",
			     (unsigned long long)seed, cfg.L, bad, first, p[first], q[first]);
		/* the block without attention has its MLP and x0 lambdas, no attention tensors */
		size_t n;
		unsigned char *b = read_file(path, &n);
		char *hdr = strndup((char *)b + 8, header_len(b)), key[64];
		int na = ng_spr_no_attn(&cfg);
		snprintf(key, sizeof(key), "\"blocks.%d.fcw\"", na);
		cr_expect(strstr(hdr, key), "no %s", key);
		snprintf(key, sizeof(key), "\"blocks.%d.qkvw\"", na);
		cr_expect(!strstr(hdr, key), "%s written for the block without attention", key);
		free(hdr);
		free(b);
		free(p);
		free(q);
	}
}

/* Header edits (edit_fn's ctx): rename a tensor, change its shape or dtype, add one, set or
 * delete a metadata entry. */
struct edit {
	const char *tensor;   /* the tensor edited, or NULL */
	const char *rename;   /* its new name */
	json_t *shape;        /* its new shape (consumed) */
	const char *dtype;    /* its new dtype */
	const char *add;      /* a zero-size tensor of this name at the end of the data */
	size_t data_bytes;    /* the data section's size (for add) */
	const char *meta_key; /* metadata entry set to meta_value, or deleted when that is NULL */
	const char *meta_value;
};

static void edit_fn(json_t *root, void *ctx)
{
	const struct edit *e = ctx;
	if (e->tensor) {
		json_t *t = json_object_get(root, e->tensor);
		cr_assert(t, "no tensor %s", e->tensor);
		if (e->shape)
			json_object_set_new(t, "shape", e->shape);
		if (e->dtype)
			json_object_set_new(t, "dtype", json_string(e->dtype));
		if (e->rename) {
			json_object_set(root, e->rename, t);
			json_object_del(root, e->tensor);
		}
	}
	if (e->add)
		json_object_set_new(root, e->add,
				    json_pack("{s:s, s:[i], s:[I, I]}", "dtype", "F32", "shape", 0,
					      "data_offsets", (json_int_t)e->data_bytes,
					      (json_int_t)e->data_bytes));
	if (e->meta_key) {
		json_t *meta = json_object_get(root, "__metadata__");
		if (e->meta_value)
			json_object_set_new(meta, e->meta_key, json_string(e->meta_value));
		else
			json_object_del(meta, e->meta_key);
	}
}

Test(spr_cpu, corrupt_truncated_edited_files_refused)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	ng_test_dir_make("ng_spr_test_");
	struct ng_gpt_config cfg = spr_cfg(&r, 6, 128);
	struct ng_gpt_layout lay;
	float *p = random_params(&cfg, &lay, &r, 1.0);
	char path[512], badp[512];
	snprintf(path, sizeof(path), "%s/m.safetensors", ng_test_dir);
	snprintf(badp, sizeof(badp), "%s/bad.safetensors", ng_test_dir);
	cr_assert_eq(ng_ckpt_write_model(path, &cfg, p), NG_OK, "%s", ng_error_message());
	size_t n;
	unsigned char *b = read_file(path, &n);
	size_t data = n - 8 - header_len(b);
	char want[160];
	int C = cfg.C;

	struct edit e = { .tensor = "blocks.1.fcw", .rename = "blocks.1.fcX" };
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	expect_refused(badp, "tensor blocks.1.fcw of the speedrun model L=6 is missing", seed);

	e = (struct edit){ .tensor = "blocks.2.qkvw", .shape = json_pack("[i, i]", C, 3 * C) };
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	snprintf(want, sizeof(want), "tensor blocks.2.qkvw has shape [%d, %d] dtype F32, expected "
		 "[%d, %d]", C, 3 * C, 3 * C, C);
	expect_refused(badp, want, seed);

	e = (struct edit){ .tensor = "headw", .dtype = "I32" };
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	expect_refused(badp, "tensor headw has shape", seed);
	expect_refused(badp, "dtype I32", seed);

	e = (struct edit){ .add = "blocks.6.fcw", .data_bytes = data };
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	expect_refused(badp, "tensor blocks.6.fcw is not part of a speedrun model of L=6", seed);

	e = (struct edit){ .meta_key = "n_head" };
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	expect_refused(badp, "metadata n_head is missing", seed);

	e = (struct edit){ .meta_key = "n_positions", .meta_value = "0" };
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	expect_refused(badp, "metadata n_positions = \"0\" is not an integer", seed);

	e = (struct edit){ .meta_key = "n_layer", .meta_value = "7" };
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	expect_refused(badp, "even number of layers", seed);

	e = (struct edit){ .meta_key = "n_layer", .meta_value = "8" }; /* blocks 6, 7 absent */
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	expect_refused(badp, "of the speedrun model L=8 is missing", seed);

	e = (struct edit){ .meta_key = "n_embd", .meta_value = "32" };
	rewrite(b, n, badp, edit_fn, &e, STAMP);
	snprintf(want, sizeof(want), "metadata n_embd = 32, but the tensors give %d", C);
	expect_refused(badp, want, seed);

	/* an edit under the old checksum: refused by it; without a checksum: read */
	e = (struct edit){ .meta_key = "n_head", .meta_value = "4" };
	rewrite(b, n, badp, edit_fn, &e, KEEP);
	expect_refused(badp, "checksum mismatch", seed);
	rewrite(b, n, badp, edit_fn, &e, NONE);
	struct ng_gpt_config got;
	float *q;
	cr_expect_eq(ng_ckpt_read_model(badp, &got, &q), NG_OK, "%s", ng_error_message());
	cr_expect(got.H == 4 && got.arch == NG_ARCH_SPEEDRUN);
	free(q);

	/* a flipped data byte, and truncations anywhere */
	unsigned char *c = malloc(n);
	memcpy(c, b, n);
	c[n - 1 - ng_rng_below(&r, data)] ^= 0x10;
	write_file(badp, c, n);
	expect_refused(badp, "checksum mismatch", seed);
	for (int k = 0; k < 24; k++) {
		size_t len = k < 8 ? (size_t)k * n / 8 : ng_rng_below(&r, n);
		write_file(badp, b, len);
		struct ng_gpt_config g2;
		float *q2 = NULL;
		ng_clear_error();
		cr_expect_eq(ng_ckpt_read_model(badp, &g2, &q2), NG_ERR_INPUT,
			     "seed %llu: %zu of %zu bytes accepted", (unsigned long long)seed, len, n);
		cr_expect(q2 == NULL);
		free(q2);
	}
	free(c);
	free(b);
	free(p);
}

/* `train --device cpu --model speedrun-tiny` for 6 steps of B = 1 x 256 tokens, checkpoints
 * every 3, one validation batch, with the optimizer given and extra flags. */
static enum ng_status train(const char *out, const char *optimizer, const char *extra1,
			    const char *extra2, const char *metrics, long long seed)
{
	char sd[32];
	snprintf(sd, sizeof(sd), "%lld", seed);
	char *argv[] = { "train", "--device", "cpu", "--model", "speedrun-tiny", "--seq-len",
			   "256", "--steps", "6", "--optimizer", (char *)optimizer, "--seed", sd,
			   "--val-batches", "1", "--ckpt-every", "3", "--out", (char *)out,
			   "--metrics", (char *)metrics };
	return train_with(argv, (int)(sizeof(argv) / sizeof(argv[0])), extra1, extra2);
}

Test(spr_cpu, cpu_resume_is_bit_identical, .timeout = 300)
{
	long long seed = (long long)(seed_now() % 1000000);
	ng_test_dir_make("ng_spr_test_");
	static const char *opts[] = { "muon", "adamw" };
	for (int o = 0; o < 2; o++) {
		char a[512], bdir[512], ma[512], mb[512];
		snprintf(a, sizeof(a), "%s/%s_a", ng_test_dir, opts[o]);
		snprintf(bdir, sizeof(bdir), "%s/%s_b", ng_test_dir, opts[o]);
		snprintf(ma, sizeof(ma), "%s/%s_a.jsonl", ng_test_dir, opts[o]);
		snprintf(mb, sizeof(mb), "%s/%s_b.jsonl", ng_test_dir, opts[o]);
		cr_assert_eq(train(a, opts[o], NULL, NULL, ma, seed), NG_OK, "%s",
			     ng_error_message());
		cr_assert_eq(train(bdir, opts[o], "--stop-after", "3", mb, seed), NG_OK, "%s",
			     ng_error_message());
		char later[600];
		ng_ckpt_path(later, sizeof(later), bdir, "state", 6);
		cr_assert(access(later, F_OK) != 0, "the stopped run went past step 3");
		cr_assert_eq(train(bdir, opts[o], "--resume", NULL, mb, seed), NG_OK, "%s",
			     ng_error_message());
		char la[8][32], lb[8][32];
		int na = losses(ma, la, 8), nb = losses(mb, lb, 8);
		cr_assert_eq(na, 6);
		cr_assert_eq(nb, 6, "resumed metrics hold %d steps", nb);
		for (int i = 0; i < 6; i++)
			cr_assert_str_eq(la[i], lb[i], "%s, seed %lld: step %d loss %s uninterrupted, "
					 "%s resumed", opts[o], seed, i + 1, la[i], lb[i]);
		cr_expect(strtod(la[5], NULL) < strtod(la[0], NULL), "%s: loss %s -> %s", opts[o],
			  la[0], la[5]);
		/* the final state (params, moments, step) byte for byte, the training time aside */
		char pa[600], pb[600];
		ng_ckpt_path(pa, sizeof(pa), a, "state", 6);
		ng_ckpt_path(pb, sizeof(pb), bdir, "state", 6);
		cr_assert(same_state_but_time(pa, pb), "%s, seed %lld: final state files differ",
			  opts[o], seed);
	}
	/* a GPT-2 run of the same sizes does not resume the speedrun model's state */
	char dir[512], sd[32];
	snprintf(dir, sizeof(dir), "%s/adamw_b", ng_test_dir);
	snprintf(sd, sizeof(sd), "%lld", seed);
	char *argv[] = { "train", "--device", "cpu", "--model", "tiny", "--layers", "6",
			 "--batch", "1", "--seq-len", "256", "--steps", "6", "--seed", sd,
			 "--out", dir, "--resume" };
	ng_clear_error();
	cr_assert_eq(ng_cmd_train(18, argv), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "holds a speedrun model, this run trains a GPT-2"),
		  "%s", ng_error_message());
}

/* The loss of step 2 of 10, resumed from a state written at step 1 with random weights: the
 * reference's at window ng_spr_window_blocks(1, 10) = 2 blocks (long 256 tokens, short 128 <
 * T = 512) on synthetic batch 1, which the widest window would not give. */
Test(spr_cpu, cpu_step_takes_the_gpu_window_schedule, .timeout = 120)
{
	/* the seed gives the weights and the synthetic batch; a batch whose documents all end
	 * within the short window gives both windows one loss, so the first seed from the clock
	 * whose two windows differ is the one taken (at most 32 tried) */
	uint64_t seed = seed_now() % 1000000;
	struct ng_gpt_config cfg;
	cr_assert_eq(ng_gpt_preset(&cfg, "speedrun-tiny"), NG_OK);
	struct ng_gpt_layout lay;
	int W = ng_spr_window_blocks(1, 10);
	cr_expect_eq(W, 2);
	uint16_t *w = malloc(sizeof(uint16_t) * (cfg.T + 1));
	cr_assert(w);
	float *p = NULL;
	double want = 0, widest = 0;
	for (int tries = 0; tries < 32; tries++, seed++) {
		free(p);
		p = signal_params(&cfg, &lay, seed);
		struct ng_synth syn;
		cr_assert_eq(ng_synth_init(&syn, cfg.V, seed), NG_OK);
		ng_synth_batch(&syn, 0, 1, 1, cfg.T, w);
		ng_synth_free(&syn);
		want = ref_loss(&cfg, p, w, 1, cfg.T, W);
		widest = ref_loss(&cfg, p, w, 1, cfg.T, ng_spr_window_blocks(1, 1));
		if (fabs(widest - want) > 2e-5 * want)
			break;
	}
	cr_expect(fabs(widest - want) > 2e-5 * want, "seed %llu: the windows give the same loss "
		  "%.8g, so this test does not tell them apart", (unsigned long long)seed, want);
	ng_test_dir_make("ng_spr_test_");
	struct ng_train_state s = { .cfg = cfg, .B = 1, .T = cfg.T, .K = 1, .step = 1,
				    .seed = seed, .world = 1, .shuffle = -1 };
	cr_assert_eq(ng_ckpt_state_alloc(&s, 8, lay.total), NG_OK);
	for (size_t i = 0; i < lay.total; i++)
		((double *)s.params)[i] = p[i];
	char dir[512], metrics[512], sd[32];
	snprintf(dir, sizeof(dir), "%s/ck", ng_test_dir);
	snprintf(metrics, sizeof(metrics), "%s/m.jsonl", ng_test_dir);
	snprintf(sd, sizeof(sd), "%llu", (unsigned long long)seed);
	cr_assert_eq(ng_ckpt_save(dir, &s, p), NG_OK, "%s", ng_error_message());
	ng_ckpt_state_free(&s);
	char *argv[] = { "train", "--device", "cpu", "--model", "speedrun-tiny", "--steps", "10",
			 "--stop-after", "2", "--optimizer", "adamw", "--seed", sd, "--out", dir,
			 "--resume", "--val-batches", "0", "--metrics", metrics };
	cr_assert_eq(ng_cmd_train(20, argv), NG_OK, "%s", ng_error_message());
	char l[4][32];
	cr_assert_eq(losses(metrics, l, 4), 1);
	double got = strtod(l[0], NULL);
	cr_expect(fabs(got - want) <= 2e-6 * want, "seed %llu: step 2 loss %.8g, the reference "
		  "at W = %d %.8g (at the widest window %.8g)", (unsigned long long)seed, got, W,
		  want, widest);
	free(w);
	free(p);
}

/* --init FILE: the first step's loss is the reference's with the file's weights (window 1 at
 * step 0); a file of another model is refused naming both. */
Test(spr_cpu, init_from_a_speedrun_file, .timeout = 120)
{
	uint64_t seed = seed_now() % 1000000;
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	ng_test_dir_make("ng_spr_test_");
	struct ng_gpt_config cfg;
	cr_assert_eq(ng_gpt_preset(&cfg, "speedrun-tiny"), NG_OK);
	cfg.T = 256;
	cr_assert_eq(ng_gpt_check(&cfg), NG_OK);
	struct ng_gpt_layout lay;
	float *p = signal_params(&cfg, &lay, seed);
	char model[512], metrics[512], sd[32];
	snprintf(model, sizeof(model), "%s/m.safetensors", ng_test_dir);
	snprintf(metrics, sizeof(metrics), "%s/m.jsonl", ng_test_dir);
	snprintf(sd, sizeof(sd), "%llu", (unsigned long long)seed);
	cr_assert_eq(ng_ckpt_write_model(model, &cfg, p), NG_OK, "%s", ng_error_message());
	char *argv[] = { "train", "--device", "cpu", "--model", "speedrun-tiny", "--seq-len",
			 "256", "--steps", "1", "--seed", sd, "--init", model, "--val-batches",
			 "0", "--metrics", metrics };
	cr_assert_eq(ng_cmd_train(17, argv), NG_OK, "%s", ng_error_message());
	char l[4][32];
	cr_assert_eq(losses(metrics, l, 4), 1);
	struct ng_synth syn;
	cr_assert_eq(ng_synth_init(&syn, cfg.V, seed), NG_OK);
	uint16_t w[257];
	ng_synth_batch(&syn, 0, 0, 1, cfg.T, w);
	ng_synth_free(&syn);
	double want = ref_loss(&cfg, p, w, 1, cfg.T, 1), got = strtod(l[0], NULL);
	cr_expect(fabs(got - want) <= 2e-6 * want, "seed %llu: first loss %.8g, the reference "
		  "with the file's weights %.8g", (unsigned long long)seed, got, want);

	/* the run's sizes or family differ from the file's */
	char *deeper[] = { "train", "--device", "cpu", "--model", "speedrun-tiny", "--seq-len",
			   "256", "--layers", "8", "--steps", "1", "--init", model };
	ng_clear_error();
	cr_expect_eq(ng_cmd_train(13, deeper), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "is a speedrun model L=6 H=2 C=64 T=256") &&
		  strstr(ng_error_message(), "the run a speedrun model L=8"), "%s",
		  ng_error_message());
	char *gpt2[] = { "train", "--device", "cpu", "--model", "tiny", "--layers", "6",
			 "--seq-len", "256", "--steps", "1", "--init", model };
	ng_clear_error();
	cr_expect_eq(ng_cmd_train(13, gpt2), NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "the run a GPT-2 model L=6"), "%s",
		  ng_error_message());
	free(p);
}

/* `eval --device cpu` of a speedrun model file on a shard = the reference's mean loss over the
 * same windows (file order, B consecutive windows a batch) at the widest window, as the GPU's
 * eval graph runs it. Documents start at token V - 1 (every ~40 tokens here). */
Test(spr_cpu, eval_matches_the_reference_loss, .timeout = 120)
{
	uint64_t seed = seed_now();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	ng_test_dir_make("ng_spr_test_");
	struct ng_gpt_config cfg = spr_cfg(&r, 6, 200);
	struct ng_gpt_layout lay;
	float *p = signal_params(&cfg, &lay, seed);
	char model[512], shard[512], out[512];
	snprintf(model, sizeof(model), "%s/m.safetensors", ng_test_dir);
	snprintf(shard, sizeof(shard), "%s/val_000000.bin", ng_test_dir);
	snprintf(out, sizeof(out), "%s/eval.out", ng_test_dir);
	cr_assert_eq(ng_ckpt_write_model(model, &cfg, p), NG_OK, "%s", ng_error_message());
	int B = 2, nb = 3, T = cfg.T, ntok = nb * B * T + 1;
	uint16_t *tok = malloc(sizeof(uint16_t) * ntok), *w = malloc(sizeof(uint16_t) * B * (T + 1));
	cr_assert(tok && w);
	for (int i = 0; i < ntok; i++)
		tok[i] = (uint16_t)(ng_rng_below(&r, 40) == 0 ? (uint64_t)cfg.V - 1
							      : ng_rng_below(&r, (uint64_t)cfg.V));
	write_shard(shard, tok, ntok);
	double want = 0;
	for (int k = 0; k < nb; k++) {
		for (int b = 0; b < B; b++) /* window j = tokens [j T, j T + T] */
			memcpy(w + b * (T + 1), tok + (k * B + b) * T, sizeof(uint16_t) * (T + 1));
		want += ref_loss(&cfg, p, w, B, T, ng_spr_window_blocks(1, 1)) / nb;
	}

	double got = eval_cpu_loss(model, shard, out, NULL);
	cr_expect(fabs(got - want) <= 2e-6, "seed %llu: eval %.6f, reference %.8f (abs err %.3g)",
		  (unsigned long long)seed, got, want, fabs(got - want));
	free(tok);
	free(w);
	free(p);
}

/* A validation after step s of S attends within the window of step s, ng_spr_window_blocks(s,
 * S) blocks (here 3 of 10), as the GPU's eval graph does and as the reference run validates;
 * `eval --window W` within W blocks and `eval` within the widest. Trained with AdamW at lr 0,
 * the weights stay the file's, so every figure is the reference's mean loss over the two
 * validation sequences at its window. The first seed from the clock whose windows 3 and 14
 * give different losses is taken (at most 32 tried). */
Test(spr_cpu, validation_takes_the_step_window, .timeout = 180)
{
	uint64_t seed = seed_now() % 1000000;
	struct ng_gpt_config cfg;
	cr_assert_eq(ng_gpt_preset(&cfg, "speedrun-tiny"), NG_OK);
	const int T = cfg.T, W = ng_spr_window_blocks(2, 10), widest = ng_spr_window_blocks(1, 1);
	cr_expect_eq(W, 3);
	const int nval = 2 * T + 1, ntrain = 4 * T + 1; /* two validation sequences of T + 1 */
	uint16_t *val = malloc(sizeof(uint16_t) * nval), *trn = malloc(sizeof(uint16_t) * ntrain);
	cr_assert(val && trn);
	struct ng_gpt_layout lay;
	float *p = NULL;
	double want = 0, want_widest = 0;
	for (int tries = 0; tries < 32; tries++, seed++) {
		free(p);
		p = signal_params(&cfg, &lay, seed);
		struct ng_rng r;
		ng_rng_seed(&r, seed);
		long_documents(val, nval, cfg.V, &r);
		want = (ref_loss(&cfg, p, val, 1, T, W) + ref_loss(&cfg, p, val + T, 1, T, W)) / 2;
		want_widest = (ref_loss(&cfg, p, val, 1, T, widest) +
			       ref_loss(&cfg, p, val + T, 1, T, widest)) / 2;
		if (fabs(want_widest - want) > 2e-5 * want)
			break;
	}
	cr_expect(fabs(want_widest - want) > 2e-5 * want, "seed %llu: the windows give the same "
		  "loss %.8g, so this test does not tell them apart", (unsigned long long)seed,
		  want);
	struct ng_rng r;
	ng_rng_seed(&r, seed ^ 0x5eed);
	long_documents(trn, ntrain, cfg.V, &r);
	ng_test_dir_make("ng_spr_test_");
	char model[512], vshard[512], tshard[512], dir[512], metrics[512], out[512], sd[32];
	snprintf(model, sizeof(model), "%s/m.safetensors", ng_test_dir);
	snprintf(vshard, sizeof(vshard), "%s/val_000000.bin", ng_test_dir);
	snprintf(tshard, sizeof(tshard), "%s/train_000000.bin", ng_test_dir);
	snprintf(dir, sizeof(dir), "%s/ck", ng_test_dir);
	snprintf(metrics, sizeof(metrics), "%s/m.jsonl", ng_test_dir);
	snprintf(out, sizeof(out), "%s/eval.out", ng_test_dir);
	snprintf(sd, sizeof(sd), "%llu", (unsigned long long)seed);
	cr_assert_eq(ng_ckpt_write_model(model, &cfg, p), NG_OK, "%s", ng_error_message());
	write_shard(vshard, val, nval);
	write_shard(tshard, trn, ntrain);

	char *argv[] = { "train", "--device", "cpu", "--model", "speedrun-tiny", "--batch", "1",
			 "--steps", "10", "--stop-after", "2", "--optimizer", "adamw", "--lr", "0",
			 "--train", tshard, "--val", vshard, "--val-every", "2", "--val-batches",
			 "2", "--seed", sd, "--init", model, "--out", dir, "--metrics", metrics };
	cr_assert_eq(ng_cmd_train((int)(sizeof(argv) / sizeof(argv[0])), argv), NG_OK, "%s",
		     ng_error_message());
	char v[4][32];
	int steps[4];
	cr_assert_eq(metric_texts(metrics, "val_loss", v, steps, 4), 1);
	cr_expect_eq(steps[0], 2);
	double got = strtod(v[0], NULL);
	cr_expect(fabs(got - want) <= 2e-6 * want, "seed %llu: validation after step 2 %.8g, the "
		  "reference at W = %d %.8g (at the widest window %.8g)", (unsigned long long)seed,
		  got, W, want, want_widest);

	double at_w = eval_cpu_loss(model, vshard, out, "3"); /* prints %.6f */
	cr_expect(fabs(at_w - want) <= 2e-6, "seed %llu: eval --window 3 %.6f, the reference "
		  "%.8f", (unsigned long long)seed, at_w, want);
	double dflt = eval_cpu_loss(model, vshard, out, NULL);
	cr_expect(fabs(dflt - want_widest) <= 2e-6, "seed %llu: eval %.6f, the reference at the "
		  "widest window %.8f", (unsigned long long)seed, dflt, want_widest);
	free(val);
	free(trn);
	free(p);
}

/* sample reads a speedrun model file and decodes it (graph/sampler_spr.c; the logits are
 * checked against the reference in tests/test_sample_spr.c). */
Test(spr_cpu, sample_reads_a_speedrun_model)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_rng r;
	ng_rng_seed(&r, 1);
	ng_test_dir_make("ng_spr_test_");
	struct ng_gpt_config cfg = spr_cfg(&r, 6, 128);
	struct ng_gpt_layout lay;
	float *p = random_params(&cfg, &lay, &r, 0.3);
	char model[512];
	snprintf(model, sizeof(model), "%s/m.safetensors", ng_test_dir);
	cr_assert_eq(ng_ckpt_write_model(model, &cfg, p), NG_OK, "%s", ng_error_message());
	char *argv[] = { "sample", "--ckpt", model, "--tokens", "4" };
	ng_clear_error();
	cr_expect_eq(ng_cmd_sample(5, argv), NG_OK, "%s", ng_error_message());
	free(p);
}

/* The whole recipe against an independent implementation of its text: `speedrun_peer.py
 * --check-train` (float64 PyTorch on the CPU: Muon, Adam's groups, the lr, momentum and window
 * schedules, the validations) beside `train --device cpu` of this build, 6 steps with the
 * momentum warm-up over 3 (the window 1 -> 12 blocks, the cooldown). Needs PyTorch; run from
 * the source root. */
Test(spr_cpu, recipe_matches_the_pytorch_peer, .timeout = 600)
{
	if (access("tools/peer/speedrun_peer.py", R_OK) != 0)
		cr_skip_test("tools/peer/speedrun_peer.py not here: run from the source root");
	if (system("python3 -c 'import numpy, torch' >/dev/null 2>&1") != 0)
		cr_skip_test("needs PyTorch and numpy (python3 -c 'import numpy, torch')");
	char exe[4096];
	ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	cr_assert(len > 0);
	exe[len] = '\0';
	*strrchr(exe, '/') = '\0'; /* <build>/tests */
	*strrchr(exe, '/') = '\0'; /* <build> */
	ng_test_dir_make("ng_spr_test_");
	char cmd[8192], log[512];
	snprintf(log, sizeof(log), "%s/check.txt", ng_test_dir);
	snprintf(cmd, sizeof(cmd), "python3 tools/peer/speedrun_peer.py --check-train --steps 6 "
		 "--muon-momentum-warmup 3 --seed %llu --build '%s' >'%s' 2>&1",
		 (unsigned long long)(seed_now() % 100000), exe, log);
	int rc = system(cmd);
	size_t n;
	char *out = read_text(log, &n);
	cr_expect(rc == 0 && strstr(out, "check-train: PASS"), "%s\n%s", cmd, out);
	free(out);
}
