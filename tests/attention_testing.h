/*
 * tests/attention_testing.h — what the attention tests (test_attention.c, GPT-2's causal mask;
 * test_attention_masked.c, the speedrun model's mask) share: the naive bf16 witness of the
 * FlashAttention tolerance rule and the comparison that applies it.
 *
 * The witness is what PyTorch's bf16 math path computes: every matmul output, the scaled scores,
 * the probabilities and the gradients rounded to bf16, fp32 accumulation. The rule
 * (docs/CONTRIBUTING.md): max|kernel - fp64| <= 2 * max|witness - fp64| + atol.
 * Header-only (static functions), as tests/kernel_testing.h.
 */
#ifndef NG_TESTS_ATTENTION_TESTING_H
#define NG_TESTS_ATTENTION_TESTING_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* x rounded to bf16 (nearest even), back in fp32. */
static float at_rbf(float x)
{
	uint32_t u;
	memcpy(&u, &x, 4);
	if ((u & 0x7fffffffu) <= 0x7f800000u) {
		u += 0x7fffu + ((u >> 16) & 1u);
		u &= 0xffff0000u;
	}
	memcpy(&x, &u, 4);
	return x;
}

/* The naive bf16 attention, forward and backward, on the CPU: query t of sequence b sees keys
 * first[b * T + t] .. t (first NULL: 0 .. t, GPT-2's causal mask); scores scale * q . k.
 * qkv (B,T,3,H,D), dout and out (B,T,H,D), lse (B,H,T), dqkv (B,T,3,H,D) "=". */
static void at_lowp_attention(float *out, float *lse, float *dqkv, const float *qkv,
			      const float *dout, const int32_t *first, float scale, int B, int H,
			      int T, int D)
{
	size_t C3 = (size_t)3 * H * D;
#pragma omp parallel for schedule(dynamic)
	for (int bh = 0; bh < B * H; bh++) {
		int b = bh / H, h = bh % H;
		float *p = malloc(sizeof(float) * (size_t)T * 2);
		float *acc = calloc((size_t)2 * T * D + D, sizeof(float));
		float *dp = p + T, *dk = acc, *dv = acc + (size_t)T * D, *tmp = acc + (size_t)2 * T * D;
#define ROW(t, sec) (qkv + ((size_t)b * T + (t)) * C3 + (size_t)((sec) * H + h) * D)
		for (int t = 0; t < T; t++) {
			const float *q = ROW(t, 0);
			int f = first ? first[(size_t)b * T + t] : 0;
			float m = -INFINITY;
			for (int j = f; j <= t; j++) {
				const float *k = ROW(j, 1);
				float s = 0.0f;
				for (int d = 0; d < D; d++)
					s += q[d] * k[d];
				p[j] = at_rbf(at_rbf(s) * scale);
				m = fmaxf(m, p[j]);
			}
			float sum = 0.0f;
			for (int j = f; j <= t; j++)
				sum += (p[j] = expf(p[j] - m));
			lse[(size_t)bh * T + t] = m + logf(sum);
			for (int j = f; j <= t; j++)
				p[j] = at_rbf(p[j] / sum);
			const float *dO = dout + (((size_t)b * T + t) * H + h) * D;
			float *o = out + (((size_t)b * T + t) * H + h) * D;
			for (int d = 0; d < D; d++)
				tmp[d] = 0.0f;
			float pdp = 0.0f;
			for (int j = f; j <= t; j++) {
				const float *v = ROW(j, 2);
				float a = 0.0f;
				for (int d = 0; d < D; d++) {
					tmp[d] += p[j] * v[d];
					a += dO[d] * v[d];
					dv[(size_t)j * D + d] += p[j] * dO[d];
				}
				dp[j] = at_rbf(a);
				pdp += p[j] * dp[j];
			}
			for (int d = 0; d < D; d++)
				o[d] = at_rbf(tmp[d]), tmp[d] = 0.0f;
			for (int j = f; j <= t; j++) {
				float ds = at_rbf(at_rbf(p[j] * (dp[j] - pdp)) * scale);
				const float *k = ROW(j, 1);
				for (int d = 0; d < D; d++) {
					tmp[d] += ds * k[d];
					dk[(size_t)j * D + d] += ds * q[d];
				}
			}
			float *dq = dqkv + ((size_t)b * T + t) * C3 + (size_t)h * D;
			for (int d = 0; d < D; d++)
				dq[d] = at_rbf(tmp[d]);
		}
		for (int j = 0; j < T; j++)
			for (int d = 0; d < D; d++) {
				size_t r = ((size_t)b * T + j) * C3;
				dqkv[r + (size_t)(H + h) * D + d] = at_rbf(dk[(size_t)j * D + d]);
				dqkv[r + (size_t)(2 * H + h) * D + d] = at_rbf(dv[(size_t)j * D + d]);
			}
#undef ROW
		free(p);
		free(acc);
	}
}

/* Max abs error of got vs ref (and the worst index, rel error there); max |ref|. */
struct at_err {
	double abs, rel, ref_max;
	size_t worst;
};

static struct at_err at_compare(const float *got, const double *ref, size_t n)
{
	struct at_err e = {0, 0, 0, 0};
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - ref[i]);
		if (fabs(ref[i]) > e.ref_max)
			e.ref_max = fabs(ref[i]);
		if (d > e.abs || isnan(d)) {
			e.abs = isnan(d) ? INFINITY : d;
			e.worst = i;
		}
	}
	e.rel = e.abs / fmax(fabs(ref[e.worst]), 1e-6);
	return e;
}

/* The rule, atol = max(atol_rel * max|ref|, atol_floor); ctx names the case and its seed. */
static void at_check_rule(const char *what, const float *got, const float *lowp, const double *ref,
			  size_t n, double atol_rel, double atol_floor, const char *ctx)
{
	struct at_err k = at_compare(got, ref, n), l = at_compare(lowp, ref, n);
	double atol = fmax(atol_rel * k.ref_max, atol_floor);
	double bound = 2.0 * l.abs + atol;
	cr_expect(k.abs <= bound,
		  "%s %s: max abs err %.3e > bound %.3e (2 x naive bf16 err %.3e + atol %.2e); max rel "
		  "err %.3e at index %zu (got %.6f ref %.6f)",
		  ctx, what, k.abs, bound, l.abs, atol, k.rel, k.worst, got[k.worst], ref[k.worst]);
	cr_log_info("%s %s: err %.3e, naive bf16 err %.3e, bound %.3e", ctx, what, k.abs, l.abs,
		    bound);
}

#endif
