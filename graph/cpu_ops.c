/*
 * graph/cpu_ops.c — the double-precision reference ops declared in graph/cpu_ops.h.
 *
 * Why: this is the oracle every GPU kernel test and the CPU reference model (cpu_ref.c) compare
 * against, so each function is the plainest loop that is obviously the textbook formula. Speed
 * matters only enough for tests to finish: OpenMP splits the big outer loops (matmul rows and
 * columns) and nothing else, and every parallel loop writes disjoint outputs so results do not
 * depend on the thread count. The causal attention is the masked attention of cpu_spr_ops.c
 * with one document and no window.
 *
 * Shapes are documented per function in cpu_ops.h. References: GPT-2 as in llm.c / nanoGPT
 * (pre-LN, tanh GELU, tied head); AdamW (Loshchilov & Hutter, decoupled decay); the attention
 * backward recomputes the softmax from qkv, so it is exact (no stored probabilities).
 */
#include "graph/cpu_ops.h"
#include "graph/cpu_spr_ops.h"

#include <math.h>

#define NG_REF_LN_EPS 1e-5
#define NG_REF_PI 3.14159265358979323846
/* Below this many multiply-adds a loop runs on one thread: starting a team costs more than the
 * work, and tiny test shapes then stay fast on a loaded 2-core CI machine. */
#define NG_REF_OMP_MIN_WORK 262144.0

void ng_ref_encoder_fwd(double *out, const int32_t *tok, const double *wte, const double *wpe,
			int B, int T, int C)
{
	for (int b = 0; b < B; b++) {
		for (int t = 0; t < T; t++) {
			double *o = out + ((size_t)b * T + t) * C;
			const double *we = wte + (size_t)tok[(size_t)b * T + t] * C;
			const double *pe = wpe + (size_t)t * C;
			for (int c = 0; c < C; c++)
				o[c] = we[c] + pe[c];
		}
	}
}

void ng_ref_encoder_bwd(double *dwte, double *dwpe, const double *dout, const int32_t *tok, int B,
			int T, int C)
{
	for (int b = 0; b < B; b++) {
		for (int t = 0; t < T; t++) {
			const double *d = dout + ((size_t)b * T + t) * C;
			double *we = dwte + (size_t)tok[(size_t)b * T + t] * C;
			double *pe = dwpe + (size_t)t * C;
			for (int c = 0; c < C; c++) {
				we[c] += d[c];
				pe[c] += d[c];
			}
		}
	}
}

void ng_ref_layernorm_fwd(double *out, double *mean, double *rstd, const double *inp,
			  const double *w, const double *b, int N, int C)
{
	for (int n = 0; n < N; n++) {
		const double *x = inp + (size_t)n * C;
		double *o = out + (size_t)n * C;
		double mu = 0.0;
		for (int c = 0; c < C; c++)
			mu += x[c];
		mu /= C;
		double var = 0.0;
		for (int c = 0; c < C; c++)
			var += (x[c] - mu) * (x[c] - mu);
		var /= C;
		double rs = 1.0 / sqrt(var + NG_REF_LN_EPS);
		for (int c = 0; c < C; c++)
			o[c] = (x[c] - mu) * rs * w[c] + b[c];
		mean[n] = mu;
		rstd[n] = rs;
	}
}

void ng_ref_layernorm_bwd(double *dinp, double *dw, double *db, const double *dout,
			  const double *inp, const double *w, const double *mean,
			  const double *rstd, int N, int C)
{
	for (int n = 0; n < N; n++) {
		const double *x = inp + (size_t)n * C;
		const double *d = dout + (size_t)n * C;
		double mu = mean[n], rs = rstd[n];
		/* xhat = (x - mu) * rs; dxhat = d * w;
		 * dx = rs * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) */
		double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
		for (int c = 0; c < C; c++) {
			double xhat = (x[c] - mu) * rs;
			double dxhat = d[c] * w[c];
			sum_dxhat += dxhat;
			sum_dxhat_xhat += dxhat * xhat;
			if (dw)
				dw[c] += d[c] * xhat;
			if (db)
				db[c] += d[c];
		}
		if (!dinp)
			continue;
		double m1 = sum_dxhat / C, m2 = sum_dxhat_xhat / C;
		double *dx = dinp + (size_t)n * C;
		for (int c = 0; c < C; c++) {
			double xhat = (x[c] - mu) * rs;
			dx[c] += rs * (d[c] * w[c] - m1 - xhat * m2);
		}
	}
}

void ng_ref_matmul_fwd(double *out, const double *inp, const double *w, const double *bias, int N,
		       int IC, int OC)
{
#pragma omp parallel for schedule(static) if((double)N * IC * OC >= NG_REF_OMP_MIN_WORK)
	for (int n = 0; n < N; n++) {
		const double *x = inp + (size_t)n * IC;
		for (int o = 0; o < OC; o++) {
			const double *wr = w + (size_t)o * IC;
			double s = bias ? bias[o] : 0.0;
			for (int i = 0; i < IC; i++)
				s += x[i] * wr[i];
			out[(size_t)n * OC + o] = s;
		}
	}
}

void ng_ref_matmul_bwd(double *dinp, double *dw, double *dbias, const double *dout,
		       const double *inp, const double *w, int N, int IC, int OC)
{
	if (dinp) {
		/* dinp[n, i] += sum_o dout[n, o] * w[o, i]; rows are independent */
#pragma omp parallel for schedule(static) if((double)N * IC * OC >= NG_REF_OMP_MIN_WORK)
		for (int n = 0; n < N; n++) {
			const double *d = dout + (size_t)n * OC;
			double *dx = dinp + (size_t)n * IC;
			for (int o = 0; o < OC; o++) {
				const double *wr = w + (size_t)o * IC;
				double g = d[o];
				for (int i = 0; i < IC; i++)
					dx[i] += g * wr[i];
			}
		}
	}
	if (dw || dbias) {
		/* dw[o, i] += sum_n dout[n, o] * inp[n, i]; output rows o are independent */
#pragma omp parallel for schedule(static) if((double)N * IC * OC >= NG_REF_OMP_MIN_WORK)
		for (int o = 0; o < OC; o++) {
			double *dwr = dw ? dw + (size_t)o * IC : NULL;
			double sb = 0.0;
			for (int n = 0; n < N; n++) {
				double g = dout[(size_t)n * OC + o];
				sb += g;
				if (dwr) {
					const double *x = inp + (size_t)n * IC;
					for (int i = 0; i < IC; i++)
						dwr[i] += g * x[i];
				}
			}
			if (dbias)
				dbias[o] += sb;
		}
	}
}

#define NG_REF_GELU_K 0.7978845608028654 /* sqrt(2/pi) */

void ng_ref_gelu_fwd(double *out, const double *inp, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		double x = inp[i];
		out[i] = 0.5 * x * (1.0 + tanh(NG_REF_GELU_K * (x + 0.044715 * x * x * x)));
	}
}

void ng_ref_gelu_bwd(double *dinp, const double *inp, const double *dout, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		double x = inp[i];
		double u = NG_REF_GELU_K * (x + 0.044715 * x * x * x);
		double th = tanh(u);
		double du = NG_REF_GELU_K * (1.0 + 3.0 * 0.044715 * x * x);
		double g = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du;
		dinp[i] = g * dout[i];
	}
}

/* The causal attention is the speedrun's masked attention (graph/cpu_spr_ops.c) with one
 * document, no window and the scale 1/sqrt(D): one implementation serves both models. */
void ng_ref_attention_fwd(double *out, double *lse, const double *qkv, int B, int T, int H, int D)
{
	ng_ref_attention_masked_fwd(out, lse, qkv, NULL, 0, 1, 1.0 / sqrt((double)D), B, T, H, D);
}

void ng_ref_attention_bwd(double *dqkv, const double *dout, const double *qkv, int B, int T, int H,
			  int D)
{
	ng_ref_attention_masked_bwd(dqkv, dout, qkv, NULL, 0, 1, 1.0 / sqrt((double)D), B, T, H, D);
}

double ng_ref_crossentropy(double *losses, double *dlogits, const double *logits,
			   const int32_t *targets, int N, int V, int Vp, double dloss)
{
	double total = 0.0;
	for (int n = 0; n < N; n++) {
		const double *z = logits + (size_t)n * Vp;
		double mx = -INFINITY;
		for (int v = 0; v < V; v++)
			if (z[v] > mx)
				mx = z[v];
		double sum = 0.0;
		for (int v = 0; v < V; v++)
			sum += exp(z[v] - mx);
		double lse = mx + log(sum);
		int tg = targets[n];
		double loss = lse - z[tg];
		if (losses)
			losses[n] = loss;
		total += loss;
		if (dlogits) {
			double *dz = dlogits + (size_t)n * Vp;
			for (int v = 0; v < V; v++)
				dz[v] = dloss * (exp(z[v] - lse) - (v == tg ? 1.0 : 0.0));
			for (int v = V; v < Vp; v++)
				dz[v] = 0.0;
		}
	}
	return N > 0 ? total / N : 0.0;
}

void ng_ref_adamw(double *p, double *m, double *v, const double *grad, size_t n, double lr,
		  double beta1, double beta2, double eps, double wd, double grad_scale, int step)
{
	double bc1 = 1.0 - pow(beta1, step), bc2 = 1.0 - pow(beta2, step);
	for (size_t i = 0; i < n; i++) {
		double g = grad[i] * grad_scale;
		m[i] = beta1 * m[i] + (1.0 - beta1) * g;
		v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
		double mhat = m[i] / bc1, vhat = v[i] / bc2;
		p[i] -= lr * (mhat / (sqrt(vhat) + eps) + wd * p[i]);
	}
}

double ng_ref_lr(int step, int warmup, int total, double lr_max, double final_frac, int cosine)
{
	if (step < warmup)
		return lr_max * (double)(step + 1) / (double)warmup;
	double lr_min = lr_max * final_frac;
	int span = total - 1 - warmup; /* decay runs from step `warmup` to step total - 1 */
	if (span <= 0)
		return lr_max; /* no room to decay after the warmup */
	double frac = (double)(step - warmup) / (double)span;
	if (frac > 1.0)
		frac = 1.0;
	if (cosine)
		return lr_min + 0.5 * (lr_max - lr_min) * (1.0 + cos(NG_REF_PI * frac));
	return lr_max - (lr_max - lr_min) * frac;
}

double ng_ref_fd_derivative(double (*f)(void *ctx), void *ctx, double *x, double h)
{
	double x0 = *x;
	*x = x0 + h;
	double f1p = f(ctx);
	*x = x0 - h;
	double f1m = f(ctx);
	*x = x0 + 2.0 * h;
	double f2p = f(ctx);
	*x = x0 - 2.0 * h;
	double f2m = f(ctx);
	*x = x0;
	return (8.0 * (f1p - f1m) - (f2p - f2m)) / (12.0 * h);
}

void ng_ref_fd_compare(struct ng_ref_fd_result *res, double (*f)(void *ctx), void *ctx, double *x,
		       const double *analytic, const size_t *idx, size_t count, double h,
		       double floor)
{
	res->max_rel = 0.0;
	res->max_rel_big = 0.0;
	res->max_abs = 0.0;
	res->worst_index = 0;
	res->analytic = 0.0;
	res->numeric = 0.0;
	res->count = count;
	for (size_t k = 0; k < count; k++) {
		size_t i = idx ? idx[k] : k;
		double n = ng_ref_fd_derivative(f, ctx, x + i, h);
		double a = analytic[i];
		double err = fabs(a - n);
		double den = fmax(fmax(fabs(a), fabs(n)), floor);
		if (err > res->max_abs)
			res->max_abs = err;
		if (den > floor && err / den > res->max_rel_big)
			res->max_rel_big = err / den;
		if (err / den > res->max_rel || k == 0) {
			res->max_rel = err / den;
			res->worst_index = i;
			res->analytic = a;
			res->numeric = n;
		}
	}
}
