/*
 * tests/test_encoder.c — token + position embedding (kernels/encoder.h) against
 * ng_ref_encoder_fwd/bwd (graph/cpu_ops.h, double).
 * Forward: bf16 output vs the rounded reference, 1 ulp. Backward: the FlashAttention rule against
 * a naive fp32 loop over positions (atol: 4 fp32 ulps of the largest reference value, below),
 * onto nonzero random dwte/dwpe ("+="), with tokens uniform,
 * with heavy repeats, all equal, or Zipfian (long runs that the backward cuts into windows and
 * recombines); and bit-identical over two runs.
 * Shapes: T = 1, C = 1600, 776 (8 x 97), 200, 24, 8, Vp = 50304, 50257, 1, B*T up to 65536
 * (the backward's packed 32-bit sort keys) and 131072 (too many position bits: the pairs sort).
 * The lookup without positions (ng_embed_fwd/bwd) against ng_ref_embed_fwd/bwd
 * (graph/cpu_spr_ops.h): the forward bit for bit, the backward as the encoder's, also with
 * one sort shared by two tables.
 */
#include <criterion/criterion.h>

#include "graph/cpu_ops.h"
#include "graph/cpu_spr_ops.h"
#include "kernels/encoder.h"
#include "tests/kernel_testing.h"

/* How the backward tests draw tokens. */
enum tok_mode {
	TOK_MODE_UNIFORM, /* uniform over [0, Vp) */
	TOK_MODE_HOT,     /* half uniform, half from tokens 0..2 (long runs) */
	TOK_MODE_EQUAL,   /* every token the same random one (the executor's warm-up) */
	TOK_MODE_ZIPF,    /* p(token r) ~ 1/(r+1): real text's frequent tokens */
};

/* Random tokens in [0, Vp) drawn as `mode` says. */
static int32_t *random_tokens(struct ng_rng *r, int n, int Vp, enum tok_mode mode)
{
	int32_t *t = (int32_t *)kt_xmalloc((size_t)n * sizeof(int32_t));
	double *cdf = NULL;
	if (mode == TOK_MODE_ZIPF) {
		cdf = (double *)kt_xmalloc((size_t)Vp * sizeof(double));
		double acc = 0.0;
		for (int v = 0; v < Vp; v++)
			cdf[v] = acc += 1.0 / (v + 1);
	}
	int32_t same = (int32_t)ng_rng_below(r, (uint64_t)Vp);
	for (int i = 0; i < n; i++) {
		if (mode == TOK_MODE_EQUAL) {
			t[i] = same;
		} else if (mode == TOK_MODE_ZIPF) {
			double u = ng_rng_uniform(r) * cdf[Vp - 1];
			int lo = 0, hi = Vp - 1; /* first v with cdf[v] >= u */
			while (lo < hi) {
				int mid = (lo + hi) / 2;
				if (cdf[mid] >= u)
					hi = mid;
				else
					lo = mid + 1;
			}
			t[i] = lo;
		} else {
			t[i] = (mode == TOK_MODE_HOT && ng_rng_below(r, 2))
				       ? (int32_t)ng_rng_below(r, 3)
				       : (int32_t)ng_rng_below(r, (uint64_t)Vp);
		}
	}
	free(cdf);
	return t;
}

static void encoder_fwd_case(int B, int T, int C, int Vp)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t nwte = (size_t)Vp * C, nwpe = (size_t)T * C, nout = (size_t)B * T * C;
	ng_bf16 *wte = kt_xmalloc(nwte * 2), *wpe = kt_xmalloc(nwpe * 2), *out = kt_xmalloc(nout * 2);
	double *wte_d = kt_xmalloc(nwte * 8), *wpe_d = kt_xmalloc(nwpe * 8), *ref = kt_xmalloc(nout * 8);
	kt_fill_bf16(&r, wte, wte_d, nwte, 0.0, 0.5);
	kt_fill_bf16(&r, wpe, wpe_d, nwpe, 0.1, 0.3);
	int32_t *tok = random_tokens(&r, B * T, Vp, TOK_MODE_UNIFORM);
	ng_ref_encoder_fwd(ref, tok, wte_d, wpe_d, B, T, C);

	void *d_wte = kt_upload(wte, nwte * 2), *d_wpe = kt_upload(wpe, nwpe * 2);
	void *d_tok = kt_upload(tok, (size_t)B * T * 4), *d_out = kt_upload(NULL, nout * 2);
	kt_ok(ng_encoder_fwd(d_out, d_tok, d_wte, d_wpe, B, T, C, 0), "ng_encoder_fwd");
	kt_download(out, d_out, nout * 2);
	char what[96];
	snprintf(what, sizeof(what), "encoder_fwd B=%d T=%d C=%d Vp=%d", B, T, C, Vp);
	check_bf16_(what, seed, out, ref, nout, 1.0, 0.0);
	cudaFree(d_wte), cudaFree(d_wpe), cudaFree(d_tok), cudaFree(d_out);
	free(wte), free(wpe), free(out), free(wte_d), free(wpe_d), free(ref), free(tok);
}

/* The backward's atol: 4 fp32 ulps (2^-21 relative) of the largest |reference| value. The kernel
 * sums a long run in another order than the naive loop (window pieces, 16 slices, then the
 * slices), so its error is not always below twice the naive's: when the naive sum happens to
 * round well, the kernel's last additions (the slices into the total, the total into the table,
 * each rounded at up to half an ulp of the row's magnitude) can exceed it by a fraction of an
 * ulp of the largest value; a fixed atol of 1e-6 is below that ulp once values pass ~8. A lost
 * or doubled row of dout moves an element by ~1, far above this atol. */
static double sum_atol(const double *ref, size_t n)
{
	double m = 0.0;
	for (size_t i = 0; i < n; i++)
		m = fmax(m, fabs(ref[i]));
	return 0x1p-21 * m;
}

static void encoder_bwd_case(int B, int T, int C, int Vp, enum tok_mode hot)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t nwte = (size_t)Vp * C, nwpe = (size_t)T * C, nout = (size_t)B * T * C;
	ng_bf16 *dout = kt_xmalloc(nout * 2);
	double *dout_d = kt_xmalloc(nout * 8);
	kt_fill_bf16(&r, dout, dout_d, nout, 0.0, 1.0);
	int32_t *tok = random_tokens(&r, B * T, Vp, hot);
	float *wte0 = kt_xmalloc(nwte * 4), *wpe0 = kt_xmalloc(nwpe * 4);
	for (size_t i = 0; i < nwte; i++)
		wte0[i] = (float)ng_rng_normal(&r);
	for (size_t i = 0; i < nwpe; i++)
		wpe0[i] = (float)ng_rng_normal(&r);

	/* fp64 reference and naive fp32 loop over positions in order */
	double *ref_te = kt_f2d(wte0, nwte), *ref_pe = kt_f2d(wpe0, nwpe);
	ng_ref_encoder_bwd(ref_te, ref_pe, dout_d, tok, B, T, C);
	float *nv_te = kt_xmalloc(nwte * 4), *nv_pe = kt_xmalloc(nwpe * 4);
	memcpy(nv_te, wte0, nwte * 4);
	memcpy(nv_pe, wpe0, nwpe * 4);
	for (int i = 0; i < B * T; i++)
		for (int c = 0; c < C; c++) {
			float d = kt_bf16_to_f32(dout[(size_t)i * C + c]);
			nv_te[(size_t)tok[i] * C + c] += d;
			nv_pe[(size_t)(i % T) * C + c] += d;
		}

	size_t sb = ng_encoder_bwd_scratch_bytes(B, T, C);
	void *d_dout = kt_upload(dout, nout * 2), *d_tok = kt_upload(tok, (size_t)B * T * 4);
	void *d_scr = kt_upload(NULL, sb);
	float *d_te = kt_upload(NULL, nwte * 4), *d_pe = kt_upload(NULL, nwpe * 4);
	float *got_te[3], *got_pe[3];
	/* runs 0 and 1: ng_encoder_bwd; run 2: the step's way, the sort on a second stream joined
	 * by an event before ng_encoder_bwd_sorted, each with its own buffer */
	size_t sorted_b = ng_encoder_bwd_sorted_bytes(B, T), work_b = ng_encoder_bwd_work_bytes(B, T, C);
	cr_assert(sorted_b > 0 && work_b > 0 && sorted_b + work_b <= sb,
		  "encoder_bwd sizes: sorted %zu + work %zu vs scratch %zu", sorted_b, work_b, sb);
	void *d_sorted = kt_upload(NULL, sorted_b), *d_work = kt_upload(NULL, work_b);
	cudaStream_t side;
	cudaEvent_t join;
	kt_cuda(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "stream");
	kt_cuda(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "event");
	for (int run = 0; run < 3; run++) {
		kt_cuda(cudaMemcpy(d_te, wte0, nwte * 4, cudaMemcpyHostToDevice), "H2D");
		kt_cuda(cudaMemcpy(d_pe, wpe0, nwpe * 4, cudaMemcpyHostToDevice), "H2D");
		if (run < 2) {
			kt_ok(ng_encoder_bwd(d_te, d_pe, d_dout, d_tok, B, T, C, Vp, d_scr, sb, 0),
			      "ng_encoder_bwd");
		} else {
			kt_ok(ng_encoder_bwd_sort(d_sorted, sorted_b, d_tok, B, T, Vp, side),
			      "ng_encoder_bwd_sort");
			kt_cuda(cudaEventRecord(join, side), "record");
			kt_cuda(cudaStreamWaitEvent(0, join, 0), "wait");
			kt_ok(ng_encoder_bwd_sorted(d_te, d_pe, d_dout, d_sorted, B, T, C, Vp, d_work,
						    work_b, 0),
			      "ng_encoder_bwd_sorted");
			kt_cuda(cudaDeviceSynchronize(), "sync");
		}
		got_te[run] = kt_xmalloc(nwte * 4);
		got_pe[run] = kt_xmalloc(nwpe * 4);
		kt_download(got_te[run], d_te, nwte * 4);
		kt_download(got_pe[run], d_pe, nwpe * 4);
	}
	char what[128];
	snprintf(what, sizeof(what), "encoder_bwd dwte B=%d T=%d C=%d Vp=%d token mode %d", B, T, C, Vp,
		 (int)hot);
	double *g = kt_f2d(got_te[0], nwte), *nv = kt_f2d(nv_te, nwte);
	check_fa_(what, seed, g, nv, ref_te, nwte, sum_atol(ref_te, nwte));
	free(g), free(nv);
	snprintf(what, sizeof(what), "encoder_bwd dwpe B=%d T=%d C=%d Vp=%d", B, T, C, Vp);
	g = kt_f2d(got_pe[0], nwpe), nv = kt_f2d(nv_pe, nwpe);
	check_fa_(what, seed, g, nv, ref_pe, nwpe, sum_atol(ref_pe, nwpe));
	free(g), free(nv);
	cr_expect(memcmp(got_te[0], got_te[1], nwte * 4) == 0 &&
		  memcmp(got_pe[0], got_pe[1], nwpe * 4) == 0,
		  "encoder_bwd B=%d T=%d C=%d: two runs differ (not deterministic); seed %llu", B, T,
		  C, (unsigned long long)seed);
	cr_expect(memcmp(got_te[0], got_te[2], nwte * 4) == 0 &&
		  memcmp(got_pe[0], got_pe[2], nwpe * 4) == 0,
		  "encoder_bwd B=%d T=%d C=%d: sort + sorted (two streams) differ from "
		  "ng_encoder_bwd; seed %llu", B, T, C, (unsigned long long)seed);
	for (int run = 0; run < 3; run++)
		free(got_te[run]), free(got_pe[run]);
	cudaStreamDestroy(side), cudaEventDestroy(join), cudaFree(d_sorted), cudaFree(d_work);
	cudaFree(d_dout), cudaFree(d_tok), cudaFree(d_scr), cudaFree(d_te), cudaFree(d_pe);
	free(dout), free(dout_d), free(tok), free(wte0), free(wpe0), free(ref_te), free(ref_pe);
	free(nv_te), free(nv_pe);
}

Test(encoder, fwd_shapes)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	encoder_fwd_case(4, 64, 768, 50304);
	encoder_fwd_case(3, 1, 776, 50257);
	encoder_fwd_case(2, 37, 8, 131);
	encoder_fwd_case(16, 1024, 1600, 2000);
}

Test(encoder, bwd_shapes_and_determinism)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	encoder_bwd_case(4, 64, 768, 50304, TOK_MODE_UNIFORM);
	encoder_bwd_case(16, 256, 776, 1000, TOK_MODE_HOT);
	encoder_bwd_case(5, 1, 776, 50257, TOK_MODE_HOT);
	encoder_bwd_case(2, 37, 8, 131, TOK_MODE_HOT);
	/* 131072 positions (17 bits) + 16 token bits do not pack into 32-bit keys: the pairs sort */
	encoder_bwd_case(128, 1024, 8, 50304, TOK_MODE_UNIFORM);
}

/* Long runs cut into windows and recombined: every token equal (one run over every window),
 * Zipfian tokens (several long runs, window edges inside and between them), at window sizes
 * 64 (n = 65536, the d12 batch), 32 and 16. */
Test(encoder, bwd_long_runs)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	encoder_bwd_case(8, 1024, 776, 1000, TOK_MODE_EQUAL);
	encoder_bwd_case(7, 1, 24, 5, TOK_MODE_EQUAL);
	encoder_bwd_case(3, 1000, 200, 50257, TOK_MODE_ZIPF);
	encoder_bwd_case(20, 1000, 40, 50304, TOK_MODE_ZIPF);
	encoder_bwd_case(64, 1024, 8, 2000, TOK_MODE_ZIPF);
	encoder_bwd_case(64, 1024, 16, 1, TOK_MODE_EQUAL);
}

/* The lookup without positions (ng_embed_fwd): each output row is its table row, bit for bit
 * (0 ulp against ng_ref_embed_fwd). */
static void embed_fwd_case(int N, int C, int rows)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t ntab = (size_t)rows * C, nout = (size_t)N * C;
	ng_bf16 *tab = kt_xmalloc(ntab * 2), *out = kt_xmalloc(nout * 2);
	double *tab_d = kt_xmalloc(ntab * 8), *ref = kt_xmalloc(nout * 8);
	kt_fill_bf16(&r, tab, tab_d, ntab, 0.0, 1.0);
	int32_t *tok = random_tokens(&r, N, rows, TOK_MODE_HOT);
	ng_ref_embed_fwd(ref, tok, tab_d, N, C);
	void *d_tab = kt_upload(tab, ntab * 2), *d_tok = kt_upload(tok, (size_t)N * 4);
	void *d_out = kt_upload(NULL, nout * 2);
	kt_ok(ng_embed_fwd(d_out, d_tab, d_tok, N, C, 0), "ng_embed_fwd");
	kt_download(out, d_out, nout * 2);
	char what[96];
	snprintf(what, sizeof(what), "embed_fwd N=%d C=%d rows=%d", N, C, rows);
	check_bf16_(what, seed, out, ref, nout, 0.0, 0.0);
	cudaFree(d_tab), cudaFree(d_tok), cudaFree(d_out);
	free(tab), free(out), free(tab_d), free(ref), free(tok);
}

/* The embedding backward (ng_embed_bwd) onto nonzero random tables: the FlashAttention rule
 * against a naive fp32 loop over the rows in order, as the encoder's; two runs the same bits;
 * and two tables over the same tokens from one shared sort (ng_encoder_bwd_sort with B = 1,
 * then ng_encoder_bwd_sorted without a position table, as the step can do for wte and the value
 * embeddings), the first bit-identical to ng_embed_bwd. */
static void embed_bwd_case(int N, int C, int rows, enum tok_mode mode)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t ntab = (size_t)rows * C, nout = (size_t)N * C;
	ng_bf16 *dout[2];
	double *dout_d[2], *ref[2];
	float *tab0[2], *naive[2];
	int32_t *tok = random_tokens(&r, N, rows, mode);
	for (int k = 0; k < 2; k++) {
		dout[k] = kt_xmalloc(nout * 2);
		dout_d[k] = kt_xmalloc(nout * 8);
		kt_fill_bf16(&r, dout[k], dout_d[k], nout, 0.0, 1.0);
		tab0[k] = kt_xmalloc(ntab * 4);
		for (size_t i = 0; i < ntab; i++)
			tab0[k][i] = (float)ng_rng_normal(&r);
		ref[k] = kt_f2d(tab0[k], ntab);
		ng_ref_embed_bwd(ref[k], dout_d[k], tok, N, C);
		naive[k] = kt_xmalloc(ntab * 4);
		memcpy(naive[k], tab0[k], ntab * 4);
		for (int i = 0; i < N; i++)
			for (int c = 0; c < C; c++)
				naive[k][(size_t)tok[i] * C + c] +=
					kt_bf16_to_f32(dout[k][(size_t)i * C + c]);
	}
	size_t sb = ng_embed_bwd_scratch_bytes(N, C), sorted_b = ng_encoder_bwd_sorted_bytes(1, N);
	size_t work_b = ng_encoder_bwd_work_bytes(1, N, C);
	cr_assert(sb > 0 && sorted_b + work_b <= sb, "embed_bwd sizes: %zu + %zu vs %zu", sorted_b,
		  work_b, sb);
	void *d_dout[2] = {kt_upload(dout[0], nout * 2), kt_upload(dout[1], nout * 2)};
	void *d_tok = kt_upload(tok, (size_t)N * 4), *d_scr = kt_upload(NULL, sb);
	void *d_sorted = kt_upload(NULL, sorted_b), *d_work = kt_upload(NULL, work_b);
	float *d_tab = kt_upload(NULL, ntab * 4), *got[4];
	/* runs 0, 1: ng_embed_bwd on table 0; 2, 3: tables 0 and 1 from one shared sort */
	kt_ok(ng_encoder_bwd_sort(d_sorted, sorted_b, d_tok, 1, N, rows, 0), "ng_encoder_bwd_sort");
	for (int run = 0; run < 4; run++) {
		int k = run == 3;
		kt_cuda(cudaMemcpy(d_tab, tab0[k], ntab * 4, cudaMemcpyHostToDevice), "H2D");
		if (run < 2)
			kt_ok(ng_embed_bwd(d_tab, d_dout[0], d_tok, N, C, rows, d_scr, sb, 0),
			      "ng_embed_bwd");
		else
			kt_ok(ng_encoder_bwd_sorted(d_tab, NULL, d_dout[k], d_sorted, 1, N, C, rows,
						    d_work, work_b, 0),
			      "ng_encoder_bwd_sorted");
		got[run] = kt_xmalloc(ntab * 4);
		kt_download(got[run], d_tab, ntab * 4);
	}
	char what[128];
	for (int k = 0; k < 2; k++) {
		snprintf(what, sizeof(what), "embed_bwd table %d N=%d C=%d rows=%d token mode %d",
			 k, N, C, rows, (int)mode);
		double *g = kt_f2d(got[k ? 3 : 0], ntab), *nv = kt_f2d(naive[k], ntab);
		check_fa_(what, seed, g, nv, ref[k], ntab, sum_atol(ref[k], ntab));
		free(g), free(nv);
	}
	cr_expect(memcmp(got[0], got[1], ntab * 4) == 0,
		  "embed_bwd N=%d C=%d: two runs differ (not deterministic); seed %llu", N, C,
		  (unsigned long long)seed);
	cr_expect(memcmp(got[0], got[2], ntab * 4) == 0,
		  "embed_bwd N=%d C=%d: the shared sort differs from ng_embed_bwd; seed %llu", N, C,
		  (unsigned long long)seed);
	for (int k = 0; k < 2; k++) {
		cudaFree(d_dout[k]);
		free(dout[k]), free(dout_d[k]), free(ref[k]), free(tab0[k]), free(naive[k]);
	}
	for (int run = 0; run < 4; run++)
		free(got[run]);
	cudaFree(d_tok), cudaFree(d_scr), cudaFree(d_sorted), cudaFree(d_work), cudaFree(d_tab);
	free(tok);
}

Test(encoder, embed_fwd_shapes)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	embed_fwd_case(1000, 768, 50304);
	embed_fwd_case(1, 768, 50304);
	embed_fwd_case(7, 24, 5);
	embed_fwd_case(4096, 64, 512);
}

/* Uniform and Zipfian tokens at the model's vocabulary, long runs of equal tokens (cut into
 * windows), N = 1, and 131072 rows (the sort's keys do not pack). */
Test(encoder, embed_bwd_shapes_and_determinism)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	embed_bwd_case(4096, 768, 50304, TOK_MODE_ZIPF);
	embed_bwd_case(1000, 24, 50304, TOK_MODE_UNIFORM);
	embed_bwd_case(1, 768, 50304, TOK_MODE_UNIFORM);
	embed_bwd_case(7, 24, 5, TOK_MODE_EQUAL);
	embed_bwd_case(65536, 8, 512, TOK_MODE_EQUAL);
	embed_bwd_case(131072, 8, 50304, TOK_MODE_HOT);
}

Test(encoder, bad_shape_is_an_input_error)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	ng_clear_error();
	void *p = kt_upload(NULL, 1024);
	cr_expect(ng_encoder_fwd(p, p, p, p, 1, 1, 12, 0) == NG_ERR_INPUT,
		  "C=12 (not a multiple of 8) must be refused");
	cr_expect(strstr(ng_error_message(), "C=12") != NULL, "message names the value: %s",
		  ng_error_message());
	cudaFree(p);
	ng_clear_error();
}
