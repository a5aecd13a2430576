/*
 * kernels/muon.h — the Muon optimizer on the device (--optimizer muon): the per-step scalars,
 * the momentum with the Nesterov look-ahead, the per-matrix Frobenius normalisation, the
 * Newton-Schulz orthogonalisation as strided-batched cuBLASLt GEMMs (kernels/muon_ns.c), the
 * update of the split fp32 master (kernels/split.h), and the Adam of the speedrun for the
 * parameters that are not hidden matrices. Valid C11; launchers return NG_OK or an error.
 *
 * The update, for one hidden matrix W (rows x cols, stored (out, in) like torch.nn.Linear) with
 * gradient g (times the clip scale) and momentum buffer m (fp32):
 *   m = lerp(m, g, 1 - mu)              = mu m + (1 - mu) g
 *   u = lerp(g, m, mu)                  = (1 - mu) g + mu m        (Nesterov)
 *   X = bf16(u) / (||bf16(u)||_F + 1e-7), in bf16
 *   5 times, with (a, b, c) = (3.4445, -4.7750, 2.0315), every product a bf16 GEMM that
 *   accumulates in fp32 and rounds once:
 *     A = X X^T;  B = b A + c (A A);  X = a X + B X
 *   (rows > cols: the iteration of X^T, written without transposes as A = X^T X,
 *   X = a X + X B: the same dot products)
 *   W -= lr * max(1, rows / cols)^0.5 * X
 * B = b A + c (A A) is one GEMM of A with itself, alpha = c, beta = b, C = A; X = a X + B X is
 * one GEMM with beta = a, C = X. In bf16 the grouping matters (B is rounded once).
 * The Adam of the rest (Jordan et al.'s speedrun form; no weight decay):
 *   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
 *   p -= lr_group * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps),  t = step + 1
 * ng_adamw (kernels/optim.h) divides v by its correction inside the root, eps outside
 * (m / bc1 / (sqrt(v / bc2) + eps)), which puts eps * sqrt(bc2) where this form has eps, and
 * its eps is a constant of the capture, so it cannot be made to match by arguments: this file
 * has the one kernel of that form.
 *
 * Adam groups: the speedrun model gives its (untied) embeddings 75 x 0.008 = 0.6, its head
 * 27.5 x 0.008 = 0.22 and its scalars 5 x 0.008 = 0.04 (train sets 75 for that family).
 * GPT-2 ties the head to wte, so the embedding group (wte, wpe) gets a head's rate (multiplier
 * 1) by default: on the CPU reference's tiny model, 50 steps, 0.6 drove the loss from 6.27 up to
 * 12.1 at step 10 and ended at 3.80; 0.008 ended at 2.76 (AdamW's defaults: 4.43). Biases and
 * LayerNorm weights get 5 x 0.008 = 0.04, the speedrun's scalar lr.
 *
 * Scalars: a run's constants (struct ng_muon_config) are kernel arguments; everything that
 * changes with the step (Muon's lr and momentum, each Adam group's step size) is computed on
 * the device from st->step by ng_muon_schedule into a struct ng_muon_scalars in device memory,
 * which the other kernels read, so a replayed graph sees this step's values.
 * Schedule: lr factor 1 until step (1 - cooldown_frac) * total, then linear to final_frac at
 * the last step (ng_muon_lr_factor); mu from mu_start to mu_end linearly over mu_warmup steps.
 *
 * References: K. Jordan et al., "Muon: an optimizer for hidden layers in neural networks"
 * (2024, kellerjordan.github.io/posts/muon) and the modded-nanogpt speedrun's description of
 * it (the quintic coefficients, the Nesterov form, the shape scale and the schedule).
 */
#ifndef NG_KERNELS_MUON_H
#define NG_KERNELS_MUON_H

#include <cuda_runtime.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The quintic Newton-Schulz coefficients and the normalisation's epsilon. */
#define NG_MUON_NS_A 3.4445
#define NG_MUON_NS_B (-4.7750)
#define NG_MUON_NS_C 2.0315
#define NG_MUON_NS_STEPS 5
#define NG_MUON_NORM_EPS 1e-7

/* Adam's parameter groups under Muon, each with its own learning-rate multiplier. */
enum ng_muon_adam_group {
	NG_MUON_ADAM_EMBED,  /* wte (GPT-2: also the tied head), wpe, the value embeddings */
	NG_MUON_ADAM_SCALAR, /* biases and LayerNorm weights; the speedrun model's scalars */
	NG_MUON_ADAM_HEAD,   /* the speedrun model's untied head */
	NG_MUON_ADAM_GROUPS
};

/* Constants of a Muon run (passed by value). */
struct ng_muon_config {
	float lr;             /* Muon learning rate (0.05) */
	float mu_start;       /* momentum at step 0 (0.85) */
	float mu_end;         /* momentum after the warm-up (0.95) */
	int mu_warmup;        /* steps of the linear momentum warm-up (300) */
	float adam_lr;        /* Adam base learning rate (0.008) */
	float adam_mult[NG_MUON_ADAM_GROUPS]; /* its multiplier per group (embeddings 1,
	                       * biases and LayerNorm 5, head 27.5; the speedrun model's
	                       * embeddings 75); see "Adam groups" */
	float beta1, beta2;   /* Adam (0.8, 0.95) */
	float eps;            /* Adam (1e-10) */
	float cooldown_frac;  /* last fraction of the steps with the linear cooldown (0.4) */
	float final_frac;     /* lr factor at the last step (0.1) */
	int total;            /* optimizer steps of the run */
};

/* The per-step scalars (device memory, written by ng_muon_schedule). */
struct ng_muon_scalars {
	float lr;             /* Muon lr of this step: cfg.lr * factor */
	float mu;             /* momentum of this step */
	float adam_alpha[NG_MUON_ADAM_GROUPS]; /* Adam step size: adam_lr * mult * factor *
	                       * sqrt(1 - b2^t) / (1 - b1^t) */
	float pad_[4];
};

#ifdef __CUDACC__
#define NG_MUON_FN_ static inline __host__ __device__
#else
#define NG_MUON_FN_ static inline
#endif

/* The defaults above. The body is in the header so that C and CUDA share one definition. */
NG_MUON_FN_ struct ng_muon_config ng_muon_config_default(int total)
{
	struct ng_muon_config c = { 0.05f, 0.85f, 0.95f, 300, 0.008f, { 1.0f, 5.0f, 27.5f },
				    0.8f, 0.95f, 1e-10f, 0.4f, 0.1f, total };
	return c;
}

/* The learning-rate factor at 0-based step `step` of `total`: 1, then over the last
 * cooldown_frac of the run linear in the step to final_frac at step == total. */
NG_MUON_FN_ double ng_muon_lr_factor(int step, int total, double cooldown_frac,
				     double final_frac)
{
	if (total <= 0 || cooldown_frac <= 0.0)
		return 1.0;
	double x = (double)step / (double)total;
	if (x < 1.0 - cooldown_frac)
		return 1.0;
	double w = (1.0 - x) / cooldown_frac;
	if (w < 0.0)
		w = 0.0;
	return w + (1.0 - w) * final_frac;
}

/* The momentum at 0-based step `step`. */
NG_MUON_FN_ double ng_muon_momentum(int step, double mu_start, double mu_end, int warmup)
{
	double f = warmup > 0 ? (double)step / (double)warmup : 1.0;
	if (f > 1.0)
		f = 1.0;
	return (1.0 - f) * mu_start + f * mu_end;
}

#undef NG_MUON_FN_

/* One thread: *out from st->step and cfg (see the top); st->lr = Muon's lr of this step (what
 * the metrics report). */
enum ng_status ng_muon_schedule(struct ng_muon_scalars *out,    /* device, = */
				struct ng_step_state *st,       /* device, lr written */
				struct ng_muon_config cfg, cudaStream_t s);

/* m = mu m + (1 - mu) g; u = bf16((1 - mu) g + mu m), g = grad * st->clip_scale. Nothing when
 * st->skipped. grad, m 16-byte aligned, u 8-byte aligned. */
enum ng_status ng_muon_momentum_update(ng_bf16 *u,        /* (n) bf16, = */
				       float *m,          /* (n) fp32, updated */
				       const float *grad, /* (n) fp32 */
				       size_t n, const struct ng_muon_scalars *sc, /* device */
				       const struct ng_step_state *st, cudaStream_t s);

/* For each of `batch` matrices of `numel` bf16 elements, `stride` elements apart, in place:
 * x = bf16(x / (||x||_F + 1e-7)), the norm summed in double in a fixed order (deterministic):
 * per chunk of NG_MUON_NORM_CHUNK elements into `partials`, then per matrix. */
#define NG_MUON_NORM_CHUNK 16384
enum ng_status ng_muon_normalize(ng_bf16 *x,              /* (batch, stride) bf16, updated */
				 double *partials,        /* ng_muon_normalize_scratch_bytes, = */
				 size_t numel, size_t stride, int batch, cudaStream_t s);
/* The bytes of ng_muon_normalize's partials for `batch` matrices of `numel` elements. */
size_t ng_muon_normalize_scratch_bytes(size_t numel, int batch);

/* The Muon step of n master weights: w = split(hi, lo); w -= sc->lr * scale * x; split again.
 * Nothing when st->skipped. hi, lo, x 8-byte aligned. */
enum ng_status ng_muon_apply(ng_bf16 *param_hi,          /* (n) bf16 copy, updated */
			     uint16_t *param_lo,         /* (n) low half, updated */
			     const ng_bf16 *x,           /* (n) bf16, the orthogonalised update */
			     size_t n, float scale,
			     const struct ng_muon_scalars *sc, const struct ng_step_state *st,
			     cudaStream_t s);

/* The speedrun's Adam (see the top) on n master weights of Adam group `group`, step size
 * sc->adam_alpha[group], g = grad * st->clip_scale. Nothing when st->skipped. grad, m, v
 * 16-byte aligned; hi, lo 8-byte aligned. */
enum ng_status ng_muon_adam(ng_bf16 *param_hi,           /* (n) bf16 copy, updated */
			    uint16_t *param_lo,          /* (n) low half, updated */
			    float *m,                    /* (n) fp32, updated */
			    float *v,                    /* (n) fp32, updated */
			    const float *grad,           /* (n) fp32 */
			    size_t n, int group, float beta1, float beta2, float eps,
			    const struct ng_muon_scalars *sc, const struct ng_step_state *st,
			    cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
