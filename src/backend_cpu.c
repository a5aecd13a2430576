/*
 * src/backend_cpu.c — the training backend on the double-precision CPU references: the GPT-2
 * family's (graph/cpu_ref.h) and the speedrun model's (graph/cpu_spr.h). Same loop, schedule,
 * logging as the GPU path, synchronous. For tiny models and for checking the GPU path.
 *
 * The speedrun model runs as the GPU step does (graph/step_spr.h): the window at 0-based step s
 * of S is ng_spr_window_blocks(s, S) blocks, an evaluation the window it is given (a
 * validation after s steps: the window of step s, as the GPU's; 0: the widest), a
 * document starts at token V - 1 (cpu_spr's default), the gradient is that of the loss summed
 * over the step's tokens while the loss reported is their mean. Its optimizer (AdamW or Muon,
 * graph/cpu_muon.h) works on a struct ng_cpu_model that borrows the speedrun model's
 * parameters and gradients and owns the moments, so both families share one update, one
 * state format and one resume.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_muon.h"
#include "graph/cpu_ops.h"
#include "graph/cpu_ref.h"
#include "graph/cpu_spr.h"
#include "graph/step_spr.h"
#include "src/train.h"

struct cpu_ctx {
	struct ng_cpu_model m;      /* GPT-2: the model. Speedrun: the optimizer's view, cfg, lay,
	                             * params and grads borrowed from spr, m and v its own */
	struct ng_cpu_spr_model spr; /* the speedrun model (arch NG_ARCH_SPEEDRUN), else unused */
	bool is_spr;                /* the run's model is the speedrun's */
	const struct ng_train_opts *o;
	uint16_t *buf;              /* K * B * (T+1) tokens of the next step */
	int32_t *inputs, *targets;  /* (B, T) */
	struct ng_step_result pending;
	int have_pending;
	long long step;             /* steps submitted */
};

static enum ng_status cpu_input_buffer(void *ctx, uint16_t **buf)
{
	*buf = ((struct cpu_ctx *)ctx)->buf;
	return NG_OK;
}

static void split(struct cpu_ctx *c, const uint16_t *w)
{
	int B = c->o->shape.B, T = c->o->shape.T;
	for (int b = 0; b < B; b++)
		for (int t = 0; t < T; t++) {
			c->inputs[b * T + t] = w[b * (T + 1) + t];
			c->targets[b * T + t] = w[b * (T + 1) + t + 1];
		}
}

/* The forward of the micro-batch in inputs/targets: its mean loss over the B*T tokens. The
 * speedrun model attends within `window` blocks. */
static enum ng_status forward(struct cpu_ctx *c, int window, double *loss)
{
	if (!c->is_spr)
		return ng_cpu_forward(&c->m, c->inputs, c->targets, loss);
	double sum = 0;
	enum ng_status st = ng_cpu_spr_forward(&c->spr, c->inputs, c->targets, window, &sum);
	*loss = sum / ((double)c->o->shape.B * c->o->shape.T);
	return st;
}

static enum ng_status cpu_submit(void *ctx)
{
	struct cpu_ctx *c = ctx;
	const struct ng_train_opts *o = c->o;
	const struct ng_shape *s = &o->shape;
	size_t window = (size_t)s->B * (s->T + 1);
	int W = ng_spr_window_blocks((int)c->step, (int)o->steps); /* the GPU's: exec_replay.c */
	double loss = 0;
	enum ng_status st;
	ng_cpu_zero_grad(&c->m); /* the speedrun model's gradients too: m borrows them */
	for (int k = 0; k < s->K; k++) {
		double l;
		split(c, c->buf + k * window);
		st = forward(c, W, &l);
		/* GPT-2: the gradient of the step's mean loss; speedrun: of its sum */
		if (!st)
			st = c->is_spr ? ng_cpu_spr_backward(&c->spr, 1.0)
				       : ng_cpu_backward(&c->m, 1.0 / s->K);
		if (st)
			return st;
		loss += l / s->K;
	}
	double lr = ng_ref_lr((int)c->step, (int)o->warmup, (int)o->steps, o->lr, o->lr_final_frac,
			      strcmp(o->schedule, "cosine") == 0);
	if (ng_train_is_muon(o)) /* the lr reported: Muon's */
		lr = o->muon.lr * ng_muon_lr_factor((int)c->step, o->muon.total,
						    o->muon.cooldown_frac, o->muon.final_frac);
	double norm = ng_cpu_grad_norm(&c->m);
	bool skip = !isfinite(norm) || !isfinite(loss);
	if (!skip && ng_train_is_muon(o))
		ng_cpu_muon_step(&c->m, &o->muon, (int)c->step, o->clip);
	else if (!skip)
		ng_cpu_adamw_step(&c->m, lr, o->beta1, o->beta2, o->eps, o->weight_decay, o->clip);
	c->step++;
	c->pending = (struct ng_step_result){ c->step, loss, norm, lr, skip, false, 0 };
	c->have_pending = 1;
	return NG_OK;
}

static enum ng_status cpu_collect(void *ctx, struct ng_step_result *out, int max, bool wait,
				  int *n)
{
	struct cpu_ctx *c = ctx;
	*n = 0;
	if (c->have_pending && max > 0) {
		out[0] = c->pending;
		c->have_pending = 0;
		*n = 1;
	}
	return NG_OK;
}

static enum ng_status cpu_evaluate(void *ctx, const uint16_t *tokens, int n, int window,
				   double *loss)
{
	struct cpu_ctx *c = ctx;
	size_t batch = (size_t)c->o->shape.B * (c->o->shape.T + 1); /* tokens a micro-batch */
	int W = window > 0 ? window : ng_spr_window_blocks(1, 1);
	double sum = 0;
	for (int i = 0; i < n; i++) {
		double l;
		split(c, tokens + i * batch);
		enum ng_status st = forward(c, W, &l);
		if (st)
			return st;
		sum += l;
	}
	*loss = sum / n;
	return NG_OK;
}

static enum ng_status cpu_save_state(void *ctx, struct ng_train_state *s, float **params32)
{
	struct cpu_ctx *c = ctx;
	size_t n = c->m.lay.total;
	*params32 = malloc(n * sizeof(float));
	if (!*params32)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for a checkpoint");
	enum ng_status st = ng_ckpt_state_alloc(s, 8, n);
	if (st) {
		free(*params32);
		*params32 = NULL;
		return st;
	}
	memcpy(s->params, c->m.params, n * sizeof(double));
	memcpy(s->m, c->m.m, n * sizeof(double));
	memcpy(s->v, c->m.v, n * sizeof(double));
	for (size_t i = 0; i < n; i++)
		(*params32)[i] = (float)c->m.params[i];
	s->step = c->step;
	s->n_skipped = c->step - c->m.step;
	return NG_OK;
}

/* dst (n doubles) from a state buffer of 4- or 8-byte elements. */
static void widen(double *dst, const void *src, int elem, size_t n)
{
	if (elem == 8) {
		memcpy(dst, src, n * sizeof(double));
		return;
	}
	for (size_t i = 0; i < n; i++)
		dst[i] = ((const float *)src)[i];
}

static enum ng_status cpu_load_state(void *ctx, const struct ng_train_state *s)
{
	struct cpu_ctx *c = ctx;
	if (s->n != c->m.lay.total)
		return ng_fail(NG_ERR_INPUT, "training state has %zu parameters, the model %zu",
			       s->n, c->m.lay.total);
	widen(c->m.params, s->params, s->elem_size, s->n);
	widen(c->m.m, s->m, s->elem_size, s->n);
	widen(c->m.v, s->v, s->elem_size, s->n);
	c->step = s->step;
	c->m.step = (int)(s->step - s->n_skipped);
	return NG_OK;
}

static void cpu_free(void *ctx)
{
	struct cpu_ctx *c = ctx;
	if (c->is_spr) {
		free(c->m.m);
		free(c->m.v);
		ng_cpu_spr_free(&c->spr);
	} else {
		ng_cpu_model_free(&c->m);
	}
	free(c->buf);
	free(c->inputs);
	free(c->targets);
	free(c);
}

/* The speedrun model for B x T tokens and the optimizer's view of it (see the top). On failure
 * nothing is left to free. */
static enum ng_status speedrun_init(struct cpu_ctx *c, const struct ng_shape *s, uint64_t seed)
{
	enum ng_status st = ng_cpu_spr_init(&c->spr, &s->model, s->B, s->T, seed);
	if (st)
		return st;
	struct ng_cpu_model *m = &c->m;
	memset(m, 0, sizeof(*m));
	m->cfg = c->spr.cfg;
	m->lay = c->spr.lay;
	m->B = s->B;
	m->T = s->T;
	m->params = c->spr.params;
	m->grads = c->spr.grads;
	m->m = calloc(m->lay.total, sizeof(double));
	m->v = calloc(m->lay.total, sizeof(double));
	if (!m->m || !m->v) {
		free(m->m);
		free(m->v);
		ng_cpu_spr_free(&c->spr);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for the optimizer's moments "
			       "(%zu parameters)", m->lay.total);
	}
	return NG_OK;
}

enum ng_status ng_backend_cpu_init(struct ng_backend *be, const struct ng_train_opts *o)
{
	const struct ng_shape *s = &o->shape;
	struct cpu_ctx *c = calloc(1, sizeof(*c));
	if (!c)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	c->o = o;
	c->is_spr = s->model.arch == NG_ARCH_SPEEDRUN;
	enum ng_status st = c->is_spr ? speedrun_init(c, s, (uint64_t)o->seed)
				      : ng_cpu_model_init(&c->m, &s->model, s->B, s->T,
							  (uint64_t)o->seed);
	if (st) {
		free(c);
		return st;
	}
	c->buf = malloc((size_t)s->K * s->B * (s->T + 1) * sizeof(uint16_t));
	c->inputs = malloc((size_t)s->B * s->T * sizeof(int32_t));
	c->targets = malloc((size_t)s->B * s->T * sizeof(int32_t));
	if (!c->buf || !c->inputs || !c->targets) {
		cpu_free(c);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for the CPU batch buffers");
	}
	*be = (struct ng_backend){
		.name = "cpu (double-precision reference)", .ctx = c, .peak_flops = 0,
		.input_buffer = cpu_input_buffer, .submit = cpu_submit, .collect = cpu_collect,
		.evaluate = cpu_evaluate, .save_state = cpu_save_state,
		.load_state = cpu_load_state, .free = cpu_free,
	};
	return NG_OK;
}
