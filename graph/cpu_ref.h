/*
 * graph/cpu_ref.h — the whole GPT-2 training step on the CPU, in double precision: forward, loss,
 * backward, gradient norm, clipping and AdamW. It is rung 1 of the verification ladder
 * (docs/DESIGN.md): checked by finite differences, then used as the oracle for the GPU step on
 * tiny models. Built only from graph/cpu_ops.h; parameter layout, names and init from
 * graph/gpt.h.
 *
 * The model is exactly docs/DESIGN.md's: pre-LN blocks
 *   x = wte[tok] + wpe[t]
 *   x = x + attproj(attention(qkv(ln1(x))));  x = x + fcproj(gelu(fc(ln2(x))))     (L times)
 *   logits (B*T, Vp) = lnf(x) @ wte^T;  loss = mean cross-entropy over the first V columns.
 * Padded vocabulary rows of wte (V..Vp-1) never win and get exactly zero gradient; the padding
 * elements between tensors (NG_PARAM_ALIGN) stay zero in params, grads and moments.
 *
 * Gradient accumulation: call forward + backward K times with dloss_scale = 1/K (grads add up),
 * then one ng_cpu_adamw_step. Clipping: when clip > 0 and the global norm exceeds it, every
 * gradient is used scaled by clip / norm (scaled inside AdamW; the stored grads are unchanged).
 */
#ifndef NG_GRAPH_CPU_REF_H
#define NG_GRAPH_CPU_REF_H

#include <stddef.h>
#include <stdint.h>

#include "graph/gpt.h"
#include "util/status.h"

/* Activations of one forward pass; N = B*T rows. Per-layer arrays hold L slices back to back. */
struct ng_cpu_acts {
	double *encoded;   /* (N, C) wte[tok] + wpe[t] */
	double *ln1;       /* (L, N, C) */
	double *ln1_mean;  /* (L, N) */
	double *ln1_rstd;  /* (L, N) */
	double *qkv;       /* (L, N, 3C) laid out (B, T, 3, H, D) */
	double *atty;      /* (L, N, C) attention output (B, T, H, D) */
	double *residual2; /* (L, N, C) x after the attention block */
	double *ln2;       /* (L, N, C) */
	double *ln2_mean;  /* (L, N) */
	double *ln2_rstd;  /* (L, N) */
	double *fch;       /* (L, N, 4C) fc output before GELU */
	double *fch_gelu;  /* (L, N, 4C) */
	double *residual3; /* (L, N, C) x after the MLP block (the next layer's input) */
	double *lnf;       /* (N, C) */
	double *lnf_mean;  /* (N) */
	double *lnf_rstd;  /* (N) */
	double *logits;    /* (N, Vp) */
	double *losses;    /* (N) per-token loss */
};

/* Scratch gradients of activations used by the backward pass (reused across layers). */
struct ng_cpu_scratch {
	double *dres;     /* (N, C) gradient of the residual stream */
	double *dln;      /* (N, C) gradient of a LayerNorm output */
	double *datty;    /* (N, C) */
	double *dqkv;     /* (N, 3C) */
	double *dfch;     /* (N, 4C) gradient of the fc output (before GELU) */
	double *dfch_gelu;/* (N, 4C) */
	double *dlogits;  /* (N, Vp) */
};

struct ng_cpu_model {
	struct ng_gpt_config cfg;    /* model configuration (Vp filled) */
	struct ng_gpt_layout lay;    /* flat layout, shared with the GPU path */
	int B;                       /* batch (sequences) the activations are sized for */
	int T;                       /* sequence length, T <= cfg.T (wpe rows 0..T-1 are used) */
	double *params;              /* (lay.total) */
	double *grads;               /* (lay.total) accumulated by backward */
	double *m;                   /* (lay.total) AdamW first moment */
	double *v;                   /* (lay.total) AdamW second moment */
	int step;                    /* AdamW steps taken (the next step is step + 1) */
	int32_t *inputs;             /* (B, T) tokens of the last forward */
	int32_t *targets;            /* (B, T) targets of the last forward */
	int have_targets;            /* last forward had targets, so backward may run */
	double mean_loss;            /* mean loss of the last forward (0 without targets) */
	struct ng_cpu_acts a;        /* activations of the last forward */
	struct ng_cpu_scratch s;     /* backward scratch */
	double *arena_;              /* one allocation holding everything above */
};

/* Check cfg (ng_gpt_check), allocate for B sequences of T tokens (T <= cfg->T), and initialise
 * the parameters with ng_gpt_init(seed) (float values widened to double). Grads, moments and
 * the step counter start at zero. NG_ERR_INPUT for bad sizes or an arena beyond the machine's
 * physical memory (ng_cpu_arena_fits), NG_ERR_RUNTIME when out of memory.
 * On failure m holds nothing to free. */
enum ng_status ng_cpu_model_init(struct ng_cpu_model *m, const struct ng_gpt_config *cfg, int B,
				 int T, uint64_t seed);
void ng_cpu_model_free(struct ng_cpu_model *m);
/* NG_OK when a reference arena of `bytes` fits this machine's physical memory (or it cannot be
 * told); else NG_ERR_INPUT, "<who>: ... needs X GiB, more than this machine's Y GiB", with a hint
 * toward a smaller model or the GPU: a model too large for --device cpu is refused before any
 * allocation, which with memory overcommit could otherwise succeed and then swap. */
enum ng_status ng_cpu_arena_fits(const char *who, size_t bytes);

/* Replace the parameters with a float copy (lay.total elements, the ng_gpt_init layout). */
void ng_cpu_model_load_params(struct ng_cpu_model *m, const float *params);

/* Forward over inputs (B, T) in [0, V). With targets (B, T) in [0, V) it computes the losses and
 * returns their mean; with targets NULL it stops at the logits and returns 0. Token values are
 * checked: NG_ERR_INPUT naming the first bad one (then nothing is computed). */
enum ng_status ng_cpu_forward(struct ng_cpu_model *m, const int32_t *inputs,
			      const int32_t *targets, double *mean_loss);

void ng_cpu_zero_grad(struct ng_cpu_model *m);

/* grads += d(mean_loss * dloss_scale)/d(params), for the last forward. NG_ERR_INPUT when the last
 * forward had no targets (or none ran). */
enum ng_status ng_cpu_backward(struct ng_cpu_model *m, double dloss_scale);

/* Global L2 norm of all gradients. */
double ng_cpu_grad_norm(const struct ng_cpu_model *m);

/* One AdamW step (step counter += 1 first, bias correction with the new count): weight decay wd
 * only on tensors with spec.decay (2-D weights); clip > 0 enables global-norm clipping
 * (scale clip / norm when norm > clip). Returns the pre-clip global gradient norm. Grads are
 * left as they are (call ng_cpu_zero_grad before the next accumulation). */
double ng_cpu_adamw_step(struct ng_cpu_model *m, double lr, double beta1, double beta2, double eps,
			 double wd, double clip);

#endif
