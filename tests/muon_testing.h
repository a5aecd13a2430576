/*
 * tests/muon_testing.h — the checks of one GPU Muon step against the double-precision
 * reference (graph/cpu_muon.h), shared by the GPT-2 and speedrun step tests. Both take the
 * weights before (p0) and after (p1) the step and the GPU's own gradients (grads), flat in the
 * graph's layout, so that only the optimizer is compared.
 */
#ifndef NG_TESTS_MUON_TESTING_H
#define NG_TESTS_MUON_TESTING_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "graph/cpu_muon.h"
#include "graph/ir.h"

/* Every Adam parameter (step `step` of a fresh state, gradient scale gs): the GPU's weights
 * within 1e-4 of the reference's, relative, with the step size added to the denominator (fp32
 * against double). */
static inline void mt_check_adam(const struct ng_graph *g, const struct ng_muon_config *c, int step,
			  double gs, const float *p0, const float *p1, const float *grads,
			  uint64_t seed)
{
	for (int i = 0; i < NG_P_COUNT; i++) {
		int group = ng_muon_adam_group_of((enum ng_param_id)i);
		const struct ng_param_spec *p = &g->lay.p[i];
		if (group < 0 || !ng_param_present(p))
			continue;
		size_t nn = p->numel;
		double *pd = malloc(nn * 8), *md = calloc(nn, 8), *vd = calloc(nn, 8),
		       *gd = malloc(nn * 8);
		cr_assert(pd && md && vd && gd);
		for (size_t j = 0; j < nn; j++) {
			pd[j] = p0[p->offset + j];
			gd[j] = grads[p->offset + j];
		}
		double alpha = ng_ref_muon_adam_alpha(c, group, step);
		ng_ref_adam_speedrun(pd, md, vd, gd, nn, alpha, c->beta1, c->beta2, c->eps, gs);
		double worst = 0;
		for (size_t j = 0; j < nn; j++) {
			double d = fabs(p1[p->offset + j] - pd[j]) / (fabs(pd[j]) + alpha);
			worst = d > worst ? d : worst;
		}
		cr_expect(worst < 1e-4, "adam %s: worst rel err %.3e (seed %llu)", p->name, worst,
			  (unsigned long long)seed);
		free(pd), free(md), free(vd), free(gd);
	}
}

/* Each Muon group from a zero momentum (momentum mu, learning rate lr, gradient scale gs): the
 * update W1 - W0 in relative L2, by the FlashAttention rule: the GPU's error against the double
 * Newton-Schulz within 2 x the bf16 emulation's + 1e-3. Each group's errors go to stderr,
 * after `tag`. */
static inline void mt_check_muon(const struct ng_graph *g, double mu, double lr, double gs,
			  const float *p0, const float *p1, const float *grads, uint64_t seed,
			  const char *tag)
{
	struct ng_muon_group grp[NG_MUON_GROUPS];
	ng_muon_groups(&g->cfg, grp);
	for (int k = 0; k < NG_MUON_GROUPS; k++) {
		const struct ng_param_spec *p = &g->lay.p[grp[k].param];
		size_t nn = (size_t)grp[k].batch * grp[k].rows * grp[k].cols;
		cr_assert_leq(nn, p->numel, "group %d: %zu elements, %s has %zu", k, nn, p->name,
			      p->numel);
		double *w[2], *m = malloc(nn * 8), *gd = malloc(nn * 8);
		cr_assert(m && gd);
		for (int b = 0; b < 2; b++) { /* b = 0: double Newton-Schulz, 1: bf16 emulation */
			w[b] = malloc(nn * 8);
			cr_assert(w[b]);
			for (size_t j = 0; j < nn; j++) {
				w[b][j] = p0[p->offset + j];
				gd[j] = grads[p->offset + j];
				m[j] = 0;
			}
			ng_ref_muon(w[b], m, gd, grp[k].batch, grp[k].rows, grp[k].cols, mu, lr,
				    grp[k].scale, gs, b);
		}
		double eg = 0, ee = 0, den = 0;
		for (size_t j = 0; j < nn; j++) {
			double d64 = w[0][j] - p0[p->offset + j];
			double dg = (double)p1[p->offset + j] - p0[p->offset + j];
			double de = w[1][j] - p0[p->offset + j];
			eg += (dg - d64) * (dg - d64);
			ee += (de - d64) * (de - d64);
			den += d64 * d64;
		}
		eg = sqrt(eg / den), ee = sqrt(ee / den);
		fprintf(stderr, "%s muon %-9s (%d x %d x %d) update rel L2 err %.3e (bf16 emulation "
			"%.3e)\n", tag, p->name, grp[k].batch, grp[k].rows, grp[k].cols, eg, ee);
		cr_expect(eg <= 2 * ee + 1e-3, "muon %s: update rel L2 err %.3e > 2 x bf16 "
			  "emulation's %.3e + 1e-3 (seed %llu)", p->name, eg, ee,
			  (unsigned long long)seed);
		free(w[0]), free(w[1]), free(m), free(gd);
	}
}

#endif
