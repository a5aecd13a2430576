/*
 * graph/cpu_spr_ops.c — the double-precision reference of the speedrun model's operations
 * declared in graph/cpu_spr_ops.h: weightless RMSNorm, QK-norm + half-truncated rotary, relu^2,
 * the two-term scalar mix, embedding lookups, document ids, the windowed document attention, FP8
 * rounding and the soft-capped cross-entropy.
 *
 * Why: as graph/cpu_ops.c, the oracle of the CPU reference model (graph/cpu_spr.c) and of the GPU
 * kernels of these ops, so each function is the plainest loop of its formula. The masked
 * attention also serves as cpu_ops.c's causal attention (one document, no window). Only the
 * attention is large enough for OpenMP; its parallel loops write disjoint outputs (one (b, h)
 * pair each), so results do not depend on the thread count. The soft-capped loss reuses
 * cpu_ops.c's cross-entropy on the capped logits.
 *
 * References: RMSNorm (Zhang & Sennrich 2019) without a weight, as F.rms_norm; rotary position
 * embedding (Su et al. 2021) on half of each head's pairs; FP8 formats E4M3 and E5M2 (Micikevicius
 * et al. 2022, "FP8 formats for deep learning"; OCP 8-bit floating point specification): E4M3 has
 * bias 7, 3 mantissa bits, no infinities, largest 448, smallest normal 2^-6, subnormal step
 * 2^-9; E5M2 has bias 15, 2 mantissa bits, largest 57344, smallest normal 2^-14, subnormal step
 * 2^-16.
 */
#include "graph/cpu_spr_ops.h"

#include "graph/cpu_ops.h"
#include "kernels/window.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Below this many multiply-adds a loop runs on one thread (as cpu_ops.c). */
#define NG_SPR_REF_OMP_MIN_WORK 262144.0

void ng_ref_rmsnorm_fwd(double *out, double *rstd, const double *inp, int N, int C, double eps)
{
	for (int n = 0; n < N; n++) {
		const double *x = inp + (size_t)n * C;
		double *o = out + (size_t)n * C;
		double ss = 0.0;
		for (int c = 0; c < C; c++)
			ss += x[c] * x[c];
		double rs = 1.0 / sqrt(ss / C + eps);
		for (int c = 0; c < C; c++)
			o[c] = x[c] * rs;
		if (rstd)
			rstd[n] = rs;
	}
}

/* One row of the RMSNorm backward: dx += rs * (d - y * mean(d * y)), y = x * rs. Shared by the
 * plain RMSNorm and the per-head QK-norm. */
static void rmsnorm_row_bwd_(double *dx, const double *d, const double *x, double rs, int C)
{
	double dy = 0.0;
	for (int c = 0; c < C; c++)
		dy += d[c] * x[c] * rs;
	dy /= C;
	for (int c = 0; c < C; c++)
		dx[c] += rs * (d[c] - x[c] * rs * dy);
}

void ng_ref_rmsnorm_bwd(double *dinp, const double *dout, const double *inp, const double *rstd,
			int N, int C)
{
	for (int n = 0; n < N; n++)
		rmsnorm_row_bwd_(dinp + (size_t)n * C, dout + (size_t)n * C, inp + (size_t)n * C,
				 rstd[n], C);
}

void ng_ref_rotary_freqs(double *freq, int D)
{
	int half = D / 2, q = D / 4;
	for (int i = 0; i < half; i++) {
		if (i >= q)
			freq[i] = 0.0;
		else if (q == 1)
			freq[i] = 1.0;
		else
			freq[i] = pow(1.0 / 1024.0, (double)i / (double)(q - 1));
	}
}

/* The workspace of the QK-norm + rotary: freq (D/2) filled, then D doubles of scratch. NULL when
 * out of memory (cannot happen at reference sizes; the caller then leaves its output as is). */
static double *rotary_work_(int D)
{
	double *w = malloc((size_t)(D / 2 + D) * sizeof(double));
	if (w)
		ng_ref_rotary_freqs(w, D);
	return w;
}

/* o = y with pair i rotated by the angle pos * freq[i]: o1 = y1 cos + y2 sin,
 * o2 = -y1 sin + y2 cos. The rotation is orthogonal, so -pos applies its transpose. */
static void rotate_(double *o, const double *y, const double *freq, double pos, int D)
{
	int half = D / 2;
	for (int i = 0; i < half; i++) {
		double th = pos * freq[i], c = cos(th), s = sin(th);
		double y1 = y[i], y2 = y[i + half];
		o[i] = y1 * c + y2 * s;
		o[i + half] = -y1 * s + y2 * c;
	}
}

/* One row (3, H, D) of the QK-norm + rotary at position pos, with freq and D doubles of scratch
 * y from rotary_work_; rstd (2H) may be NULL. */
static void qk_row_fwd_(double *orow, double *rstd, const double *row, double pos, int H, int D,
			double eps, const double *freq, double *y)
{
	size_t v0 = (size_t)2 * H * D;
	for (int j = 0; j < 2 * H; j++) { /* q heads, then k heads */
		double rs;
		ng_ref_rmsnorm_fwd(y, &rs, row + (size_t)j * D, 1, D, eps);
		if (rstd)
			rstd[j] = rs;
		rotate_(orow + (size_t)j * D, y, freq, pos, D);
	}
	memcpy(orow + v0, row + v0, (size_t)H * D * sizeof(double));
}

void ng_ref_qk_norm_rotary_fwd(double *out, double *rstd, const double *qkv, int N, int T, int H,
			       int D, double eps)
{
	size_t C3 = (size_t)3 * H * D;
	double *freq = rotary_work_(D);
	if (!freq)
		return;
	for (int n = 0; n < N; n++)
		qk_row_fwd_(out + (size_t)n * C3, rstd ? rstd + (size_t)n * 2 * H : NULL,
			    qkv + (size_t)n * C3, (double)(n % T), H, D, eps, freq, freq + D / 2);
	free(freq);
}

void ng_ref_qk_norm_rotary_at(double *out, const double *qkv, int pos, int H, int D, double eps)
{
	double *freq = rotary_work_(D);
	if (!freq)
		return;
	qk_row_fwd_(out, NULL, qkv, (double)pos, H, D, eps, freq, freq + D / 2);
	free(freq);
}

void ng_ref_qk_norm_rotary_bwd(double *dqkv, const double *dout, const double *qkv,
			       const double *rstd, int N, int T, int H, int D)
{
	size_t C3 = (size_t)3 * H * D;
	double *freq = rotary_work_(D);
	if (!freq)
		return;
	double *dy = freq + D / 2;
	for (int n = 0; n < N; n++) {
		const double *row = qkv + (size_t)n * C3, *drow = dout + (size_t)n * C3;
		double *dxrow = dqkv + (size_t)n * C3;
		for (int j = 0; j < 2 * H; j++) {
			size_t off = (size_t)j * D;
			rotate_(dy, drow + off, freq, -(double)(n % T), D);
			rmsnorm_row_bwd_(dxrow + off, dy, row + off, rstd[(size_t)n * 2 * H + j],
					 D);
		}
		for (size_t c = (size_t)2 * H * D; c < C3; c++)
			dxrow[c] += drow[c];
	}
	free(freq);
}

void ng_ref_relu2_fwd(double *out, const double *inp, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		double r = inp[i] > 0.0 ? inp[i] : 0.0;
		out[i] = r * r;
	}
}

void ng_ref_relu2_bwd(double *dinp, const double *inp, const double *dout, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		double r = inp[i] > 0.0 ? inp[i] : 0.0;
		dinp[i] = 2.0 * r * dout[i];
	}
}

void ng_ref_mix2_fwd(double *out, double a, const double *u, double b, const double *w, size_t n)
{
	for (size_t i = 0; i < n; i++)
		out[i] = a * u[i] + (w ? b * w[i] : 0.0);
}

void ng_ref_mix2_bwd(double *du, double *dw, double *da, double *db, const double *dout, double a,
		     const double *u, double b, const double *w, size_t n)
{
	double sa = 0.0, sb = 0.0;
	for (size_t i = 0; i < n; i++) {
		if (du)
			du[i] += a * dout[i];
		if (dw)
			dw[i] += b * dout[i];
		if (da)
			sa += dout[i] * u[i];
		if (db && w)
			sb += dout[i] * w[i];
	}
	if (da)
		*da += sa;
	if (db && w)
		*db += sb;
}

void ng_ref_embed_fwd(double *out, const int32_t *tok, const double *table, int N, int C)
{
	for (int n = 0; n < N; n++)
		memcpy(out + (size_t)n * C, table + (size_t)tok[n] * C, (size_t)C * sizeof(double));
}

void ng_ref_embed_bwd(double *dtable, const double *dout, const int32_t *tok, int N, int C)
{
	for (int n = 0; n < N; n++) {
		double *dt = dtable + (size_t)tok[n] * C;
		const double *d = dout + (size_t)n * C;
		for (int c = 0; c < C; c++)
			dt[c] += d[c];
	}
}

void ng_ref_doc_ids(int32_t *doc, const int32_t *tok, int B, int T, int32_t bos)
{
	for (int b = 0; b < B; b++) {
		int32_t id = 0;
		for (int t = 0; t < T; t++) {
			size_t i = (size_t)b * T + t;
			if (tok[i] == bos)
				id++;
			doc[i] = id;
		}
	}
}

/* Whether query t of sequence b sees key s under the speedrun mask (cpu_spr_ops.h). */
static int sees_(const int32_t *doc, int window, int block, int b, int T, int t, int s)
{
	if (s > t)
		return 0;
	if (window > 0 && s < ng_attention_window_first(t, window, block))
		return 0;
	if (doc && doc[(size_t)b * T + s] != doc[(size_t)b * T + t])
		return 0;
	return 1;
}

/* Softmax probabilities p[0..t] of the masked score row (b, t, h) (0 where masked); returns the
 * natural-log lse of the visible scaled scores. */
static double masked_row_probs_(double *p, const double *qkv, const int32_t *doc, int window,
				int block, double scale, int b, int t, int h, int T, int H, int D)
{
	size_t C3 = (size_t)3 * H * D;
	const double *q = qkv + ((size_t)b * T + t) * C3 + (size_t)h * D;
	double mx = -INFINITY;
	for (int s = 0; s <= t; s++) {
		if (!sees_(doc, window, block, b, T, t, s))
			continue;
		const double *k = qkv + ((size_t)b * T + s) * C3 + (size_t)(H + h) * D;
		double dot = 0.0;
		for (int d = 0; d < D; d++)
			dot += q[d] * k[d];
		p[s] = dot * scale;
		if (p[s] > mx)
			mx = p[s];
	}
	double sum = 0.0;
	for (int s = 0; s <= t; s++) {
		if (sees_(doc, window, block, b, T, t, s)) {
			p[s] = exp(p[s] - mx);
			sum += p[s];
		} else {
			p[s] = 0.0;
		}
	}
	for (int s = 0; s <= t; s++)
		p[s] /= sum;
	return mx + log(sum);
}

void ng_ref_attention_masked_fwd(double *out, double *lse, const double *qkv, const int32_t *doc,
				 int window, int block, double scale, int B, int T, int H, int D)
{
	size_t C3 = (size_t)3 * H * D;
#pragma omp parallel for schedule(dynamic) \
	if((double)B * H * T * T * D >= NG_SPR_REF_OMP_MIN_WORK)
	for (int bh = 0; bh < B * H; bh++) {
		int b = bh / H, h = bh % H;
		const double *seq = qkv + (size_t)b * T * C3;
		size_t vo = (size_t)(2 * H + h) * D;
		double *p = malloc((size_t)T * sizeof(double));
		if (!p)
			continue; /* cannot happen at reference sizes; output left as is */
		for (int t = 0; t < T; t++) {
			double l = masked_row_probs_(p, qkv, doc, window, block, scale, b, t, h, T,
						     H, D);
			if (lse)
				lse[((size_t)b * H + h) * T + t] = l;
			double *o = out + (((size_t)b * T + t) * H + h) * D;
			for (int d = 0; d < D; d++)
				o[d] = 0.0;
			for (int s = 0; s <= t; s++) {
				if (p[s] == 0.0)
					continue;
				const double *v = seq + s * C3 + vo;
				for (int d = 0; d < D; d++)
					o[d] += p[s] * v[d];
			}
		}
		free(p);
	}
}

void ng_ref_attention_masked_bwd(double *dqkv, const double *dout, const double *qkv,
				 const int32_t *doc, int window, int block, double scale, int B, int T,
				 int H, int D)
{
	size_t C3 = (size_t)3 * H * D;
	/* Each (b, h) touches only its own q, k, v columns of dqkv: the parallel loop is
	 * race-free. */
#pragma omp parallel for schedule(dynamic) \
	if((double)B * H * T * T * D >= NG_SPR_REF_OMP_MIN_WORK)
	for (int bh = 0; bh < B * H; bh++) {
		int b = bh / H, h = bh % H;
		const double *seq = qkv + (size_t)b * T * C3;
		double *dseq = dqkv + (size_t)b * T * C3;
		size_t ko = (size_t)(H + h) * D, vo = (size_t)(2 * H + h) * D;
		double *p = malloc((size_t)2 * T * sizeof(double));
		if (!p)
			continue;
		double *dp = p + T;
		for (int t = 0; t < T; t++) {
			masked_row_probs_(p, qkv, doc, window, block, scale, b, t, h, T, H, D);
			const double *q = qkv + ((size_t)b * T + t) * C3 + (size_t)h * D;
			double *dq = dqkv + ((size_t)b * T + t) * C3 + (size_t)h * D;
			const double *dout_row = dout + (((size_t)b * T + t) * H + h) * D;
			/* dP[s] = dout . v_s ; dS = P * (dP - sum_s P dP); masked keys skipped */
			double pdp = 0.0;
			for (int s = 0; s <= t; s++) {
				if (!sees_(doc, window, block, b, T, t, s))
					continue;
				const double *v = seq + s * C3 + vo;
				double *dv = dseq + s * C3 + vo;
				double acc = 0.0;
				for (int d = 0; d < D; d++) {
					acc += dout_row[d] * v[d];
					dv[d] += p[s] * dout_row[d];
				}
				dp[s] = acc;
				pdp += p[s] * acc;
			}
			for (int s = 0; s <= t; s++) {
				if (!sees_(doc, window, block, b, T, t, s))
					continue;
				double ds = p[s] * (dp[s] - pdp) * scale;
				const double *k = seq + s * C3 + ko;
				double *dk = dseq + s * C3 + ko;
				for (int d = 0; d < D; d++) {
					dq[d] += ds * k[d];
					dk[d] += ds * q[d];
				}
			}
		}
		free(p);
	}
}

/* Round x to the nearest value of a binary format with `mbits` stored mantissa bits, smallest
 * normal exponent `emin` (below it the quantum stays 2^(emin - mbits): subnormals) and largest
 * finite value `maxv` (beyond it: saturate). Ties go to even: rint in the default rounding mode,
 * and a / q is exact because q is a power of two. */
static double round_fp8_(double x, int mbits, int emin, double maxv)
{
	if (x == 0.0 || isnan(x))
		return x;
	double a = fabs(x);
	int e;
	frexp(a, &e); /* a = f 2^e, f in [0.5, 1): the unbiased exponent of a is e - 1 */
	e -= 1;
	if (e < emin)
		e = emin;
	double q = ldexp(1.0, e - mbits);
	double r = rint(a / q) * q;
	if (r > maxv)
		r = maxv;
	return copysign(r, x);
}

double ng_ref_round_e4m3(double x)
{
	return round_fp8_(x, 3, -6, 448.0);
}

double ng_ref_round_e5m2(double x)
{
	return round_fp8_(x, 2, -14, 57344.0);
}

/* The capped logits s go through cpu_ops.c's cross-entropy over all Vp columns, whose dlogits
 * is dloss (softmax(s) - onehot); the chain rule then multiplies by ds/dz. */
void ng_ref_softcap_fwd(double *s, const double *z, size_t n, double cap, double div)
{
	for (size_t i = 0; i < n; i++)
		s[i] = cap / (1.0 + exp(-z[i] / div));
}

double ng_ref_softcap_crossentropy(double *losses, double *dz, const double *z,
				   const int32_t *targets, int N, int Vp, double cap, double div,
				   double dloss)
{
	size_t n = (size_t)N * Vp;
	double *s = calloc(n ? n : 1, sizeof(double));
	double *l = losses ? losses : malloc((size_t)N * sizeof(double));
	if (!s || !l) {
		free(s);
		if (!losses)
			free(l);
		return NAN; /* cannot happen at reference sizes */
	}
	ng_ref_softcap_fwd(s, z, n, cap, div);
	ng_ref_crossentropy(l, dz, s, targets, N, Vp, Vp, dloss);
	if (dz)
		for (size_t i = 0; i < n; i++)
			dz[i] *= s[i] * (1.0 - s[i] / cap) / div;
	double total = 0.0;
	for (int r = 0; r < N; r++)
		total += l[r];
	free(s);
	if (!losses)
		free(l);
	return total;
}
