/*
 * graph/sampler.h — text generation on the GPU with a KV cache: the launches of one decode
 * step (embedding, L x [LN, QKV, attention over the cache, projection + residual, LN, FC+GELU,
 * projection + residual], LN, head, sampling) are captured ONCE as a CUDA Graph and replayed
 * per token. The position, the tokens and the RNG counter live in device memory
 * (kernels/decode.h), so nothing of a replay is frozen at capture. The prompt runs through the
 * same graph: the sampling kernel leaves prompt positions as they are.
 *
 * Numerics: weights bf16 (the copy training reads: the high half of the split fp32 master,
 * kernels/split.h), activations, KV cache and logits fp32.
 * Memory: weights (lay.total bf16) + 2 L T C floats of cache + a few rows.
 *
 * The speedrun model (arch NG_ARCH_SPEEDRUN, graph/sampler_spr.c) runs its own step through
 * the same contract: embedding + RMSNorm, L x [U-net skip, x0 mixing, (RMSNorm, QKV, QK-norm +
 * rotary + value mixing, attention over the cache within the document and the block's window,
 * projection + residual), RMSNorm, FC + relu^2, projection + residual], RMSNorm, head, soft
 * cap, sampling; its logits are the soft-capped ones. Its scalars (xlambda, vlambda, skipw) are
 * kept in fp32 as the training step reads them; its cache holds the L - 1 blocks with
 * attention. Its reference is graph/cpu_spr_decode.h.
 */
#ifndef NG_GRAPH_SAMPLER_H
#define NG_GRAPH_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "graph/gpt.h"
#include "kernels/types.h"

struct ng_sampler_config {
	struct ng_gpt_config model;  /* checked configuration (Vp filled) */
	int top_k;                   /* 0: the whole vocabulary */
	float temperature;           /* <= 0: greedy */
	uint64_t seed;               /* the RNG counter's key */
	bool no_graph;               /* launch the step's kernels eagerly (tests: replay == eager) */
	bool stop_at_eot;            /* stop once NG_SAMPLER_EOT is sampled (checked every
				      * NG_SAMPLER_CHUNK tokens: one host sync per chunk) */
	int window;                  /* speedrun: the attention window W in blocks of
				      * NG_SPR_WINDOW_BLOCK tokens; 0: the widest, the end of
				      * training's schedule (ng_spr_window_blocks(1, 1), as the
				      * evaluation step) */
};

#define NG_SAMPLER_EOT 50256  /* GPT-2's <|endoftext|> */
#define NG_SAMPLER_CHUNK 16   /* decode steps between two end-of-text checks */

struct ng_sampler {
	struct ng_sampler_config cfg;
	struct ng_gpt_layout lay;
	ng_bf16 *w;                  /* (lay.total) bf16 parameters, flat layout */
	float *x;                    /* (C) residual stream */
	float *ln;                   /* (C) LayerNorm output */
	float *qkv;                  /* (3C) */
	float *att;                  /* (C) attention output */
	float *fc;                   /* (4C) GELU(fc) */
	float *logits;               /* (Vp) logits of the last processed position */
	float *kcache, *vcache;      /* (Lc, T, C) each; Lc = L (GPT-2) or L - 1 (speedrun: the
				      * blocks with attention, by ng_spr_attn_slot) */
	float *x0;                   /* (C) speedrun: rmsnorm(wte[tok]) */
	float *skip;                 /* (L/2, C) speedrun: outputs of blocks 0 .. L/2-1 (U-net) */
	float *scalars;              /* speedrun: fp32 copy of the flat range xlambda .. skipw */
	int *doc_start;              /* device scalar, speedrun: the current document's start */
	int window;                  /* speedrun: W in use (cfg.window, or its default) */
	int32_t *tokens;             /* (T) the sequence: prompt, then samples */
	int *pos;                    /* device scalar: the position processed next */
	int *n_prompt;               /* device scalar */
	cudaStream_t stream;
	cudaGraph_t graph;           /* the captured decode step */
	cudaGraphExec_t exec;
	bool inited;
};

/* Upload params (lay.total floats, graph/gpt.h layout) as bf16, allocate the cache, capture the
 * step (unless no_graph). NG_ERR_INPUT for a bad config, NG_ERR_RUNTIME for CUDA failures. */
enum ng_status ng_sampler_init(struct ng_sampler *s, const struct ng_sampler_config *cfg,
			       const float *params);
void ng_sampler_free(struct ng_sampler *s);

/* Run the prompt (n_prompt >= 1 tokens) and then n_new sampled tokens: n_prompt - 1 + n_new
 * decode steps (n_new may be 0: the prompt only, logits predict position n_prompt). out gets
 * the sampled tokens (may be NULL when n_new == 0) and *n_out (may be NULL) how many: n_new,
 * or fewer when stop_at_eot met the end of text (out then ends before it). *seconds: the
 * device time of the steps. logits (may be NULL): one row of V floats per decode step, row i
 * predicting position i + 1 (steps run one at a time with a copy after each: a check, not the
 * fast path). n_prompt + n_new <= T, or NG_ERR_INPUT. */
enum ng_status ng_sampler_generate(struct ng_sampler *s, const int32_t *prompt, int n_prompt,
				   int n_new, int32_t *out, int *n_out, double *seconds,
				   float *logits);
/* The logits of the last step (Vp floats) to the host. */
enum ng_status ng_sampler_logits(struct ng_sampler *s, float *host);

/* graph/sampler_spr.c, for sampler.c only: the speedrun model's decode step (the body of its
 * captured graph). */
enum ng_status ng_sampler_spr_enqueue_(struct ng_sampler *s);

#endif
