/*
 * graph/cpu_spr_decode.h — the speedrun model (arch NG_ARCH_SPEEDRUN) decoded one token at a
 * time with a KV cache, in double precision: the reference of the GPU decode step
 * (graph/sampler_spr.c), itself checked against the full forward of graph/cpu_spr.h
 * (tests/test_cpu_spr_decode.c: the logits of every position agree to ~1e-12).
 *
 * A step takes the token at position t = pos and computes, in cpu_spr.h's order:
 *   x0 = x = rmsnorm(wte[tok])
 *   block l: (l >= L/2: x += skipw[l - L/2] * the output of block L - 1 - l)
 *            x = l0 x + l1 x0
 *            with attention: q, k, v of rmsnorm(x) @ qkvw^T; q and k QK-normed and rotated at
 *              position t; v = a0 v + a1 ve[tok] (a0 v without a value embedding); k and v go
 *              into row t of the block's cache; the query attends to cache rows [lo, t] with
 *              lo = max(start of the current document, t - window_l + 1), window_l =
 *              ng_cpu_spr_block_window(cfg, l, W); x += attention @ attprojw^T
 *            x += relu(rmsnorm(x) @ fcw^T)^2 @ fcprojw^T
 *   logits (Vp) = 30 sigmoid(rmsnorm(x) @ headw^T / (7.5 sqrt(C)))  (the soft-capped logits)
 * A document starts at each token equal to bos (cfg.V - 1); tokens before the first bos form
 * document 0 (ng_ref_doc_ids), so the current document's start is the last position <= t that
 * holds bos, or 0. Rotary positions count from the start of the sequence, not the document.
 * The cache holds the La = L - 1 blocks with attention (slot ng_spr_attn_slot), (La, Tmax, C)
 * each for k and v.
 */
#ifndef NG_GRAPH_CPU_SPR_DECODE_H
#define NG_GRAPH_CPU_SPR_DECODE_H

#include <stdint.h>

#include "graph/gpt.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ng_cpu_spr_decoder {
	struct ng_gpt_config cfg;  /* model configuration (arch NG_ARCH_SPEEDRUN, Vp filled) */
	struct ng_gpt_layout lay;  /* flat layout of params */
	const double *params;      /* (lay.total) borrowed, graph/gpt.h layout */
	int Tmax;                  /* positions the cache holds, <= cfg.T */
	int window;                /* W, in blocks of NG_SPR_WINDOW_BLOCK tokens */
	int32_t bos;               /* token that starts a document: cfg.V - 1 */
	int pos;                   /* the position the next step processes */
	int doc_start;             /* first position of the current document */
	double *kcache, *vcache;   /* (La, Tmax, C) each: roped QK-normed keys, mixed values */
	double *x;                 /* (C) residual stream */
	double *x0;                /* (C) rmsnorm(wte[tok]) */
	double *skip;              /* (L/2, C) outputs of blocks 0 .. L/2 - 1 for the U-net */
	double *ln;                /* (C) rmsnorm output */
	double *qkv;               /* (3C) rmsnorm(x) @ qkvw^T */
	double *qkvr;              /* (3C) q, k normed and rotated, v mixed */
	double *att;               /* (C) attention output */
	double *tmp;               /* (C) a projection's output before its residual add */
	double *fc;                /* (4C) the MLP's hidden row */
	double *scores;            /* (Tmax) attention weights of one head */
	double *logits;            /* (Vp) soft-capped logits of the last step (predict pos) */
	double *arena_;            /* one allocation holding the doubles above */
};

/* Check cfg (ng_gpt_check; arch NG_ARCH_SPEEDRUN), window >= 1 and 1 <= Tmax <= cfg->T, and
 * allocate the cache. params (lay.total doubles) is borrowed and must outlive d. NG_ERR_INPUT
 * for bad sizes, NG_ERR_RUNTIME when out of memory; on failure d holds nothing to free. */
enum ng_status ng_cpu_spr_decode_init(struct ng_cpu_spr_decoder *d,
				      const struct ng_gpt_config *cfg, const double *params,
				      int Tmax, int window);
void ng_cpu_spr_decode_free(struct ng_cpu_spr_decoder *d);

/* Start a new sequence: the next step is position 0 (the cache rows are rewritten as it goes). */
void ng_cpu_spr_decode_reset(struct ng_cpu_spr_decoder *d);

/* Process token tok at position d->pos: d->logits = the soft-capped logits predicting the
 * token at d->pos + 1; then d->pos += 1. NG_ERR_INPUT for a token outside [0, V) or a full
 * cache (d->pos == Tmax); then nothing changes. */
enum ng_status ng_cpu_spr_decode_step(struct ng_cpu_spr_decoder *d, int32_t tok);

#ifdef __cplusplus
}
#endif

#endif
