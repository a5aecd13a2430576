/*
 * graph/cpu_ops.h — the double-precision reference of every operation of the GPT-2 step. It is
 * the oracle: the CPU reference model (cpu_ref.c) is built from these, and every GPU kernel test
 * compares against them. Plain loops, written for obviousness; OpenMP where a loop is large.
 *
 * Conventions: row-major; N = rows (B*T tokens); "+=" outputs accumulate into what the caller
 * provides (zero them first for a plain result), "=" outputs are overwritten.
 * Linear layers store W as (OC, IC), as torch.nn.Linear does: out = inp @ W^T + bias.
 * Attention: qkv is (B, T, 3, H, D) (q | k | v, head-major inside each), out (B, T, H, D),
 * causal, scale 1/sqrt(D); lse (B, H, T) is the natural-log log-sum-exp of each scaled score row.
 */
#ifndef NG_GRAPH_CPU_OPS_H
#define NG_GRAPH_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>

/* out (B*T, C) = wte[tok] + wpe[t]. wte (Vp, C), wpe (>=T, C), tok (B, T). */
void ng_ref_encoder_fwd(double *out, const int32_t *tok, const double *wte, const double *wpe,
			int B, int T, int C);
/* dwte (Vp, C) +=, dwpe (>=T, C) += from dout (B*T, C). */
void ng_ref_encoder_bwd(double *dwte, double *dwpe, const double *dout, const int32_t *tok, int B,
			int T, int C);

/* out (N, C) =, mean (N) =, rstd (N) = ; eps 1e-5, biased variance. */
void ng_ref_layernorm_fwd(double *out, double *mean, double *rstd, const double *inp,
			  const double *w, const double *b, int N, int C);
/* dinp (N, C) +=, dw (C) +=, db (C) += . Any of the three may be NULL. */
void ng_ref_layernorm_bwd(double *dinp, double *dw, double *db, const double *dout,
			  const double *inp, const double *w, const double *mean,
			  const double *rstd, int N, int C);

/* out (N, OC) = inp (N, IC) @ w (OC, IC)^T + bias (OC; may be NULL). */
void ng_ref_matmul_fwd(double *out, const double *inp, const double *w, const double *bias, int N,
		       int IC, int OC);
/* dinp (N, IC) +=, dw (OC, IC) +=, dbias (OC) += ; any may be NULL. */
void ng_ref_matmul_bwd(double *dinp, double *dw, double *dbias, const double *dout,
		       const double *inp, const double *w, int N, int IC, int OC);

/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). out/dinp "=". */
void ng_ref_gelu_fwd(double *out, const double *inp, size_t n);
void ng_ref_gelu_bwd(double *dinp, const double *inp, const double *dout, size_t n);

/* out (B, T, H, D) =, lse (B, H, T) = (lse may be NULL). */
void ng_ref_attention_fwd(double *out, double *lse, const double *qkv, int B, int T, int H, int D);
/* dqkv (B, T, 3, H, D) += from dout (B, T, H, D). */
void ng_ref_attention_bwd(double *dqkv, const double *dout, const double *qkv, int B, int T, int H,
			  int D);

/* Softmax cross-entropy over the first V of Vp columns of logits (N, Vp). losses (N) =,
 * dlogits (N, Vp) = dloss * (softmax - onehot), padded columns V..Vp-1 get 0. Either output may
 * be NULL. Returns the mean loss. */
double ng_ref_crossentropy(double *losses, double *dlogits, const double *logits,
			   const int32_t *targets, int N, int V, int Vp, double dloss);

/* One AdamW step on n elements, `step` counted from 1 (bias correction 1 - beta^step).
 * Decoupled weight decay: p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p). grad is used as
 * grad * grad_scale (the clip scale). */
void ng_ref_adamw(double *p, double *m, double *v, const double *grad, size_t n, double lr,
		  double beta1, double beta2, double eps, double wd, double grad_scale, int step);

/* The learning rate at optimizer step `step` (0-based): linear warmup over `warmup` steps to
 * lr_max, then cosine (cosine != 0) or linear decay to lr_max * final_frac at step total - 1. */
double ng_ref_lr(int step, int warmup, int total, double lr_max, double final_frac, int cosine);

/* Test helper: the derivative of the scalar f(ctx) with respect to *x by the fourth-order central
 * difference (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / (12 h); *x is restored exactly. */
double ng_ref_fd_derivative(double (*f)(void *ctx), void *ctx, double *x, double h);

/* Worst disagreement found by ng_ref_fd_compare. */
struct ng_ref_fd_result {
	double max_rel;     /* largest |a - n| / max(|a|, |n|, floor) */
	double max_abs;     /* largest |a - n| */
	size_t worst_index; /* element (into x) where max_rel occurred */
	double analytic;    /* a at the worst element */
	double numeric;     /* n at the worst element */
	double max_rel_big; /* largest |a - n| / max(|a|, |n|) where that max is >= floor */
	size_t count;       /* elements checked */
};
/* Compare analytic[i] with the finite-difference derivative of f with respect to x[i], for i in
 * idx[0..count-1] (idx NULL: i = 0..count-1). floor keeps the relative error of tiny gradients
 * meaningful. x is restored. */
void ng_ref_fd_compare(struct ng_ref_fd_result *res, double (*f)(void *ctx), void *ctx, double *x,
		       const double *analytic, const size_t *idx, size_t count, double h,
		       double floor);

#endif
