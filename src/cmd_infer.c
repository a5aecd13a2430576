/*
 * src/cmd_infer.c — `nanograph sample` (KV-cache generation on the GPU, graph/sampler.h, for
 * both model families: GPT-2 and the speedrun model; the prompt encoded and the output decoded
 * with the GPT-2 tokenizer, which both use) and `nanograph eval`
 * (validation loss and perplexity of a checkpoint through the training backends' evaluation
 * step: the GPU's captured eval graph, or the CPU reference with --device cpu; either family,
 * the speedrun model at its widest window). --ckpt takes a model file (model_*.safetensors, or
 * any HF GPT-2 safetensors) or a checkpoint directory (its latest model).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "data/loader.h"
#include "data/tokenizer.h"
#include "graph/sampler.h"
#include "graph/step_spr.h"
#include "kernels/check.h"
#include "kernels/decode.h"
#include "src/checkpoint.h"
#include "src/commands.h"
#include "src/train.h"
#include "util/file.h"

/* The model of --ckpt (a file, or a directory's latest checkpoint). */
static enum ng_status load_ckpt(const char *ckpt, struct ng_gpt_config *cfg, float **params)
{
	if (!ckpt)
		return ng_fail(NG_ERR_INPUT, "--ckpt PATH is required (a model_*.safetensors file "
			       "or a checkpoint directory)");
	struct stat sb;
	char path[4096];
	snprintf(path, sizeof(path), "%s", ckpt);
	if (stat(ckpt, &sb) == 0 && S_ISDIR(sb.st_mode)) {
		long long step;
		enum ng_status st = ng_ckpt_latest(ckpt, &step);
		if (st)
			return st;
		ng_ckpt_path(path, sizeof(path), ckpt, "model", step);
	}
	enum ng_status st = ng_ckpt_read_model(path, cfg, params);
	if (!st)
		fprintf(stderr, "model: %s | %s L=%d H=%d C=%d T=%d V=%d\n", path,
			cfg->arch == NG_ARCH_SPEEDRUN ? "speedrun" : "GPT-2", cfg->L, cfg->H,
			cfg->C, cfg->T, cfg->V);
	return st;
}

static const char *vocab_dir(const char *flag)
{
	return flag ? flag : ng_tokenizer_default_dir();
}

/* --logits: int32 n_rows, V, n_seq; int32 tokens[n_seq] (prompt then samples); float32
 * rows[n_rows][V], row i the logits after token i (predicting token i + 1). */
static enum ng_status write_logits(const char *path, const int32_t *ids, int n_prompt,
				   const int32_t *out, int n_new, const float *rows, int n_rows,
				   int V)
{
	FILE *f = fopen(path, "wb");
	if (!f)
		return ng_fail(NG_ERR_INPUT, "sample --logits %s: cannot create it", path);
	int32_t head[3] = { n_rows, V, n_prompt + n_new };
	bool ok = fwrite(head, sizeof(head), 1, f) == 1 &&
		  fwrite(ids, sizeof(int32_t), (size_t)n_prompt, f) == (size_t)n_prompt &&
		  fwrite(out, sizeof(int32_t), (size_t)n_new, f) == (size_t)n_new &&
		  fwrite(rows, sizeof(float) * V, (size_t)n_rows, f) == (size_t)n_rows;
	ok = (fclose(f) == 0) && ok;
	if (!ok)
		return ng_fail(NG_ERR_RUNTIME, "sample --logits %s: write failed (disk full?)", path);
	return NG_OK;
}

enum ng_status ng_cmd_sample(int argc, char **argv)
{
	const char *ckpt = NULL, *prompt = NULL, *vocab = NULL;
	long long tokens = 64, top_k = 40, seed = 1337, window = 0;
	double temperature = 1.0;
	bool no_graph = false, ignore_eot = false;
	const char *logits_path = NULL;
	struct ng_flag flags[] = {
		{ "--ckpt", NG_FLAG_STRING, &ckpt, 0, 0, "PATH",
		  "model_*.safetensors (or HF GPT-2 safetensors), or a checkpoint directory", false },
		{ "--prompt", NG_FLAG_STRING, &prompt, 0, 0, "TEXT",
		  "text to continue (default: <|endoftext|>)", false },
		{ "--tokens", NG_FLAG_INT, &tokens, 1, 1e6, "N", "tokens to generate (64)", false },
		{ "--temperature", NG_FLAG_DOUBLE, &temperature, 0, 100, "X",
		  "softmax temperature, 0 = greedy (1.0)", false },
		{ "--top-k", NG_FLAG_INT, &top_k, 0, NG_DECODE_MAX_TOP_K, "K",
		  "sample among the K most likely tokens, 0 = all (40)", false },
		{ "--seed", NG_FLAG_INT, &seed, 0, 9e18, "N", "sampling RNG (1337)", false },
		{ "--vocab", NG_FLAG_STRING, &vocab, 0, 0, "DIR",
		  "GPT-2 encoder.json + vocab.bpe (default $NG_GPT2_DIR, else the tree's data/gpt2)",
		  false },
		{ "--no-graph", NG_FLAG_BOOL, &no_graph, 0, 0, NULL,
		  "launch each decode step's kernels eagerly instead of replaying the CUDA Graph",
		  false },
		{ "--ignore-eot", NG_FLAG_BOOL, &ignore_eot, 0, 0, NULL,
		  "keep generating past <|endoftext|> (default: stop there)", false },
		{ "--logits", NG_FLAG_STRING, &logits_path, 0, 0, "FILE",
		  "write every step's logits (float32; see tools/peer/hf_check.py) -- a check, slow",
		  false },
		{ "--window", NG_FLAG_INT, &window, 0, 1e6, "W",
		  "speedrun model: attention window in blocks of 128 tokens, 0 = the widest, as at "
		  "the end of training (0)", false },
	};
	struct ng_command_spec spec = {
		.name = "sample",
		.summary = "Generate text on the GPU with a KV cache; each token is one replay of a "
			   "captured decode graph (GPT-2 models).",
		.usage = "--ckpt PATH [--prompt TEXT] [--tokens N] [--temperature X] [--top-k K] "
			 "[--seed N]",
		.flags = flags,
		.nflags = (int)(sizeof(flags) / sizeof(flags[0])),
	};
	char *pos[1];
	int npos;
	bool help;
	enum ng_status st = ng_cli_parse(&spec, argc, argv, pos, &npos, &help);
	if (st || help)
		return st;
	if (ng_cuda_device_count() == 0) {
		ng_fail(NG_ERR_RUNTIME, "sample: no CUDA device found");
		ng_hint("sample runs on the GPU; `nanograph eval --device cpu` works without one");
		return NG_ERR_RUNTIME;
	}
	struct ng_tokenizer tok;
	st = ng_tokenizer_load(&tok, vocab_dir(vocab));
	if (st) {
		ng_hint("point --vocab (or NG_GPT2_DIR) at a directory with encoder.json and "
			"vocab.bpe");
		return st;
	}
	struct ng_gpt_config cfg;
	float *params = NULL;
	struct ng_token_buf buf = { 0 };
	struct ng_sampler smp = { 0 };
	int32_t *ids = NULL, *out = NULL;
	uint16_t *out16 = NULL;
	char *text = NULL;
	float *rows = NULL;
	st = load_ckpt(ckpt, &cfg, &params);
	if (st)
		goto done;
	/* the default prompt is the document start: <|endoftext|> for GPT-2 (or token 0 in a
	 * vocabulary without it); the speedrun model's document-start token V - 1 (the same
	 * 50256 in GPT-2's vocabulary) */
	int32_t start;
	switch (cfg.arch) {
	case NG_ARCH_GPT2:
		start = cfg.V > NG_TOKENIZER_EOT ? NG_TOKENIZER_EOT : 0;
		if (window)
			fprintf(stderr, "sample: --window applies to the speedrun model only; "
				"ignored\n");
		break;
	case NG_ARCH_SPEEDRUN:
		start = cfg.V - 1;
		break;
	default:
		st = ng_fail(NG_ERR_INPUT, "sample: %s holds model family %d, which sample does "
			     "not know", ckpt, cfg.arch);
		ng_hint("sample runs GPT-2 (family 0) and the speedrun model (family 1)");
		goto done;
	}
	if (prompt && *prompt)
		st = ng_tokenizer_encode(&tok, NULL, prompt, strlen(prompt), &buf);
	else
		st = ng_token_buf_push(&buf, (uint16_t)start);
	if (st)
		goto done;
	int n_prompt = (int)buf.len, n_new = (int)tokens;
	if (n_prompt + n_new > cfg.T) {
		fprintf(stderr, "sample: %d prompt + %d new tokens exceed the context of %d; "
			"generating %d\n", n_prompt, n_new, cfg.T, cfg.T - n_prompt);
		n_new = cfg.T - n_prompt;
	}
	ids = malloc(sizeof(int32_t) * (size_t)n_prompt);
	out = malloc(sizeof(int32_t) * (size_t)(n_new > 0 ? n_new : 1));
	out16 = malloc(sizeof(uint16_t) * (size_t)(n_new > 0 ? n_new : 1));
	if (!ids || !out || !out16) {
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory");
		goto done;
	}
	for (int i = 0; i < n_prompt; i++)
		ids[i] = buf.data[i];
	struct ng_sampler_config sc = { .model = cfg, .top_k = (int)top_k,
					.temperature = (float)temperature, .seed = (uint64_t)seed,
					.no_graph = no_graph,
					.stop_at_eot = !ignore_eot && !logits_path,
					.window = cfg.arch == NG_ARCH_SPEEDRUN ? (int)window : 0 };
	int steps = n_prompt + (n_new > 0 ? n_new : 1) - 1, n_done = 0;
	if (logits_path) {
		rows = malloc((size_t)steps * cfg.V * sizeof(float));
		if (!rows) {
			st = ng_fail(NG_ERR_RUNTIME, "out of host memory for %d rows of logits", steps);
			goto done;
		}
	}
	st = ng_sampler_init(&smp, &sc, params);
	double secs = 0;
	if (!st)
		st = ng_sampler_generate(&smp, ids, n_prompt, n_new, out, &n_done, &secs, rows);
	if (!st && logits_path)
		st = write_logits(logits_path, ids, n_prompt, out, n_new, rows, steps, cfg.V);
	if (st)
		goto done;
	for (int i = 0; i < n_done; i++)
		out16[i] = (uint16_t)out[i];
	size_t len;
	st = ng_tokenizer_decode(&tok, out16, (size_t)n_done, &text, &len);
	if (st)
		goto done;
	printf("%s%s\n", prompt ? prompt : "", text);
	fflush(stdout);
	if (n_done < n_new) /* the steps of the chunk that met the end of text ran too */
		steps = n_prompt - 1 + (n_done / NG_SAMPLER_CHUNK + 1) * NG_SAMPLER_CHUNK;
	fprintf(stderr, "sample: %d prompt + %d new tokens%s in %.3f s of device time | %.0f "
		"decode steps/s | %s\n", n_prompt, n_done,
		n_done < n_new ? " (stopped at <|endoftext|>)" : "", secs,
		secs > 0 ? steps / secs : 0.0,
		no_graph ? "eager launches" : "one CUDA Graph replay per token");
done:
	free(rows);
	free(text);
	free(ids);
	free(out);
	free(out16);
	free(buf.data);
	free(params);
	ng_sampler_free(&smp);
	ng_tokenizer_free(&tok);
	return st;
}

enum ng_status ng_cmd_eval(int argc, char **argv)
{
	const char *ckpt = NULL, *val = NULL, *device = "cuda";
	long long batch = 8, batches = 0, attn_window = 0;
	struct ng_flag flags[] = {
		{ "--ckpt", NG_FLAG_STRING, &ckpt, 0, 0, "PATH",
		  "model_*.safetensors (or HF GPT-2 safetensors), or a checkpoint directory", false },
		{ "--val", NG_FLAG_STRING, &val, 0, 0, "GLOB", "validation shards", false },
		{ "--batch", NG_FLAG_INT, &batch, 1, 1e6, "B",
		  "sequences per batch (8; the speedrun model's: 1)", false },
		{ "--batches", NG_FLAG_INT, &batches, 0, 1e9, "N",
		  "batches to evaluate, 0 = one pass over the shards, at most 100 (0)", false },
		{ "--device", NG_FLAG_STRING, &device, 0, 0, "cuda|cpu",
		  "cuda (default) or cpu (the double-precision reference)", false },
		{ "--window", NG_FLAG_INT, &attn_window, 0, ng_spr_window_blocks(1, 1), "W",
		  "speedrun model: attention window in blocks of 128 tokens, 0 = the widest, as at "
		  "the end of training (0)", false },
	};
	struct ng_command_spec spec = {
		.name = "eval",
		.summary = "Validation loss and perplexity of a checkpoint.",
		.usage = "--ckpt PATH --val GLOB [--batch B] [--batches N] [--device cuda|cpu] "
			 "[--window W]",
		.flags = flags,
		.nflags = (int)(sizeof(flags) / sizeof(flags[0])),
	};
	char *pos[1];
	int npos;
	bool help;
	enum ng_status st = ng_cli_parse(&spec, argc, argv, pos, &npos, &help);
	if (st || help)
		return st;
	if (!val)
		return ng_fail(NG_ERR_INPUT, "eval: --val GLOB is required");
	if (strcmp(device, "cpu") != 0 && strcmp(device, "cuda") != 0)
		return ng_fail(NG_ERR_INPUT, "eval --device: '%s' is not cuda or cpu", device);
	if (strcmp(device, "cuda") == 0 && ng_cuda_device_count() == 0) {
		ng_fail(NG_ERR_RUNTIME, "eval: no CUDA device found");
		ng_hint("evaluate on the CPU reference with --device cpu (small models only)");
		return NG_ERR_RUNTIME;
	}
	struct ng_gpt_config cfg;
	float *params = NULL;
	st = load_ckpt(ckpt, &cfg, &params);
	if (st)
		return st;
	if (cfg.arch == NG_ARCH_SPEEDRUN && !ng_cli_seen(&spec, "--batch"))
		batch = 1; /* its sequences are long (49152 tokens): one a batch, as train takes */
	if (cfg.arch != NG_ARCH_SPEEDRUN && attn_window)
		fprintf(stderr, "eval: --window applies to the speedrun model only; ignored\n");
	struct ng_loader ld;
	struct ng_loader_config lc = { .pattern = val, .B = (int)batch, .T = cfg.T,
				       .vocab = cfg.V, .rank = 0, .world = 1, .seed = 0,
				       .shuffle = false, .prefetch = 2 };
	uint16_t *tokens = NULL;
	struct ng_backend be = { 0 };
	struct ng_train_state s = { 0 };
	st = ng_loader_open(&ld, &lc);
	if (st) {
		free(params);
		return st;
	}
	struct ng_loader_pos lp;
	ng_loader_tell(&ld, &lp);
	long long per_epoch = (long long)(lp.windows / (uint64_t)batch);
	int n = (int)(batches > 0 ? batches : per_epoch < 100 ? per_epoch : 100);
	size_t window = (size_t)batch * (cfg.T + 1);
	size_t bytes;
	if (ng_size_mul(window, (size_t)n * sizeof(uint16_t), &bytes))
		tokens = malloc(bytes);
	if (!tokens) {
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory for %d batches", n);
		goto done;
	}
	for (int i = 0; i < n && !st; i++) {
		const uint16_t *b;
		st = ng_loader_next(&ld, &b);
		if (!st)
			memcpy(tokens + i * window, b, window * sizeof(uint16_t));
	}
	if (st)
		goto done;
	struct ng_train_opts o = { .shape = { cfg, (int)batch, cfg.T, 1 }, .steps = 1, .lr = 0,
				   .schedule = "cosine", .val_glob = val, .val_batches = n,
				   .device = device };
	st = strcmp(device, "cpu") == 0 ? ng_backend_cpu_init(&be, &o)
					 : ng_backend_cuda_init(&be, &o);
	if (st)
		goto done;
	struct ng_gpt_layout lay;
	ng_gpt_layout(&cfg, &lay);
	st = ng_ckpt_state_alloc(&s, 4, lay.total);
	if (!st) {
		memcpy(s.params, params, lay.total * sizeof(float));
		st = be.load_state(be.ctx, &s);
	}
	double loss = 0;
	if (!st)
		st = be.evaluate(be.ctx, tokens, n, (int)attn_window, &loss);
	if (!st) {
		printf("{\"val_loss\":%.6f,\"perplexity\":%.4f,\"tokens\":%lld}\n", loss, exp(loss),
		       (long long)n * batch * cfg.T);
		fprintf(stderr, "eval: %d batches x %lld x %d tokens | val loss %.4f | perplexity "
			"%.2f\n", n, batch, cfg.T, loss, exp(loss));
	}
done:
	if (be.free)
		be.free(be.ctx);
	ng_ckpt_state_free(&s);
	ng_loader_close(&ld);
	free(tokens);
	free(params);
	return st;
}
