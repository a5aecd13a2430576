/*
 * graph/cpu_spr.h — the speedrun model (arch NG_ARCH_SPEEDRUN) on the CPU in double precision:
 * forward, soft-capped loss and backward. It is the speedrun's rung 1 of the verification ladder
 * (docs/DESIGN.md): checked by finite differences and against a PyTorch implementation
 * (tools/peer/speedrun_peer.py --check), then the oracle of the GPU step. Built only from
 * graph/cpu_ops.h and graph/cpu_spr_ops.h; layout, per-block rules (ng_spr_*) and init from
 * graph/gpt.h.
 *
 * The model, B sequences of T tokens, N = B*T rows, rmsnorm weightless (eps NG_SPR_RMS_EPS):
 *   x0 = x = rmsnorm(wte[tok])
 *   block l = 0 .. L-1:
 *     l >= L/2:  x = x + skipw[l - L/2] * (output of block L - 1 - l)        (U-net)
 *     x = l0 * x + l1 * x0                                                    (xlambda[l])
 *     with attention:  qkv = rmsnorm(x) @ qkvw^T, q and k QK-normed per head then rotary
 *       (position = index in the sequence), v = a0 v + a1 ve[tok] (a0 v without a value
 *       embedding; vlambda[slot]), y = attention(q, k, v) with scale NG_SPR_ATTN_SCALE,
 *       x = x + y @ attprojw^T
 *     x = x + relu(rmsnorm(x) @ fcw^T)^2 @ fcprojw^T
 *     l < L/2: the output is kept for block L - 1 - l
 *   z (N, Vp) = rmsnorm(x) @ headw^T;  s = 30 sigmoid(z / (7.5 sqrt(C)))
 *   loss = sum over the N tokens of logsumexp(s) - s[target], over all Vp columns.
 * The attention mask (ng_ref_attention_masked_fwd): causal, within a document (a document starts
 * at each token equal to `bos`), and s at or after the first key of t's window of
 * ng_cpu_spr_block_window(cfg, l, W) tokens in whole blocks of NG_SPR_WINDOW_BLOCK
 * (kernels/window.h: t / 128 - s / 128 < the window's blocks).
 *
 * head_fp8 = 1 simulates the reference's FP8 head instead of the exact product, with
 * xs = sqrt(C) / 448, ws = 24 / 448, gs = 1 / 448 (bf16 roundings are not simulated):
 *   forward  x8 = e4m3(x / xs), w8 = e4m3(w / ws), z = (x8 @ w8^T) xs ws
 *   backward g8 = e5m2(dz / gs), dx = (g8 @ w8) gs ws, dheadw += (g8^T @ x8) gs xs
 * (so its gradient is the reference's, not the exact gradient of its forward).
 * head_fp8 = 2 is the GPU step's FP8 head forward alone (graph/step.h "FP8": per-tensor scales
 * from the tensors' maxima): that forward with xs = head_xs, ws = head_ws, and the exact head's
 * backward; head_fp8 = 3 its E5M2 backward too (NG_FP8_HEAD_BWD): head_fp8 = 1's backward with
 * those xs and ws.
 */
#ifndef NG_GRAPH_CPU_SPR_H
#define NG_GRAPH_CPU_SPR_H

#include <stddef.h>
#include <stdint.h>

#include "graph/gpt.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The FP8 head's scales (the reference's head); the input's is sqrt(C) / 448. */
#define NG_SPR_FP8_WS (24.0 / 448.0) /* weight */
#define NG_SPR_FP8_GS (1.0 / NG_SPR_HEAD_GSCALE) /* output gradient */

/* Activations of one forward pass; N = B*T rows. Per-block arrays hold L slices back to back
 * (the slice of the block without attention is unused in the attention arrays). */
struct ng_cpu_spr_acts {
	double *emb;       /* (N, C) wte[tok] */
	double *emb_rstd;  /* (N) */
	double *x0;        /* (N, C) rmsnorm(emb) */
	double *ve;        /* (NG_SPR_VE, N, C) value-embedding lookups ve[t][tok] */
	double *xin;       /* (L, N, C) x entering block l, after the U-net add */
	double *xmix;      /* (L, N, C) after the x0 mixing */
	double *ln1;       /* (L, N, C) rmsnorm(xmix) */
	double *ln1_rstd;  /* (L, N) */
	double *qkv;       /* (L, N, 3C) ln1 @ qkvw^T, laid out (B, T, 3, H, D) */
	double *qk_rstd;   /* (L, N, 2, H) QK-norm's rstd */
	double *qkvr;      /* (L, N, 3C) attention input: q, k normed and rotated, v mixed */
	double *atty;      /* (L, N, C) attention output (B, T, H, D) */
	double *xattn;     /* (L, N, C) x after the attention (xmix without attention) */
	double *ln2;       /* (L, N, C) rmsnorm(xattn) */
	double *ln2_rstd;  /* (L, N) */
	double *fch;       /* (L, N, 4C) ln2 @ fcw^T */
	double *fch_act;   /* (L, N, 4C) relu(fch)^2 */
	double *xout;      /* (L, N, C) block output */
	double *xf;        /* (N, C) rmsnorm(xout[L-1]) */
	double *xf_rstd;   /* (N) */
	double *x8;        /* (N, C) e4m3(xf / xs) (head_fp8 only) */
	double *w8;        /* (Vp, C) e4m3(headw / ws) (head_fp8 only) */
	double *logits;    /* (N, Vp) z, before the soft cap */
	double *losses;    /* (N) per-token loss */
};

/* Scratch of the backward pass (reused across blocks). */
struct ng_cpu_spr_scratch {
	double *dx;        /* (N, C) gradient of the residual stream */
	double *dx0;       /* (N, C) gradient of x0, summed over the blocks */
	double *dxmix;     /* (N, C) */
	double *dln;       /* (N, C) gradient of an rmsnorm output */
	double *datty;     /* (N, C) */
	double *dqkv;      /* (N, 3C) gradient of qkv */
	double *dqkvr;     /* (N, 3C) gradient of the attention input */
	double *dve;       /* (N, C) gradient of one value-embedding lookup */
	double *dfch;      /* (N, 4C) */
	double *dfch_act;  /* (N, 4C) */
	double *dskip;     /* (L/2, N, C) gradient of the outputs kept for the U-net */
	double *dlogits;   /* (N, Vp) gradient of z, kept after backward */
	double *dxf;       /* (N, C) gradient of the head's input xf, kept after backward */
	double *g8;        /* (N, Vp) e5m2(dz / gs) (head_fp8 only) */
	double *dw8;       /* (Vp, C) g8^T @ x8 before its scale (head_fp8 only) */
};

struct ng_cpu_spr_model {
	struct ng_gpt_config cfg;    /* model configuration (arch NG_ARCH_SPEEDRUN, Vp filled) */
	struct ng_gpt_layout lay;    /* flat layout, shared with the GPU path */
	int B;                       /* batch (sequences) the activations are sized for */
	int T;                       /* tokens a sequence, T <= cfg.T */
	int head_fp8;                /* 0: exact head; 1: the reference's FP8 head (above);
				      * 2: the GPU's forward alone: as 1 with the scales below, the
				      * backward exact (from the bf16 head's dz, W and x); 3: the
				      * GPU's forward and E5M2 backward, as 1 with those scales */
	double head_xs, head_ws;     /* head_fp8 = 2, 3: the input's and the weight's descale */
	int32_t bos;                 /* token that starts a document: cfg.V - 1 (50256 for
				      * GPT-2's vocabulary, NG_SPR_BOS); may be changed */
	double *params;              /* (lay.total) */
	double *grads;               /* (lay.total) accumulated by backward */
	int32_t *inputs;             /* (B, T) tokens of the last forward */
	int32_t *targets;            /* (B, T) targets of the last forward */
	int32_t *doc;                /* (B, T) document ids of the last forward's inputs */
	int window;                  /* W of the last forward (blocks of NG_SPR_WINDOW_BLOCK) */
	int have_targets;            /* last forward had targets, so backward may run */
	double loss_sum;             /* summed loss of the last forward (0 without targets) */
	struct ng_cpu_spr_acts a;    /* activations of the last forward */
	struct ng_cpu_spr_scratch s; /* backward scratch */
	double *arena_;              /* one allocation holding the doubles above */
};

/* Block l's attention window in tokens for the window W >= 1: W * NG_SPR_WINDOW_BLOCK for the
 * long-window blocks (ng_spr_long_window), max(1, W / 2) * NG_SPR_WINDOW_BLOCK for the others.
 * Query t sees key s only if t - s < this. */
int ng_cpu_spr_block_window(const struct ng_gpt_config *cfg, int l, int W);

/* Check cfg (ng_gpt_check; arch must be NG_ARCH_SPEEDRUN), allocate for B sequences of T tokens
 * (T <= cfg->T) and initialise the parameters with ng_gpt_init(seed) (floats widened). Grads
 * start at zero, head_fp8 at 0. NG_ERR_INPUT for bad sizes or an arena beyond the machine's
 * physical memory (ng_cpu_arena_fits), NG_ERR_RUNTIME when out of memory.
 * On failure m holds nothing to free. */
enum ng_status ng_cpu_spr_init(struct ng_cpu_spr_model *m, const struct ng_gpt_config *cfg,
			       int B, int T, uint64_t seed);
void ng_cpu_spr_free(struct ng_cpu_spr_model *m);

/* Replace the parameters with a float copy (lay.total elements, the ng_gpt_init layout). */
void ng_cpu_spr_load_params(struct ng_cpu_spr_model *m, const float *params);

/* For checks: give the zero-initialised matrices and the scalars seeded random values, so every
 * gradient carries signal: attprojw N(0, 0.15), fcprojw N(0, 0.08), headw N(0, 1.5) (the
 * logits then spread over much of the soft cap), xlambda (1 + N(0, 0.3), N(0, 0.5)), vlambda
 * 0.5 + N(0, 0.3), skipw 1 + N(0, 0.3). The other tensors keep their values. */
void ng_cpu_spr_randomize(struct ng_cpu_spr_model *m, uint64_t seed);

/* Forward over inputs (B, T) in [0, V) at window W >= 1. With targets (B, T) in [0, V) it
 * computes the losses and returns their sum in *loss_sum (may be NULL); with targets NULL it
 * stops at the logits (*loss_sum = 0). NG_ERR_INPUT for a bad token or window (then nothing is
 * computed). */
enum ng_status ng_cpu_spr_forward(struct ng_cpu_spr_model *m, const int32_t *inputs,
				  const int32_t *targets, int window, double *loss_sum);

void ng_cpu_spr_zero_grad(struct ng_cpu_spr_model *m);

/* grads += d(loss_sum * dloss_scale)/d(params) for the last forward (dloss_scale = 1 / (B T)
 * asks for the mean). With head_fp8 the head's gradients are the FP8 ones documented above.
 * NG_ERR_INPUT when the last forward had no targets (or none ran). */
enum ng_status ng_cpu_spr_backward(struct ng_cpu_spr_model *m, double dloss_scale);

#ifdef __cplusplus
}
#endif

#endif
