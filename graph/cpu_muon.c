/*
 * graph/cpu_muon.c — Muon and the speedrun's Adam on the CPU (see cpu_muon.h): plain loops in
 * double, and the same loops with the GPU's bf16 roundings for the kernel tests' baseline.
 */
#include "graph/cpu_muon.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void ng_muon_groups(const struct ng_gpt_config *cfg, struct ng_muon_group out[NG_MUON_GROUPS])
{
	int L = cfg->L, C = cfg->C;
	int La = cfg->arch == NG_ARCH_SPEEDRUN ? L - 1 : L; /* blocks with attention */
	out[0] = (struct ng_muon_group){ NG_P_QKVW, 3 * La, C, C, 1.0 };
	out[1] = (struct ng_muon_group){ NG_P_ATTPROJW, La, C, C, 1.0 };
	out[2] = (struct ng_muon_group){ NG_P_FCW, L, 4 * C, C, 2.0 };
	out[3] = (struct ng_muon_group){ NG_P_FCPROJW, L, C, 4 * C, 1.0 };
}

int ng_muon_adam_group_of(enum ng_param_id p)
{
	switch (p) {
	case NG_P_QKVW: case NG_P_ATTPROJW: case NG_P_FCW: case NG_P_FCPROJW:
		return -1;
	case NG_P_WTE: case NG_P_WPE: case NG_P_VE:
		return NG_MUON_ADAM_EMBED;
	case NG_P_HEADW:
		return NG_MUON_ADAM_HEAD;
	default:
		return NG_MUON_ADAM_SCALAR;
	}
}

/* x rounded to bf16 (nearest even), as a double. */
static double rb(double x)
{
	float f = (float)x;
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7FFFFFFFu) > 0x7F800000u)
		return x;
	u += 0x7FFFu + ((u >> 16) & 1u);
	u &= 0xFFFF0000u;
	memcpy(&f, &u, 4);
	return f;
}

/* The iteration on a wide (or square) X: r <= c, row-major, in place. */
static void ns_wide(double *X, int r, int c, int steps, int bf16)
{
	const double a = NG_MUON_NS_A, b = NG_MUON_NS_B, cc = NG_MUON_NS_C;
	size_t rr = (size_t)r * r, rc = (size_t)r * c;
	double *A = malloc(rr * sizeof(double)), *B = malloc(rr * sizeof(double));
	double *Y = malloc(rc * sizeof(double));
	if (!A || !B || !Y)
		abort(); /* the reference's few KiB; a test helper */
	for (int s = 0; s < steps; s++) {
		for (int i = 0; i < r; i++)
			for (int j = 0; j < r; j++) {
				double d = 0;
				float f = 0;
				for (int k = 0; k < c; k++) {
					d += X[(size_t)i * c + k] * X[(size_t)j * c + k];
					f += (float)X[(size_t)i * c + k] * (float)X[(size_t)j * c + k];
				}
				A[(size_t)i * r + j] = bf16 ? rb(f) : d;
			}
		for (int i = 0; i < r; i++)
			for (int j = 0; j < r; j++) {
				double d = 0;
				float f = 0;
				for (int k = 0; k < r; k++) {
					d += A[(size_t)i * r + k] * A[(size_t)k * r + j];
					f += (float)A[(size_t)i * r + k] * (float)A[(size_t)k * r + j];
				}
				B[(size_t)i * r + j] = bf16 ? rb((float)cc * f + (float)b *
								 (float)A[(size_t)i * r + j])
							    : cc * d + b * A[(size_t)i * r + j];
			}
		for (int i = 0; i < r; i++)
			for (int j = 0; j < c; j++) {
				double d = 0;
				float f = 0;
				for (int k = 0; k < r; k++) {
					d += B[(size_t)i * r + k] * X[(size_t)k * c + j];
					f += (float)B[(size_t)i * r + k] * (float)X[(size_t)k * c + j];
				}
				Y[(size_t)i * c + j] = bf16 ? rb(f + (float)a * (float)X[(size_t)i * c + j])
							    : d + a * X[(size_t)i * c + j];
			}
		memcpy(X, Y, rc * sizeof(double));
	}
	free(A), free(B), free(Y);
}

void ng_ref_newton_schulz(double *x, const double *u, int rows, int cols, int steps, int bf16)
{
	size_t n = (size_t)rows * cols;
	int tall = rows > cols;
	int r = tall ? cols : rows, c = tall ? rows : cols;
	double *X = malloc(n * sizeof(double));
	if (!X)
		abort();
	for (int i = 0; i < rows; i++)
		for (int j = 0; j < cols; j++) {
			double v = u[(size_t)i * cols + j];
			X[tall ? (size_t)j * rows + i : (size_t)i * cols + j] = bf16 ? rb(v) : v;
		}
	double ss = 0;
	for (size_t i = 0; i < n; i++)
		ss += X[i] * X[i];
	if (bf16) {
		float den = (float)sqrt(ss) + (float)NG_MUON_NORM_EPS;
		for (size_t i = 0; i < n; i++)
			X[i] = rb((float)X[i] / den);
	} else {
		double den = sqrt(ss) + NG_MUON_NORM_EPS;
		for (size_t i = 0; i < n; i++)
			X[i] /= den;
	}
	ns_wide(X, r, c, steps, bf16);
	for (int i = 0; i < rows; i++)
		for (int j = 0; j < cols; j++)
			x[(size_t)i * cols + j] = X[tall ? (size_t)j * rows + i : (size_t)i * cols + j];
	free(X);
}

void ng_ref_muon(double *w, double *m, const double *g, int batch, int rows, int cols,
		 double mu, double lr, double scale, double grad_scale, int bf16)
{
	size_t n = (size_t)rows * cols;
	double *u = malloc(n * sizeof(double)), *x = malloc(n * sizeof(double));
	if (!u || !x)
		abort();
	for (int k = 0; k < batch; k++) {
		double *wk = w + k * n, *mk = m + k * n;
		const double *gk = g + k * n;
		for (size_t i = 0; i < n; i++) {
			double gi = gk[i] * grad_scale;
			mk[i] = mu * mk[i] + (1.0 - mu) * gi;
			u[i] = (1.0 - mu) * gi + mu * mk[i];
		}
		ng_ref_newton_schulz(x, u, rows, cols, NG_MUON_NS_STEPS, bf16);
		for (size_t i = 0; i < n; i++)
			wk[i] -= lr * scale * x[i];
	}
	free(u), free(x);
}

void ng_ref_adam_speedrun(double *p, double *m, double *v, const double *g, size_t n,
			  double alpha, double beta1, double beta2, double eps, double grad_scale)
{
	for (size_t i = 0; i < n; i++) {
		double gi = g[i] * grad_scale;
		m[i] = beta1 * m[i] + (1.0 - beta1) * gi;
		v[i] = beta2 * v[i] + (1.0 - beta2) * gi * gi;
		p[i] -= alpha * m[i] / (sqrt(v[i]) + eps);
	}
}

double ng_ref_muon_adam_alpha(const struct ng_muon_config *c, int group, int step)
{
	double t = step + 1.0;
	double f = ng_muon_lr_factor(step, c->total, c->cooldown_frac, c->final_frac);
	return (double)c->adam_lr * c->adam_mult[group] * f * sqrt(1.0 - pow(c->beta2, t)) /
	       (1.0 - pow(c->beta1, t));
}

double ng_cpu_muon_step(struct ng_cpu_model *m, const struct ng_muon_config *c, int step,
			double clip)
{
	double norm = ng_cpu_grad_norm(m);
	double gs = clip > 0.0 && norm > clip ? clip / norm : 1.0;
	double f = ng_muon_lr_factor(step, c->total, c->cooldown_frac, c->final_frac);
	double mu = ng_muon_momentum(step, c->mu_start, c->mu_end, c->mu_warmup);
	m->step += 1;
	struct ng_muon_group grp[NG_MUON_GROUPS];
	ng_muon_groups(&m->cfg, grp);
	for (int k = 0; k < NG_MUON_GROUPS; k++) {
		size_t off = m->lay.p[grp[k].param].offset;
		ng_ref_muon(m->params + off, m->m + off, m->grads + off, grp[k].batch, grp[k].rows,
			    grp[k].cols, mu, c->lr * f, grp[k].scale, gs, 0);
	}
	for (int i = 0; i < NG_P_COUNT; i++) {
		int group = ng_muon_adam_group_of((enum ng_param_id)i);
		if (group < 0)
			continue;
		const struct ng_param_spec *p = &m->lay.p[i];
		ng_ref_adam_speedrun(m->params + p->offset, m->m + p->offset, m->v + p->offset,
				     m->grads + p->offset, p->numel,
				     ng_ref_muon_adam_alpha(c, group, step), c->beta1, c->beta2,
				     c->eps, gs);
	}
	return norm;
}
