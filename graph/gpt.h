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
 */
#ifndef NG_GRAPH_GPT_H
#define NG_GRAPH_GPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/status.h"

#define NG_PARAM_ALIGN 64 /* elements; 128 B of bf16, 256 B of fp32 */

struct ng_gpt_config {
	int L;  /* layers */
	int H;  /* heads */
	int C;  /* channels (model width), C = H * D */
	int T;  /* maximum sequence length (context) */
	int V;  /* vocabulary size */
	int Vp; /* vocabulary padded to a multiple of 128 (50257 -> 50304) */
};

enum ng_param_id {
	NG_P_WTE, NG_P_WPE, NG_P_LN1W, NG_P_LN1B, NG_P_QKVW, NG_P_QKVB, NG_P_ATTPROJW,
	NG_P_ATTPROJB, NG_P_LN2W, NG_P_LN2B, NG_P_FCW, NG_P_FCB, NG_P_FCPROJW, NG_P_FCPROJB,
	NG_P_LNFW, NG_P_LNFB,
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

/* Presets "tiny", "d12", "d24", "d36", "d48". Returns NG_ERR_INPUT for an unknown name. */
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
