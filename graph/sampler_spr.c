/*
 * graph/sampler_spr.c — the speedrun model's decode step (graph/sampler.h): the launches of one
 * token, in graph/cpu_spr_decode.h's order, from kernels/decode.h (GEMVs with the relu^2 and
 * residual epilogues, attention over the cache with the document and window bound) and
 * kernels/decode_spr.h (embedding + RMSNorm, RMSNorm, scalar mixes, QK-norm + rotary + value
 * mixing, soft cap). sampler.c allocates, captures and replays it.
 * Per block l the window is ng_cpu_spr_block_window(cfg, l, W) tokens, fixed at capture; the
 * position, the tokens and the document start are device values, so one capture serves every
 * token.
 */
#include "graph/sampler.h"

#include <math.h>

#include "graph/cpu_spr.h"
#include "kernels/decode.h"
#include "kernels/decode_spr.h"

/* bf16 slice i (dim 0) of parameter id: a block's slot of the attention tensors, a table of ve. */
static const ng_bf16 *slice_(const struct ng_sampler *s, enum ng_param_id id, int i)
{
	const struct ng_param_spec *p = &s->lay.p[id];
	return s->w + p->offset + p->numel / p->shape[0] * (size_t)i;
}

/* fp32 device scalar i of parameter id (xlambda, vlambda or skipw). */
static const float *scalar_(const struct ng_sampler *s, enum ng_param_id id, int i)
{
	return s->scalars + (s->lay.p[id].offset - s->lay.p[NG_P_XLAMBDA].offset) + i;
}

/* Block l's attention branch: x += attproj(attention(qk_rotary(qkv(rmsnorm(x))), vmix)). */
static enum ng_status attention_branch_(struct ng_sampler *s, int l, int slot)
{
	const struct ng_gpt_config *m = &s->cfg.model;
	int C = m->C, T = m->T, D = C / m->H, ve = ng_spr_ve(m, l);
	float *kc = s->kcache + (size_t)slot * T * C, *vc = s->vcache + (size_t)slot * T * C;
	cudaStream_t st = s->stream;
	enum ng_status r = ng_decode_rmsnorm(s->ln, s->x, C, NG_SPR_RMS_EPS, st);
	if (!r)
		r = ng_decode_gemv(s->qkv, slice_(s, NG_P_QKVW, slot), NULL, s->ln, C, 3 * C,
				   NG_DECODE_ACT_NONE, 0, st);
	if (!r)
		r = ng_decode_spr_qk_rotary(s->qkv, ve >= 0 ? slice_(s, NG_P_VE, ve) : NULL,
					    s->tokens, s->pos, scalar_(s, NG_P_VLAMBDA, 2 * slot),
					    scalar_(s, NG_P_VLAMBDA, 2 * slot + 1), m->H, D,
					    NG_SPR_RMS_EPS, st);
	if (!r)
		r = ng_decode_attention_masked(s->att, kc, vc, s->qkv, s->pos, s->doc_start,
					       ng_cpu_spr_block_window(m, l, s->window),
					       NG_SPR_WINDOW_BLOCK, NG_SPR_ATTN_SCALE, m->H, D, T, st);
	if (!r)
		r = ng_decode_gemv(s->x, slice_(s, NG_P_ATTPROJW, slot), NULL, s->att, C, C,
				   NG_DECODE_ACT_NONE, 1, st);
	return r;
}

enum ng_status ng_sampler_spr_enqueue_(struct ng_sampler *s)
{
	const struct ng_gpt_config *m = &s->cfg.model;
	int C = m->C, L = m->L;
	cudaStream_t st = s->stream;
	enum ng_status r = ng_decode_spr_embed(s->x, s->x0, s->doc_start, slice_(s, NG_P_WTE, 0),
					       s->tokens, s->pos, m->V - 1, C, NG_SPR_RMS_EPS, st);
	for (int l = 0; l < L && !r; l++) {
		if (l >= L / 2) /* the U-net: x += skipw[j] * the output of block L - 1 - l */
			r = ng_decode_mix2(s->x, NULL, s->x, scalar_(s, NG_P_SKIPW, l - L / 2),
					   s->skip + (size_t)(L - 1 - l) * C, C, st);
		if (!r) /* x = l0 x + l1 x0 */
			r = ng_decode_mix2(s->x, scalar_(s, NG_P_XLAMBDA, 2 * l), s->x,
					   scalar_(s, NG_P_XLAMBDA, 2 * l + 1), s->x0, C, st);
		int slot = ng_spr_attn_slot(m, l);
		if (!r && slot >= 0)
			r = attention_branch_(s, l, slot);
		if (!r)
			r = ng_decode_rmsnorm(s->ln, s->x, C, NG_SPR_RMS_EPS, st);
		if (!r)
			r = ng_decode_gemv(s->fc, slice_(s, NG_P_FCW, l), NULL, s->ln, C, 4 * C,
					   NG_DECODE_ACT_RELU2, 0, st);
		if (!r)
			r = ng_decode_gemv(s->x, slice_(s, NG_P_FCPROJW, l), NULL, s->fc, 4 * C, C,
					   NG_DECODE_ACT_NONE, 1, st);
		if (!r && l < L / 2) /* kept for block L - 1 - l */
			r = ng_decode_mix2(s->skip + (size_t)l * C, NULL, s->x, NULL, NULL, C, st);
	}
	if (!r)
		r = ng_decode_rmsnorm(s->ln, s->x, C, NG_SPR_RMS_EPS, st);
	if (!r)
		r = ng_decode_gemv(s->logits, slice_(s, NG_P_HEADW, 0), NULL, s->ln, C, m->Vp,
				   NG_DECODE_ACT_NONE, 0, st);
	if (!r)
		r = ng_decode_softcap(s->logits, m->Vp, (float)NG_SPR_SOFTCAP,
				      (float)(NG_SPR_SOFTCAP_DIV * sqrt((double)C)), st);
	if (!r)
		r = ng_decode_sample(s->tokens, s->pos, s->n_prompt, s->logits, m->V, s->cfg.top_k,
				     s->cfg.temperature, s->cfg.seed, st);
	return r;
}
