/*
 * graph/gpt.h — the GPT-2 model description shared by every path: its configuration, presets,
 * the parameter layout (names, shapes, offsets in ONE flat buffer) and the seeded initialisation.
 * The CPU reference, the GPU step and checkpoints all use this layout, so parameter i means the
 * same thing everywhere.
 *
 * Layout (llm.c order; every weight matrix is (out, in) row-major, as torch.nn.Linear stores it):
 *   wte (Vp, C)  wpe (T, C)  ln1w (L, C)  ln1b (L, C)  qkvw (L, 3C, C)  qkvb (L, 3C)
 *   attprojw (L, C, C)  attprojb (L, C)  ln2w (L, C)  ln2b (L, C)  fcw (L, 4C, C)  fcb (L, 4C)
 *   fcprojw (L, C, 4C)  fcprojb (L, C)  lnfw (C)  lnfb (C)
 * Each tensor starts at a multiple of NG_PARAM_ALIGN elements so bf16 and fp32 views of any tensor
 * are 16-byte aligned (the padding elements are zero and never touched).
 * The qkv rows are [q (C) | k (C) | v (C)], and within each, head h owns columns h*D .. h*D+D-1.
 * Init: N(0, 0.02); attprojw and fcprojw N(0, 0.02/sqrt(2L)); LayerNorm weights 1; biases 0.
 * wte rows V..Vp-1 (padding) are zero.
 *
 * A second family, the speedrun model (arch NG_ARCH_SPEEDRUN, docs/DESIGN.md "The speedrun
 * model"), shares the flat-buffer scheme and the matrix names. Its tensors:
 *   wte (Vp, C)  ve (3, Vp, C)  qkvw (La, 3C, C)  attprojw (La, C, C)  fcw (L, 4C, C)
 *   fcprojw (L, C, 4C)  headw (Vp, C)  xlambda (L, 2)  vlambda (La, 2)  skipw (L/2)
 * where La = L - 1 is the number of blocks with attention (block ng_spr_no_attn has none; the
 * attention tensors of block l are slot ng_spr_attn_slot(l) of dim 0). Every GPT-2 tensor that
 * this family lacks (wpe, LayerNorms, biases) has numel 0 and takes no space; likewise ve,
 * headw and the scalars in a GPT-2 layout. ng_param_present says which are there.
 * Init: wte and ve N(0, 1) on rows 0..V-1 (the rows V..Vp-1 are never looked up and stay 0);
 * qkvw and fcw uniform with std 0.5 / sqrt(fan_in); attprojw, fcprojw and headw zero;
 * xlambda (1, 0) per block, vlambda (0.5, 0.5), skipw 1.
 */
#ifndef NG_GRAPH_GPT_H
#define NG_GRAPH_GPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/status.h"

#define NG_PARAM_ALIGN 64 /* elements; 128 B of bf16, 256 B of fp32 */

enum ng_arch {
	NG_ARCH_GPT2 = 0,     /* the 2019 GPT-2: LayerNorm, GELU, learned positions, tied head */
	NG_ARCH_SPEEDRUN = 1, /* the NanoGPT speedrun model: RMSNorm, rotary, QK-norm, relu^2,
			       * value embeddings, U-net skips, windowed document attention, untied
			       * soft-capped head */
};

struct ng_gpt_config {
	int L;  /* layers */
	int H;  /* heads */
	int C;  /* channels (model width), C = H * D */
	int T;  /* maximum sequence length (context) */
	int V;  /* vocabulary size */
	int Vp; /* vocabulary padded to a multiple of 128 (50257 -> 50304) */
	int arch; /* enum ng_arch; 0 (GPT-2) unless a preset or flag says otherwise */
};

enum ng_param_id {
	NG_P_WTE, NG_P_WPE, NG_P_LN1W, NG_P_LN1B, NG_P_QKVW, NG_P_QKVB, NG_P_ATTPROJW,
	NG_P_ATTPROJB, NG_P_LN2W, NG_P_LN2B, NG_P_FCW, NG_P_FCB, NG_P_FCPROJW, NG_P_FCPROJB,
	NG_P_LNFW, NG_P_LNFB,
	NG_P_VE, NG_P_HEADW, NG_P_XLAMBDA, NG_P_VLAMBDA, NG_P_SKIPW, /* speedrun only */
	NG_P_COUNT
};

struct ng_param_spec {
	const char *name; /* "wte", "qkvw", ... */
	int ndim;         /* 1..3; per-layer tensors have L as dim 0 */
	size_t shape[3];
	size_t numel;     /* product of shape */
	size_t offset;    /* in elements from the start of the flat buffer */
	bool decay;       /* weight decay applies: the 2-D weight matrices (wte, wpe, *w of linears) */
	bool per_layer;   /* dim 0 is L */
};

struct ng_gpt_layout {
	struct ng_param_spec p[NG_P_COUNT];
	size_t total;     /* elements in the flat buffer, padding included */
	size_t n_params;  /* real parameters (sum of numel), padded vocabulary rows included */
};

/* A tensor of the layout that the model has (numel > 0): the other family's are absent. */
static inline bool ng_param_present(const struct ng_param_spec *p) { return p->numel > 0; }

/* The speedrun model's per-block structure (arch NG_ARCH_SPEEDRUN), for any L >= 6, even:
 *  - the block without attention: 7 of 12 (the reference's), L * 7 / 12 in general;
 *  - long-window blocks (window W; the others W / 2): 0, L / 3 and L - 1 (0, 4, 11 of 12);
 *  - value embeddings: blocks 0, 1, 2 use ve 0, 1, 2, and so do blocks L-3, L-2, L-1;
 *  - U-net: blocks 0 .. L/2-1 push their outputs; block L/2 + j adds skipw[j] * the output of
 *    block L/2 - 1 - j before its x0 mixing. */
#define NG_SPR_VE 3 /* value-embedding tables */
static inline int ng_spr_no_attn(const struct ng_gpt_config *c) { return c->L * 7 / 12; }
static inline bool ng_spr_has_attn(const struct ng_gpt_config *c, int l)
{
	return l != ng_spr_no_attn(c);
}
/* Slot of block l in the attention tensors (qkvw, attprojw, vlambda), -1 for the block without. */
static inline int ng_spr_attn_slot(const struct ng_gpt_config *c, int l)
{
	int n = ng_spr_no_attn(c);
	return l == n ? -1 : l < n ? l : l - 1;
}
static inline bool ng_spr_long_window(const struct ng_gpt_config *c, int l)
{
	return l == 0 || l == c->L / 3 || l == c->L - 1;
}
/* The value-embedding table block l uses, or -1. */
static inline int ng_spr_ve(const struct ng_gpt_config *c, int l)
{
	if (l < NG_SPR_VE)
		return l;
	if (l >= c->L - NG_SPR_VE)
		return l - (c->L - NG_SPR_VE);
	return -1;
}
/* The speedrun model's constants (docs/DESIGN.md "The speedrun model"). */
#define NG_SPR_RMS_EPS 1.1920929e-7   /* fp32 machine epsilon, F.rms_norm's default */
#define NG_SPR_ATTN_SCALE 0.12        /* softmax scale (not 1/sqrt(D)) */
#define NG_SPR_SOFTCAP 30.0           /* logits = 30 sigmoid(z / (7.5 sqrt(C))) */
#define NG_SPR_SOFTCAP_DIV 7.5
#define NG_SPR_HEAD_GSCALE 448.0      /* the FP8 head's gradient: E5M2(dz x 448), the reference's
                                       * grad_s = 1 / 448 */
#define NG_SPR_BOS 50256              /* <|endoftext|>, V - 1 of GPT-2's vocabulary: the token
                                       * V - 1 starts a document */
#define NG_SPR_WINDOW_BLOCK 128       /* the window counts blocks of this many tokens */

/* Presets "tiny", "d12", "d24", "d36", "d48" (GPT-2), "speedrun" (12 x 768, 6 heads of 128,
 * 49152 tokens) and "speedrun-tiny" (6 x 64, 2 heads of 32, vocab 512, 512 tokens).
 * Returns NG_ERR_INPUT for an unknown name. */
enum ng_status ng_gpt_preset(struct ng_gpt_config *cfg, const char *name);
/* Fill Vp from V and check the configuration: positive sizes, C % H == 0, head size a multiple
 * of 8 and <= 256, ... Errors name the problem. */
enum ng_status ng_gpt_check(struct ng_gpt_config *cfg);
void ng_gpt_layout(const struct ng_gpt_config *cfg, struct ng_gpt_layout *lay);
/* Seeded init into params (lay->total floats). Same seed, same bits, on every machine. */
void ng_gpt_init(const struct ng_gpt_config *cfg, const struct ng_gpt_layout *lay, uint64_t seed,
		 float *params);
/* Training FLOPs per token by the convention of docs/GPU.md: 6*N + 6*L*C*T (N counts the padded
 * wte). */
double ng_gpt_flops_per_token(const struct ng_gpt_config *cfg, int T);

#endif
