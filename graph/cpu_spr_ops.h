/*
 * graph/cpu_spr_ops.h — the double-precision reference of every operation the speedrun model
 * adds to graph/cpu_ops.h (docs/DESIGN.md "The speedrun model"). As cpu_ops.h: the oracle of the
 * CPU reference model (graph/cpu_spr.c) and of every GPU kernel test of these ops; plain loops.
 *
 * Conventions as cpu_ops.h: row-major, N rows, "+=" outputs accumulate, "=" outputs overwrite.
 * qkv is (N, 3, H, D) per token (q | k | v, head-major inside each), N = B*T with token t of
 * sequence b at row b*T + t. Positions for the rotary are the token's index t in its sequence
 * (not reset at document starts).
 */
#ifndef NG_GRAPH_CPU_SPR_OPS_H
#define NG_GRAPH_CPU_SPR_OPS_H

#include <stddef.h>
#include <stdint.h>

/* Weightless RMSNorm over rows of C: out = inp / sqrt(mean(inp^2) + eps); rstd (N) = the
 * 1 / sqrt(...) of each row (may be NULL). out "=", may not alias inp. */
void ng_ref_rmsnorm_fwd(double *out, double *rstd, const double *inp, int N, int C, double eps);
/* dinp (N, C) += the gradient through ng_ref_rmsnorm_fwd, from dout and the forward's inp and
 * rstd: rstd * (dout - y * mean(dout * y)) with y = inp * rstd. */
void ng_ref_rmsnorm_bwd(double *dinp, const double *dout, const double *inp, const double *rstd,
			int N, int C);

/* The half-truncated rotary's angular frequencies: freq[i] for pair i = 0 .. D/2 - 1, where pair
 * i is (x[i], x[i + D/2]); pairs i < D/4 get (1/1024)^(i / (D/4 - 1)) (1 when D/4 == 1), the
 * rest 0 (not rotated). */
void ng_ref_rotary_freqs(double *freq, int D);

/* QK-norm then rotary, on q and k of qkv (N, 3, H, D), T tokens a sequence (position = row % T):
 * for q and k of every head: y = rmsnorm(x) over its D channels (eps), then with theta =
 * pos * freq[i]: y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos for x1 = y[i], x2 = y[i + D/2].
 * out (N, 3, H, D) "=": q and k transformed, v copied. rstd (N, 2, H) = each (row, q|k, head)'s
 * 1/sqrt(mean + eps) (may be NULL). */
void ng_ref_qk_norm_rotary_fwd(double *out, double *rstd, const double *qkv, int N, int T, int H,
			       int D, double eps);
/* The same for one row (3, H, D) at position pos (the decode step's token): out "=". */
void ng_ref_qk_norm_rotary_at(double *out, const double *qkv, int pos, int H, int D, double eps);
/* dqkv (N, 3, H, D) += the gradient through ng_ref_qk_norm_rotary_fwd from dout (N, 3, H, D)
 * (its v part passes straight through), given the forward's input qkv and rstd. */
void ng_ref_qk_norm_rotary_bwd(double *dqkv, const double *dout, const double *qkv,
			       const double *rstd, int N, int T, int H, int D);

/* relu^2: out = max(x, 0)^2; dinp = 2 max(x, 0) dout. Both "=" over n elements. */
void ng_ref_relu2_fwd(double *out, const double *inp, size_t n);
void ng_ref_relu2_bwd(double *dinp, const double *inp, const double *dout, size_t n);

/* The two-term mix of the model's scalars: out = a * u + b * w over n elements ("="; w may be
 * NULL: out = a * u). It is the x0 mixing (x = l0 x + l1 x0), the value mixing (v = a0 v + a1 ve)
 * and the U-net skip (x = 1 * x + w_j * skip). Backward, all "+=", any output NULL to skip it:
 * du += a dout, dw += b dout, da += sum(dout * u), db += sum(dout * w). */
void ng_ref_mix2_fwd(double *out, double a, const double *u, double b, const double *w, size_t n);
void ng_ref_mix2_bwd(double *du, double *dw, double *da, double *db, const double *dout, double a,
		     const double *u, double b, const double *w, size_t n);

/* Embedding lookup: out (N, C) = table[tok[r]] ("="); backward dtable (rows, C) += dout rows. */
void ng_ref_embed_fwd(double *out, const int32_t *tok, const double *table, int N, int C);
void ng_ref_embed_bwd(double *dtable, const double *dout, const int32_t *tok, int N, int C);

/* Document ids: doc[b, t] = the number of tokens equal to bos in tok[b, 0..t] (so a document
 * starts at each bos and keys of another document have another id). */
void ng_ref_doc_ids(int32_t *doc, const int32_t *tok, int B, int T, int32_t bos);

/* Attention over qkv (B, T, 3, H, D) with the speedrun's mask: query t sees key s iff s <= t,
 * doc[b, s] == doc[b, t] (doc may be NULL: one document) and s >=
 * ng_attention_window_first(t, window, block) (kernels/window.h; window <= 0: no window;
 * block >= 1 its granularity: 1, the last `window` tokens; the speedrun's 128, the last
 * window / 128 blocks of 128 tokens, t's own included, as its reference masks). Scores
 * scale * q . k. out (B, T, H, D) "=", lse (B, H, T) "=" (may be NULL; natural log of
 * sum_s exp(score)). A query always sees itself, so no row is empty. */
void ng_ref_attention_masked_fwd(double *out, double *lse, const double *qkv, const int32_t *doc,
				 int window, int block, double scale, int B, int T, int H, int D);
/* dqkv (B, T, 3, H, D) += from dout (B, T, H, D), the same mask and scale. */
void ng_ref_attention_masked_bwd(double *dqkv, const double *dout, const double *qkv,
				 const int32_t *doc, int window, int block, double scale, int B, int T,
				 int H, int D);

/* FP8 rounding as a cast does it: to the nearest E4M3 (max 448) or E5M2 (max 57344) value, ties
 * to even, subnormals included; values beyond the largest finite saturate to it (the speedrun's
 * scales keep every operand inside the range). */
double ng_ref_round_e4m3(double x);
double ng_ref_round_e5m2(double x);

/* The soft cap of the head's raw logits: s = cap * sigmoid(z / div) over n values ("="; s may
 * equal z). */
void ng_ref_softcap_fwd(double *s, const double *z, size_t n, double cap, double div);

/* The soft-capped head's loss over all Vp columns of z (N, Vp) (the raw logits):
 *   s = cap * sigmoid(z / div);  losses[r] = logsumexp(s[r]) - s[r, targets[r]]  (N, "=").
 * dz (N, Vp) "=" dloss * (softmax(s) - onehot) * ds/dz, with ds/dz = s (1 - s / cap) / div.
 * losses or dz may be NULL. Returns the sum of the losses. */
double ng_ref_softcap_crossentropy(double *losses, double *dz, const double *z,
				   const int32_t *targets, int N, int Vp, double cap, double div,
				   double dloss);

#endif
