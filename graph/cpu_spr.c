/*
 * graph/cpu_spr.c — the speedrun model on the CPU in double precision (see cpu_spr.h): one arena
 * of doubles for params, grads, activations and backward scratch; forward and backward composed
 * from graph/cpu_ops.c and graph/cpu_spr_ops.c in the order of cpu_spr.h's model.
 */
#include "graph/cpu_spr.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_ops.h"
#include "graph/cpu_ref.h"
#include "graph/cpu_spr_ops.h"
#include "util/rng.h"

/* The arena being laid out: with base NULL it only counts. */
struct arena_ {
	double *base; /* the allocation, or NULL */
	size_t used;  /* doubles handed out so far */
};

/* Hand out `n` doubles (NULL while counting). */
static double *take_(struct arena_ *ar, size_t n)
{
	double *p = ar->base ? ar->base + ar->used : NULL;
	ar->used += n;
	return p;
}

int ng_cpu_spr_block_window(const struct ng_gpt_config *cfg, int l, int W)
{
	int n = ng_spr_long_window(cfg, l) ? W : W / 2;
	return (n > 1 ? n : 1) * NG_SPR_WINDOW_BLOCK;
}

/* Lay the arena `base` out into m's pointers (base NULL: only count); returns the doubles it
 * takes. */
static size_t layout_arena_(struct ng_cpu_spr_model *m, double *base)
{
	size_t L = m->cfg.L, C = m->cfg.C, Vp = m->cfg.Vp, N = (size_t)m->B * m->T;
	size_t H = m->cfg.H, NC = N * C;
	struct arena_ ar = { base, 0 }, *c = &ar;
	struct ng_cpu_spr_acts a;
	struct ng_cpu_spr_scratch s;
	double *params = take_(c, m->lay.total), *grads = take_(c, m->lay.total);
	a.emb = take_(c, NC);
	a.emb_rstd = take_(c, N);
	a.x0 = take_(c, NC);
	a.ve = take_(c, NG_SPR_VE * NC);
	a.xin = take_(c, L * NC);
	a.xmix = take_(c, L * NC);
	a.ln1 = take_(c, L * NC);
	a.ln1_rstd = take_(c, L * N);
	a.qkv = take_(c, L * 3 * NC);
	a.qk_rstd = take_(c, L * N * 2 * H);
	a.qkvr = take_(c, L * 3 * NC);
	a.atty = take_(c, L * NC);
	a.xattn = take_(c, L * NC);
	a.ln2 = take_(c, L * NC);
	a.ln2_rstd = take_(c, L * N);
	a.fch = take_(c, L * 4 * NC);
	a.fch_act = take_(c, L * 4 * NC);
	a.xout = take_(c, L * NC);
	a.xf = take_(c, NC);
	a.xf_rstd = take_(c, N);
	a.x8 = take_(c, NC);
	a.w8 = take_(c, Vp * C);
	a.logits = take_(c, N * Vp);
	a.losses = take_(c, N);
	s.dx = take_(c, NC);
	s.dx0 = take_(c, NC);
	s.dxmix = take_(c, NC);
	s.dln = take_(c, NC);
	s.datty = take_(c, NC);
	s.dqkv = take_(c, 3 * NC);
	s.dqkvr = take_(c, 3 * NC);
	s.dve = take_(c, NC);
	s.dfch = take_(c, 4 * NC);
	s.dfch_act = take_(c, 4 * NC);
	s.dskip = take_(c, L / 2 * NC);
	s.dlogits = take_(c, N * Vp);
	s.dxf = take_(c, NC);
	s.g8 = take_(c, N * Vp);
	s.dw8 = take_(c, Vp * C);
	if (base) {
		m->params = params;
		m->grads = grads;
		m->a = a;
		m->s = s;
	}
	return ar.used;
}

enum ng_status ng_cpu_spr_init(struct ng_cpu_spr_model *m, const struct ng_gpt_config *cfg,
			       int B, int T, uint64_t seed)
{
	memset(m, 0, sizeof(*m));
	m->cfg = *cfg;
	enum ng_status st = ng_gpt_check(&m->cfg);
	if (st != NG_OK)
		return st;
	if (m->cfg.arch != NG_ARCH_SPEEDRUN) {
		ng_fail(NG_ERR_INPUT, "speedrun cpu reference: model family %d is not the speedrun "
			"model", m->cfg.arch);
		ng_hint("graph/cpu_ref.h is the GPT-2 reference");
		return NG_ERR_INPUT;
	}
	if (B < 1 || T < 1 || T > m->cfg.T) {
		ng_fail(NG_ERR_INPUT, "speedrun cpu reference: batch %d x length %d is invalid "
			"(need B >= 1, 1 <= T <= %d)", B, T, m->cfg.T);
		ng_hint("the sequence length cannot exceed the model context (--seq-len)");
		return NG_ERR_INPUT;
	}
	ng_gpt_layout(&m->cfg, &m->lay);
	m->B = B;
	m->T = T;
	m->bos = m->cfg.V - 1;
	size_t N = (size_t)B * T, n = layout_arena_(m, NULL);
	enum ng_status fits = ng_cpu_arena_fits("speedrun cpu reference", n * sizeof(double));
	if (fits != NG_OK) {
		memset(m, 0, sizeof(*m));
		return fits;
	}
	m->arena_ = calloc(n, sizeof(double));
	m->inputs = calloc(3 * N, sizeof(int32_t));
	float *f = malloc(m->lay.total * sizeof(float));
	if (!m->arena_ || !m->inputs || !f) {
		free(m->arena_);
		free(m->inputs);
		free(f);
		memset(m, 0, sizeof(*m));
		return ng_fail(NG_ERR_RUNTIME, "speedrun cpu reference: out of memory allocating "
			       "%zu MiB", n * sizeof(double) >> 20);
	}
	m->targets = m->inputs + N;
	m->doc = m->inputs + 2 * N;
	layout_arena_(m, m->arena_);
	ng_gpt_init(&m->cfg, &m->lay, seed, f);
	ng_cpu_spr_load_params(m, f);
	free(f);
	return NG_OK;
}

void ng_cpu_spr_free(struct ng_cpu_spr_model *m)
{
	free(m->arena_);
	free(m->inputs);
	memset(m, 0, sizeof(*m));
}

void ng_cpu_spr_load_params(struct ng_cpu_spr_model *m, const float *params)
{
	for (size_t i = 0; i < m->lay.total; i++)
		m->params[i] = params[i];
}

void ng_cpu_spr_randomize(struct ng_cpu_spr_model *m, uint64_t seed)
{
	const struct ng_param_spec *p = m->lay.p;
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct { int id; double mean, std; } t[] = {
		{ NG_P_ATTPROJW, 0.0, 0.15 }, { NG_P_FCPROJW, 0.0, 0.08 }, { NG_P_HEADW, 0.0, 1.5 },
		{ NG_P_VLAMBDA, 0.5, 0.3 }, { NG_P_SKIPW, 1.0, 0.3 },
	};
	for (size_t k = 0; k < sizeof(t) / sizeof(t[0]); k++)
		for (size_t j = 0; j < p[t[k].id].numel; j++)
			m->params[p[t[k].id].offset + j] = t[k].mean + t[k].std * ng_rng_normal(&r);
	double *xl = m->params + p[NG_P_XLAMBDA].offset;
	for (int l = 0; l < m->cfg.L; l++) {
		xl[2 * l] = 1.0 + 0.3 * ng_rng_normal(&r);
		xl[2 * l + 1] = 0.5 * ng_rng_normal(&r);
	}
}

void ng_cpu_spr_zero_grad(struct ng_cpu_spr_model *m)
{
	memset(m->grads, 0, m->lay.total * sizeof(double));
}

/* Pointer to slice `l` of tensor `id` (dim 0; l = 0 for a whole tensor) in a flat buffer. */
static double *tensor_(const struct ng_cpu_spr_model *m, double *base, enum ng_param_id id, int l)
{
	const struct ng_param_spec *p = &m->lay.p[id];
	return base + p->offset + p->numel / p->shape[0] * (size_t)l;
}

static enum ng_status check_tokens_(const struct ng_cpu_spr_model *m, const int32_t *tok,
				    const char *what)
{
	size_t N = (size_t)m->B * m->T;
	for (size_t i = 0; i < N; i++) {
		if (tok[i] < 0 || tok[i] >= m->cfg.V) {
			ng_fail(NG_ERR_INPUT, "speedrun cpu reference: %s[%zu] = %d is outside the "
				"vocabulary [0, %d)", what, i, tok[i], m->cfg.V);
			ng_hint("token ids must be smaller than --vocab");
			return NG_ERR_INPUT;
		}
	}
	return NG_OK;
}

/* The block whose output block l (>= L/2) adds (its skip weight is skipw[l - L/2]). */
static int skip_src_(const struct ng_cpu_spr_model *m, int l) { return m->cfg.L - 1 - l; }

/* The FP8 head's input scale sqrt(C) / 448, and the soft cap's divisor 7.5 sqrt(C). */
static double head_xs_(const struct ng_cpu_spr_model *m) { return sqrt((double)m->cfg.C) / 448.0; }
static double softcap_div_(const struct ng_cpu_spr_model *m)
{
	return NG_SPR_SOFTCAP_DIV * sqrt((double)m->cfg.C);
}

/* z (N, Vp) = xf @ headw^T, exact or through the simulated FP8 cast. */
static void head_fwd_(struct ng_cpu_spr_model *m)
{
	struct ng_cpu_spr_acts *a = &m->a;
	int N = m->B * m->T, C = m->cfg.C, Vp = m->cfg.Vp;
	const double *w = tensor_(m, m->params, NG_P_HEADW, 0);
	if (!m->head_fp8) {
		ng_ref_matmul_fwd(a->logits, a->xf, w, NULL, N, C, Vp);
		return;
	}
	double xs = m->head_fp8 >= 2 ? m->head_xs : head_xs_(m);
	double ws = m->head_fp8 >= 2 ? m->head_ws : NG_SPR_FP8_WS;
	for (size_t i = 0; i < (size_t)N * C; i++)
		a->x8[i] = ng_ref_round_e4m3(a->xf[i] / xs);
	for (size_t i = 0; i < (size_t)Vp * C; i++)
		a->w8[i] = ng_ref_round_e4m3(w[i] / ws);
	ng_ref_matmul_fwd(a->logits, a->x8, a->w8, NULL, N, C, Vp);
	for (size_t i = 0; i < (size_t)N * Vp; i++)
		a->logits[i] *= xs * ws;
}

/* From dz = s->dlogits: dxf (N, C) "=" and dheadw +=, exact or the FP8 head's. */
static void head_bwd_(struct ng_cpu_spr_model *m, double *dxf)
{
	struct ng_cpu_spr_acts *a = &m->a;
	struct ng_cpu_spr_scratch *s = &m->s;
	int N = m->B * m->T, C = m->cfg.C, Vp = m->cfg.Vp;
	size_t NC = (size_t)N * C, VC = (size_t)Vp * C;
	double *dw = tensor_(m, m->grads, NG_P_HEADW, 0);
	memset(dxf, 0, NC * sizeof(double));
	if (m->head_fp8 != 1 && m->head_fp8 != 3) {
		ng_ref_matmul_bwd(dxf, dw, NULL, s->dlogits, a->xf,
				  tensor_(m, m->params, NG_P_HEADW, 0), N, C, Vp);
		return;
	}
	double xs = m->head_fp8 == 3 ? m->head_xs : head_xs_(m);
	double ws = m->head_fp8 == 3 ? m->head_ws : NG_SPR_FP8_WS, gs = NG_SPR_FP8_GS;
	for (size_t i = 0; i < (size_t)N * Vp; i++)
		s->g8[i] = ng_ref_round_e5m2(s->dlogits[i] / gs);
	memset(s->dw8, 0, VC * sizeof(double));
	ng_ref_matmul_bwd(dxf, s->dw8, NULL, s->g8, a->x8, a->w8, N, C, Vp);
	for (size_t i = 0; i < NC; i++)
		dxf[i] *= gs * ws;
	for (size_t i = 0; i < VC; i++)
		dw[i] += s->dw8[i] * gs * xs;
}

/* The value mixing of every token row: the v of qkvr (the C values after q and k) = a0 v + a1 ve
 * from the v of qkv, or a0 v when ve is NULL. */
static void value_mix_fwd_(double *qkvr, const double *qkv, const double *ve, double a0,
			   double a1, int N, int C)
{
	for (int n = 0; n < N; n++) {
		size_t v = (size_t)n * 3 * C + 2 * (size_t)C;
		ng_ref_mix2_fwd(qkvr + v, a0, qkv + v, a1, ve ? ve + (size_t)n * C : NULL, C);
	}
}

enum ng_status ng_cpu_spr_forward(struct ng_cpu_spr_model *m, const int32_t *inputs,
				  const int32_t *targets, int window, double *loss_sum)
{
	if (window < 1) {
		ng_fail(NG_ERR_INPUT, "speedrun cpu reference: window %d is not >= 1", window);
		ng_hint("the window counts blocks of %d tokens", NG_SPR_WINDOW_BLOCK);
		return NG_ERR_INPUT;
	}
	enum ng_status st = check_tokens_(m, inputs, "inputs");
	if (st == NG_OK && targets)
		st = check_tokens_(m, targets, "targets");
	if (st != NG_OK)
		return st;
	const struct ng_gpt_config *cfg = &m->cfg;
	int B = m->B, T = m->T, C = cfg->C, H = cfg->H, L = cfg->L, Vp = cfg->Vp;
	int N = B * T, D = C / H;
	size_t NC = (size_t)N * C;
	struct ng_cpu_spr_acts *a = &m->a;
	double *P = m->params;
	memcpy(m->inputs, inputs, (size_t)N * sizeof(int32_t));
	ng_ref_doc_ids(m->doc, inputs, B, T, m->bos);
	m->window = window;

	ng_ref_embed_fwd(a->emb, inputs, tensor_(m, P, NG_P_WTE, 0), N, C);
	ng_ref_rmsnorm_fwd(a->x0, a->emb_rstd, a->emb, N, C, NG_SPR_RMS_EPS);
	for (int t = 0; t < NG_SPR_VE; t++)
		ng_ref_embed_fwd(a->ve + t * NC, inputs, tensor_(m, P, NG_P_VE, t), N, C);
	for (int l = 0; l < L; l++) {
		const double *xprev = l == 0 ? a->x0 : a->xout + (size_t)(l - 1) * NC;
		double *xin = a->xin + l * NC, *xmix = a->xmix + l * NC, *xattn = a->xattn + l * NC;
		double *ln2 = a->ln2 + l * NC, *fch = a->fch + 4 * l * NC;
		double *fch_act = a->fch_act + 4 * l * NC, *xout = a->xout + l * NC;
		const double *xl = tensor_(m, P, NG_P_XLAMBDA, l);

		if (l >= L / 2)
			ng_ref_mix2_fwd(xin, 1.0, xprev, P[m->lay.p[NG_P_SKIPW].offset + l - L / 2],
					a->xout + (size_t)skip_src_(m, l) * NC, NC);
		else
			memcpy(xin, xprev, NC * sizeof(double));
		ng_ref_mix2_fwd(xmix, xl[0], xin, xl[1], a->x0, NC);
		int slot = ng_spr_attn_slot(cfg, l);
		if (slot >= 0) {
			double *ln1 = a->ln1 + l * NC, *qkv = a->qkv + 3 * l * NC;
			double *qkvr = a->qkvr + 3 * l * NC, *atty = a->atty + l * NC;
			const double *vl = tensor_(m, P, NG_P_VLAMBDA, slot);
			int ve = ng_spr_ve(cfg, l);
			ng_ref_rmsnorm_fwd(ln1, a->ln1_rstd + (size_t)l * N, xmix, N, C,
					   NG_SPR_RMS_EPS);
			ng_ref_matmul_fwd(qkv, ln1, tensor_(m, P, NG_P_QKVW, slot), NULL, N, C,
					  3 * C);
			ng_ref_qk_norm_rotary_fwd(qkvr, a->qk_rstd + (size_t)l * N * 2 * H, qkv, N,
						  T, H, D, NG_SPR_RMS_EPS);
			value_mix_fwd_(qkvr, qkv, ve >= 0 ? a->ve + ve * NC : NULL, vl[0], vl[1], N,
				       C);
			ng_ref_attention_masked_fwd(atty, NULL, qkvr, m->doc,
						    ng_cpu_spr_block_window(cfg, l, window),
						    NG_SPR_WINDOW_BLOCK, NG_SPR_ATTN_SCALE, B, T, H,
						    D);
			ng_ref_matmul_fwd(xattn, atty, tensor_(m, P, NG_P_ATTPROJW, slot), NULL, N,
					  C, C);
			for (size_t i = 0; i < NC; i++)
				xattn[i] += xmix[i];
		} else {
			memcpy(xattn, xmix, NC * sizeof(double));
		}
		ng_ref_rmsnorm_fwd(ln2, a->ln2_rstd + (size_t)l * N, xattn, N, C, NG_SPR_RMS_EPS);
		ng_ref_matmul_fwd(fch, ln2, tensor_(m, P, NG_P_FCW, l), NULL, N, C, 4 * C);
		ng_ref_relu2_fwd(fch_act, fch, 4 * NC);
		ng_ref_matmul_fwd(xout, fch_act, tensor_(m, P, NG_P_FCPROJW, l), NULL, N, 4 * C, C);
		for (size_t i = 0; i < NC; i++)
			xout[i] += xattn[i];
	}
	ng_ref_rmsnorm_fwd(a->xf, a->xf_rstd, a->xout + (size_t)(L - 1) * NC, N, C, NG_SPR_RMS_EPS);
	head_fwd_(m);

	m->have_targets = targets != NULL;
	m->loss_sum = 0.0;
	if (targets) {
		memcpy(m->targets, targets, (size_t)N * sizeof(int32_t));
		m->loss_sum = ng_ref_softcap_crossentropy(a->losses, NULL, a->logits, targets, N,
							  Vp, NG_SPR_SOFTCAP, softcap_div_(m), 0.0);
	}
	if (loss_sum)
		*loss_sum = m->loss_sum;
	return NG_OK;
}

/* The backward of block l's attention branch, from s->dx = d(xattn): adds the branch's part of
 * d(xmix) into s->dxmix, and the gradients of qkvw, attprojw, vlambda and the value embedding. */
static void attention_bwd_(struct ng_cpu_spr_model *m, int l, int slot)
{
	const struct ng_gpt_config *cfg = &m->cfg;
	struct ng_cpu_spr_acts *a = &m->a;
	struct ng_cpu_spr_scratch *s = &m->s;
	int B = m->B, T = m->T, C = cfg->C, H = cfg->H, N = B * T, D = C / H;
	size_t NC = (size_t)N * C;
	double *P = m->params, *G = m->grads;
	const double *qkv = a->qkv + 3 * l * NC, *qkvr = a->qkvr + 3 * l * NC;
	const double *vl = tensor_(m, P, NG_P_VLAMBDA, slot);
	double *dvl = tensor_(m, G, NG_P_VLAMBDA, slot);
	int ve = ng_spr_ve(cfg, l);

	memset(s->datty, 0, NC * sizeof(double));
	ng_ref_matmul_bwd(s->datty, tensor_(m, G, NG_P_ATTPROJW, slot), NULL, s->dx,
			  a->atty + l * NC, tensor_(m, P, NG_P_ATTPROJW, slot), N, C, C);
	memset(s->dqkvr, 0, 3 * NC * sizeof(double));
	ng_ref_attention_masked_bwd(s->dqkvr, s->datty, qkvr, m->doc,
				    ng_cpu_spr_block_window(cfg, l, m->window), NG_SPR_WINDOW_BLOCK,
				    NG_SPR_ATTN_SCALE, B, T, H, D);
	/* value mixing, v_r = a0 v + a1 ve: d(ve) = a1 dv_r, da0 = sum dv_r v, da1 = sum dv_r ve,
	 * and dv_r becomes dv = a0 dv_r in place (the v part of the rotary's output gradient) */
	if (ve >= 0)
		memset(s->dve, 0, NC * sizeof(double));
	for (int n = 0; n < N; n++) {
		double *dv = s->dqkvr + (size_t)n * 3 * C + 2 * (size_t)C;
		const double *v = qkv + (size_t)n * 3 * C + 2 * (size_t)C;
		const double *e = ve >= 0 ? a->ve + ve * NC + (size_t)n * C : NULL;
		double *de = e ? s->dve + (size_t)n * C : NULL;
		ng_ref_mix2_bwd(NULL, de, &dvl[0], &dvl[1], dv, vl[0], v, vl[1], e, C);
		for (int c = 0; c < C; c++)
			dv[c] *= vl[0];
	}
	if (ve >= 0)
		ng_ref_embed_bwd(tensor_(m, G, NG_P_VE, ve), s->dve, m->inputs, N, C);
	memset(s->dqkv, 0, 3 * NC * sizeof(double));
	ng_ref_qk_norm_rotary_bwd(s->dqkv, s->dqkvr, qkv, a->qk_rstd + (size_t)l * N * 2 * H, N, T,
				  H, D);
	memset(s->dln, 0, NC * sizeof(double));
	ng_ref_matmul_bwd(s->dln, tensor_(m, G, NG_P_QKVW, slot), NULL, s->dqkv, a->ln1 + l * NC,
			  tensor_(m, P, NG_P_QKVW, slot), N, C, 3 * C);
	ng_ref_rmsnorm_bwd(s->dxmix, s->dln, a->xmix + l * NC, a->ln1_rstd + (size_t)l * N, N, C);
}

enum ng_status ng_cpu_spr_backward(struct ng_cpu_spr_model *m, double dloss_scale)
{
	if (!m->have_targets) {
		ng_fail(NG_ERR_INPUT, "speedrun cpu reference: backward needs a forward with "
			"targets first");
		ng_hint("call ng_cpu_spr_forward with a non-NULL targets array");
		return NG_ERR_INPUT;
	}
	const struct ng_gpt_config *cfg = &m->cfg;
	int C = cfg->C, L = cfg->L, Vp = cfg->Vp, N = m->B * m->T;
	size_t NC = (size_t)N * C;
	struct ng_cpu_spr_acts *a = &m->a;
	struct ng_cpu_spr_scratch *s = &m->s;
	double *P = m->params, *G = m->grads;
	double *skipw = P + m->lay.p[NG_P_SKIPW].offset, *dskipw = G + m->lay.p[NG_P_SKIPW].offset;

	ng_ref_softcap_crossentropy(NULL, s->dlogits, a->logits, m->targets, N, Vp, NG_SPR_SOFTCAP,
				    softcap_div_(m), dloss_scale);
	head_bwd_(m, s->dxf);
	memset(s->dx, 0, NC * sizeof(double));
	ng_ref_rmsnorm_bwd(s->dx, s->dxf, a->xout + (size_t)(L - 1) * NC, a->xf_rstd, N, C);
	memset(s->dx0, 0, NC * sizeof(double));
	memset(s->dskip, 0, (size_t)(L / 2) * NC * sizeof(double));

	for (int l = L - 1; l >= 0; l--) {
		const double *xattn = a->xattn + l * NC;
		/* s->dx holds d(xout); the outputs kept for the U-net add what they got there */
		if (l < L / 2)
			for (size_t i = 0; i < NC; i++)
				s->dx[i] += s->dskip[l * NC + i];
		/* xout = xattn + fcproj(relu2(fc(rmsnorm(xattn)))) */
		memset(s->dfch_act, 0, 4 * NC * sizeof(double));
		ng_ref_matmul_bwd(s->dfch_act, tensor_(m, G, NG_P_FCPROJW, l), NULL, s->dx,
				  a->fch_act + 4 * l * NC, tensor_(m, P, NG_P_FCPROJW, l), N, 4 * C,
				  C);
		ng_ref_relu2_bwd(s->dfch, a->fch + 4 * l * NC, s->dfch_act, 4 * NC);
		memset(s->dln, 0, NC * sizeof(double));
		ng_ref_matmul_bwd(s->dln, tensor_(m, G, NG_P_FCW, l), NULL, s->dfch,
				  a->ln2 + l * NC, tensor_(m, P, NG_P_FCW, l), N, C, 4 * C);
		ng_ref_rmsnorm_bwd(s->dx, s->dln, xattn, a->ln2_rstd + (size_t)l * N, N, C);
		/* s->dx holds d(xattn); xattn = xmix (+ the attention branch) */
		memcpy(s->dxmix, s->dx, NC * sizeof(double));
		int slot = ng_spr_attn_slot(cfg, l);
		if (slot >= 0)
			attention_bwd_(m, l, slot);
		/* xmix = l0 xin + l1 x0 */
		const double *xl = tensor_(m, P, NG_P_XLAMBDA, l);
		double *dxl = tensor_(m, G, NG_P_XLAMBDA, l);
		memset(s->dx, 0, NC * sizeof(double));
		ng_ref_mix2_bwd(s->dx, s->dx0, &dxl[0], &dxl[1], s->dxmix, xl[0], a->xin + l * NC,
				xl[1], a->x0, NC);
		/* s->dx holds d(xin); xin = xprev (+ skipw[j] * xout[src]) */
		if (l >= L / 2) {
			int j = l - L / 2, src = skip_src_(m, l);
			ng_ref_mix2_bwd(NULL, s->dskip + (size_t)src * NC, NULL, &dskipw[j], s->dx,
					1.0, a->xout + (size_t)(l - 1) * NC, skipw[j],
					a->xout + (size_t)src * NC, NC);
		}
		/* s->dx now holds d(xprev): d(xout[l - 1]), or d(x0) for l = 0 */
	}
	for (size_t i = 0; i < NC; i++)
		s->dx0[i] += s->dx[i];
	memset(s->dln, 0, NC * sizeof(double));
	ng_ref_rmsnorm_bwd(s->dln, s->dx0, a->emb, a->emb_rstd, N, C);
	ng_ref_embed_bwd(tensor_(m, G, NG_P_WTE, 0), s->dln, m->inputs, N, C);
	return NG_OK;
}
