/*
 * graph/cpu_ref.c — the CPU reference GPT-2 (see cpu_ref.h): one arena of doubles holding
 * params, grads, AdamW moments, activations and backward scratch; forward, backward and AdamW
 * composed from the ops of graph/cpu_ops.c in the order of docs/DESIGN.md's step.
 */
#include "graph/cpu_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graph/cpu_ops.h"

/* Hand out `n` doubles from the arena cursor. */
static double *take_(double **cur, size_t n)
{
	double *p = *cur;
	*cur += n;
	return p;
}

enum ng_status ng_cpu_arena_fits(const char *who, size_t bytes)
{
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
	if (pages <= 0 || page <= 0 || bytes / (size_t)page < (size_t)pages)
		return NG_OK;
	ng_fail(NG_ERR_INPUT, "%s: the double-precision reference of this model and batch needs "
		"%.1f GiB, more than this machine's %.1f GiB", who, (double)bytes / (1 << 30),
		(double)pages * (double)page / (1 << 30));
	ng_hint("--device cpu is for small models (--model tiny or speedrun-tiny, a smaller "
		"--batch or --seq-len); train this one on the GPU");
	return NG_ERR_INPUT;
}

enum ng_status ng_cpu_model_init(struct ng_cpu_model *m, const struct ng_gpt_config *cfg, int B,
				 int T, uint64_t seed)
{
	memset(m, 0, sizeof(*m));
	m->cfg = *cfg;
	enum ng_status st = ng_gpt_check(&m->cfg);
	if (st != NG_OK)
		return st;
	if (B < 1 || T < 1 || T > m->cfg.T) {
		ng_fail(NG_ERR_INPUT, "cpu reference: batch %d x length %d is invalid (need B >= 1, "
			"1 <= T <= %d)", B, T, m->cfg.T);
		ng_hint("the sequence length cannot exceed the model context (--seq-len)");
		return NG_ERR_INPUT;
	}
	ng_gpt_layout(&m->cfg, &m->lay);
	m->B = B;
	m->T = T;
	size_t L = m->cfg.L, C = m->cfg.C, Vp = m->cfg.Vp, N = (size_t)B * T;
	size_t n_state = 4 * m->lay.total;
	size_t n_acts = N * C + L * N * (16 * C + 4) + N * C + 2 * N + N * Vp + N;
	size_t n_scratch = N * C * 3 + N * 3 * C + 2 * N * 4 * C + N * Vp;
	size_t n = n_state + n_acts + n_scratch;
	if ((st = ng_cpu_arena_fits("cpu reference", n * sizeof(double))) != NG_OK) {
		memset(m, 0, sizeof(*m));
		return st;
	}
	m->arena_ = calloc(n, sizeof(double));
	m->inputs = calloc(2 * N, sizeof(int32_t));
	if (!m->arena_ || !m->inputs) {
		free(m->arena_);
		free(m->inputs);
		memset(m, 0, sizeof(*m));
		return ng_fail(NG_ERR_RUNTIME, "cpu reference: out of memory allocating %zu MiB",
			       n * sizeof(double) >> 20);
	}
	m->targets = m->inputs + N;
	double *cur = m->arena_;
	m->params = take_(&cur, m->lay.total);
	m->grads = take_(&cur, m->lay.total);
	m->m = take_(&cur, m->lay.total);
	m->v = take_(&cur, m->lay.total);
	struct ng_cpu_acts *a = &m->a;
	a->encoded = take_(&cur, N * C);
	a->ln1 = take_(&cur, L * N * C);
	a->ln1_mean = take_(&cur, L * N);
	a->ln1_rstd = take_(&cur, L * N);
	a->qkv = take_(&cur, L * N * 3 * C);
	a->atty = take_(&cur, L * N * C);
	a->residual2 = take_(&cur, L * N * C);
	a->ln2 = take_(&cur, L * N * C);
	a->ln2_mean = take_(&cur, L * N);
	a->ln2_rstd = take_(&cur, L * N);
	a->fch = take_(&cur, L * N * 4 * C);
	a->fch_gelu = take_(&cur, L * N * 4 * C);
	a->residual3 = take_(&cur, L * N * C);
	a->lnf = take_(&cur, N * C);
	a->lnf_mean = take_(&cur, N);
	a->lnf_rstd = take_(&cur, N);
	a->logits = take_(&cur, N * Vp);
	a->losses = take_(&cur, N);
	struct ng_cpu_scratch *s = &m->s;
	s->dres = take_(&cur, N * C);
	s->dln = take_(&cur, N * C);
	s->datty = take_(&cur, N * C);
	s->dqkv = take_(&cur, N * 3 * C);
	s->dfch = take_(&cur, N * 4 * C);
	s->dfch_gelu = take_(&cur, N * 4 * C);
	s->dlogits = take_(&cur, N * Vp);
	/* every take_ above must fit the count computed for calloc */
	size_t used = (size_t)(cur - m->arena_);
	if (used != n) {
		ng_cpu_model_free(m);
		return ng_fail(NG_ERR_RUNTIME, "cpu reference: arena sizing bug (%zu != %zu doubles)",
			       used, n);
	}

	float *f = malloc(m->lay.total * sizeof(float));
	if (!f) {
		ng_cpu_model_free(m);
		return ng_fail(NG_ERR_RUNTIME, "cpu reference: out of memory for %zu init floats",
			       m->lay.total);
	}
	ng_gpt_init(&m->cfg, &m->lay, seed, f);
	ng_cpu_model_load_params(m, f);
	free(f);
	return NG_OK;
}

void ng_cpu_model_free(struct ng_cpu_model *m)
{
	free(m->arena_);
	free(m->inputs);
	memset(m, 0, sizeof(*m));
}

void ng_cpu_model_load_params(struct ng_cpu_model *m, const float *params)
{
	for (size_t i = 0; i < m->lay.total; i++)
		m->params[i] = params[i];
}

/* Pointer to tensor `id` (layer `l` for per-layer tensors) inside a flat buffer. */
static double *tensor_(const struct ng_cpu_model *m, double *base, enum ng_param_id id, int l)
{
	const struct ng_param_spec *p = &m->lay.p[id];
	size_t per = p->per_layer ? p->numel / p->shape[0] : 0;
	return base + p->offset + per * (size_t)l;
}

static enum ng_status check_tokens_(const struct ng_cpu_model *m, const int32_t *tok,
				    const char *what)
{
	size_t N = (size_t)m->B * m->T;
	for (size_t i = 0; i < N; i++) {
		if (tok[i] < 0 || tok[i] >= m->cfg.V) {
			ng_fail(NG_ERR_INPUT, "cpu reference: %s[%zu] = %d is outside the vocabulary "
				"[0, %d)", what, i, tok[i], m->cfg.V);
			ng_hint("token ids must be smaller than --vocab");
			return NG_ERR_INPUT;
		}
	}
	return NG_OK;
}

enum ng_status ng_cpu_forward(struct ng_cpu_model *m, const int32_t *inputs,
			      const int32_t *targets, double *mean_loss)
{
	enum ng_status st = check_tokens_(m, inputs, "inputs");
	if (st == NG_OK && targets)
		st = check_tokens_(m, targets, "targets");
	if (st != NG_OK)
		return st;
	int B = m->B, T = m->T, C = m->cfg.C, H = m->cfg.H, L = m->cfg.L;
	int N = B * T, D = C / H;
	size_t NC = (size_t)N * C;
	struct ng_cpu_acts *a = &m->a;
	double *P = m->params;
	memcpy(m->inputs, inputs, (size_t)N * sizeof(int32_t));

	ng_ref_encoder_fwd(a->encoded, inputs, tensor_(m, P, NG_P_WTE, 0),
			   tensor_(m, P, NG_P_WPE, 0), B, T, C);
	for (int l = 0; l < L; l++) {
		const double *res = l == 0 ? a->encoded : a->residual3 + (size_t)(l - 1) * NC;
		double *ln1 = a->ln1 + l * NC, *qkv = a->qkv + 3 * l * NC;
		double *atty = a->atty + l * NC, *res2 = a->residual2 + l * NC;
		double *ln2 = a->ln2 + l * NC, *fch = a->fch + 4 * l * NC;
		double *fchg = a->fch_gelu + 4 * l * NC, *res3 = a->residual3 + l * NC;

		ng_ref_layernorm_fwd(ln1, a->ln1_mean + (size_t)l * N, a->ln1_rstd + (size_t)l * N,
				     res, tensor_(m, P, NG_P_LN1W, l), tensor_(m, P, NG_P_LN1B, l),
				     N, C);
		ng_ref_matmul_fwd(qkv, ln1, tensor_(m, P, NG_P_QKVW, l),
				  tensor_(m, P, NG_P_QKVB, l), N, C, 3 * C);
		ng_ref_attention_fwd(atty, NULL, qkv, B, T, H, D);
		/* res2 = res + atty @ attprojw^T + attprojb */
		ng_ref_matmul_fwd(res2, atty, tensor_(m, P, NG_P_ATTPROJW, l),
				  tensor_(m, P, NG_P_ATTPROJB, l), N, C, C);
		for (size_t i = 0; i < NC; i++)
			res2[i] += res[i];
		ng_ref_layernorm_fwd(ln2, a->ln2_mean + (size_t)l * N, a->ln2_rstd + (size_t)l * N,
				     res2, tensor_(m, P, NG_P_LN2W, l), tensor_(m, P, NG_P_LN2B, l),
				     N, C);
		ng_ref_matmul_fwd(fch, ln2, tensor_(m, P, NG_P_FCW, l), tensor_(m, P, NG_P_FCB, l),
				  N, C, 4 * C);
		ng_ref_gelu_fwd(fchg, fch, 4 * NC);
		ng_ref_matmul_fwd(res3, fchg, tensor_(m, P, NG_P_FCPROJW, l),
				  tensor_(m, P, NG_P_FCPROJB, l), N, 4 * C, C);
		for (size_t i = 0; i < NC; i++)
			res3[i] += res2[i];
	}
	ng_ref_layernorm_fwd(a->lnf, a->lnf_mean, a->lnf_rstd, a->residual3 + (size_t)(L - 1) * NC,
			     tensor_(m, P, NG_P_LNFW, 0), tensor_(m, P, NG_P_LNFB, 0), N, C);
	/* tied head: logits over all Vp rows of wte (padded rows are zero, so their logits are 0
	 * and the loss ignores them) */
	ng_ref_matmul_fwd(a->logits, a->lnf, tensor_(m, P, NG_P_WTE, 0), NULL, N, C, m->cfg.Vp);

	m->have_targets = targets != NULL;
	m->mean_loss = 0.0;
	if (targets) {
		memcpy(m->targets, targets, (size_t)N * sizeof(int32_t));
		m->mean_loss = ng_ref_crossentropy(a->losses, NULL, a->logits, targets, N,
						   m->cfg.V, m->cfg.Vp, 0.0);
	}
	if (mean_loss)
		*mean_loss = m->mean_loss;
	return NG_OK;
}

void ng_cpu_zero_grad(struct ng_cpu_model *m)
{
	memset(m->grads, 0, m->lay.total * sizeof(double));
}

enum ng_status ng_cpu_backward(struct ng_cpu_model *m, double dloss_scale)
{
	if (!m->have_targets) {
		ng_fail(NG_ERR_INPUT, "cpu reference: backward needs a forward with targets first");
		ng_hint("call ng_cpu_forward with a non-NULL targets array");
		return NG_ERR_INPUT;
	}
	int B = m->B, T = m->T, C = m->cfg.C, H = m->cfg.H, L = m->cfg.L, Vp = m->cfg.Vp;
	int N = B * T, D = C / H;
	size_t NC = (size_t)N * C;
	struct ng_cpu_acts *a = &m->a;
	struct ng_cpu_scratch *s = &m->s;
	double *P = m->params, *G = m->grads;

	/* d(mean loss * scale)/dlogits = scale / N * (softmax - onehot) */
	ng_ref_crossentropy(NULL, s->dlogits, a->logits, m->targets, N, m->cfg.V, Vp,
			    dloss_scale / N);
	memset(s->dln, 0, NC * sizeof(double));
	ng_ref_matmul_bwd(s->dln, tensor_(m, G, NG_P_WTE, 0), NULL, s->dlogits, a->lnf,
			  tensor_(m, P, NG_P_WTE, 0), N, C, Vp);
	memset(s->dres, 0, NC * sizeof(double));
	ng_ref_layernorm_bwd(s->dres, tensor_(m, G, NG_P_LNFW, 0), tensor_(m, G, NG_P_LNFB, 0),
			     s->dln, a->residual3 + (size_t)(L - 1) * NC,
			     tensor_(m, P, NG_P_LNFW, 0), a->lnf_mean, a->lnf_rstd, N, C);

	for (int l = L - 1; l >= 0; l--) {
		const double *res = l == 0 ? a->encoded : a->residual3 + (size_t)(l - 1) * NC;
		const double *ln1 = a->ln1 + l * NC, *qkv = a->qkv + 3 * l * NC;
		const double *atty = a->atty + l * NC, *res2 = a->residual2 + l * NC;
		const double *ln2 = a->ln2 + l * NC, *fch = a->fch + 4 * l * NC;
		const double *fchg = a->fch_gelu + 4 * l * NC;

		/* s->dres holds d(res3); res3 = res2 + fcproj(...), so it is also d(fcproj out)
		 * and the first part of d(res2). */
		memset(s->dfch_gelu, 0, 4 * NC * sizeof(double));
		ng_ref_matmul_bwd(s->dfch_gelu, tensor_(m, G, NG_P_FCPROJW, l),
				  tensor_(m, G, NG_P_FCPROJB, l), s->dres, fchg,
				  tensor_(m, P, NG_P_FCPROJW, l), N, 4 * C, C);
		ng_ref_gelu_bwd(s->dfch, fch, s->dfch_gelu, 4 * NC);
		memset(s->dln, 0, NC * sizeof(double));
		ng_ref_matmul_bwd(s->dln, tensor_(m, G, NG_P_FCW, l), tensor_(m, G, NG_P_FCB, l),
				  s->dfch, ln2, tensor_(m, P, NG_P_FCW, l), N, C, 4 * C);
		ng_ref_layernorm_bwd(s->dres, tensor_(m, G, NG_P_LN2W, l),
				     tensor_(m, G, NG_P_LN2B, l), s->dln, res2,
				     tensor_(m, P, NG_P_LN2W, l), a->ln2_mean + (size_t)l * N,
				     a->ln2_rstd + (size_t)l * N, N, C);
		/* s->dres now holds d(res2); res2 = res + attproj(...) */
		memset(s->datty, 0, NC * sizeof(double));
		ng_ref_matmul_bwd(s->datty, tensor_(m, G, NG_P_ATTPROJW, l),
				  tensor_(m, G, NG_P_ATTPROJB, l), s->dres, atty,
				  tensor_(m, P, NG_P_ATTPROJW, l), N, C, C);
		memset(s->dqkv, 0, 3 * NC * sizeof(double));
		ng_ref_attention_bwd(s->dqkv, s->datty, qkv, B, T, H, D);
		memset(s->dln, 0, NC * sizeof(double));
		ng_ref_matmul_bwd(s->dln, tensor_(m, G, NG_P_QKVW, l), tensor_(m, G, NG_P_QKVB, l),
				  s->dqkv, ln1, tensor_(m, P, NG_P_QKVW, l), N, C, 3 * C);
		ng_ref_layernorm_bwd(s->dres, tensor_(m, G, NG_P_LN1W, l),
				     tensor_(m, G, NG_P_LN1B, l), s->dln, res,
				     tensor_(m, P, NG_P_LN1W, l), a->ln1_mean + (size_t)l * N,
				     a->ln1_rstd + (size_t)l * N, N, C);
		/* s->dres now holds d(res), the previous layer's output */
	}
	ng_ref_encoder_bwd(tensor_(m, G, NG_P_WTE, 0), tensor_(m, G, NG_P_WPE, 0), s->dres,
			   m->inputs, B, T, C);
	return NG_OK;
}

double ng_cpu_grad_norm(const struct ng_cpu_model *m)
{
	double ss = 0.0;
	for (size_t i = 0; i < m->lay.total; i++)
		ss += m->grads[i] * m->grads[i];
	return sqrt(ss);
}

double ng_cpu_adamw_step(struct ng_cpu_model *m, double lr, double beta1, double beta2, double eps,
			 double wd, double clip)
{
	double norm = ng_cpu_grad_norm(m);
	double scale = clip > 0.0 && norm > clip ? clip / norm : 1.0;
	m->step += 1;
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &m->lay.p[i];
		ng_ref_adamw(m->params + p->offset, m->m + p->offset, m->v + p->offset,
			     m->grads + p->offset, p->numel, lr, beta1, beta2, eps,
			     p->decay ? wd : 0.0, scale, m->step);
	}
	return norm;
}
