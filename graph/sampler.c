/*
 * graph/sampler.c — KV-cache generation (see sampler.h): one decode step as a list of
 * kernels/decode.h launches, captured once and replayed per token. The speedrun model's step
 * is graph/sampler_spr.c's; allocation, capture and the generation loop serve both families.
 */
#include "graph/sampler.h"

#include <stdlib.h>
#include <string.h>

#include "graph/step_spr.h"
#include "kernels/check.h"
#include "kernels/decode.h"
#include "kernels/split.h"

/* bf16 pointer of parameter `id` of layer `layer`. */
static const ng_bf16 *wp(const struct ng_sampler *s, int id, int layer)
{
	const struct ng_param_spec *p = &s->lay.p[id];
	size_t per = p->per_layer ? p->numel / p->shape[0] : 0;
	return s->w + p->offset + (size_t)(layer > 0 ? layer : 0) * per;
}

/* The launches of one decode step (the body of the captured graph). */
static enum ng_status enqueue_step(struct ng_sampler *s)
{
	const struct ng_gpt_config *m = &s->cfg.model;
	if (m->arch == NG_ARCH_SPEEDRUN)
		return ng_sampler_spr_enqueue_(s);
	int C = m->C, T = m->T, D = C / m->H;
	cudaStream_t st = s->stream;
	enum ng_status r = ng_decode_embed(s->x, wp(s, NG_P_WTE, 0), wp(s, NG_P_WPE, 0), s->tokens,
					   s->pos, C, st);
	for (int l = 0; l < m->L && !r; l++) {
		float *kc = s->kcache + (size_t)l * T * C, *vc = s->vcache + (size_t)l * T * C;
		r = ng_decode_layernorm(s->ln, s->x, wp(s, NG_P_LN1W, l), wp(s, NG_P_LN1B, l), C, st);
		if (!r)
			r = ng_decode_gemv(s->qkv, wp(s, NG_P_QKVW, l), wp(s, NG_P_QKVB, l), s->ln, C,
					   3 * C, NG_DECODE_ACT_NONE, 0, st);
		if (!r)
			r = ng_decode_attention(s->att, kc, vc, s->qkv, s->pos, m->H, D, T, st);
		if (!r)
			r = ng_decode_gemv(s->x, wp(s, NG_P_ATTPROJW, l), wp(s, NG_P_ATTPROJB, l),
					   s->att, C, C, NG_DECODE_ACT_NONE, 1, st);
		if (!r)
			r = ng_decode_layernorm(s->ln, s->x, wp(s, NG_P_LN2W, l), wp(s, NG_P_LN2B, l),
						C, st);
		if (!r)
			r = ng_decode_gemv(s->fc, wp(s, NG_P_FCW, l), wp(s, NG_P_FCB, l), s->ln, C,
					   4 * C, NG_DECODE_ACT_GELU, 0, st);
		if (!r)
			r = ng_decode_gemv(s->x, wp(s, NG_P_FCPROJW, l), wp(s, NG_P_FCPROJB, l), s->fc,
					   4 * C, C, NG_DECODE_ACT_NONE, 1, st);
	}
	if (!r)
		r = ng_decode_layernorm(s->ln, s->x, wp(s, NG_P_LNFW, 0), wp(s, NG_P_LNFB, 0), C, st);
	if (!r)
		r = ng_decode_gemv(s->logits, wp(s, NG_P_WTE, 0), NULL, s->ln, C, m->Vp,
				   NG_DECODE_ACT_NONE, 0, st);
	if (!r)
		r = ng_decode_sample(s->tokens, s->pos, s->n_prompt, s->logits, m->V, s->cfg.top_k,
				     s->cfg.temperature, s->cfg.seed, st);
	return r;
}

/* The flat range xlambda .. skipw of the speedrun model's scalars: first element and count (0
 * for GPT-2, which has none). */
static size_t scalar_range(const struct ng_sampler *s, size_t *first)
{
	const struct ng_param_spec *a = &s->lay.p[NG_P_XLAMBDA], *b = &s->lay.p[NG_P_SKIPW];
	*first = a->offset;
	return ng_param_present(a) ? b->offset + b->numel - a->offset : 0;
}

/* One device allocation carved into the buffers, each 256-byte aligned (the speedrun model's
 * buffers take no space in a GPT-2 sampler). */
static enum ng_status alloc_all(struct ng_sampler *s)
{
	const struct ng_gpt_config *m = &s->cfg.model;
	bool spr = m->arch == NG_ARCH_SPEEDRUN;
	size_t C = (size_t)m->C, first;
	size_t cache = (size_t)(spr ? m->L - 1 : m->L) * m->T * C;
	size_t sizes[] = { s->lay.total * sizeof(ng_bf16), C * 4, C * 4, 3 * C * 4, C * 4,
			   4 * C * 4, (size_t)m->Vp * 4, cache * 4, cache * 4,
			   ((size_t)m->T + 1) * 4, 4, 4, spr ? C * 4 : 0,
			   spr ? (size_t)(m->L / 2) * C * 4 : 0, scalar_range(s, &first) * 4,
			   spr ? 4 : 0 };
	void **dst[] = { (void **)&s->w, (void **)&s->x, (void **)&s->ln, (void **)&s->qkv,
			 (void **)&s->att, (void **)&s->fc, (void **)&s->logits,
			 (void **)&s->kcache, (void **)&s->vcache, (void **)&s->tokens,
			 (void **)&s->pos, (void **)&s->n_prompt, (void **)&s->x0,
			 (void **)&s->skip, (void **)&s->scalars, (void **)&s->doc_start };
	int n = (int)(sizeof(sizes) / sizeof(sizes[0]));
	size_t total = 0;
	for (int i = 0; i < n; i++)
		total += (sizes[i] + 255) / 256 * 256;
	char *base;
	if (NG_CUDA_CHECK(cudaMalloc((void **)&base, total)))
		return NG_ERR_RUNTIME;
	for (int i = 0; i < n; i++) {
		*dst[i] = base;
		base += (sizes[i] + 255) / 256 * 256;
	}
	return NG_CUDA_CHECK(cudaMemset(s->w, 0, total));
}

enum ng_status ng_sampler_init(struct ng_sampler *s, const struct ng_sampler_config *cfg,
			       const float *params)
{
	memset(s, 0, sizeof(*s));
	s->cfg = *cfg;
	s->inited = true;
	enum ng_status st = ng_gpt_check(&s->cfg.model);
	if (st)
		return st;
	if (cfg->top_k < 0 || cfg->top_k > NG_DECODE_MAX_TOP_K)
		return ng_fail(NG_ERR_INPUT, "sample --top-k %d: must be 0 (all) .. %d", cfg->top_k,
			       NG_DECODE_MAX_TOP_K);
	if (cfg->window < 0)
		return ng_fail(NG_ERR_INPUT, "sample: window %d must be >= 0 (0: the widest)",
			       cfg->window);
	s->window = cfg->window > 0 ? cfg->window : ng_spr_window_blocks(1, 1);
	ng_gpt_layout(&s->cfg.model, &s->lay);
	if (NG_CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking)))
		return NG_ERR_RUNTIME;
	st = alloc_all(s);
	if (st)
		return st;
	/* the bf16 copy as training keeps it: the high half of the split master (kernels/split.h,
	 * ties away from zero), so sampling reads the very weights the last step read */
	size_t n = s->lay.total;
	ng_bf16 *hi = malloc(n * sizeof(ng_bf16));
	if (!hi)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for %zu parameters", n);
#pragma omp parallel for schedule(static)
	for (long long i = 0; i < (long long)n; i++) {
		uint16_t lo;
		ng_split_encode(params[i], &hi[i], &lo);
	}
	/* on the (non-blocking) stream: a pageable cudaMemcpy may return before its DMA lands */
	st = NG_CUDA_CHECK(cudaMemcpyAsync(s->w, hi, n * sizeof(ng_bf16), cudaMemcpyHostToDevice,
					   s->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(s->stream));
	free(hi);
	size_t first, ns = scalar_range(s, &first);
	if (!st && ns) /* the speedrun model's scalars in fp32, as the training step reads them */
		st = NG_CUDA_CHECK(cudaMemcpy(s->scalars, params + first, ns * sizeof(float),
					      cudaMemcpyHostToDevice));
	if (st || cfg->no_graph)
		return st;
	/* capture with the global mode: a forbidden call (sync, malloc) inside fails loudly */
	if (NG_CUDA_CHECK(cudaStreamBeginCapture(s->stream, cudaStreamCaptureModeGlobal)))
		return NG_ERR_RUNTIME;
	st = enqueue_step(s);
	cudaGraph_t g = NULL;
	cudaError_t ce = cudaStreamEndCapture(s->stream, &g);
	if (st) {
		if (g)
			cudaGraphDestroy(g);
		return st;
	}
	if (NG_CUDA_CHECK(ce))
		return NG_ERR_RUNTIME;
	s->graph = g;
	return NG_CUDA_CHECK(cudaGraphInstantiate(&s->exec, g, 0));
}

void ng_sampler_free(struct ng_sampler *s)
{
	if (!s->inited)
		return;
	if (s->stream)
		cudaStreamSynchronize(s->stream);
	if (s->exec)
		cudaGraphExecDestroy(s->exec);
	if (s->graph)
		cudaGraphDestroy(s->graph);
	cudaFree(s->w); /* the base of the one allocation */
	if (s->stream)
		cudaStreamDestroy(s->stream);
	s->inited = false;
}

/* Launch decode steps [*i, end) and, with `logits`, copy each step's row after it. */
static enum ng_status run_steps(struct ng_sampler *s, int *i, int end, float *logits)
{
	const struct ng_gpt_config *m = &s->cfg.model;
	enum ng_status st = NG_OK;
	for (; *i < end && !st; (*i)++) {
		st = s->cfg.no_graph ? enqueue_step(s)
				     : NG_CUDA_CHECK(cudaGraphLaunch(s->exec, s->stream));
		if (!st && logits)
			st = NG_CUDA_CHECK(cudaMemcpyAsync(logits + (size_t)*i * m->V, s->logits,
							   (size_t)m->V * sizeof(float),
							   cudaMemcpyDeviceToHost, s->stream));
	}
	return st;
}

enum ng_status ng_sampler_generate(struct ng_sampler *s, const int32_t *prompt, int n_prompt,
				   int n_new, int32_t *out, int *n_out, double *seconds,
				   float *logits)
{
	const struct ng_gpt_config *m = &s->cfg.model;
	if (n_prompt < 1 || n_new < 0 || n_prompt + n_new > m->T) {
		ng_fail(NG_ERR_INPUT, "sample: %d prompt tokens + %d new tokens exceed the context "
			"of %d positions (or the prompt is empty)", n_prompt, n_new, m->T);
		ng_hint("use fewer --tokens or a shorter --prompt");
		return NG_ERR_INPUT;
	}
	for (int i = 0; i < n_prompt; i++)
		if (prompt[i] < 0 || prompt[i] >= m->V)
			return ng_fail(NG_ERR_INPUT, "sample: prompt token %d = %d is outside the "
				       "vocabulary of %d", i, prompt[i], m->V);
	int zero = 0;
	int steps = n_prompt + (n_new > 0 ? n_new : 1) - 1;
	bool stop = s->cfg.stop_at_eot && m->V > NG_SAMPLER_EOT && n_new > 0;
	int done = n_new;
	cudaEvent_t e0, e1;
	enum ng_status st = NG_CUDA_CHECK(cudaMemcpyAsync(s->tokens, prompt,
							  n_prompt * sizeof(int32_t),
							  cudaMemcpyHostToDevice, s->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpyAsync(s->pos, &zero, sizeof(int),
						   cudaMemcpyHostToDevice, s->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaMemcpyAsync(s->n_prompt, &n_prompt, sizeof(int),
						   cudaMemcpyHostToDevice, s->stream));
	if (!st) /* the locals above stay alive; wait so the copies are done either way */
		st = NG_CUDA_CHECK(cudaStreamSynchronize(s->stream));
	if (st || NG_CUDA_CHECK(cudaEventCreate(&e0)))
		return NG_ERR_RUNTIME;
	if (NG_CUDA_CHECK(cudaEventCreate(&e1))) {
		cudaEventDestroy(e0);
		return NG_ERR_RUNTIME;
	}
	st = NG_CUDA_CHECK(cudaEventRecord(e0, s->stream));
	int i = 0;
	if (!st && stop) { /* the prompt in one go, then chunks with an end-of-text check after each */
		st = run_steps(s, &i, n_prompt - 1, logits);
		while (!st && i < steps) {
			int from = i - (n_prompt - 1); /* tokens sampled before this chunk */
			int end = i + NG_SAMPLER_CHUNK < steps ? i + NG_SAMPLER_CHUNK : steps;
			st = run_steps(s, &i, end, logits);
			int got = i - (n_prompt - 1);
			if (!st)
				st = NG_CUDA_CHECK(cudaMemcpyAsync(out + from,
								   s->tokens + n_prompt + from,
								   (size_t)(got - from) * sizeof(int32_t),
								   cudaMemcpyDeviceToHost, s->stream));
			if (!st)
				st = NG_CUDA_CHECK(cudaStreamSynchronize(s->stream));
			for (int k = from; k < got && !st && done == n_new; k++)
				if (out[k] == NG_SAMPLER_EOT)
					done = k;
			if (done < n_new)
				break;
		}
	} else if (!st) {
		st = run_steps(s, &i, steps, logits);
	}
	if (!st)
		st = NG_CUDA_CHECK(cudaEventRecord(e1, s->stream));
	if (!st)
		st = NG_CUDA_CHECK(cudaStreamSynchronize(s->stream));
	float ms = 0;
	if (!st)
		st = NG_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
	cudaEventDestroy(e0);
	cudaEventDestroy(e1);
	if (seconds)
		*seconds = ms * 1e-3;
	if (!st && n_new > 0 && !stop)
		st = NG_CUDA_CHECK(cudaMemcpy(out, s->tokens + n_prompt, n_new * sizeof(int32_t),
					      cudaMemcpyDeviceToHost));
	if (n_out)
		*n_out = done;
	return st;
}

enum ng_status ng_sampler_logits(struct ng_sampler *s, float *host)
{
	if (NG_CUDA_CHECK(cudaStreamSynchronize(s->stream)))
		return NG_ERR_RUNTIME;
	return NG_CUDA_CHECK(cudaMemcpy(host, s->logits, (size_t)s->cfg.model.Vp * sizeof(float),
					cudaMemcpyDeviceToHost));
}
