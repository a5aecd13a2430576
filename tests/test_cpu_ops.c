/*
 * tests/test_cpu_ops.c — checks of the double reference ops (graph/cpu_ops.c): every backward
 * against fourth-order central finite differences of its forward, on tiny awkward shapes (C not
 * a power of two, T=1 rows, large-mean inputs), plus a few forward values known in closed form,
 * AdamW against hand-derived values and the learning-rate schedule's corner points.
 *
 * The gradient checks are tests/ref_testing.h's: the scalar f = sum(out * R) for a fixed random
 * R, so dout = R, "+=" outputs pre-filled with random values that are subtracted afterwards.
 * Fresh random inputs each run; the seed is in every message.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/cpu_ops.h"
#include "tests/ref_testing.h"

/* ---- layernorm ---- */
struct ln_ctx { double *out, *mean, *rstd, *inp, *w, *b, *R; int N, C; };
static double ln_f_(void *p)
{
	struct ln_ctx *c = p;
	ng_ref_layernorm_fwd(c->out, c->mean, c->rstd, c->inp, c->w, c->b, c->N, c->C);
	return dot_(c->out, c->R, (size_t)c->N * c->C);
}

Test(cpu_ops, layernorm_bwd_fd, .init = setup_, .fini = release_)
{
	int N = 3, C = 13;
	size_t NC = (size_t)N * C;
	struct ln_ctx c = { keep_(NC * 8), keep_(N * 8), keep_(N * 8), rnd_(NC, 3.0, 1.5),
			    rnd_(C, 1.0, 0.3), rnd_(C, 0.0, 0.3), rnd_(NC, 0.0, 1.0), N, C };
	double *dinp = rnd_(NC, 0, 1), *dw = rnd_(C, 0, 1), *db = rnd_(C, 0, 1);
	double *dinp0 = keep_(NC * 8), *dw0 = keep_(C * 8), *db0 = keep_(C * 8);
	memcpy(dinp0, dinp, NC * 8);
	memcpy(dw0, dw, C * 8);
	memcpy(db0, db, C * 8);
	ln_f_(&c);
	ng_ref_layernorm_bwd(dinp, dw, db, c.R, c.inp, c.w, c.mean, c.rstd, N, C);
	expect_grad_("layernorm dinp", ln_f_, &c, c.inp, dinp, dinp0, NC);
	expect_grad_("layernorm dw", ln_f_, &c, c.w, dw, dw0, C);
	expect_grad_("layernorm db", ln_f_, &c, c.b, db, db0, C);
	/* forward: with w = 1, b = 0 every row has mean 0 and variance var / (var + eps) */
	for (int i = 0; i < C; i++) {
		c.w[i] = 1.0;
		c.b[i] = 0.0;
	}
	ln_f_(&c);
	for (int n = 0; n < N; n++) {
		double mu = 0, var = 0;
		for (int i = 0; i < C; i++)
			mu += c.out[n * C + i] / C;
		for (int i = 0; i < C; i++)
			var += (c.out[n * C + i] - mu) * (c.out[n * C + i] - mu) / C;
		double r2 = c.rstd[n] * c.rstd[n], want = 1.0 - 1e-5 * r2;
		cr_expect(fabs(mu) < 1e-12 && fabs(var - want) < 1e-12,
			  "layernorm row %d: mean %.3g, var %.15g, want %.15g (seed %llu)", n, mu, var,
			  want, (unsigned long long)seed_);
	}
}

/* ---- matmul ---- */
struct mm_ctx { double *out, *inp, *w, *bias, *R; int N, IC, OC; };
static double mm_f_(void *p)
{
	struct mm_ctx *c = p;
	ng_ref_matmul_fwd(c->out, c->inp, c->w, c->bias, c->N, c->IC, c->OC);
	return dot_(c->out, c->R, (size_t)c->N * c->OC);
}

Test(cpu_ops, matmul_bwd_fd, .init = setup_, .fini = release_)
{
	int N = 5, IC = 7, OC = 6;
	struct mm_ctx c = { keep_((size_t)N * OC * 8), rnd_((size_t)N * IC, 0, 1),
			    rnd_((size_t)OC * IC, 0, 1), rnd_(OC, 0, 1), rnd_((size_t)N * OC, 0, 1),
			    N, IC, OC };
	double *dinp = rnd_((size_t)N * IC, 0, 1), *dw = rnd_((size_t)OC * IC, 0, 1);
	double *db = rnd_(OC, 0, 1);
	double *dinp0 = keep_((size_t)N * IC * 8), *dw0 = keep_((size_t)OC * IC * 8);
	double *db0 = keep_(OC * 8);
	memcpy(dinp0, dinp, (size_t)N * IC * 8);
	memcpy(dw0, dw, (size_t)OC * IC * 8);
	memcpy(db0, db, OC * 8);
	mm_f_(&c);
	/* forward, one element by hand: out[2, 3] */
	double want = c.bias[3];
	for (int i = 0; i < IC; i++)
		want += c.inp[2 * IC + i] * c.w[3 * IC + i];
	cr_expect(fabs(c.out[2 * OC + 3] - want) < 1e-14, "matmul out[2,3] %.17g want %.17g",
		  c.out[2 * OC + 3], want);
	ng_ref_matmul_bwd(dinp, dw, db, c.R, c.inp, c.w, N, IC, OC);
	expect_grad_("matmul dinp", mm_f_, &c, c.inp, dinp, dinp0, (size_t)N * IC);
	expect_grad_("matmul dw", mm_f_, &c, c.w, dw, dw0, (size_t)OC * IC);
	expect_grad_("matmul dbias", mm_f_, &c, c.bias, db, db0, OC);
}

/* ---- gelu ---- */
struct gelu_ctx { double *out, *inp, *R; size_t n; };
static double gelu_f_(void *p)
{
	struct gelu_ctx *c = p;
	ng_ref_gelu_fwd(c->out, c->inp, c->n);
	return dot_(c->out, c->R, c->n);
}

Test(cpu_ops, gelu_bwd_fd, .init = setup_, .fini = release_)
{
	size_t n = 31;
	struct gelu_ctx c = { keep_(n * 8), rnd_(n, 0, 2.0), rnd_(n, 0, 1), n };
	double *dinp = keep_(n * 8);
	ng_ref_gelu_bwd(dinp, c.inp, c.R, n);
	expect_grad_("gelu dinp", gelu_f_, &c, c.inp, dinp, NULL, n);
	/* forward at known points (tanh approximation) */
	double x[3] = { 1.0, -1.0, 0.0 }, y[3];
	ng_ref_gelu_fwd(y, x, 3);
	double want1 = 0.5 * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * 1.044715));
	cr_expect(fabs(y[0] - want1) < 1e-15 && fabs(y[1] - (want1 - 1.0)) < 1e-15 && y[2] == 0.0,
		  "gelu(1) %.17g gelu(-1) %.17g gelu(0) %g; want %.17g", y[0], y[1], y[2], want1);
	cr_expect(fabs(y[0] - 0.8411919906082768) < 1e-12, "gelu(1) = %.17g", y[0]);
}

/* ---- attention ---- */
struct att_ctx { double *out, *lse, *qkv, *R; int B, T, H, D; };
static double att_f_(void *p)
{
	struct att_ctx *c = p;
	ng_ref_attention_fwd(c->out, c->lse, c->qkv, c->B, c->T, c->H, c->D);
	return dot_(c->out, c->R, (size_t)c->B * c->T * c->H * c->D);
}

Test(cpu_ops, attention_bwd_fd, .init = setup_, .fini = release_)
{
	int B = 2, T = 5, H = 2, D = 3;
	size_t nqkv = (size_t)B * T * 3 * H * D, nout = (size_t)B * T * H * D;
	struct att_ctx c = { keep_(nout * 8), keep_((size_t)B * H * T * 8), rnd_(nqkv, 0, 1.0),
			     rnd_(nout, 0, 1), B, T, H, D };
	double *dqkv = rnd_(nqkv, 0, 1), *dqkv0 = keep_(nqkv * 8);
	memcpy(dqkv0, dqkv, nqkv * 8);
	att_f_(&c);
	ng_ref_attention_bwd(dqkv, c.R, c.qkv, B, T, H, D);
	expect_grad_("attention dqkv", att_f_, &c, c.qkv, dqkv, dqkv0, nqkv);
	/* forward: row t = 0 attends only to itself, so out = v_0; lse(t=0) = q.k / sqrt(D) */
	for (int b = 0; b < B; b++) {
		for (int h = 0; h < H; h++) {
			const double *q = c.qkv + (size_t)b * T * 3 * H * D + h * D;
			const double *k = q + H * D, *v = q + 2 * H * D;
			double s = dot_(q, k, D) / sqrt((double)D);
			double l = c.lse[((size_t)b * H + h) * T];
			cr_expect(fabs(l - s) < 1e-13, "lse[b%d,h%d,t0] %.17g want %.17g", b, h, l, s);
			for (int d = 0; d < D; d++) {
				double o = c.out[((size_t)b * T * H + h) * D + d];
				cr_expect(fabs(o - v[d]) < 1e-15, "out[b%d,t0,h%d,%d] %.17g want %.17g",
					  b, h, d, o, v[d]);
			}
		}
	}
}

/* ---- cross-entropy ---- */
struct ce_ctx { double *logits; int32_t *tg; int N, V, Vp; };
static double ce_f_(void *p)
{
	struct ce_ctx *c = p;
	return ng_ref_crossentropy(NULL, NULL, c->logits, c->tg, c->N, c->V, c->Vp, 0.0);
}

Test(cpu_ops, crossentropy_bwd_fd, .init = setup_, .fini = release_)
{
	int N = 4, V = 7, Vp = 10;
	size_t n = (size_t)N * Vp;
	int32_t tg[4];
	for (int i = 0; i < N; i++)
		tg[i] = (int32_t)ng_rng_below(&rng_, V);
	struct ce_ctx c = { rnd_(n, 0, 2.0), tg, N, V, Vp };
	for (int i = 0; i < N; i++)
		c.logits[(size_t)i * Vp + V] = 100.0; /* a padded logit that must never win */
	double *dl = rnd_(n, 0, 1), losses[4];
	double mean = ng_ref_crossentropy(losses, dl, c.logits, tg, N, V, Vp, 1.0 / N);
	for (int i = 0; i < N; i++) {
		const double *z = c.logits + (size_t)i * Vp;
		double s = 0.0;
		for (int v = 0; v < V; v++)
			s += exp(z[v]);
		double want = log(s) - z[tg[i]];
		cr_expect(fabs(losses[i] - want) < 1e-13, "loss[%d] %.17g want %.17g (seed %llu)", i,
			  losses[i], want, (unsigned long long)seed_);
		for (int v = V; v < Vp; v++)
			cr_expect(dl[(size_t)i * Vp + v] == 0.0, "dlogits[%d,%d] (padded) = %g", i, v,
				  dl[(size_t)i * Vp + v]);
	}
	cr_expect(fabs(mean - (losses[0] + losses[1] + losses[2] + losses[3]) / 4) < 1e-14);
	expect_grad_("crossentropy dlogits", ce_f_, &c, c.logits, dl, NULL, n);
}

/* ---- encoder ---- */
struct enc_ctx { double *out, *wte, *wpe, *R; int32_t *tok; int B, T, C; };
static double enc_f_(void *p)
{
	struct enc_ctx *c = p;
	ng_ref_encoder_fwd(c->out, c->tok, c->wte, c->wpe, c->B, c->T, c->C);
	return dot_(c->out, c->R, (size_t)c->B * c->T * c->C);
}

Test(cpu_ops, encoder_bwd_fd, .init = setup_, .fini = release_)
{
	int B = 2, T = 3, C = 5, Vp = 4, Tmax = 4;
	int32_t tok[6] = { 1, 3, 1, 0, 1, 2 }; /* token 1 repeats: its gradient must add up */
	struct enc_ctx c = { keep_((size_t)B * T * C * 8), rnd_((size_t)Vp * C, 0, 1),
			     rnd_((size_t)Tmax * C, 0, 1), rnd_((size_t)B * T * C, 0, 1), tok, B, T,
			     C };
	double *dwte = rnd_((size_t)Vp * C, 0, 1), *dwpe = rnd_((size_t)Tmax * C, 0, 1);
	double *dwte0 = keep_((size_t)Vp * C * 8), *dwpe0 = keep_((size_t)Tmax * C * 8);
	memcpy(dwte0, dwte, (size_t)Vp * C * 8);
	memcpy(dwpe0, dwpe, (size_t)Tmax * C * 8);
	enc_f_(&c);
	cr_expect(c.out[4 * C + 2] == c.wte[1 * C + 2] + c.wpe[1 * C + 2], "encoder out[1,1,2]");
	ng_ref_encoder_bwd(dwte, dwpe, c.R, tok, B, T, C);
	expect_grad_("encoder dwte", enc_f_, &c, c.wte, dwte, dwte0, (size_t)Vp * C);
	expect_grad_("encoder dwpe", enc_f_, &c, c.wpe, dwpe, dwpe0, (size_t)Tmax * C);
}

/* ---- AdamW and the schedule ---- */
Test(cpu_ops, adamw_two_steps_by_hand)
{
	double p[2] = { 0.5, -0.25 }, m[2] = { 0, 0 }, v[2] = { 0, 0 };
	double g1[2] = { 0.1, -0.3 }, g2[2] = { -0.2, 0.05 };
	double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, sc = 0.5;
	ng_ref_adamw(p, m, v, g1, 2, lr, b1, b2, eps, wd, sc, 1);
	/* step 1: mhat = g, vhat = g^2 (g = grad * scale), so the update is sign(g) |g|/(|g|+eps) */
	double p1_0 = 0.5 - lr * (0.05 / (0.05 + eps) + wd * 0.5);
	double p1_1 = -0.25 - lr * (-0.15 / (0.15 + eps) + wd * -0.25);
	cr_expect(fabs(p[0] - p1_0) < 1e-15 && fabs(p[1] - p1_1) < 1e-15,
		  "step 1: p %.17g %.17g want %.17g %.17g", p[0], p[1], p1_0, p1_1);
	ng_ref_adamw(p, m, v, g2, 2, lr, b1, b2, eps, wd, sc, 2);
	double gs1[2] = { 0.05, -0.15 }, gs2[2] = { -0.1, 0.025 }, p1[2] = { p1_0, p1_1 };
	for (int i = 0; i < 2; i++) {
		double mm = b1 * (1 - b1) * gs1[i] + (1 - b1) * gs2[i];
		double vv = b2 * (1 - b2) * gs1[i] * gs1[i] + (1 - b2) * gs2[i] * gs2[i];
		double mhat = mm / (1 - b1 * b1), vhat = vv / (1 - b2 * b2);
		double want = p1[i] - lr * (mhat / (sqrt(vhat) + eps) + wd * p1[i]);
		cr_expect(fabs(m[i] - mm) < 1e-16 && fabs(v[i] - vv) < 1e-17,
			  "step 2 moments [%d]: m %.17g want %.17g, v %.17g want %.17g", i, m[i], mm,
			  v[i], vv);
		cr_expect(fabs(p[i] - want) < 1e-15, "step 2: p[%d] %.17g want %.17g", i, p[i], want);
	}
	/* literal check of step 1 element 0: 0.5 - 0.01 * (0.9999998 + 0.05) */
	cr_expect(fabs(p1_0 - 0.489500002) < 1e-9, "p1_0 %.12g", p1_0);
}

Test(cpu_ops, lr_schedule_points)
{
	/* warmup 10 to 1e-3, then decay to 1e-4 at step 99 */
	cr_expect(fabs(ng_ref_lr(0, 10, 100, 1e-3, 0.1, 1) - 1e-4) < 1e-18);
	cr_expect(fabs(ng_ref_lr(9, 10, 100, 1e-3, 0.1, 1) - 1e-3) < 1e-18);
	cr_expect(fabs(ng_ref_lr(10, 10, 100, 1e-3, 0.1, 1) - 1e-3) < 1e-18);
	cr_expect(fabs(ng_ref_lr(99, 10, 100, 1e-3, 0.1, 1) - 1e-4) < 1e-18);
	cr_expect(fabs(ng_ref_lr(99, 10, 100, 1e-3, 0.1, 0) - 1e-4) < 1e-18);
	/* halfway through the decay: cosine and linear both at the midpoint 5.5e-4 */
	double mid = ng_ref_lr(10 + 89 / 2, 10, 100, 1e-3, 0.1, 0);
	double want = 1e-3 - 9e-4 * (44.0 / 89.0);
	cr_expect(fabs(mid - want) < 1e-18, "linear mid %.17g want %.17g", mid, want);
	double cmid = ng_ref_lr(10, 0, 21, 1.0, 0.0, 1); /* frac = 0.5 */
	cr_expect(fabs(cmid - 0.5) < 1e-15, "cosine mid %.17g", cmid);
	cr_expect(ng_ref_lr(200, 10, 100, 1e-3, 0.1, 1) == ng_ref_lr(99, 10, 100, 1e-3, 0.1, 1));
}
