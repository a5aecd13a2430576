/*
 * graph/cpu_muon.h — Muon (kernels/muon.h gives the update) on the CPU: the double-precision
 * reference of the Newton-Schulz iteration, of the Muon step of a batch of matrices and of the
 * speedrun's Adam, a bf16 emulation of the GPU's arithmetic (the naive baseline of the kernel
 * tests' tolerance rule), the table of which parameters Muon takes, and the whole optimizer
 * step of the CPU reference model (--device cpu --optimizer muon).
 *
 * Hidden matrices (graph/gpt.h layout, each (out, in)), their batches and the update's shape
 * scale max(1, rows / cols)^0.5:
 *   qkvw     3L matrices (C, C): each layer's q, k and v slices separately    scale 1
 *   attprojw L (C, C)                                                         scale 1
 *   fcw      L (4C, C) (tall: the iteration of its transpose)                 scale 2
 *   fcprojw  L (C, 4C)                                                        scale 1
 * Every batch is contiguous in the flat buffer: matrix k of a group starts at the parameter's
 * offset + k * rows * cols. Everything else goes to Adam: wte (tied head) and wpe in the
 * embedding group, biases and LayerNorm weights in the scalar group.
 * The Muon momentum lives in the AdamW first-moment buffer's ranges of these matrices (their
 * second-moment ranges stay zero), so the state file holds it as "adam_m" unchanged.
 */
#ifndef NG_GRAPH_CPU_MUON_H
#define NG_GRAPH_CPU_MUON_H

#include <stddef.h>

#include "graph/cpu_ref.h"
#include "graph/gpt.h"
#include "kernels/muon.h"

#define NG_MUON_GROUPS 4

/* One batch of same-shape hidden matrices. */
struct ng_muon_group {
	enum ng_param_id param; /* qkvw, attprojw, fcw or fcprojw */
	int batch;              /* matrices: 3L for qkv, else L */
	int rows, cols;         /* of each matrix, as stored */
	double scale;           /* max(1, rows / cols)^0.5 */
};

/* The four groups in the order above. */
void ng_muon_groups(const struct ng_gpt_config *cfg, struct ng_muon_group out[NG_MUON_GROUPS]);
/* The Adam group of a parameter (enum ng_muon_adam_group), or -1 for a Muon matrix. */
int ng_muon_adam_group_of(enum ng_param_id p);

/* From u (rows x cols, row-major): X = u / (||u|| + 1e-7), then `steps` quintic Newton-Schulz
 * steps, into x (rows x cols). bf16 = 0: all in double. bf16 = 1: the GPU's arithmetic
 * emulated: u rounded to bf16, the norm of that, X rounded to bf16, and each of the three
 * products summed in fp32 from bf16 operands and rounded to bf16 once (alpha and beta applied
 * to the fp32 sum, as cuBLASLt does). rows > cols: the iteration of the transpose. */
void ng_ref_newton_schulz(double *x, const double *u, int rows, int cols, int steps, int bf16);

/* Muon on `batch` matrices (rows x cols) back to back: m = mu m + (1 - mu) g gs; u = (1 - mu) g
 * gs + mu m; x = NS5(u) (bf16 as above); w -= lr * scale * x. */
void ng_ref_muon(double *w, double *m, const double *g, int batch, int rows, int cols,
		 double mu, double lr, double scale, double grad_scale, int bf16);

/* The speedrun's Adam (kernels/muon.h) on n weights with step size alpha (lr and the bias
 * correction folded in: lr sqrt(1 - b2^t) / (1 - b1^t)). */
void ng_ref_adam_speedrun(double *p, double *m, double *v, const double *g, size_t n,
			  double alpha, double beta1, double beta2, double eps, double grad_scale);

/* Adam's step size of a group at 0-based step `step` (the formula of ng_muon_schedule). */
double ng_ref_muon_adam_alpha(const struct ng_muon_config *c, int group, int step);

/* The whole optimizer step of the CPU model under Muon, at 0-based step `step` (the schedule's
 * and the bias correction's count): global-norm clip as ng_cpu_adamw_step, Muon on the hidden
 * matrices (momentum in m->m), the speedrun's Adam on the rest; m->step += 1. Returns the
 * pre-clip gradient norm. */
double ng_cpu_muon_step(struct ng_cpu_model *m, const struct ng_muon_config *c, int step,
			double clip);

#endif
