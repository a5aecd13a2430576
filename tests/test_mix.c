/*
 * tests/test_mix.c — the two-term scalar mix (kernels/mix.h) against ng_ref_mix2_fwd/bwd
 * (graph/cpu_spr_ops.h, double).
 * Tolerances. bf16 outputs (out, du, dw): the kernel forms v = a u + b w (or [du +] a dout) in
 * fp32 with at most two roundings, |v - exact| <= 2 * 2^-24 * (|a u| + |b w|); rounding v and
 * the exact value to bf16 gives results one ulp apart at most, plus |v - exact| where the terms
 * cancel: 1 ulp + atol = 2^-20 max(|a u| + |b w|) (the bound, times 8). Scalar gradients (fp32):
 * the FlashAttention rule against a naive fp32 loop over the elements in order (the products of
 * two bf16 are exact in fp32), with atol = 64 * 2^-24 * (sum |dout u| + |da0|): any fixed order
 * of fp32 additions with chains of at most ~50 is within that bound, and the kernel's at these
 * sizes are 8 a thread (one unit), an 8-level tree, then double.
 * Determinism: two runs, the same bytes (scalar gradients and du / dw). Columns C .. ld - 1 of
 * every output must keep their bytes.
 * Shapes: N = 1, 7, 1000; C = 24, 768, 21 (odd: the scalar path); ld = C, C + 8, 3C (v inside
 * the fused qkv buffer); pointers offset by 16 bytes (vector path) or 2 bytes (scalar path);
 * w, a, b NULL; out == u and du == dout in place; each backward output alone.
 * The argument checks run without a GPU (nothing reaches the device when they refuse).
 */
#include <criterion/criterion.h>

#include "graph/cpu_spr_ops.h"
#include "kernels/mix.h"
#include "tests/kernel_testing.h"

/* An (N, ld) bf16 matrix: every element random (the padding columns too, to see that nothing
 * writes them), on the host and on the device at `off` bytes past a 256-byte boundary. */
struct mx {
	int N, C, ld; /* shape and leading dimension (elements) */
	ng_bf16 *h;   /* (N, ld) host bits */
	double *v;    /* (N, C) the values, packed */
	void *base;   /* the device allocation */
	ng_bf16 *d;   /* the device matrix, base + off */
};

static struct mx mx_new(struct ng_rng *r, int N, int C, int ld, int off, double sd)
{
	struct mx m = {N, C, ld, NULL, NULL, NULL, NULL};
	size_t n = (size_t)N * ld;
	m.h = kt_xmalloc(n * 2);
	m.v = kt_xmalloc((size_t)N * C * 8);
	kt_fill_bf16(r, m.h, NULL, n, 0.0, sd);
	for (int i = 0; i < N; i++)
		for (int c = 0; c < C; c++)
			m.v[(size_t)i * C + c] = kt_bf16_to_f32(m.h[(size_t)i * ld + c]);
	m.base = kt_upload(NULL, n * 2 + (size_t)off);
	m.d = (ng_bf16 *)((char *)m.base + off);
	kt_cuda(cudaMemcpy(m.d, m.h, n * 2, cudaMemcpyHostToDevice), "H2D");
	return m;
}

/* Puts the host bits back on the device (a run's fresh start). */
static void mx_reset(const struct mx *m)
{
	kt_cuda(cudaMemcpy(m->d, m->h, (size_t)m->N * m->ld * 2, cudaMemcpyHostToDevice), "H2D");
}

/* The device matrix: all (N, ld) bits into *all (new), its (N, C) part packed into *got (new);
 * expects the padding columns to hold m's bits still. */
static void mx_get(const struct mx *m, const char *what, uint64_t seed, ng_bf16 **all,
		   ng_bf16 **got)
{
	size_t n = (size_t)m->N * m->ld;
	*all = kt_xmalloc(n * 2);
	*got = kt_xmalloc((size_t)m->N * m->C * 2);
	kt_download(*all, m->d, n * 2);
	size_t bad = n;
	for (int i = 0; i < m->N; i++) {
		memcpy(*got + (size_t)i * m->C, *all + (size_t)i * m->ld, (size_t)m->C * 2);
		for (size_t j = (size_t)i * m->ld + m->C; j < (size_t)(i + 1) * m->ld; j++)
			if ((*all)[j] != m->h[j] && bad == n)
				bad = j;
	}
	cr_expect(bad == n, "%s: padding element %zu (row %zu, column %zu) was written; seed %llu",
		  what, bad, bad / m->ld, bad % m->ld, (unsigned long long)seed);
}

static void mx_free(struct mx *m)
{
	cudaFree(m->base);
	free(m->h), free(m->v);
}

/* A device fp32 scalar holding x. */
static float *scalar_new(float x) { return kt_upload(&x, 4); }

static float scalar_get(const float *d)
{
	float x;
	kt_download(&x, d, 4);
	return x;
}

/* One forward: out = a u + b w over (N, C). ld_out < 0: in place, out is u. */
static void mix_fwd_case(int N, int C, int ld_u, int ld_w, int ld_out, int off, int use_a,
			 int use_b, int use_w)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	int in_place = ld_out < 0;
	struct mx u = mx_new(&r, N, C, ld_u, off, 1.0), w = mx_new(&r, N, C, ld_w, off, 2.0);
	struct mx o = in_place ? u : mx_new(&r, N, C, ld_out, off, 1.0);
	float a = (float)(0.5 + ng_rng_uniform(&r)), b = (float)(ng_rng_uniform(&r) - 0.5);
	float *d_a = scalar_new(a), *d_b = scalar_new(b);
	double av = use_a ? a : 1.0, bv = use_b ? b : 1.0;
	size_t n = (size_t)N * C;
	double *ref = kt_xmalloc(n * 8), mag = 0.0;
	ng_ref_mix2_fwd(ref, av, u.v, bv, use_w ? w.v : NULL, n);
	for (size_t i = 0; i < n; i++)
		mag = fmax(mag, fabs(av * u.v[i]) + (use_w ? fabs(bv * w.v[i]) : 0.0));
	kt_ok(ng_mix2_fwd(o.d, o.ld, use_a ? d_a : NULL, u.d, u.ld, use_b ? d_b : NULL,
			  use_w ? w.d : NULL, w.ld, N, C, 0),
	      "ng_mix2_fwd");
	char what[160];
	snprintf(what, sizeof(what),
		 "mix2_fwd N=%d C=%d ld u %d w %d out %d off %d a %d b %d w %d in place %d", N, C,
		 ld_u, ld_w, o.ld, off, use_a, use_b, use_w, in_place);
	ng_bf16 *all, *got;
	mx_get(&o, what, seed, &all, &got);
	check_bf16_(what, seed, got, ref, n, 1.0, ldexp(mag, -20));
	free(all), free(got), free(ref);
	cudaFree(d_a), cudaFree(d_b);
	if (!in_place)
		mx_free(&o);
	mx_free(&u), mx_free(&w);
}

Test(mix, fwd_shapes)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	/* the value mixing: v inside qkv (ld 3C) in place, ve (ld C) */
	mix_fwd_case(1000, 768, 2304, 768, -1, 0, 1, 1, 1);
	/* the x0 mixing into a fresh buffer, rows padded, pointers 16 bytes off */
	mix_fwd_case(7, 768, 776, 768, 784, 16, 1, 1, 1);
	mix_fwd_case(1, 24, 24, 32, 24, 0, 1, 1, 1);
	/* the U-net skip (a = 1), a block without value embedding (w NULL), both scalars 1 */
	mix_fwd_case(7, 24, 24, 24, 24, 0, 0, 1, 1);
	mix_fwd_case(1000, 24, 72, 24, -1, 16, 1, 1, 0);
	mix_fwd_case(7, 768, 768, 768, 768, 0, 0, 0, 1);
	/* the scalar path: odd C, odd ld, pointers 2 bytes off */
	mix_fwd_case(7, 21, 21, 23, 25, 0, 1, 1, 1);
	mix_fwd_case(1000, 24, 24, 24, 24, 2, 1, 1, 1);
	mix_fwd_case(1, 768, 769, 768, -1, 0, 1, 0, 1);
}

enum {
	OUT_DU = 1, /* du wanted */
	OUT_DW = 2, /* dw wanted */
	OUT_DA = 4, /* da wanted */
	OUT_DB = 8, /* db wanted */
};

/* Checks one scalar gradient: the FlashAttention rule against the naive fp32 loop. */
static void check_scalar_grad(const char *what, uint64_t seed, float got, double ref, float x0,
			      const double *g, const double *x, size_t n)
{
	float naive = x0;
	double abs_sum = fabs((double)x0);
	for (size_t i = 0; i < n; i++) {
		naive += (float)g[i] * (float)x[i];
		abs_sum += fabs(g[i] * x[i]);
	}
	double gd = got, nd = naive;
	check_fa_(what, seed, &gd, &nd, &ref, 1, 64.0 * ldexp(abs_sum, -24));
}

/* One backward: dout and du share ld_g (du == dout when in_place), u has ld_u, w and dw ld_w. */
static void mix_bwd_case(int N, int C, int ld_g, int ld_u, int ld_w, int off, unsigned outs,
			 int du_acc, int dw_acc, int in_place, int use_a, int use_b)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct mx g = mx_new(&r, N, C, ld_g, off, 1.0), u = mx_new(&r, N, C, ld_u, off, 1.0);
	struct mx w = mx_new(&r, N, C, ld_w, off, 0.5);
	struct mx du = in_place ? g : mx_new(&r, N, C, ld_g, off, 0.25);
	struct mx dw = mx_new(&r, N, C, ld_w, off, 0.25);
	float a = (float)(0.5 + ng_rng_uniform(&r)), b = (float)(ng_rng_uniform(&r) - 0.5);
	float da0 = (float)ng_rng_normal(&r), db0 = (float)ng_rng_normal(&r);
	float *d_a = scalar_new(a), *d_b = scalar_new(b), *d_da = scalar_new(da0);
	float *d_db = scalar_new(db0);
	double av = use_a ? a : 1.0, bv = use_b ? b : 1.0;
	size_t n = (size_t)N * C, sb = ng_mix2_bwd_scratch_bytes(N, C);
	cr_assert(sb > 0 && sb % 16 == 0, "ng_mix2_bwd_scratch_bytes(%d, %d) = %zu", N, C, sb);
	void *d_scr = kt_upload(NULL, sb);

	/* the reference; its du and dw start from the old values when accumulating */
	double *ref_du = kt_xmalloc(n * 8), *ref_dw = kt_xmalloc(n * 8), ref_da = da0, ref_db = db0;
	double mag_u = 0.0, mag_w = 0.0;
	for (size_t i = 0; i < n; i++) {
		ref_du[i] = du_acc && !in_place ? du.v[i] : 0.0;
		ref_dw[i] = dw_acc ? dw.v[i] : 0.0;
		mag_u = fmax(mag_u, fabs(av * g.v[i]) + fabs(ref_du[i]));
		mag_w = fmax(mag_w, fabs(bv * g.v[i]) + fabs(ref_dw[i]));
	}
	ng_ref_mix2_bwd(ref_du, ref_dw, &ref_da, &ref_db, g.v, av, u.v, bv, w.v, n);

	ng_bf16 *du_all[2], *du_got[2], *dw_all[2], *dw_got[2];
	float da_got[2], db_got[2];
	char what[200];
	snprintf(what, sizeof(what),
		 "mix2_bwd N=%d C=%d ld g %d u %d w %d off %d outputs %#x acc %d %d in place %d "
		 "a %d b %d",
		 N, C, ld_g, ld_u, ld_w, off, outs, du_acc, dw_acc, in_place, use_a, use_b);
	for (int run = 0; run < 2; run++) {
		mx_reset(&g), mx_reset(&du), mx_reset(&dw);
		kt_cuda(cudaMemcpy(d_da, &da0, 4, cudaMemcpyHostToDevice), "H2D");
		kt_cuda(cudaMemcpy(d_db, &db0, 4, cudaMemcpyHostToDevice), "H2D");
		/* u and w are passed only where their scalar's gradient is asked for */
		kt_ok(ng_mix2_bwd(outs & OUT_DU ? du.d : NULL, du.ld, du_acc,
				  outs & OUT_DW ? dw.d : NULL, dw.ld, dw_acc,
				  outs & OUT_DA ? d_da : NULL, outs & OUT_DB ? d_db : NULL, g.d,
				  g.ld, use_a ? d_a : NULL, outs & OUT_DA ? u.d : NULL, u.ld,
				  use_b ? d_b : NULL, outs & OUT_DB ? w.d : NULL, w.ld, N, C, d_scr,
				  0),
		      "ng_mix2_bwd");
		mx_get(&du, what, seed, &du_all[run], &du_got[run]);
		mx_get(&dw, what, seed, &dw_all[run], &dw_got[run]);
		da_got[run] = scalar_get(d_da);
		db_got[run] = scalar_get(d_db);
	}
	size_t full_g = (size_t)N * ld_g * 2, full_w = (size_t)N * ld_w * 2;
	if (outs & OUT_DU)
		check_bf16_(what, seed, du_got[0], ref_du, n, 1.0, ldexp(mag_u, -20));
	else if (!in_place)
		cr_expect(memcmp(du_all[0], du.h, full_g) == 0, "%s: du written; seed %llu", what,
			  (unsigned long long)seed);
	if (outs & OUT_DW)
		check_bf16_(what, seed, dw_got[0], ref_dw, n, 1.0, ldexp(mag_w, -20));
	else
		cr_expect(memcmp(dw_all[0], dw.h, full_w) == 0, "%s: dw written; seed %llu", what,
			  (unsigned long long)seed);
	if (outs & OUT_DA)
		check_scalar_grad(what, seed, da_got[0], ref_da, da0, g.v, u.v, n);
	else
		cr_expect(da_got[0] == da0, "%s: da written; seed %llu", what,
			  (unsigned long long)seed);
	if (outs & OUT_DB)
		check_scalar_grad(what, seed, db_got[0], ref_db, db0, g.v, w.v, n);
	else
		cr_expect(db_got[0] == db0, "%s: db written; seed %llu", what,
			  (unsigned long long)seed);
	cr_expect(memcmp(&da_got[0], &da_got[1], 4) == 0 &&
			  memcmp(&db_got[0], &db_got[1], 4) == 0 &&
			  memcmp(du_all[0], du_all[1], full_g) == 0 &&
			  memcmp(dw_all[0], dw_all[1], full_w) == 0,
		  "%s: two runs differ (not deterministic): da %.9g %.9g, db %.9g %.9g; seed %llu",
		  what, da_got[0], da_got[1], db_got[0], db_got[1], (unsigned long long)seed);
	for (int run = 0; run < 2; run++)
		free(du_all[run]), free(du_got[run]), free(dw_all[run]), free(dw_got[run]);
	free(ref_du), free(ref_dw);
	cudaFree(d_a), cudaFree(d_b), cudaFree(d_da), cudaFree(d_db), cudaFree(d_scr);
	if (!in_place)
		mx_free(&du);
	mx_free(&g), mx_free(&u), mx_free(&w), mx_free(&dw);
}

#define OUT_ALL (OUT_DU | OUT_DW | OUT_DA | OUT_DB)

Test(mix, bwd_shapes_and_determinism)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	/* the value mixing: dv in place inside dqkv (ld 3C), dve accumulated over two blocks */
	mix_bwd_case(1000, 768, 2304, 2304, 768, 0, OUT_ALL, 0, 1, 1, 1, 1);
	/* the x0 mixing: dx written, dx0 accumulated */
	mix_bwd_case(1000, 768, 768, 768, 768, 16, OUT_ALL, 0, 1, 0, 1, 1);
	mix_bwd_case(7, 768, 776, 784, 768, 0, OUT_ALL, 1, 0, 0, 1, 1);
	mix_bwd_case(1, 24, 24, 32, 24, 0, OUT_ALL, 1, 1, 0, 1, 1);
	mix_bwd_case(1, 768, 768, 768, 768, 0, OUT_ALL, 0, 0, 0, 1, 1);
	/* the U-net skip: a = 1 and no du (dout passes through), dw += w_j dout, db */
	mix_bwd_case(1000, 24, 24, 24, 24, 0, OUT_DW | OUT_DB, 0, 1, 0, 0, 1);
	/* a block without value embedding: dv = a0 dout in place, da0 */
	mix_bwd_case(7, 768, 2304, 2304, 768, 16, OUT_DU | OUT_DA, 0, 0, 1, 1, 0);
	/* each output alone */
	mix_bwd_case(7, 24, 24, 24, 24, 0, OUT_DU, 1, 0, 0, 1, 1);
	mix_bwd_case(7, 24, 24, 24, 24, 0, OUT_DW, 0, 0, 0, 1, 1);
	mix_bwd_case(1000, 768, 768, 768, 768, 0, OUT_DA, 0, 0, 0, 1, 1);
	mix_bwd_case(7, 24, 24, 24, 24, 0, OUT_DB, 0, 0, 0, 0, 0);
	/* the scalar path: odd C and ld, pointers 2 bytes off */
	mix_bwd_case(7, 21, 21, 23, 25, 0, OUT_ALL, 1, 1, 0, 1, 1);
	mix_bwd_case(1000, 24, 24, 24, 24, 2, OUT_ALL, 0, 1, 1, 1, 1);
	mix_bwd_case(1, 768, 769, 768, 768, 0, OUT_ALL, 0, 0, 0, 1, 1);
}

/* Refusals name the values; they happen before anything reaches the device, so this runs
 * without a GPU (the pointers are never dereferenced). */
Test(mix, bad_arguments_are_input_errors)
{
	static ng_bf16 buf[64] __attribute__((aligned(16)));
	static float f[4] __attribute__((aligned(16)));
	ng_bf16 *p = buf;
	ng_clear_error();
	cr_expect(ng_mix2_fwd(p, 16, f, p + 8, 20, f, p, 24, 3, 24, 0) == NG_ERR_INPUT,
		  "out ld 16 < C 24 must be refused");
	cr_expect(strstr(ng_error_message(), "ld 16") != NULL, "message: %s", ng_error_message());
	ng_clear_error();
	cr_expect(ng_mix2_fwd(p, 24, f, p, 32, f, NULL, 24, 3, 24, 0) == NG_ERR_INPUT,
		  "out == u with another ld must be refused");
	ng_clear_error();
	cr_expect(ng_mix2_fwd(p, 24, f, p, 24, f, NULL, 24, 0, 24, 0) == NG_ERR_INPUT,
		  "N = 0 must be refused");
	cr_expect(strstr(ng_error_message(), "N=0") != NULL, "message: %s", ng_error_message());
	ng_clear_error();
	cr_expect(ng_mix2_bwd(p, 24, 1, NULL, 24, 0, NULL, NULL, p, 24, f, NULL, 24, f, NULL, 24,
			      2, 24, NULL, 0) == NG_ERR_INPUT,
		  "du == dout with du_acc 1 must be refused");
	cr_expect(strstr(ng_error_message(), "du_acc 1") != NULL, "message: %s",
		  ng_error_message());
	ng_clear_error();
	cr_expect(ng_mix2_bwd(NULL, 24, 0, NULL, 24, 0, f, NULL, p, 24, f, NULL, 24, f, NULL, 24,
			      2, 24, p, 0) == NG_ERR_INPUT,
		  "da without u must be refused");
	ng_clear_error();
	cr_expect(ng_mix2_bwd(NULL, 24, 0, NULL, 24, 0, f, NULL, p, 24, f, p, 24, f, NULL, 24, 2,
			      24, NULL, 0) == NG_ERR_INPUT,
		  "da without scratch must be refused");
	ng_clear_error();
	cr_expect(ng_mix2_bwd(NULL, 24, 0, NULL, 24, 0, NULL, NULL, NULL, 24, f, NULL, 24, f, NULL,
			      24, 2, 24, NULL, 0) == NG_OK,
		  "no output asked for is nothing to do");
	cr_expect(ng_mix2_bwd_scratch_bytes(0, 24) == 0, "no scratch for N = 0");
	cr_expect(ng_mix2_bwd_scratch_bytes(49152, 768) % 16 == 0 &&
			  ng_mix2_bwd_scratch_bytes(49152, 768) >= 2 * sizeof(float),
		  "scratch bytes: %zu", ng_mix2_bwd_scratch_bytes(49152, 768));
	ng_clear_error();
}
