/*
 * tests/test_cpu_spr.c — the speedrun model's CPU reference (graph/cpu_spr.c) checked as a
 * whole, on the speedrun-tiny preset (L = 6, H = 2, C = 64, D = 32, Vp = 512):
 *   - the loss at init is B T ln(Vp) (the zero head makes every capped logit 15), and only the
 *     head gets a gradient there; the loss covers all Vp columns (also with V < Vp);
 *   - the gradient of every tensor against fourth-order central finite differences of the loss
 *     (samples in every slice), with the zero-initialised tensors (attprojw, fcprojw, headw) and
 *     the scalars randomised so every path carries signal, two document starts in the batch:
 *     B = 2, T = 24 (windows longer than T), B = 1, T = 300 at windows 1 and 3 (128 and 384
 *     tokens, so the window cuts the long-window blocks at W = 1 only), and L = 8 (a block
 *     with attention but no value embedding);
 *   - the FP8 head: logits and gradients against a direct evaluation of its definition;
 *   - bad input (token, window, backward without targets) is a returned status.
 * The FD runs on the mean loss (~7), each stencil free of relu^2 kinks (fd_element_), relative
 * error 1e-6 (FD_TOL). Fresh random values each run; the seed is in every message.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/cpu_ops.h"
#include "graph/cpu_spr.h"
#include "graph/cpu_spr_ops.h"
#include "tests/ref_testing.h"

static struct ng_gpt_config tiny_cfg_(void)
{
	struct ng_gpt_config c;
	cr_assert(ng_gpt_preset(&c, "speedrun-tiny") == NG_OK);
	return c;
}

static void random_tokens_(int32_t *tok, size_t n, int V)
{
	for (size_t i = 0; i < n; i++)
		tok[i] = (int32_t)ng_rng_below(&rng_, (uint64_t)V - 1); /* never bos = V - 1 */
}

/* ng_cpu_spr_randomize from the test's random stream. */
static void randomize_(struct ng_cpu_spr_model *m)
{
	ng_cpu_spr_randomize(m, ng_rng_u64(&rng_));
}

struct loss_ctx {
	struct ng_cpu_spr_model *m;
	const int32_t *inp, *tgt;
	int window;
	const unsigned char *sign; /* (L, N, 4C) fch > 0 at the unperturbed parameters, or NULL */
	int crossed;               /* a forward since the last reset saw another sign */
};

/* The mean loss (the sum over B T tokens, divided by B T): FD then works on a value of ~7. It
 * notes whether any relu^2 input changed sign against c->sign. */
static double loss_f_(void *p)
{
	struct loss_ctx *c = p;
	struct ng_cpu_spr_model *m = c->m;
	double sum = 0.0;
	enum ng_status st = ng_cpu_spr_forward(m, c->inp, c->tgt, c->window, &sum);
	cr_assert(st == NG_OK, "forward failed: %s", ng_error_message());
	size_t n = (size_t)m->cfg.L * m->B * m->T * 4 * m->cfg.C;
	for (size_t i = 0; c->sign && i < n; i++)
		if ((m->a.fch[i] > 0.0) != c->sign[i])
			c->crossed = 1;
	return sum / ((double)m->B * m->T);
}

/* The FD of the loss in this model. relu^2 is only C^1: where a unit's kink falls inside the
 * stencil's +-2h the stencil is not the smooth fourth-order one, and its error is O(h) (up to
 * 2e-5 relative measured at h = 1e-3, when a scalar such as xlambda moves every unit after it).
 * So each element starts at h = 2.5e-4 and takes h / 4 while a forward of its stencil sees a
 * relu^2 input change sign (a kink crossed), at most FD_TRIES times (down to h ~ 1e-6); an
 * element whose stencils all cross one is counted and left out (at most a quarter may be). On
 * a smooth stencil the error is truncation (h^4, negligible) plus the rounding of the mean loss
 * (a few ulps of ~7, ~6e-15) times 18 / (12 h): gradients below floor(h) = 1e-7 / h are held to
 * the absolute FD_TOL floor(h) = 1e-13 / h, ten times that noise, the others to FD_TOL
 * relative. */
#define FD_TRIES 5

/* FD of element i (into params) by the rule above; returns 0 when every stencil crossed a kink,
 * else 1 with *res its result. */
static int fd_element_(struct ng_ref_fd_result *res, struct loss_ctx *c, size_t i)
{
	double h = 2.5e-4;
	for (int k = 0; k < FD_TRIES; k++, h /= 4) {
		c->crossed = 0;
		ng_ref_fd_compare(res, loss_f_, c, c->m->params, c->m->grads, &i, 1, h, 1e-7 / h);
		if (!c->crossed)
			return 1;
	}
	return 0;
}

/* Check random elements of every present tensor: one in every slice (dim 0) when all_slices;
 * else one in every slice of qkvw (the windowed attention of each block), one in a random slice
 * of the other matrices and tables, and none of the scalars: a scalar moves every unit after it,
 * and at N = 300 (460k relu^2 units) its stencils cross kinks at any usable h. For wte and ve
 * the rows are drawn from the input tokens (other rows have exactly zero gradient, checked
 * separately). */
static void fd_every_tensor_(struct ng_cpu_spr_model *m, struct loss_ctx *c, int all_slices,
			     const char *what)
{
	int C = m->cfg.C, N = m->B * m->T, checked = 0, kinked = 0;
	for (int id = 0; id < NG_P_COUNT; id++) {
		const struct ng_param_spec *p = &m->lay.p[id];
		int scalar = id == NG_P_XLAMBDA || id == NG_P_VLAMBDA || id == NG_P_SKIPW;
		if (!ng_param_present(p) || (scalar && !all_slices))
			continue;
		/* slices: the blocks of a per-block tensor, the tables of ve; wte, headw and skipw
		 * are one slice each, sampled twice */
		int sliced = p->per_layer || id == NG_P_VE;
		size_t slices = sliced ? p->shape[0] : 1, per_slice = p->numel / slices;
		int by_row = id == NG_P_WTE || id == NG_P_VE;
		size_t first = 0, count = slices;
		if (!all_slices && id != NG_P_QKVW) {
			first = ng_rng_below(&rng_, slices);
			count = 1;
		}
		double worst = 0.0;
		for (size_t k = 0; k < (all_slices && !sliced ? 2 : 1) * count; k++) {
			size_t sl = first + k % count, e;
			if (by_row) {
				int32_t tok = c->inp[ng_rng_below(&rng_, (uint64_t)N)];
				size_t table = id == NG_P_VE ? sl * per_slice : 0;
				e = table + (size_t)tok * C + ng_rng_below(&rng_, (uint64_t)C);
			} else {
				e = sl * per_slice + ng_rng_below(&rng_, per_slice);
			}
			struct ng_ref_fd_result r;
			if (!fd_element_(&r, c, p->offset + e)) {
				kinked++;
				cr_log_info("%s %s[%zu]: every stencil crosses a relu^2 kink, left "
					    "out", what, p->name, e);
				continue;
			}
			checked++;
			worst = fmax(worst, r.max_rel);
			cr_expect(r.max_rel <= FD_TOL, "%s %s[%zu]: rel err %.3g > %.1g (analytic "
				  "%.12g, numeric %.12g), seed %llu", what, p->name, e, r.max_rel,
				  FD_TOL, r.analytic, r.numeric, (unsigned long long)seed_);
		}
		cr_log_info("%s %s: max rel err %.3g (seed %llu)", what, p->name, worst,
			    (unsigned long long)seed_);
	}
	cr_log_info("%s: %d elements checked, %d left out at kinks", what, checked, kinked);
	cr_expect(kinked * 4 <= checked + kinked, "%s: %d of %d elements left out at kinks (seed "
		  "%llu)", what, kinked, checked + kinked, (unsigned long long)seed_);
}

/* Two documents start inside the batch: bos (V - 1) at the given positions. */
static void fd_case_(int L, int B, int T, const int *windows, int nw, const size_t *bos_at,
		     int nbos, int all_slices)
{
	struct ng_gpt_config cfg = tiny_cfg_();
	cfg.L = L;
	struct ng_cpu_spr_model m;
	cr_assert(ng_cpu_spr_init(&m, &cfg, B, T, seed_) == NG_OK, "%s", ng_error_message());
	size_t N = (size_t)B * T;
	size_t nf = (size_t)cfg.L * N * 4 * cfg.C;
	int32_t *inp = malloc(N * sizeof(int32_t)), *tgt = malloc(N * sizeof(int32_t));
	unsigned char *sign = malloc(nf);
	cr_assert(inp && tgt && sign);
	random_tokens_(inp, N, cfg.V);
	random_tokens_(tgt, N, cfg.V);
	for (int i = 0; i < nbos; i++)
		inp[bos_at[i]] = m.bos;
	randomize_(&m);
	double prev = NAN;
	for (int w = 0; w < nw; w++) {
		struct loss_ctx c = { &m, inp, tgt, windows[w], NULL, 0 };
		double loss = 0.0;
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		cr_assert(ng_cpu_spr_forward(&m, inp, tgt, windows[w], &loss) == NG_OK);
		ng_cpu_spr_zero_grad(&m);
		cr_assert(ng_cpu_spr_backward(&m, 1.0 / (double)N) == NG_OK);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		cr_log_info("B=%d T=%d window %d: mean loss %.6f, forward + backward %.3f s", B, T,
			    windows[w], loss / N, (double)(t1.tv_sec - t0.tv_sec) +
			    1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
		/* a window that cuts changes the loss: each window here is another mask */
		cr_expect(w == 0 || loss != prev, "windows %d and %d give one loss %.17g",
			  windows[w > 0 ? w - 1 : 0], windows[w], loss);
		prev = loss;
		/* a table row no input token uses gets exactly nothing */
		int used[1024] = { 0 };
		for (size_t i = 0; i < N; i++)
			used[inp[i]] = 1;
		for (int v = 0; v < cfg.Vp; v++) {
			if (used[v])
				continue;
			const double *g = m.grads + m.lay.p[NG_P_WTE].offset + (size_t)v * cfg.C;
			for (int k = 0; k < cfg.C; k++)
				cr_expect(g[k] == 0.0, "unused wte row %d has a gradient", v);
			break;
		}
		for (int l = 0; l < cfg.L; l++) {
			int slot = ng_spr_attn_slot(&cfg, l);
			const double *dvl = m.grads + m.lay.p[NG_P_VLAMBDA].offset;
			if (slot >= 0 && ng_spr_ve(&cfg, l) < 0)
				cr_expect(dvl[2 * slot + 1] == 0.0, "block %d has no value "
					  "embedding, but its a1 has a gradient", l);
		}
		for (size_t i = 0; i < nf; i++)
			sign[i] = m.a.fch[i] > 0.0;
		c.sign = sign;
		char what[64];
		snprintf(what, sizeof(what), "B=%d T=%d W=%d", B, T, windows[w]);
		fd_every_tensor_(&m, &c, all_slices, what);
	}
	free(inp);
	free(tgt);
	free(sign);
	ng_cpu_spr_free(&m);
}

Test(cpu_spr, finite_differences_short, .init = setup_, .timeout = 300)
{
	/* T < 128: every window covers the whole sequence; documents start at t = 13 of sequence
	 * 0 and t = 9 of sequence 1 */
	const int w[1] = { 1 };
	const size_t bos[2] = { 13, 24 + 9 };
	fd_case_(6, 2, 24, w, 1, bos, 2, 1);
}

Test(cpu_spr, finite_differences_block_without_value_embedding, .init = setup_, .timeout = 300)
{
	/* L = 8: block 4 has no attention, and block 3 has attention without a value embedding
	 * (v = a0 v: its a1 gets exactly no gradient) */
	const int w[1] = { 1 };
	const size_t bos[2] = { 5, 11 };
	fd_case_(8, 1, 16, w, 1, bos, 2, 1);
}

Test(cpu_spr, finite_differences_windows, .init = setup_, .timeout = 300)
{
	/* T = 300: W = 1 gives every block 128 tokens, W = 3 the long-window blocks 384 (all of
	 * the sequence) and the others 128; documents start at t = 20 and t = 290, so the middle
	 * one (270 tokens) is longer than the windows */
	const int w[2] = { 1, 3 };
	const size_t bos[2] = { 20, 290 };
	fd_case_(6, 1, 300, w, 2, bos, 2, 0);
}

Test(cpu_spr, block_windows)
{
	struct ng_gpt_config cfg;
	cr_assert(ng_gpt_preset(&cfg, "speedrun") == NG_OK);
	/* blocks 0, 4, 11 are long; W = 1 gives everyone one block of 128, W = 14 gives 1792 and
	 * 896 tokens, W = 3 gives 384 and 128 (floor(3 / 2) = 1) */
	for (int l = 0; l < 12; l++) {
		int lng = l == 0 || l == 4 || l == 11;
		cr_expect(ng_cpu_spr_block_window(&cfg, l, 1) == 128, "block %d W 1", l);
		cr_expect(ng_cpu_spr_block_window(&cfg, l, 14) == (lng ? 1792 : 896),
			  "block %d W 14", l);
		cr_expect(ng_cpu_spr_block_window(&cfg, l, 3) == (lng ? 384 : 128), "block %d W 3",
			  l);
	}
}

Test(cpu_spr, loss_at_init, .init = setup_)
{
	/* speedrun-tiny (V = Vp = 512), then a vocabulary of 300 padded to Vp = 384: the loss is
	 * over all Vp columns either way */
	for (int k = 0; k < 2; k++) {
		struct ng_gpt_config cfg = tiny_cfg_();
		if (k == 1)
			cfg.V = 300;
		int B = 2, T = 24, N = B * T;
		struct ng_cpu_spr_model m;
		cr_assert(ng_cpu_spr_init(&m, &cfg, B, T, seed_) == NG_OK, "%s",
			  ng_error_message());
		int32_t inp[48], tgt[48];
		random_tokens_(inp, N, cfg.V);
		random_tokens_(tgt, N, cfg.V);
		inp[5] = m.bos;
		for (int fp8 = 0; fp8 < 2; fp8++) {
			m.head_fp8 = fp8;
			double loss = 0.0;
			cr_assert(ng_cpu_spr_forward(&m, inp, tgt, 1, &loss) == NG_OK);
			double want = N * log((double)m.cfg.Vp);
			cr_expect(fabs(loss - want) <= 1e-13 * want, "V %d fp8 %d: loss %.17g want "
				  "%.17g (seed %llu)", cfg.V, fp8, loss, want,
				  (unsigned long long)seed_);
			ng_cpu_spr_zero_grad(&m);
			cr_assert(ng_cpu_spr_backward(&m, 1.0) == NG_OK);
			/* a zero head passes nothing down: only headw gets a gradient, every row */
			const struct ng_param_spec *hw = &m.lay.p[NG_P_HEADW];
			for (int id = 0; id < NG_P_COUNT; id++) {
				const struct ng_param_spec *p = &m.lay.p[id];
				double ss = 0.0;
				for (size_t j = 0; j < p->numel; j++)
					ss += m.grads[p->offset + j] * m.grads[p->offset + j];
				if (id != NG_P_HEADW)
					cr_expect(ss == 0.0, "%s has a gradient at init", p->name);
			}
			size_t last = hw->offset + (size_t)(m.cfg.Vp - 1) * m.cfg.C;
			double row = 0.0;
			for (int c = 0; c < m.cfg.C; c++)
				row += fabs(m.grads[last + c]);
			cr_expect(row > 0.0, "V %d: headw's last row (%d) gets no gradient", cfg.V,
				  m.cfg.Vp - 1);
		}
		ng_cpu_spr_free(&m);
	}
}

Test(cpu_spr, fp8_head_direct, .init = setup_)
{
	struct ng_gpt_config cfg = tiny_cfg_();
	int B = 2, T = 16, N = B * T, C = cfg.C, Vp = cfg.Vp;
	struct ng_cpu_spr_model m;
	cr_assert(ng_cpu_spr_init(&m, &cfg, B, T, seed_) == NG_OK, "%s", ng_error_message());
	randomize_(&m);
	int32_t inp[32], tgt[32];
	random_tokens_(inp, N, cfg.V);
	random_tokens_(tgt, N, cfg.V);
	inp[9] = m.bos;
	double exact = 0.0, loss8 = 0.0, scale = 0.75;
	cr_assert(ng_cpu_spr_forward(&m, inp, tgt, 1, &exact) == NG_OK);
	m.head_fp8 = 1;
	cr_assert(ng_cpu_spr_forward(&m, inp, tgt, 1, &loss8) == NG_OK);
	ng_cpu_spr_zero_grad(&m);
	cr_assert(ng_cpu_spr_backward(&m, scale) == NG_OK);
	/* e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4 per operand): the logits move by a
	 * few percent of their spread, the loss by less; it must move, and not by much */
	double rel = fabs(loss8 - exact) / exact;
	cr_log_info("fp8 head: loss %.9g vs exact %.9g (rel %.3g)", loss8, exact, rel);
	cr_expect(rel > 0.0 && rel < 2e-2, "fp8 head changes the loss by %.3g (%.9g vs %.9g), "
		  "seed %llu", rel, loss8, exact, (unsigned long long)seed_);

	/* direct evaluation from the forward's head input xf and the head weight */
	double xs = sqrt((double)C) / 448.0, ws = 24.0 / 448.0, gs = 1.0 / 448.0;
	const double *xf = m.a.xf, *w = m.params + m.lay.p[NG_P_HEADW].offset;
	double *x8 = malloc((size_t)N * C * sizeof(double)), *w8 = malloc((size_t)Vp * C * 8);
	double *z = malloc((size_t)N * Vp * 8), *dz = malloc((size_t)N * Vp * 8);
	cr_assert(x8 && w8 && z && dz);
	for (size_t i = 0; i < (size_t)N * C; i++)
		x8[i] = ng_ref_round_e4m3(xf[i] / xs);
	for (size_t i = 0; i < (size_t)Vp * C; i++)
		w8[i] = ng_ref_round_e4m3(w[i] / ws);
	double zerr = 0.0, zmax = 0.0;
	for (int n = 0; n < N; n++) {
		for (int v = 0; v < Vp; v++) {
			double acc = 0.0;
			for (int c = 0; c < C; c++)
				acc += x8[n * C + c] * w8[v * C + c];
			z[n * Vp + v] = acc * xs * ws;
			zerr = fmax(zerr, fabs(z[n * Vp + v] - m.a.logits[n * Vp + v]));
			zmax = fmax(zmax, fabs(z[n * Vp + v]));
		}
	}
	cr_expect(zerr <= 1e-13 * zmax, "fp8 logits: max abs err %.3g (max %.3g)", zerr, zmax);
	double l2 = ng_ref_softcap_crossentropy(NULL, dz, z, tgt, N, Vp, 30.0,
						7.5 * sqrt((double)C), scale);
	cr_expect(fabs(l2 - loss8) <= 1e-13 * loss8, "fp8 loss %.17g, direct %.17g", loss8, l2);
	/* g8 = e5m2(dz / gs); dheadw = (g8^T x8) gs xs; dxf = (g8 w8) gs ws */
	double dwerr = 0.0, dwmax = 0.0, dxerr = 0.0, dxmax = 0.0;
	const double *dw = m.grads + m.lay.p[NG_P_HEADW].offset;
	for (int v = 0; v < Vp; v++) {
		for (int c = 0; c < C; c++) {
			double acc = 0.0;
			for (int n = 0; n < N; n++)
				acc += ng_ref_round_e5m2(dz[n * Vp + v] / gs) * x8[n * C + c];
			acc *= gs * xs;
			dwerr = fmax(dwerr, fabs(acc - dw[v * C + c]));
			dwmax = fmax(dwmax, fabs(acc));
		}
	}
	for (int n = 0; n < N; n++) {
		for (int c = 0; c < C; c++) {
			double acc = 0.0;
			for (int v = 0; v < Vp; v++)
				acc += ng_ref_round_e5m2(dz[n * Vp + v] / gs) * w8[v * C + c];
			acc *= gs * ws;
			dxerr = fmax(dxerr, fabs(acc - m.s.dxf[n * C + c]));
			dxmax = fmax(dxmax, fabs(acc));
		}
	}
	cr_expect(dwmax > 0.0 && dwerr <= 1e-13 * dwmax, "fp8 dheadw: max abs err %.3g (max %.3g)",
		  dwerr, dwmax);
	cr_expect(dxmax > 0.0 && dxerr <= 1e-13 * dxmax, "fp8 dxf: max abs err %.3g (max %.3g)",
		  dxerr, dxmax);
	free(x8);
	free(w8);
	free(z);
	free(dz);
	ng_cpu_spr_free(&m);
}

Test(cpu_spr, bad_input_is_a_status, .init = setup_)
{
	struct ng_gpt_config cfg = tiny_cfg_();
	struct ng_cpu_spr_model m;
	cr_assert(ng_cpu_spr_init(&m, &cfg, 1, 8, seed_) == NG_OK);
	int32_t tok[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
	cr_expect(ng_cpu_spr_backward(&m, 1.0) == NG_ERR_INPUT, "backward before any forward");
	cr_expect(ng_cpu_spr_forward(&m, tok, tok, 0, NULL) == NG_ERR_INPUT, "window 0");
	tok[3] = cfg.V;
	cr_expect(ng_cpu_spr_forward(&m, tok, NULL, 1, NULL) == NG_ERR_INPUT, "token V");
	tok[3] = 4;
	cr_expect(ng_cpu_spr_forward(&m, tok, NULL, 1, NULL) == NG_OK);
	cr_expect(ng_cpu_spr_backward(&m, 1.0) == NG_ERR_INPUT, "backward without targets");
	ng_cpu_spr_free(&m);
	struct ng_gpt_config g2;
	cr_assert(ng_gpt_preset(&g2, "tiny") == NG_OK);
	cr_expect(ng_cpu_spr_init(&m, &g2, 1, 8, 1) == NG_ERR_INPUT, "a GPT-2 configuration");
	cr_expect(ng_cpu_spr_init(&m, &cfg, 1, cfg.T + 1, 1) == NG_ERR_INPUT, "T > cfg.T");
}
