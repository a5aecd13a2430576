/*
 * tests/test_cpu_ref.c — the CPU reference GPT-2 (graph/cpu_ref.c) checked as a whole:
 *   - the gradient of every one of the 16 parameter tensors against fourth-order central finite
 *     differences of the loss (a random sample of elements per tensor, in every layer);
 *   - padded vocabulary rows and inter-tensor padding get exactly zero gradient and stay zero;
 *   - the loss at the default initialisation is close to ln(V);
 *   - gradient accumulation: 2 micro-batches of B/2 with scale 1/2 equal one batch of B;
 *   - AdamW steps 1 and 2 against hand-derived values, decay and no-decay tensors, clipping on;
 *   - bad input (token out of range, backward without targets) is a returned status.
 * The FD checks use larger-than-default random parameters (non-zero biases, LN weights != 1) so
 * that every path carries signal. Fresh random values each run; the seed is in every message.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/cpu_ops.h"
#include "graph/cpu_ref.h"
#include "util/rng.h"

#define FD_H 1e-3     /* fourth-order stencil: truncation ~h^4, rounding ~1e-16 |loss| / h */
#define FD_FLOOR 1e-5 /* gradients below this are held to an absolute 1e-11 (true zeros exist) */
#define FD_TOL 1e-6   /* brief: relative error <= 1e-6 per checked element */
#define FD_SAMPLES 12 /* elements checked per tensor per layer */

static uint64_t seed_;
static struct ng_rng rng_;

static void setup_(void)
{
	seed_ = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
	ng_rng_seed(&rng_, seed_);
}

/* The brief's tiny configuration: L=2, H=2, C=16 (D=8), T=8, V=37 -> Vp=128. */
static struct ng_gpt_config tiny_cfg_(void)
{
	struct ng_gpt_config c = { .L = 2, .H = 2, .C = 16, .T = 8, .V = 37, .Vp = 0 };
	return c;
}

/* Fill every real parameter with seeded random values of a useful size; padding stays zero. */
static void randomize_(struct ng_cpu_model *m, uint64_t seed)
{
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	memset(m->params, 0, m->lay.total * sizeof(double));
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &m->lay.p[i];
		size_t n = i == NG_P_WTE ? (size_t)m->cfg.V * m->cfg.C : p->numel;
		int is_lnw = i == NG_P_LN1W || i == NG_P_LN2W || i == NG_P_LNFW;
		double mean = is_lnw ? 1.0 : 0.0, std = p->decay ? 0.25 : 0.2;
		for (size_t j = 0; j < n; j++)
			m->params[p->offset + j] = mean + std * ng_rng_normal(&r);
	}
}

static void random_tokens_(int32_t *tok, size_t n, int V)
{
	for (size_t i = 0; i < n; i++)
		tok[i] = (int32_t)ng_rng_below(&rng_, (uint64_t)V);
}

struct loss_ctx {
	struct ng_cpu_model *m;
	const int32_t *inp, *tgt;
};

static double loss_f_(void *p)
{
	struct loss_ctx *c = p;
	double loss = 0.0;
	enum ng_status st = ng_cpu_forward(c->m, c->inp, c->tgt, &loss);
	cr_assert(st == NG_OK, "forward failed: %s", ng_error_message());
	return loss;
}

Test(cpu_ref, finite_differences_every_tensor, .init = setup_)
{
	struct ng_gpt_config cfg = tiny_cfg_();
	struct ng_cpu_model m;
	int B = 2, T = 8;
	cr_assert(ng_cpu_model_init(&m, &cfg, B, T, seed_) == NG_OK, "%s", ng_error_message());
	randomize_(&m, seed_ + 1);
	int32_t inp[16], tgt[16];
	random_tokens_(inp, 16, cfg.V);
	random_tokens_(tgt, 16, cfg.V);
	struct loss_ctx c = { &m, inp, tgt };
	double loss = 0.0;
	ng_cpu_zero_grad(&m);
	cr_assert(ng_cpu_forward(&m, inp, tgt, &loss) == NG_OK);
	cr_assert(ng_cpu_backward(&m, 1.0) == NG_OK);

	double worst = 0.0, worst_big = 0.0;
	const char *worst_name = "";
	for (int id = 0; id < NG_P_COUNT; id++) {
		const struct ng_param_spec *p = &m.lay.p[id];
		if (!ng_param_present(p))
			continue;
		int layers = p->per_layer ? cfg.L : 1;
		size_t per = p->per_layer ? p->numel / p->shape[0] : p->numel;
		if (id == NG_P_WTE)
			per = (size_t)cfg.V * cfg.C; /* real rows only; padded rows checked below */
		size_t idx[2 * FD_SAMPLES];
		size_t k = 0;
		for (int l = 0; l < layers; l++) {
			for (int s = 0; s < FD_SAMPLES; s++) {
				size_t e = ng_rng_below(&rng_, per);
				if (id == NG_P_WTE && s % 2 == 0) /* half from rows the encoder reads */
					e = (size_t)inp[ng_rng_below(&rng_, 16)] * cfg.C +
					    ng_rng_below(&rng_, cfg.C);
				idx[k++] = p->offset + (size_t)l * per + e;
			}
		}
		struct ng_ref_fd_result r;
		ng_ref_fd_compare(&r, loss_f_, &c, m.params, m.grads, idx, k, FD_H, FD_FLOOR);
		cr_log_info("fd %-8s: %zu elements, max rel err %.3g (%.3g where |grad| >= %.0e), "
			    "max abs err %.3g", p->name, r.count, r.max_rel, r.max_rel_big, FD_FLOOR,
			    r.max_abs);
		if (r.max_rel_big > worst_big)
			worst_big = r.max_rel_big;
		cr_expect(r.max_rel <= FD_TOL,
			  "%s: max rel err %.3g > %.1g, max abs err %.3g, worst element %zu of the "
			  "flat buffer (analytic %.12g, numeric %.12g), seed %llu", p->name,
			  r.max_rel, FD_TOL, r.max_abs, r.worst_index, r.analytic, r.numeric,
			  (unsigned long long)seed_);
		if (r.max_rel > worst) {
			worst = r.max_rel;
			worst_name = p->name;
		}
	}
	cr_log_info("fd worst relative error over all tensors: %.3g (%s); %.3g where |grad| >= "
		    "%.0e; loss %.6f, seed %llu", worst, worst_name, worst_big, FD_FLOOR, loss,
		    (unsigned long long)seed_);

	/* padded wte rows and the alignment gaps between tensors: zero gradient, exactly */
	size_t bad = 0, first = 0, end = 0;
	for (int id = 0; id < NG_P_COUNT; id++) {
		const struct ng_param_spec *p = &m.lay.p[id];
		for (size_t i = end; i < p->offset; i++)
			if (m.grads[i] != 0.0 && !bad++)
				first = i;
		end = p->offset + p->numel;
	}
	for (size_t i = end; i < m.lay.total; i++)
		if (m.grads[i] != 0.0 && !bad++)
			first = i;
	const struct ng_param_spec *wte = &m.lay.p[NG_P_WTE];
	for (size_t i = (size_t)cfg.V * cfg.C; i < wte->numel; i++)
		if (m.grads[wte->offset + i] != 0.0 && !bad++)
			first = wte->offset + i;
	cr_expect(bad == 0, "%zu padding gradients are non-zero, first at %zu (%g)", bad, first,
		  m.grads[first]);
	ng_cpu_model_free(&m);
}

Test(cpu_ref, loss_at_init_is_ln_v, .init = setup_)
{
	struct ng_gpt_config cfg;
	cr_assert(ng_gpt_preset(&cfg, "tiny") == NG_OK);
	struct ng_cpu_model m;
	int B = 4, T = cfg.T;
	cr_assert(ng_cpu_model_init(&m, &cfg, B, T, seed_) == NG_OK, "%s", ng_error_message());
	size_t N = (size_t)B * T;
	int32_t *inp = malloc(N * sizeof(int32_t)), *tgt = malloc(N * sizeof(int32_t));
	random_tokens_(inp, N, cfg.V);
	random_tokens_(tgt, N, cfg.V);
	double loss = 0.0;
	cr_assert(ng_cpu_forward(&m, inp, tgt, &loss) == NG_OK, "%s", ng_error_message());
	double want = log((double)cfg.V);
	cr_log_info("loss at init %.6f, ln(V) %.6f (seed %llu)", loss, want,
		    (unsigned long long)seed_);
	cr_expect(fabs(loss - want) < 0.1, "loss at init %.6f, ln(%d) = %.6f, seed %llu", loss,
		  cfg.V, want, (unsigned long long)seed_);
	/* padded logits are exactly zero (padded wte rows are zero) */
	for (size_t n = 0; n < N; n += 37)
		for (int v = cfg.V; v < cfg.Vp; v++)
			cr_expect(m.a.logits[n * cfg.Vp + v] == 0.0);
	free(inp);
	free(tgt);
	ng_cpu_model_free(&m);
}

Test(cpu_ref, gradient_accumulation_matches_full_batch, .init = setup_)
{
	struct ng_gpt_config cfg = tiny_cfg_();
	int B = 4, T = 8;
	struct ng_cpu_model full, half;
	cr_assert(ng_cpu_model_init(&full, &cfg, B, T, seed_) == NG_OK);
	cr_assert(ng_cpu_model_init(&half, &cfg, B / 2, T, seed_) == NG_OK);
	randomize_(&full, seed_ + 7);
	randomize_(&half, seed_ + 7);
	int32_t inp[32], tgt[32];
	random_tokens_(inp, 32, cfg.V);
	random_tokens_(tgt, 32, cfg.V);
	double lf = 0, l0 = 0, l1 = 0;
	ng_cpu_zero_grad(&full);
	cr_assert(ng_cpu_forward(&full, inp, tgt, &lf) == NG_OK);
	cr_assert(ng_cpu_backward(&full, 1.0) == NG_OK);
	ng_cpu_zero_grad(&half);
	cr_assert(ng_cpu_forward(&half, inp, tgt, &l0) == NG_OK);
	cr_assert(ng_cpu_backward(&half, 0.5) == NG_OK);
	cr_assert(ng_cpu_forward(&half, inp + 16, tgt + 16, &l1) == NG_OK);
	cr_assert(ng_cpu_backward(&half, 0.5) == NG_OK);
	cr_expect(fabs(lf - 0.5 * (l0 + l1)) < 1e-13, "loss %.17g vs mean of micro-batches %.17g",
		  lf, 0.5 * (l0 + l1));
	double max_abs = 0, max_rel = 0;
	size_t worst = 0;
	for (size_t i = 0; i < full.lay.total; i++) {
		double e = fabs(full.grads[i] - half.grads[i]);
		double rel = fabs(full.grads[i]) > 1e-9 ? e / fabs(full.grads[i]) : 0.0;
		if (e > max_abs) {
			max_abs = e;
			worst = i;
		}
		if (rel > max_rel)
			max_rel = rel;
	}
	cr_log_info("accumulation: max abs err %.3g, max rel err %.3g (where |grad| > 1e-9)",
		    max_abs, max_rel);
	cr_expect(max_abs <= 1e-12, "grads differ: max abs err %.3g, max rel err %.3g, worst "
		  "index %zu (%.17g vs %.17g), seed %llu", max_abs, max_rel, worst,
		  full.grads[worst], half.grads[worst], (unsigned long long)seed_);
	/* and the optimizer step that follows agrees too */
	ng_cpu_adamw_step(&full, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0);
	ng_cpu_adamw_step(&half, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0);
	double pmax = 0;
	for (size_t i = 0; i < full.lay.total; i++)
		pmax = fmax(pmax, fabs(full.params[i] - half.params[i]));
	cr_expect(pmax <= 1e-9, "params after AdamW differ by %.3g (seed %llu)", pmax,
		  (unsigned long long)seed_);
	ng_cpu_model_free(&full);
	ng_cpu_model_free(&half);
}

/* One checked element: tensor, layer and index inside the layer's slice. */
struct probe { enum ng_param_id id; int layer; size_t e; };

static size_t probe_index_(const struct ng_cpu_model *m, struct probe pr)
{
	const struct ng_param_spec *p = &m->lay.p[pr.id];
	size_t per = p->per_layer ? p->numel / p->shape[0] : p->numel;
	return p->offset + (size_t)pr.layer * per + pr.e;
}

Test(cpu_ref, adamw_two_steps_by_hand, .init = setup_)
{
	struct ng_gpt_config cfg = tiny_cfg_();
	struct ng_cpu_model m;
	cr_assert(ng_cpu_model_init(&m, &cfg, 2, 8, seed_) == NG_OK);
	randomize_(&m, seed_ + 3);
	int32_t inp[16], tgt[16];
	random_tokens_(inp, 16, cfg.V);
	random_tokens_(tgt, 16, cfg.V);
	const double lr = 3e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
	const struct probe probes[] = {
		{ NG_P_WTE, 0, 5 }, { NG_P_QKVW, 1, 100 }, { NG_P_FCPROJW, 0, 17 },
		{ NG_P_LN1B, 1, 3 }, { NG_P_FCB, 0, 40 }, { NG_P_LNFW, 0, 9 },
	};
	enum { NP = sizeof(probes) / sizeof(probes[0]) };
	double p0[NP], g1[NP], g2[NP], p1[NP];
	size_t at[NP];
	for (int k = 0; k < NP; k++)
		at[k] = probe_index_(&m, probes[k]);

	ng_cpu_zero_grad(&m);
	cr_assert(ng_cpu_forward(&m, inp, tgt, NULL) == NG_OK);
	cr_assert(ng_cpu_backward(&m, 1.0) == NG_OK);
	double norm1 = ng_cpu_grad_norm(&m), clip = 0.5 * norm1; /* clipping active: scale 0.5 */
	for (int k = 0; k < NP; k++) {
		p0[k] = m.params[at[k]];
		g1[k] = m.grads[at[k]];
	}
	double got_norm = ng_cpu_adamw_step(&m, lr, b1, b2, eps, wd, clip);
	cr_expect(got_norm == norm1, "adamw returned norm %.17g, grad norm %.17g", got_norm, norm1);
	cr_expect(m.step == 1);
	for (int k = 0; k < NP; k++) {
		double w = m.lay.p[probes[k].id].decay ? wd : 0.0, g = g1[k] * (clip / norm1);
		p1[k] = p0[k] - lr * (g / (fabs(g) + eps) + w * p0[k]);
		cr_expect(fabs(m.params[at[k]] - p1[k]) <= 1e-15 * (1 + fabs(p1[k])),
			  "step 1 %s[%d][%zu]: %.17g want %.17g (seed %llu)",
			  m.lay.p[probes[k].id].name, probes[k].layer, probes[k].e, m.params[at[k]],
			  p1[k], (unsigned long long)seed_);
	}

	ng_cpu_zero_grad(&m);
	cr_assert(ng_cpu_forward(&m, inp, tgt, NULL) == NG_OK);
	cr_assert(ng_cpu_backward(&m, 1.0) == NG_OK);
	double norm2 = ng_cpu_grad_norm(&m);
	double sc2 = norm2 > clip ? clip / norm2 : 1.0, sc1 = clip / norm1;
	for (int k = 0; k < NP; k++)
		g2[k] = m.grads[at[k]];
	ng_cpu_adamw_step(&m, lr, b1, b2, eps, wd, clip);
	for (int k = 0; k < NP; k++) {
		double w = m.lay.p[probes[k].id].decay ? wd : 0.0;
		double a = g1[k] * sc1, b = g2[k] * sc2;
		double mm = b1 * (1 - b1) * a + (1 - b1) * b;
		double vv = b2 * (1 - b2) * a * a + (1 - b2) * b * b;
		double want = p1[k] - lr * ((mm / (1 - b1 * b1)) / (sqrt(vv / (1 - b2 * b2)) + eps) +
					    w * p1[k]);
		cr_expect(fabs(m.params[at[k]] - want) <= 1e-14 * (1 + fabs(want)),
			  "step 2 %s[%d][%zu]: %.17g want %.17g (seed %llu)",
			  m.lay.p[probes[k].id].name, probes[k].layer, probes[k].e, m.params[at[k]],
			  want, (unsigned long long)seed_);
	}
	/* padded wte rows stay zero through the updates */
	const struct ng_param_spec *wte = &m.lay.p[NG_P_WTE];
	for (size_t i = (size_t)cfg.V * cfg.C; i < wte->numel; i++)
		cr_expect(m.params[wte->offset + i] == 0.0, "padded wte element %zu became %g", i,
			  m.params[wte->offset + i]);
	ng_cpu_model_free(&m);
}

Test(cpu_ref, short_sequence_and_bad_input, .init = setup_)
{
	struct ng_gpt_config cfg = tiny_cfg_();
	struct ng_cpu_model m;
	int T = 5; /* shorter than the context: only wpe rows 0..4 are used */
	cr_assert(ng_cpu_model_init(&m, &cfg, 2, T, seed_) == NG_OK);
	int32_t inp[10], tgt[10];
	random_tokens_(inp, 10, cfg.V);
	random_tokens_(tgt, 10, cfg.V);
	ng_clear_error();
	cr_expect(ng_cpu_backward(&m, 1.0) == NG_ERR_INPUT, "backward before forward must fail");
	ng_cpu_zero_grad(&m);
	cr_assert(ng_cpu_forward(&m, inp, tgt, NULL) == NG_OK);
	cr_assert(ng_cpu_backward(&m, 1.0) == NG_OK);
	const struct ng_param_spec *wpe = &m.lay.p[NG_P_WPE];
	double used = 0;
	for (size_t i = 0; i < (size_t)cfg.C * cfg.T; i++) {
		double g = m.grads[wpe->offset + i];
		if (i < (size_t)T * cfg.C)
			used += fabs(g);
		else
			cr_expect(g == 0.0, "wpe row %zu (unused) has gradient %g", i / cfg.C, g);
	}
	cr_expect(used > 0, "wpe rows 0..%d got no gradient", T - 1);
	inp[3] = cfg.V; /* out of range */
	ng_clear_error();
	cr_expect(ng_cpu_forward(&m, inp, tgt, NULL) == NG_ERR_INPUT);
	cr_expect(strstr(ng_error_message(), "inputs[3]") != NULL, "message: %s",
		  ng_error_message());
	inp[3] = 0;
	cr_expect(ng_cpu_forward(&m, inp, NULL, NULL) == NG_OK);
	ng_clear_error();
	cr_expect(ng_cpu_backward(&m, 1.0) == NG_ERR_INPUT, "backward after a no-target forward");
	ng_cpu_model_free(&m);
	struct ng_cpu_model m2;
	ng_clear_error();
	cr_expect(ng_cpu_model_init(&m2, &cfg, 1, cfg.T + 1, seed_) == NG_ERR_INPUT,
		  "T > context must be refused");
}
