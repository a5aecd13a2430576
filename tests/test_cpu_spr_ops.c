/*
 * tests/test_cpu_spr_ops.c — checks of the speedrun model's double reference ops
 * (graph/cpu_spr_ops.c): every backward against fourth-order central finite differences of its
 * forward on odd shapes (N = 7, C = 24, H = 3, D = 16 and D = 8, positions wrapping at T), the
 * attention mask's semantics (window 1 sees only itself, documents never see each other, window
 * <= 0 is plain causal), the rotary against a direct evaluation in complex numbers, FP8 rounding
 * against known values and against the full table of each format decoded from its bit patterns,
 * and the soft-capped loss against a direct evaluation.
 *
 * The gradient checks are tests/ref_testing.h's (f = sum(out * R), "+=" outputs pre-filled).
 * Fresh random inputs each run; the seed is in every message.
 */
#include <complex.h>
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/cpu_ops.h"
#include "graph/cpu_spr_ops.h"
#include "graph/gpt.h"
#include "tests/ref_testing.h"

#define EPS NG_SPR_RMS_EPS

/* ---- RMSNorm ---- */
struct rms_ctx { double *out, *rstd, *inp, *R; int N, C; };
static double rms_f_(void *p)
{
	struct rms_ctx *c = p;
	ng_ref_rmsnorm_fwd(c->out, c->rstd, c->inp, c->N, c->C, EPS);
	return dot_(c->out, c->R, (size_t)c->N * c->C);
}

Test(cpu_spr_ops, rmsnorm_bwd_fd, .init = setup_, .fini = release_)
{
	int N = 7, C = 24;
	size_t NC = (size_t)N * C;
	struct rms_ctx c = { keep_(NC * 8), keep_(N * 8), rnd_(NC, 2.0, 1.5), rnd_(NC, 0, 1), N,
			     C };
	double *dinp = rnd_(NC, 0, 1), *dinp0 = copy_(dinp, NC);
	rms_f_(&c);
	ng_ref_rmsnorm_bwd(dinp, c.R, c.inp, c.rstd, N, C);
	expect_grad_("rmsnorm dinp", rms_f_, &c, c.inp, dinp, dinp0, NC);
	/* forward: mean(out^2) = ms / (ms + eps) per row, and out is inp scaled by rstd */
	for (int n = 0; n < N; n++) {
		double ms = dot_(c.inp + n * C, c.inp + n * C, C) / C;
		double got = dot_(c.out + n * C, c.out + n * C, C) / C;
		cr_expect(fabs(got - ms / (ms + EPS)) < 1e-14 &&
			  fabs(c.rstd[n] - 1.0 / sqrt(ms + EPS)) < 1e-14 * c.rstd[n],
			  "rmsnorm row %d: mean square %.17g, rstd %.17g (seed %llu)", n, got,
			  c.rstd[n], (unsigned long long)seed_);
	}
	/* a row of zeros stays zero with rstd 1/sqrt(eps) */
	for (int i = 0; i < C; i++)
		c.inp[i] = 0.0;
	rms_f_(&c);
	cr_expect(c.out[0] == 0.0 && fabs(c.rstd[0] - 1.0 / sqrt(EPS)) < 1e-9, "zero row: rstd %g",
		  c.rstd[0]);
}

/* ---- QK-norm + rotary ---- */
Test(cpu_spr_ops, rotary_freqs_values)
{
	double f[64];
	ng_ref_rotary_freqs(f, 16); /* D/4 = 4 rotated pairs: 1024^(-i/3) */
	double want16[8] = { 1.0, pow(2.0, -10.0 / 3.0), pow(2.0, -20.0 / 3.0), 1.0 / 1024.0,
			     0.0, 0.0, 0.0, 0.0 };
	for (int i = 0; i < 8; i++)
		cr_expect(fabs(f[i] - want16[i]) <= 1e-15 * want16[i], "D=16 freq[%d] = %.17g want "
			  "%.17g", i, f[i], want16[i]);
	ng_ref_rotary_freqs(f, 8);
	cr_expect(f[0] == 1.0 && fabs(f[1] - 1.0 / 1024.0) < 1e-19 && f[2] == 0.0 && f[3] == 0.0,
		  "D=8 freqs %g %g %g %g", f[0], f[1], f[2], f[3]);
	ng_ref_rotary_freqs(f, 4);
	cr_expect(f[0] == 1.0 && f[1] == 0.0, "D=4 freqs %g %g", f[0], f[1]);
	ng_ref_rotary_freqs(f, 128); /* the reference's: linspace(0, 1, 32) exponents */
	for (int i = 0; i < 64; i++) {
		double want = i < 32 ? pow(1024.0, -(double)i / 31.0) : 0.0;
		cr_expect(fabs(f[i] - want) <= 1e-15 * want, "D=128 freq[%d] = %.17g want %.17g", i,
			  f[i], want);
	}
}

struct qkr_ctx { double *out, *rstd, *qkv, *R; int N, T, H, D; };
static double qkr_f_(void *p)
{
	struct qkr_ctx *c = p;
	ng_ref_qk_norm_rotary_fwd(c->out, c->rstd, c->qkv, c->N, c->T, c->H, c->D, EPS);
	return dot_(c->out, c->R, (size_t)c->N * 3 * c->H * c->D);
}

static void qk_norm_rotary_case_(int N, int T, int H, int D)
{
	size_t n = (size_t)N * 3 * H * D;
	/* positions up to T - 1 = 4 radians at frequency 1: the rotation's quadrants are all hit */
	struct qkr_ctx c = { keep_(n * 8), keep_((size_t)N * 2 * H * 8), rnd_(n, 0.5, 1.0),
			     rnd_(n, 0, 1), N, T, H, D };
	double *d = rnd_(n, 0, 1), *d0 = copy_(d, n);
	qkr_f_(&c);
	ng_ref_qk_norm_rotary_bwd(d, c.R, c.qkv, c.rstd, N, T, H, D);
	char what[64];
	snprintf(what, sizeof(what), "qk_norm_rotary dqkv (D=%d)", D);
	expect_grad_(what, qkr_f_, &c, c.qkv, d, d0, n);

	/* forward against a direct evaluation: the normed pair (x1, x2) as x1 + i x2, times
	 * e^(-i theta), is y1 + i y2 = (x1 cos + x2 sin) + i (-x1 sin + x2 cos) */
	double freq[128];
	ng_ref_rotary_freqs(freq, D);
	double worst = 0.0;
	for (int r = 0; r < N; r++) {
		for (int j = 0; j < 3; j++) {
			for (int h = 0; h < H; h++) {
				size_t off = (((size_t)r * 3 + j) * H + h) * D;
				const double *x = c.qkv + off, *o = c.out + off;
				if (j == 2) { /* v is copied */
					for (int i = 0; i < D; i++)
						cr_expect(o[i] == x[i], "v[%d,%d,%d] not copied", r,
							  h, i);
					continue;
				}
				double ms = dot_(x, x, D) / D, rs = 1.0 / sqrt(ms + EPS);
				double got = c.rstd[((size_t)r * 2 + j) * H + h];
				cr_expect(fabs(got - rs) <= 1e-14 * rs, "rstd %.17g want %.17g",
					  got, rs);
				for (int i = 0; i < D / 2; i++) {
					double complex z = (x[i] + I * x[i + D / 2]) * rs;
					z *= cexp(-I * (double)(r % T) * freq[i]);
					worst = fmax(worst, fabs(creal(z) - o[i]));
					worst = fmax(worst, fabs(cimag(z) - o[i + D / 2]));
				}
			}
		}
	}
	cr_expect(worst < 1e-14, "rotary vs complex evaluation (D=%d): max abs err %.3g (seed "
		  "%llu)", D, worst, (unsigned long long)seed_);

	/* the rotary's point: the q . k of a pair of tokens depends on their distance only, and
	 * the output's norm is the normed input's (sqrt(D ms / (ms + eps)) ~ sqrt(D)) */
	size_t row = (size_t)3 * H * D;
	for (size_t j = 0; j < 2 * (size_t)H * D; j++) { /* tokens 2 and 3 copy tokens 0 and 1 */
		c.qkv[2 * row + j] = c.qkv[j];
		c.qkv[3 * row + j] = c.qkv[row + j];
	}
	qkr_f_(&c);
	for (int h = 0; h < H; h++) {
		/* q of token 1 with k of token 0 (distance 1) vs q of token 3 with k of token 2 */
		double a = dot_(c.out + row + h * D, c.out + (size_t)(H + h) * D, D);
		double b = dot_(c.out + 3 * row + h * D, c.out + 2 * row + (size_t)(H + h) * D, D);
		cr_expect(fabs(a - b) < 1e-12, "rotary: q1.k0 %.17g != q3.k2 %.17g (head %d)", a, b,
			  h);
	}
}

Test(cpu_spr_ops, qk_norm_rotary_bwd_fd, .init = setup_, .fini = release_)
{
	qk_norm_rotary_case_(7, 5, 3, 16);
	qk_norm_rotary_case_(7, 5, 3, 8);
}

/* ---- relu^2 ---- */
struct relu2_ctx { double *out, *inp, *R; size_t n; };
static double relu2_f_(void *p)
{
	struct relu2_ctx *c = p;
	ng_ref_relu2_fwd(c->out, c->inp, c->n);
	return dot_(c->out, c->R, c->n);
}

Test(cpu_spr_ops, relu2_bwd_fd, .init = setup_, .fini = release_)
{
	size_t n = 37;
	struct relu2_ctx c = { keep_(n * 8), rnd_(n, 0, 1.5), rnd_(n, 0, 1), n };
	/* keep the stencil (+-2h) off the kink at 0, where the second derivative jumps */
	for (size_t i = 0; i < n; i++)
		if (fabs(c.inp[i]) < 0.01)
			c.inp[i] = c.inp[i] < 0 ? -0.5 : 0.5;
	double *d = keep_(n * 8);
	ng_ref_relu2_bwd(d, c.inp, c.R, n);
	expect_grad_("relu2 dinp", relu2_f_, &c, c.inp, d, NULL, n);
	double x[3] = { -2.0, 0.0, 3.0 }, y[3];
	ng_ref_relu2_fwd(y, x, 3);
	cr_expect(y[0] == 0.0 && y[1] == 0.0 && y[2] == 9.0, "relu2(-2, 0, 3) = %g %g %g", y[0],
		  y[1], y[2]);
}

/* ---- the two-term mix ---- */
struct mix_ctx { double *out, *u, *w, *R, ab[2]; size_t n; };
static double mix_f_(void *p)
{
	struct mix_ctx *c = p;
	ng_ref_mix2_fwd(c->out, c->ab[0], c->u, c->ab[1], c->w, c->n);
	return dot_(c->out, c->R, c->n);
}

Test(cpu_spr_ops, mix2_bwd_fd, .init = setup_, .fini = release_)
{
	size_t n = 29;
	struct mix_ctx c = { keep_(n * 8), rnd_(n, 0, 1), rnd_(n, 0, 1), rnd_(n, 0, 1),
			     { 0.7, -1.3 }, n };
	double *du = rnd_(n, 0, 1), *dw = rnd_(n, 0, 1), *du0 = copy_(du, n), *dw0 = copy_(dw, n);
	double dab[2] = { 0.25, -0.5 }, dab0[2] = { 0.25, -0.5 };
	mix_f_(&c);
	cr_expect(c.out[3] == 0.7 * c.u[3] + -1.3 * c.w[3], "mix out[3]");
	ng_ref_mix2_bwd(du, dw, &dab[0], &dab[1], c.R, c.ab[0], c.u, c.ab[1], c.w, n);
	expect_grad_("mix2 du", mix_f_, &c, c.u, du, du0, n);
	expect_grad_("mix2 dw", mix_f_, &c, c.w, dw, dw0, n);
	expect_grad_("mix2 da db", mix_f_, &c, c.ab, dab, dab0, 2);
	/* w NULL: out = a u; db untouched, the NULL outputs skipped */
	c.w = NULL;
	mix_f_(&c);
	cr_expect(c.out[5] == 0.7 * c.u[5], "mix without w: out[5]");
	double da = 0.0, db = 42.0;
	ng_ref_mix2_bwd(NULL, NULL, &da, &db, c.R, c.ab[0], c.u, c.ab[1], NULL, n);
	cr_expect(fabs(da - dot_(c.R, c.u, n)) < 1e-13 && db == 42.0, "mix without w: da %.17g, "
		  "db %g", da, db);
}

/* ---- embedding and document ids ---- */
struct emb_ctx { double *out, *table, *R; int32_t *tok; int N, C; };
static double emb_f_(void *p)
{
	struct emb_ctx *c = p;
	ng_ref_embed_fwd(c->out, c->tok, c->table, c->N, c->C);
	return dot_(c->out, c->R, (size_t)c->N * c->C);
}

Test(cpu_spr_ops, embed_bwd_fd, .init = setup_, .fini = release_)
{
	int N = 7, C = 5, rows = 6;
	int32_t tok[7] = { 1, 4, 1, 0, 5, 1, 4 }; /* repeats: their gradients must add up */
	struct emb_ctx c = { keep_((size_t)N * C * 8), rnd_((size_t)rows * C, 0, 1),
			     rnd_((size_t)N * C, 0, 1), tok, N, C };
	double *d = rnd_((size_t)rows * C, 0, 1), *d0 = copy_(d, (size_t)rows * C);
	emb_f_(&c);
	cr_expect(c.out[4 * C + 3] == c.table[5 * C + 3], "embed out[4,3]");
	ng_ref_embed_bwd(d, c.R, tok, N, C);
	expect_grad_("embed dtable", emb_f_, &c, c.table, d, d0, (size_t)rows * C);
}

Test(cpu_spr_ops, doc_ids_count_bos)
{
	enum { B = 2, T = 6, BOS = 9 };
	int32_t tok[B * T] = { 9, 1, 2, 9, 9, 3,   /* starts with a document */
			       4, 5, 9, 6, 7, 9 }; /* a partial document first */
	int32_t want[B * T] = { 1, 1, 1, 2, 3, 3,
				0, 0, 1, 1, 1, 2 };
	int32_t doc[B * T];
	ng_ref_doc_ids(doc, tok, B, T, BOS);
	for (int i = 0; i < B * T; i++)
		cr_expect(doc[i] == want[i], "doc[%d] = %d want %d", i, doc[i], want[i]);
}

/* ---- masked attention ---- */
struct matt_ctx { double *out, *lse, *qkv, *R; const int32_t *doc; int window, block;
		  double scale; int B, T, H, D; };
static double matt_f_(void *p)
{
	struct matt_ctx *c = p;
	ng_ref_attention_masked_fwd(c->out, c->lse, c->qkv, c->doc, c->window, c->block, c->scale,
				    c->B, c->T, c->H, c->D);
	return dot_(c->out, c->R, (size_t)c->B * c->T * c->H * c->D);
}

/* Two sequences of 7 tokens; sequence 0 has a document start at t = 3, sequence 1 at t = 0
 * and t = 5. */
static const int32_t doc7_[14] = { 0, 0, 0, 1, 1, 1, 1,   1, 1, 1, 1, 1, 2, 2 };

Test(cpu_spr_ops, attention_masked_bwd_fd, .init = setup_, .fini = release_)
{
	int B = 2, T = 7, H = 3;
	for (int Dv = 0; Dv < 2; Dv++) {
		int D = Dv ? 8 : 16;
		size_t nqkv = (size_t)B * T * 3 * H * D, nout = (size_t)B * T * H * D;
		/* token windows, then block-granular ones: 2 blocks of 2, 2 blocks of 3 */
		int windows[6] = { 0, 0, 1, 3, 4, 6 }, blocks[6] = { 1, 1, 1, 1, 2, 3 };
		for (int wi = 0; wi < 6; wi++) {
			struct matt_ctx c = { keep_(nout * 8), NULL, rnd_(nqkv, 0, 1.5),
					      rnd_(nout, 0, 1), wi == 0 ? NULL : doc7_,
					      windows[wi], blocks[wi], 0.12 * 4, B, T, H, D };
			double *d = rnd_(nqkv, 0, 1), *d0 = copy_(d, nqkv);
			matt_f_(&c);
			ng_ref_attention_masked_bwd(d, c.R, c.qkv, c.doc, c.window, c.block, c.scale,
						    B, T, H, D);
			char what[96];
			snprintf(what, sizeof(what), "masked attention dqkv (D=%d, window %d in "
				 "blocks of %d, %s)", D, c.window, c.block,
				 c.doc ? "documents" : "one document");
			/* f sums B T H D = 672 (or 336) products: its rounding, times the stencil's
			 * 18 / (12 h), puts the FD noise near 1e-11, so near-zero gradients (peaked
			 * softmax rows) are held to an absolute 1e-10 */
			expect_grad_floor_(what, matt_f_, &c, c.qkv, d, d0, nqkv, 1e-4);
		}
	}
}

/* The output of query (b, t, h) by direct evaluation over an explicit list of visible keys. */
static void direct_row_(double *o, double *lse, const double *qkv, const int *keys, int nk,
			double scale, int b, int t, int h, int T, int H, int D)
{
	size_t C3 = (size_t)3 * H * D;
	const double *q = qkv + ((size_t)b * T + t) * C3 + (size_t)h * D;
	double w[64], sum = 0.0;
	for (int j = 0; j < nk; j++) {
		const double *k = qkv + ((size_t)b * T + keys[j]) * C3 + (size_t)(H + h) * D;
		w[j] = exp(scale * dot_(q, k, D));
		sum += w[j];
	}
	*lse = log(sum);
	for (int d = 0; d < D; d++) {
		o[d] = 0.0;
		for (int j = 0; j < nk; j++) {
			size_t at = ((size_t)b * T + keys[j]) * C3 + (size_t)(2 * H + h) * D;
			o[d] += w[j] / sum * qkv[at + d];
		}
	}
}

Test(cpu_spr_ops, attention_mask_semantics, .init = setup_, .fini = release_)
{
	int B = 2, T = 7, H = 3, D = 8;
	size_t nqkv = (size_t)B * T * 3 * H * D, nout = (size_t)B * T * H * D;
	size_t C3 = (size_t)3 * H * D;
	double scale = 0.12 * 3;
	double *qkv = rnd_(nqkv, 0, 1), *out = keep_(nout * 8), *lse = keep_((size_t)B * H * T * 8);
	double *ref = keep_(nout * 8), *lse_ref = keep_((size_t)B * H * T * 8);

	/* window 1: every query sees only itself, so out = its own v and lse = scale q . k */
	ng_ref_attention_masked_fwd(out, lse, qkv, doc7_, 1, 1, scale, B, T, H, D);
	for (int r = 0; r < B * T; r++) {
		for (int h = 0; h < H; h++) {
			const double *q = qkv + r * C3 + h * D;
			double l = lse[((size_t)(r / T) * H + h) * T + r % T];
			cr_expect(fabs(l - scale * dot_(q, q + H * D, D)) < 1e-14,
				  "window 1 lse row %d", r);
			for (int d = 0; d < D; d++)
				cr_expect(out[(r * H + h) * D + d] == q[2 * H * D + d],
					  "window 1: out[%d,%d,%d] is not its own v", r, h, d);
		}
	}

	/* window <= 0 without documents: the plain causal attention of cpu_ops.h at its scale */
	double s0 = 1.0 / sqrt((double)D);
	ng_ref_attention_masked_fwd(out, lse, qkv, NULL, 0, 1, s0, B, T, H, D);
	ng_ref_attention_fwd(ref, lse_ref, qkv, B, T, H, D);
	for (size_t i = 0; i < nout; i++)
		cr_expect(out[i] == ref[i], "window 0 vs causal: out[%zu] %.17g != %.17g", i,
			  out[i], ref[i]);
	ng_ref_attention_masked_fwd(out, lse, qkv, NULL, -5, 1, s0, B, T, H, D);
	for (size_t i = 0; i < nout; i++)
		cr_expect(out[i] == ref[i], "window -5 vs causal: out[%zu]", i);
	ng_ref_attention_masked_fwd(out, lse, qkv, NULL, T, 1, s0, B, T, H, D); /* all keys */
	for (size_t i = 0; i < nout; i++)
		cr_expect(out[i] == ref[i], "window T vs causal: out[%zu]", i);

	/* documents and a window against the explicit key lists of every query: 3 tokens, then 2
	 * blocks of 2 tokens (t sees the blocks t / 2 - 1 and t / 2: 3 or 4 keys, document
	 * permitting) */
	int wins[2] = { 3, 4 }, blks[2] = { 1, 2 };
	for (int wi = 0; wi < 2; wi++) {
		double worst = 0.0;
		ng_ref_attention_masked_fwd(out, lse, qkv, doc7_, wins[wi], blks[wi], scale, B, T,
					    H, D);
		for (int b = 0; b < B; b++) {
			for (int t = 0; t < T; t++) {
				int keys[8], nk = 0;
				for (int s = 0; s <= t; s++) {
					int first = wi ? (t / 2 - 1) * 2 : t - 2;
					if (s >= first && doc7_[b * T + s] == doc7_[b * T + t])
						keys[nk++] = s;
				}
				for (int h = 0; h < H; h++) {
					double o[8], l;
					direct_row_(o, &l, qkv, keys, nk, scale, b, t, h, T, H, D);
					worst = fmax(worst,
						     fabs(l - lse[((size_t)b * H + h) * T + t]));
					const double *got = out + (((size_t)b * T + t) * H + h) * D;
					for (int d = 0; d < D; d++)
						worst = fmax(worst, fabs(o[d] - got[d]));
				}
			}
		}
		cr_expect(worst < 1e-14, "documents + window %d in blocks of %d vs direct: max abs "
			  "err %.3g (seed %llu)", wins[wi], blks[wi], worst,
			  (unsigned long long)seed_);
	}

	/* a document start sees only itself: sequence 0 t = 3 and sequence 1 t = 5 */
	ng_ref_attention_masked_fwd(out, lse, qkv, doc7_, 0, 1, scale, B, T, H, D);
	int starts[2] = { 3, T + 5 };
	for (int j = 0; j < 2; j++)
		for (int i = 0; i < H * D; i++)
			cr_expect(out[(size_t)starts[j] * H * D + i] ==
				  qkv[(size_t)starts[j] * C3 + 2 * H * D + i],
				  "document start row %d does not see only itself", starts[j]);
	/* keys of another document change nothing: perturb all of sequence 0's first document */
	memcpy(ref, out, nout * 8);
	for (int t = 0; t < 3; t++)
		for (size_t i = H * D; i < C3; i++)
			qkv[t * C3 + i] += 1.0;
	ng_ref_attention_masked_fwd(out, lse, qkv, doc7_, 0, 1, scale, B, T, H, D);
	for (int t = 3; t < T; t++)
		for (int i = 0; i < H * D; i++)
			cr_expect(out[(size_t)t * H * D + i] == ref[(size_t)t * H * D + i],
				  "another document's keys changed out[%d, %d]", t, i);
}

/* ---- FP8 rounding ---- */
/* Decode byte `code` of a format with `mbits` mantissa bits and exponent bias `bias` (positive
 * values only; the codes above `maxcode` are NaN / infinity and excluded by the caller). */
static double fp8_decode_(int code, int mbits, int bias)
{
	int e = code >> mbits, m = code & ((1 << mbits) - 1);
	if (e == 0)
		return ldexp((double)m, 1 - bias - mbits);
	return ldexp((double)((1 << mbits) + m), e - bias - mbits);
}

/* Every finite positive value of the format (codes 0 .. maxcode, increasing) rounds to itself,
 * each midpoint between neighbours goes to the even code, points just off a midpoint go to the
 * nearer value, and the negative side mirrors it. */
static void fp8_table_check_(const char *name, double (*rnd)(double), int mbits, int bias,
			     int maxcode)
{
	for (int c = 0; c <= maxcode; c++) {
		double v = fp8_decode_(c, mbits, bias);
		cr_expect(rnd(v) == v && rnd(-v) == -v, "%s: code %d (%.17g) does not round to "
			  "itself", name, c, v);
		if (c == maxcode)
			break;
		double w = fp8_decode_(c + 1, mbits, bias), mid = 0.5 * (v + w);
		double even = (c % 2 == 0) ? v : w;
		double off = (w - v) * 1e-6;
		cr_expect(rnd(mid) == even && rnd(-mid) == -even, "%s: tie %.17g -> %.17g, want "
			  "%.17g", name, mid, rnd(mid), even);
		cr_expect(rnd(mid - off) == v && rnd(mid + off) == w, "%s: near %.17g: %.17g, "
			  "%.17g", name, mid, rnd(mid - off), rnd(mid + off));
	}
}

Test(cpu_spr_ops, fp8_rounding_known_values)
{
	/* E4M3: codes 0..0x7e finite (0x7f is NaN), largest 0x7e = 1.75 * 2^8 = 448 */
	cr_expect(fp8_decode_(0x7e, 3, 7) == 448.0);
	fp8_table_check_("e4m3", ng_ref_round_e4m3, 3, 7, 0x7e);
	/* E5M2: codes 0..0x7b finite (0x7c is infinity), largest 0x7b = 1.75 * 2^15 = 57344 */
	cr_expect(fp8_decode_(0x7b, 2, 15) == 57344.0);
	fp8_table_check_("e5m2", ng_ref_round_e5m2, 2, 15, 0x7b);

	struct { double x, e4m3, e5m2; } k[] = {
		{ 448.0, 448.0, 448.0 },
		{ 464.0, 448.0, 448.0 },         /* e4m3 tie 448 | 480: 448's mantissa is even */
		{ 470.0, 448.0, 448.0 },         /* nearer 480, beyond the largest: saturates */
		{ 1000.0, 448.0, 1024.0 },
		{ 57344.0, 448.0, 57344.0 },
		{ 61440.0, 448.0, 57344.0 },     /* e5m2 tie 57344 | 65536 (infinite): saturates */
		{ 1e9, 448.0, 57344.0 },
		{ 1.0625, 1.0, 1.0 },            /* e4m3 tie 1 | 1.125 -> 1 */
		{ 1.1875, 1.25, 1.25 },          /* e4m3 tie 1.125 | 1.25 -> 1.25 (even) */
		{ 1.125, 1.125, 1.0 },           /* e5m2 tie 1 | 1.25 -> 1 */
		{ 1.375, 1.375, 1.5 },           /* e5m2 tie 1.25 | 1.5 -> 1.5 */
		{ 0.3, 0.3125, 0.3125 },
		{ 0x1p-6, 0x1p-6, 0x1p-6 },      /* e4m3 smallest normal */
		{ 0x1p-9, 0x1p-9, 0x1p-9 },      /* e4m3 smallest subnormal */
		{ 0x1p-10, 0.0, 0x1p-10 },       /* e4m3 tie 0 | 2^-9 -> 0 */
		{ 0x3p-10, 0x1p-8, 0x3p-10 },    /* e4m3 tie 2^-9 | 2^-8 -> 2^-8 */
		{ 0x7p-9, 0x7p-9, 0x7p-9 },      /* e4m3 largest subnormal */
		{ 0x1p-14, 0.0, 0x1p-14 },       /* e5m2 smallest normal */
		{ 0x1p-16, 0.0, 0x1p-16 },       /* e5m2 smallest subnormal */
		{ 0x1p-17, 0.0, 0.0 },           /* e5m2 tie 0 | 2^-16 -> 0 */
		{ 0x3p-17, 0.0, 0x1p-15 },       /* e5m2 tie 2^-16 | 2^-15 -> 2^-15 */
		{ 0.0, 0.0, 0.0 },
	};
	for (size_t i = 0; i < sizeof(k) / sizeof(k[0]); i++) {
		double a = ng_ref_round_e4m3(k[i].x), b = ng_ref_round_e5m2(k[i].x);
		double an = ng_ref_round_e4m3(-k[i].x), bn = ng_ref_round_e5m2(-k[i].x);
		cr_expect(a == k[i].e4m3 && an == -k[i].e4m3, "e4m3(+-%.17g) = %.17g %.17g, want "
			  "+-%.17g", k[i].x, a, an, k[i].e4m3);
		cr_expect(b == k[i].e5m2 && bn == -k[i].e5m2, "e5m2(+-%.17g) = %.17g %.17g, want "
			  "+-%.17g", k[i].x, b, bn, k[i].e5m2);
	}
	cr_expect(signbit(ng_ref_round_e4m3(-0.0)) && signbit(ng_ref_round_e5m2(-1e-30)),
		  "the sign of zero is kept");
	cr_expect(isnan(ng_ref_round_e4m3(NAN)) && isnan(ng_ref_round_e5m2(NAN)));
}

/* ---- soft-capped cross-entropy ---- */
struct sc_ctx { double *z; int32_t *tg; int N, Vp; double cap, div, dloss; };
static double sc_f_(void *p)
{
	struct sc_ctx *c = p;
	return c->dloss * ng_ref_softcap_crossentropy(NULL, NULL, c->z, c->tg, c->N, c->Vp, c->cap,
						      c->div, 0.0);
}

Test(cpu_spr_ops, softcap_crossentropy, .init = setup_, .fini = release_)
{
	int N = 5, Vp = 11;
	size_t n = (size_t)N * Vp;
	int32_t tg[5];
	for (int i = 0; i < N; i++)
		tg[i] = (int32_t)ng_rng_below(&rng_, Vp);
	tg[4] = Vp - 1; /* the last column is a target like any other */
	/* z spread over +-3 div, so the cap's curvature matters (s from 1.4 to 28.6) */
	double div = 7.5 * sqrt(24.0);
	struct sc_ctx c = { rnd_(n, 0, 1.5 * div), tg, N, Vp, 30.0, div, 0.37 };
	double losses[5], *dz = rnd_(n, 0, 1);
	double sum = ng_ref_softcap_crossentropy(losses, dz, c.z, tg, N, Vp, c.cap, div, c.dloss);
	double want_sum = 0.0;
	for (int r = 0; r < N; r++) {
		/* direct: s = 15 (1 + tanh(z / (2 div))), the same sigmoid written another way */
		double s[11], se = 0.0;
		for (int v = 0; v < Vp; v++) {
			s[v] = 15.0 * (1.0 + tanh(c.z[r * Vp + v] / (2.0 * div)));
			se += exp(s[v]);
		}
		double want = log(se) - s[tg[r]];
		want_sum += want;
		cr_expect(fabs(losses[r] - want) < 1e-13 * fmax(1.0, want),
			  "softcap loss[%d] %.17g want %.17g (seed %llu)", r, losses[r], want,
			  (unsigned long long)seed_);
	}
	cr_expect(fabs(sum - want_sum) < 1e-12, "softcap sum %.17g want %.17g", sum, want_sum);
	cr_expect(ng_ref_softcap_crossentropy(NULL, NULL, c.z, tg, N, Vp, c.cap, div, 1.0) == sum,
		  "losses NULL changes the sum");
	/* dz is at most 1 / div ~ 0.03 and mostly far smaller, while f ~ 5 leaves an FD noise of a
	 * few 1e-12: elements below 1e-4 are held to an absolute 1e-10 */
	expect_grad_floor_("softcap dz", sc_f_, &c, c.z, dz, NULL, n, 1e-4);
	/* zero logits: every capped logit is 15, so each loss is ln(Vp) */
	for (size_t i = 0; i < n; i++)
		c.z[i] = 0.0;
	sum = ng_ref_softcap_crossentropy(losses, NULL, c.z, tg, N, Vp, c.cap, div, 1.0);
	cr_expect(fabs(sum - N * log((double)Vp)) < 1e-13, "zero logits: sum %.17g want %.17g", sum,
		  N * log((double)Vp));
}
