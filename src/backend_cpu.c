/*
 * src/backend_cpu.c — the training backend on the double-precision CPU reference
 * (graph/cpu_ref.h): same loop, schedule, logging as the GPU path, synchronous. For tiny models
 * and for checking the GPU path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_muon.h"
#include "graph/cpu_ops.h"
#include "graph/cpu_ref.h"
#include "src/train.h"

struct cpu_ctx {
	struct ng_cpu_model m;
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

static enum ng_status cpu_submit(void *ctx)
{
	struct cpu_ctx *c = ctx;
	const struct ng_train_opts *o = c->o;
	const struct ng_shape *s = &o->shape;
	size_t window = (size_t)s->B * (s->T + 1);
	double loss = 0;
	enum ng_status st;
	ng_cpu_zero_grad(&c->m);
	for (int k = 0; k < s->K; k++) {
		double l;
		split(c, c->buf + k * window);
		st = ng_cpu_forward(&c->m, c->inputs, c->targets, &l);
		if (!st)
			st = ng_cpu_backward(&c->m, 1.0 / s->K);
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

static enum ng_status cpu_evaluate(void *ctx, const uint16_t *tokens, int n, double *loss)
{
	struct cpu_ctx *c = ctx;
	size_t window = (size_t)c->o->shape.B * (c->o->shape.T + 1);
	double sum = 0;
	for (int i = 0; i < n; i++) {
		double l;
		split(c, tokens + i * window);
		enum ng_status st = ng_cpu_forward(&c->m, c->inputs, c->targets, &l);
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
	ng_cpu_model_free(&c->m);
	free(c->buf);
	free(c->inputs);
	free(c->targets);
	free(c);
}

enum ng_status ng_backend_cpu_init(struct ng_backend *be, const struct ng_train_opts *o)
{
	const struct ng_shape *s = &o->shape;
	if (s->model.arch == NG_ARCH_SPEEDRUN) {
		ng_fail(NG_ERR_INPUT, "train --device cpu: the CPU backend trains the GPT-2 family; "
			"the speedrun model's double-precision reference is the oracle of its tests");
		ng_hint("train the speedrun model on a GPU (--device cuda), or a GPT-2 preset here");
		return NG_ERR_INPUT;
	}
	struct cpu_ctx *c = calloc(1, sizeof(*c));
	if (!c)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	c->o = o;
	enum ng_status st = ng_cpu_model_init(&c->m, &s->model, s->B, s->T, (uint64_t)o->seed);
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
