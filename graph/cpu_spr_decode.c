/*
 * graph/cpu_spr_decode.c — one-token speedrun decoding with a KV cache in double precision (see
 * cpu_spr_decode.h): the steps of graph/cpu_spr.c's forward on a single row, built from the same
 * graph/cpu_ops.h and graph/cpu_spr_ops.h references, plus the attention of one query over the
 * cache rows [lo, t].
 */
#include "graph/cpu_spr_decode.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_ops.h"
#include "kernels/window.h"
#include "graph/cpu_spr.h"
#include "graph/cpu_spr_ops.h"

/* Pointer to slice `l` of parameter `id` (dim 0; l = 0 for a whole tensor). */
static const double *tensor_(const struct ng_cpu_spr_decoder *d, enum ng_param_id id, int l)
{
	const struct ng_param_spec *p = &d->lay.p[id];
	return d->params + p->offset + p->numel / p->shape[0] * (size_t)l;
}

enum ng_status ng_cpu_spr_decode_init(struct ng_cpu_spr_decoder *d,
				      const struct ng_gpt_config *cfg, const double *params,
				      int Tmax, int window)
{
	memset(d, 0, sizeof(*d));
	d->cfg = *cfg;
	enum ng_status st = ng_gpt_check(&d->cfg);
	if (st != NG_OK)
		return st;
	if (d->cfg.arch != NG_ARCH_SPEEDRUN) {
		ng_fail(NG_ERR_INPUT, "speedrun cpu decode: model family %d is not the speedrun "
			"model", d->cfg.arch);
		ng_hint("graph/cpu_ref.h is the GPT-2 reference");
		return NG_ERR_INPUT;
	}
	if (Tmax < 1 || Tmax > d->cfg.T || window < 1) {
		ng_fail(NG_ERR_INPUT, "speedrun cpu decode: cache of %d positions at window %d is "
			"invalid (need 1 <= positions <= %d, window >= 1)", Tmax, window, d->cfg.T);
		ng_hint("the window counts blocks of %d tokens", NG_SPR_WINDOW_BLOCK);
		return NG_ERR_INPUT;
	}
	ng_gpt_layout(&d->cfg, &d->lay);
	size_t C = (size_t)d->cfg.C, L = (size_t)d->cfg.L, La = L - 1;
	size_t cache = La * (size_t)Tmax * C;
	size_t n = 2 * cache + C * (1 + 1 + L / 2 + 1 + 3 + 3 + 1 + 1 + 4) + (size_t)Tmax +
		   (size_t)d->cfg.Vp;
	double *p = calloc(n, sizeof(double));
	if (!p) {
		memset(d, 0, sizeof(*d));
		return ng_fail(NG_ERR_RUNTIME, "speedrun cpu decode: out of memory allocating %zu "
			       "MiB", n * sizeof(double) >> 20);
	}
	d->arena_ = p;
	d->kcache = p;
	d->vcache = p + cache;
	p += 2 * cache;
	d->x = p;
	d->x0 = p + C;
	d->skip = p + 2 * C;
	p += (2 + L / 2) * C;
	d->ln = p;
	d->qkv = p + C;
	d->qkvr = p + 4 * C;
	d->att = p + 7 * C;
	d->tmp = p + 8 * C;
	d->fc = p + 9 * C;
	d->scores = p + 13 * C;
	d->logits = d->scores + Tmax;
	d->params = params;
	d->Tmax = Tmax;
	d->window = window;
	d->bos = d->cfg.V - 1;
	return NG_OK;
}

void ng_cpu_spr_decode_free(struct ng_cpu_spr_decoder *d)
{
	free(d->arena_);
	memset(d, 0, sizeof(*d));
}

void ng_cpu_spr_decode_reset(struct ng_cpu_spr_decoder *d)
{
	d->pos = 0;
	d->doc_start = 0;
}

/* The attention of block `slot`'s query q (C, heads of D) at position t over cache rows
 * [lo, t]: att (C) "=", per head softmax(scale q . k) @ v. */
static void attend_(struct ng_cpu_spr_decoder *d, int slot, const double *q, int lo, int t)
{
	int C = d->cfg.C, H = d->cfg.H, D = C / H;
	const double *kc = d->kcache + (size_t)slot * d->Tmax * C;
	const double *vc = d->vcache + (size_t)slot * d->Tmax * C;
	for (int h = 0; h < H; h++) {
		const double *qh = q + (size_t)h * D;
		double mx = -INFINITY, sum = 0.0;
		for (int s = lo; s <= t; s++) {
			const double *k = kc + (size_t)s * C + (size_t)h * D;
			double sc = 0.0;
			for (int c = 0; c < D; c++)
				sc += qh[c] * k[c];
			d->scores[s - lo] = NG_SPR_ATTN_SCALE * sc;
			mx = fmax(mx, d->scores[s - lo]);
		}
		for (int s = lo; s <= t; s++) {
			d->scores[s - lo] = exp(d->scores[s - lo] - mx);
			sum += d->scores[s - lo];
		}
		double *o = d->att + (size_t)h * D;
		memset(o, 0, (size_t)D * sizeof(double));
		for (int s = lo; s <= t; s++) {
			const double *v = vc + (size_t)s * C + (size_t)h * D;
			double w = d->scores[s - lo] / sum;
			for (int c = 0; c < D; c++)
				o[c] += w * v[c];
		}
	}
}

/* Block l's attention branch at position t for token tok: x += attproj(attention(...)). */
static void attention_branch_(struct ng_cpu_spr_decoder *d, int l, int slot, int32_t tok, int t)
{
	const struct ng_gpt_config *cfg = &d->cfg;
	int C = cfg->C, H = cfg->H, D = C / H;
	const double *vl = tensor_(d, NG_P_VLAMBDA, slot);
	int ve = ng_spr_ve(cfg, l);
	ng_ref_rmsnorm_fwd(d->ln, NULL, d->x, 1, C, NG_SPR_RMS_EPS);
	ng_ref_matmul_fwd(d->qkv, d->ln, tensor_(d, NG_P_QKVW, slot), NULL, 1, C, 3 * C);
	ng_ref_qk_norm_rotary_at(d->qkvr, d->qkv, t, H, D, NG_SPR_RMS_EPS);
	ng_ref_mix2_fwd(d->qkvr + 2 * C, vl[0], d->qkv + 2 * C, vl[1],
			ve >= 0 ? tensor_(d, NG_P_VE, ve) + (size_t)tok * C : NULL, (size_t)C);
	size_t row = ((size_t)slot * d->Tmax + (size_t)t) * C;
	memcpy(d->kcache + row, d->qkvr + C, (size_t)C * sizeof(double));
	memcpy(d->vcache + row, d->qkvr + 2 * C, (size_t)C * sizeof(double));
	int lo = ng_attention_window_first(t, ng_cpu_spr_block_window(cfg, l, d->window),
					   NG_SPR_WINDOW_BLOCK); /* whole blocks, as in training */
	if (lo < d->doc_start)
		lo = d->doc_start;
	attend_(d, slot, d->qkvr, lo, t);
	ng_ref_matmul_fwd(d->tmp, d->att, tensor_(d, NG_P_ATTPROJW, slot), NULL, 1, C, C);
	for (int c = 0; c < C; c++)
		d->x[c] += d->tmp[c];
}

enum ng_status ng_cpu_spr_decode_step(struct ng_cpu_spr_decoder *d, int32_t tok)
{
	const struct ng_gpt_config *cfg = &d->cfg;
	int C = cfg->C, L = cfg->L, t = d->pos;
	if (tok < 0 || tok >= cfg->V) {
		ng_fail(NG_ERR_INPUT, "speedrun cpu decode: token %d at position %d is outside the "
			"vocabulary [0, %d)", tok, t, cfg->V);
		ng_hint("token ids must be smaller than --vocab");
		return NG_ERR_INPUT;
	}
	if (t >= d->Tmax) {
		ng_fail(NG_ERR_INPUT, "speedrun cpu decode: the cache of %d positions is full",
			d->Tmax);
		ng_hint("reset the decoder or allocate more positions");
		return NG_ERR_INPUT;
	}
	if (tok == d->bos || t == 0)
		d->doc_start = t;
	const double *skipw = tensor_(d, NG_P_SKIPW, 0);
	ng_ref_rmsnorm_fwd(d->x0, NULL, tensor_(d, NG_P_WTE, 0) + (size_t)tok * C, 1, C,
			   NG_SPR_RMS_EPS);
	memcpy(d->x, d->x0, (size_t)C * sizeof(double));
	for (int l = 0; l < L; l++) {
		const double *xl = tensor_(d, NG_P_XLAMBDA, l);
		if (l >= L / 2) /* the U-net: the output of block L - 1 - l */
			ng_ref_mix2_fwd(d->x, 1.0, d->x, skipw[l - L / 2],
					d->skip + (size_t)(L - 1 - l) * C, (size_t)C);
		ng_ref_mix2_fwd(d->x, xl[0], d->x, xl[1], d->x0, (size_t)C);
		int slot = ng_spr_attn_slot(cfg, l);
		if (slot >= 0)
			attention_branch_(d, l, slot, tok, t);
		ng_ref_rmsnorm_fwd(d->ln, NULL, d->x, 1, C, NG_SPR_RMS_EPS);
		ng_ref_matmul_fwd(d->fc, d->ln, tensor_(d, NG_P_FCW, l), NULL, 1, C, 4 * C);
		ng_ref_relu2_fwd(d->fc, d->fc, 4 * (size_t)C);
		ng_ref_matmul_fwd(d->tmp, d->fc, tensor_(d, NG_P_FCPROJW, l), NULL, 1, 4 * C, C);
		for (int c = 0; c < C; c++)
			d->x[c] += d->tmp[c];
		if (l < L / 2)
			memcpy(d->skip + (size_t)l * C, d->x, (size_t)C * sizeof(double));
	}
	ng_ref_rmsnorm_fwd(d->ln, NULL, d->x, 1, C, NG_SPR_RMS_EPS);
	ng_ref_matmul_fwd(d->logits, d->ln, tensor_(d, NG_P_HEADW, 0), NULL, 1, C, cfg->Vp);
	ng_ref_softcap_fwd(d->logits, d->logits, (size_t)cfg->Vp, NG_SPR_SOFTCAP,
			   NG_SPR_SOFTCAP_DIV * sqrt((double)C));
	d->pos = t + 1;
	return NG_OK;
}
