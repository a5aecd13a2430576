/*
 * tests/test_train_spr_gpu.c — the speedrun model's whole GPU step (graph/step_spr.c, run by
 * graph/exec_spr.c) against its double-precision CPU reference (graph/cpu_spr.c) on the tiny
 * preset, its Muon update against graph/cpu_muon.c's, its eval graph at the window it is
 * given, and the captured graph against eager launches.
 *
 * The step is taken from a state with every tensor random (the zero-initialised projections and
 * head would leave most gradients zero), at a step count where the windows are 3 blocks (long)
 * and 1 block (short) of 128 tokens, with sequences longer than the long window and several
 * documents. Tolerances as tests/test_train_gpu.c derives them: bf16 activations (unit roundoff
 * 2^-8) through ~10 rounded ops a block, compared as whole tensors by relative L2 error: 4e-2
 * for gradients, 1e-2 for the loss. The learned scalars' gradients are each a sum over N C
 * products whose terms can cancel, so a single one can miss by more than its share; they are
 * compared together, as one vector (xlambda, vlambda, skipw), at twice the gradients' bound: the
 * cancellation in those sums amplifies the per-term rounding (measured up to 4.6e-2 across
 * seeds against 4e-2 for any whole tensor). The loss the GPU reports is the mean over the step's
 * tokens; its gradient is that of the sum (the reference's training loss).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "graph/cpu_muon.h"
#include "graph/cpu_spr.h"
#include "graph/exec.h"
#include "graph/step_spr.h"
#include "kernels/check.h"
#include "kernels/gemm_sm90.h"
#include "tests/muon_testing.h"
#include "util/rng.h"

#define TOTAL_STEPS 10
#define AT_STEP 2 /* W = ceil(13.5 * 2 / 10) = 3 blocks: long 384 tokens, short 128 */

static void spr_config(struct ng_exec_config *c, int B, int T, int K, int deterministic)
{
	memset(c, 0, sizeof(*c));
	cr_assert_eq(ng_gpt_preset(&c->model, "speedrun-tiny"), NG_OK);
	c->model.T = T;
	cr_assert_eq(ng_gpt_check(&c->model), NG_OK, "%s", ng_error_message());
	c->B = B;
	c->T = T;
	c->K = K;
	ng_step_default_options(&c->step);
	c->sched = (struct ng_schedule){ 1e-3f, 0.1f, 0, TOTAL_STEPS, 1 };
	c->clip = 0;
	c->beta1 = 0.9f;
	c->beta2 = 0.95f;
	c->eps = 1e-8f;
	c->seed = 11;
	c->deterministic = deterministic;
}

/* Random parameters: every tensor present, the scalars near their init. */
static void random_params(const struct ng_gpt_layout *lay, float *p, struct ng_rng *r)
{
	memset(p, 0, lay->total * sizeof(float));
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *s = &lay->p[i];
		double centre = i == NG_P_XLAMBDA || i == NG_P_VLAMBDA || i == NG_P_SKIPW ? 0.7 : 0;
		double std = centre ? 0.3 : i == NG_P_WTE || i == NG_P_VE ? 1.0 : 0.1;
		for (size_t k = 0; k < s->numel; k++)
			p[s->offset + k] = (float)(centre + std * ng_rng_normal(r));
	}
}

/* Tokens of K x B windows of T + 1: random, with a document start every ~90 tokens. */
static void fill_tokens(uint16_t *tok, int n, int V, struct ng_rng *r)
{
	for (int i = 0; i < n; i++)
		tok[i] = (uint16_t)(ng_rng_below(r, 90) == 0 ? (uint64_t)V - 1
							     : ng_rng_below(r, (uint64_t)V - 1));
}

/* Micro-batch k of the K x B windows of T + 1 tokens as the reference's inputs and targets. */
static void split_batch(const uint16_t *tok, int k, int B, int T, int32_t *in, int32_t *tg)
{
	for (int b = 0; b < B; b++)
		for (int t = 0; t < T; t++) {
			in[b * T + t] = tok[(k * B + b) * (T + 1) + t];
			tg[b * T + t] = tok[(k * B + b) * (T + 1) + t + 1];
		}
}

static double rel_l2(const float *a, const double *ref, size_t n)
{
	double num = 0, den = 0;
	for (size_t i = 0; i < n; i++) {
		double d = a[i] - ref[i];
		num += d * d;
		den += ref[i] * ref[i];
	}
	return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The largest |bf16(x)| of n floats (the bf16 copy the GPU casts to E4M3). */
static double max_abs_bf16(const float *x, size_t n)
{
	double m = 0;
	for (size_t i = 0; i < n; i++) {
		uint32_t u;
		memcpy(&u, &x[i], 4);
		u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
		float f;
		memcpy(&f, &u, 4);
		if (fabs(f) > m)
			m = fabs(f);
	}
	return m;
}

/* FP8 tensor cores: sm_89 and newer */
static int has_fp8(void)
{
	int dev = 0, major = 0, minor = 0;
	if (cudaGetDevice(&dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
		return 0;
	return major * 10 + minor >= 89;
}

/* head_fp8 1: the GPU head in FP8, forward E4M3 and backward E5M2 (step options NG_FP8_HEAD,
 * NG_FP8_HEAD_BWD), against the reference's simulation of it (head_fp8 = 3) with the scales of
 * this first step after a restore: the input's descale 1 (no history yet), the weight's
 * max |w| / 448, the gradient's 1 / 448.
 * head_fp8 2: --fp8, every layer matmul's forward in E4M3 and its dinp E5M2 x E4M3 too, against
 * the exact reference, with tests/test_train_gpu.c's fp8 bounds: an E4M3 forward matmul's
 * output off by about sqrt(2/3) 2^-4 = 0.051 relative, the loss 2e-2; an input gradient by
 * sqrt((2^-6 + 2^-8) / 3) = 0.081, carried down into every gradient: 4x that, 0.33.
 * head_fp8 4: head_fp8 2 with --fp8-dw, every layer's dW E5M2 x E4M3: the same 0.081 a weight
 * gradient, inside that bound.
 * fuse: relu^2 in our own GEMM's epilogue (step option fuse_relu2; skipped where that GEMM
 * cannot run), within the same bounds: its one rounding less (the pre-activation) and the
 * backward's 2 sqrt(fcr) for 2 max(pre, 0) (2^-9 relative) are inside one op's bf16 share. */
static void step_matches(int B, int T, int K, int head_fp8, int fuse)
{
	if (fuse && !ng_gemm_sm90_available())
		cr_skip_test("not an sm_90 GPU (or no sm_90a build): our GEMM cannot run here");
	uint64_t seed = (uint64_t)time(NULL);
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct ng_exec_config c;
	spr_config(&c, B, T, K, 0);
	const int every = head_fp8 == 2 || head_fp8 == 4;
	const int fp8 = every ? NG_FP8_EVERY | NG_FP8_HEAD_BWD | (head_fp8 == 4 ? NG_FP8_DW_ALL : 0)
			: head_fp8 ? NG_FP8_HEAD | NG_FP8_HEAD_BWD : 0;
	const double tol_grad = every ? 0.33 : 4e-2, tol_loss = every ? 2e-2 : 1e-2;
	c.step.fp8 = fp8;
	c.step.fuse_relu2 = fuse;
	struct ng_exec e;
	cr_assert_eq(ng_exec_init(&e, &c, NULL), NG_OK, "init: %s", ng_error_message());
	cr_assert_eq(e.train.fp8, fp8, "the train graph's fp8 kinds");
	cr_assert_eq(e.train.fuse_relu2, fuse, "the train graph's relu^2 fusion");
	fprintf(stderr, "speedrun step B=%d T=%d K=%d: %s | %s\n", B, T, K,
		ng_attention_describe(&e.att_band[2]), ng_attention_describe(&e.att_band[0]));
	const struct ng_graph *g = &e.train;
	size_t total = g->lay.total;
	float *p0 = malloc(total * 4), *zero = calloc(total, 4), *grads = malloc(total * 4);
	cr_assert(p0 && zero && grads);
	random_params(&g->lay, p0, &r);
	cr_assert_eq(ng_exec_restore(&e, p0, zero, zero, AT_STEP, 0), NG_OK, "%s",
		     ng_error_message());
	uint16_t *tok;
	cr_assert_eq(ng_exec_input(&e, &tok), NG_OK);
	fill_tokens(tok, K * B * (T + 1), c.model.V, &r);
	cr_assert_eq(ng_exec_submit(&e), NG_OK, "%s", ng_error_message());
	struct ng_metrics_record rec;
	int n;
	cr_assert_eq(ng_exec_collect(&e, &rec, NULL, 1, true, &n), NG_OK, "%s", ng_error_message());
	cr_assert_eq(n, 1);
	cr_assert_eq(ng_exec_download(&e, g->t_grads, grads), NG_OK);

	struct ng_cpu_spr_model m;
	cr_assert_eq(ng_cpu_spr_init(&m, &c.model, B, T, c.seed), NG_OK, "%s", ng_error_message());
	ng_cpu_spr_load_params(&m, p0);
	if (head_fp8 == 1) {
		const struct ng_param_spec *h = &g->lay.p[NG_P_HEADW];
		m.head_fp8 = 3;
		m.head_xs = 1.0;
		m.head_ws = max_abs_bf16(p0 + h->offset, h->numel) / 448.0;
	}
	int32_t *in = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
	cr_assert(in && tg);
	double loss = 0;
	int W = ng_spr_window_blocks(AT_STEP, TOTAL_STEPS);
	ng_cpu_spr_zero_grad(&m);
	for (int k = 0; k < K; k++) {
		split_batch(tok, k, B, T, in, tg);
		double l;
		cr_assert_eq(ng_cpu_spr_forward(&m, in, tg, W, &l), NG_OK, "%s", ng_error_message());
		cr_assert_eq(ng_cpu_spr_backward(&m, 1.0), NG_OK);
		loss += l;
	}
	double mean = loss / ((double)K * B * T);
	double lerr = fabs(rec.loss - mean) / mean;
	fprintf(stderr, "speedrun step%s%s: loss gpu %.6f ref %.6f (W = %d blocks)\n",
		head_fp8 == 4 ? " (--fp8 --fp8-dw)" : head_fp8 == 2 ? " (--fp8)"
		: head_fp8 ? " (FP8 head)" : "",
		fuse ? " (fused relu^2)" : "", rec.loss, mean, W);
	cr_expect(lerr < tol_loss, "loss gpu %.6f ref %.6f rel err %.2e (seed %llu)", rec.loss, mean,
		  lerr, (unsigned long long)seed);
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &g->lay.p[i];
		if (!ng_param_present(p) || i == NG_P_XLAMBDA || i == NG_P_VLAMBDA || i == NG_P_SKIPW)
			continue;
		double err = rel_l2(grads + p->offset, m.grads + p->offset, p->numel);
		fprintf(stderr, "grad %-9s rel L2 err %.3e\n", p->name, err);
		cr_expect(err < tol_grad, "grad %s: rel L2 err %.3e (seed %llu)", p->name, err,
			  (unsigned long long)seed);
	}
	/* the scalars: one vector from xlambda to the end of skipw (padding zero on both sides) */
	const struct ng_param_spec *x = &g->lay.p[NG_P_XLAMBDA], *k = &g->lay.p[NG_P_SKIPW];
	size_t n_sc = k->offset + k->numel - x->offset;
	double err = rel_l2(grads + x->offset, m.grads + x->offset, n_sc);
	fprintf(stderr, "grad scalars   rel L2 err %.3e; skipw gpu/ref:", err);
	for (size_t j = 0; j < k->numel; j++)
		fprintf(stderr, " %.4g/%.4g", grads[k->offset + j], m.grads[k->offset + j]);
	fprintf(stderr, "\n");
	cr_expect(err < 2 * tol_grad, "grad scalars: rel L2 err %.3e (seed %llu)", err,
		  (unsigned long long)seed);
	ng_cpu_spr_free(&m);
	free(in), free(tg), free(p0), free(zero), free(grads);
	ng_exec_free(&e);
}

Test(train_spr_gpu, step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	step_matches(2, 400, 1, 0, 0);
}

Test(train_spr_gpu, accumulated_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	step_matches(1, 520, 2, 0, 0); /* T not a multiple of 128; two micro-batches summed */
}

Test(train_spr_gpu, fp8_head_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	step_matches(2, 400, 1, 1, 0);
}

Test(train_spr_gpu, fused_relu2_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	step_matches(2, 400, 1, 0, 1);
}

Test(train_spr_gpu, fused_relu2_accumulated_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	step_matches(1, 520, 2, 0, 1);
}

Test(train_spr_gpu, fused_relu2_fp8_head_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	step_matches(2, 400, 1, 1, 1);
}

Test(train_spr_gpu, fp8_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	if (!has_fp8()) {
		struct ng_exec_config c;
		spr_config(&c, 2, 400, 1, 0);
		c.step.fp8 = NG_FP8_EVERY;
		struct ng_exec e;
		cr_assert_eq(ng_exec_init(&e, &c, NULL), NG_ERR_INPUT);
		ng_exec_free(&e);
		cr_skip_test("no FP8 on this GPU (init refused --fp8, as it should)");
	}
	step_matches(2, 400, 1, 2, 0);
	step_matches(2, 400, 1, 4, 0);
}

/* The parameters after three steps (the window growing) from random ones: fp8 0 bf16, 1 --fp8
 * with E4M3 weight copies, 2 --fp8 --recompute fp8, 3 bf16 with relu^2 fused, 4 --fp8
 * --fp8-dw. */
static float *three_steps(int no_graph, int fp8, size_t *total)
{
	struct ng_rng r;
	ng_rng_seed(&r, 5);
	struct ng_exec_config c;
	spr_config(&c, 2, 400, 1, 1);
	c.no_graph = no_graph;
	c.step.fp8 = fp8 == 1 || fp8 == 2 || fp8 == 4 ? NG_FP8_EVERY : 0;
	if (fp8 == 4)
		c.step.fp8 |= NG_FP8_DW_ALL;
	c.step.recompute_fp8 = fp8 == 2;
	c.step.fuse_relu2 = fp8 == 3;
	struct ng_exec e;
	cr_assert_eq(ng_exec_init(&e, &c, NULL), NG_OK, "init: %s", ng_error_message());
	*total = e.train.lay.total;
	float *p0 = malloc(*total * 4), *zero = calloc(*total, 4), *out = malloc(*total * 4);
	cr_assert(p0 && zero && out);
	random_params(&e.train.lay, p0, &r);
	cr_assert_eq(ng_exec_restore(&e, p0, zero, zero, AT_STEP, 0), NG_OK);
	for (int s = 0; s < 3; s++) {
		uint16_t *tok;
		cr_assert_eq(ng_exec_input(&e, &tok), NG_OK);
		fill_tokens(tok, 2 * 401, e.cfg.model.V, &r);
		cr_assert_eq(ng_exec_submit(&e), NG_OK, "%s", ng_error_message());
		struct ng_metrics_record rec;
		int n;
		cr_assert_eq(ng_exec_collect(&e, &rec, NULL, 1, true, &n), NG_OK, "%s",
			     ng_error_message());
	}
	long long step, nsk;
	cr_assert_eq(ng_exec_snapshot(&e, out, NULL, NULL, &step, &nsk), NG_OK);
	cr_expect_eq(step, AT_STEP + 3);
	free(p0), free(zero);
	ng_exec_free(&e);
	return out;
}

static void expect_same_params(const float *a, const float *b, size_t total, const char *what)
{
	size_t bad = total;
	for (size_t i = 0; i < total && bad == total; i++)
		if (memcmp(&a[i], &b[i], 4) != 0)
			bad = i;
	cr_expect(bad == total, "%s differ at parameter element %zu: %.9g vs %.9g", what, bad,
		  bad < total ? a[bad] : 0.0, bad < total ? b[bad] : 0.0);
}

/* --fp8 --deterministic: the scales roll inside the graph from step to step, so graph replay
 * and eager launches must still give the same bytes (with --fp8-dw too), and so must
 * --recompute fp8 (each matmul casts its own weights: the bytes of the copies). */
Test(train_spr_gpu, fp8_graph_equals_eager_deterministic)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	if (!has_fp8())
		cr_skip_test("no FP8 on this GPU");
	size_t total = 0;
	float *graph = three_steps(0, 1, &total), *eager = three_steps(1, 1, &total);
	float *recast = three_steps(0, 2, &total);
	expect_same_params(graph, eager, total, "--fp8 graph and eager");
	expect_same_params(graph, recast, total, "--fp8 and --fp8 --recompute fp8");
	float *dw_graph = three_steps(0, 4, &total), *dw_eager = three_steps(1, 4, &total);
	expect_same_params(dw_graph, dw_eager, total, "--fp8 --fp8-dw graph and eager");
	free(graph), free(eager), free(recast), free(dw_graph), free(dw_eager);
}

/* --deterministic: the captured graph replayed gives the bytes of eager launches (--no-graph),
 * over three steps in which the window grows. */
Test(train_spr_gpu, graph_equals_eager_deterministic)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	size_t total = 0;
	float *graph = three_steps(0, 0, &total), *eager = three_steps(1, 0, &total);
	expect_same_params(graph, eager, total, "graph and eager");
	free(graph), free(eager);
	if (!ng_gemm_sm90_available())
		return;
	graph = three_steps(0, 3, &total), eager = three_steps(1, 3, &total);
	expect_same_params(graph, eager, total, "graph and eager, relu^2 fused");
	free(graph), free(eager);
}

/* The eval graph attends within the window ng_exec_evaluate is given, not the step counter's
 * (restored at AT_STEP, whose schedule gives 3 blocks): at 1, 3 and 14 blocks (and 0, the
 * widest) its mean loss over two sequences of T = 512 against the reference's at that window,
 * within the loss bound of the step tests (1e-2 relative). The documents run ~300 tokens, so
 * that the windows see different keys; each GPU loss must also lie nearer its own window's
 * reference than another window's wherever those two references differ by more than 1e-3
 * relative (the step tests' losses agree to ~1e-5). */
Test(train_spr_gpu, eval_takes_the_given_window)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = (uint64_t)time(NULL);
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const int B = 1, T = 512, NB = 2;
	struct ng_exec_config c;
	spr_config(&c, B, T, 1, 0);
	c.eval_batches = NB;
	struct ng_exec e;
	cr_assert_eq(ng_exec_init(&e, &c, NULL), NG_OK, "init: %s", ng_error_message());
	size_t total = e.train.lay.total;
	float *p0 = malloc(total * 4), *zero = calloc(total, 4);
	uint16_t *tok = malloc(sizeof(uint16_t) * NB * B * (T + 1));
	int32_t *in = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
	cr_assert(p0 && zero && tok && in && tg);
	random_params(&e.train.lay, p0, &r);
	cr_assert_eq(ng_exec_restore(&e, p0, zero, zero, AT_STEP, 0), NG_OK, "%s",
		     ng_error_message());
	const uint64_t V = (uint64_t)c.model.V;
	for (int i = 0; i < NB * B * (T + 1); i++) /* a document start about every 300 tokens */
		tok[i] = (uint16_t)(ng_rng_below(&r, 300) == 0 ? V - 1 : ng_rng_below(&r, V - 1));
	struct ng_cpu_spr_model m;
	cr_assert_eq(ng_cpu_spr_init(&m, &c.model, B, T, c.seed), NG_OK, "%s", ng_error_message());
	ng_cpu_spr_load_params(&m, p0);
	const int windows[3] = { 1, 3, NG_EXEC_SPR_BANDS };
	double want[3], got[3];
	for (int w = 0; w < 3; w++) {
		want[w] = 0;
		for (int k = 0; k < NB; k++) {
			split_batch(tok, k, B, T, in, tg);
			double l;
			cr_assert_eq(ng_cpu_spr_forward(&m, in, tg, windows[w], &l), NG_OK, "%s",
				     ng_error_message());
			want[w] += l / ((double)NB * B * T);
		}
		cr_assert_eq(ng_exec_evaluate(&e, tok, windows[w], &got[w]), NG_OK, "%s",
			     ng_error_message());
		fprintf(stderr, "speedrun eval at W = %d: gpu %.6f ref %.6f\n", windows[w], got[w],
			want[w]);
		cr_expect(fabs(got[w] - want[w]) < 1e-2 * want[w], "W = %d: eval gpu %.6f ref %.6f "
			  "(seed %llu)", windows[w], got[w], want[w], (unsigned long long)seed);
	}
	for (int w = 0; w < 3; w++)
		for (int o = 0; o < 3; o++)
			if (o != w && fabs(want[o] - want[w]) > 1e-3 * want[w])
				cr_expect(fabs(got[w] - want[w]) < fabs(got[w] - want[o]),
					  "W = %d: eval gpu %.6f nearer the reference at W = %d "
					  "(%.6f) than at its own (%.6f) (seed %llu)", windows[w],
					  got[w], windows[o], want[o], want[w],
					  (unsigned long long)seed);
	double widest;
	cr_assert_eq(ng_exec_evaluate(&e, tok, 0, &widest), NG_OK, "%s", ng_error_message());
	cr_expect(fabs(widest - got[2]) <= 1e-6 * got[2], "window 0 gives %.8f, the widest %.8f",
		  widest, got[2]); /* the same graph again: equal but for the loss sum's order */
	ng_cpu_spr_free(&m);
	free(p0), free(zero), free(tok), free(in), free(tg);
	ng_exec_free(&e);
}

/* --optimizer muon on the speedrun model (its groups: the qkv and attention-projection matrices
 * of the L - 1 blocks with attention; Adam's embeddings x75, head, scalars), one GPU step from
 * random weights restored at AT_STEP (momentum and moments zero), the update against the
 * double-precision reference applied to the GPU's own gradients at that step's schedule, by
 * tests/test_train_gpu.c's rules: Adam's parameters within 1e-4 relative (fp32 against
 * double, the step size added to the denominator); each Muon group's update W1 - W0 in
 * relative L2 within 2 x the bf16 emulation's error (graph/cpu_muon.h) + 1e-3. */
Test(train_spr_gpu, muon_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = (uint64_t)time(NULL);
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	const int B = 1, T = 400;
	struct ng_exec_config c;
	spr_config(&c, B, T, 1, 0);
	c.step.muon = 1;
	c.muon = ng_muon_config_default(TOTAL_STEPS);
	c.muon.adam_mult[NG_MUON_ADAM_EMBED] = 75; /* the speedrun's, as train sets it */
	struct ng_exec e;
	cr_assert_eq(ng_exec_init(&e, &c, NULL), NG_OK, "init: %s", ng_error_message());
	const struct ng_graph *g = &e.train;
	size_t total = g->lay.total;
	float *p0 = malloc(total * 4), *zero = calloc(total, 4), *grads = malloc(total * 4);
	float *p1 = malloc(total * 4), *m1 = malloc(total * 4), *v1 = malloc(total * 4);
	cr_assert(p0 && zero && grads && p1 && m1 && v1);
	random_params(&g->lay, p0, &r);
	cr_assert_eq(ng_exec_restore(&e, p0, zero, zero, AT_STEP, 0), NG_OK, "%s",
		     ng_error_message());
	uint16_t *tok;
	cr_assert_eq(ng_exec_input(&e, &tok), NG_OK);
	const uint64_t V = (uint64_t)c.model.V;
	for (int i = 0; i < B * (T + 1); i++)
		tok[i] = (uint16_t)(ng_rng_below(&r, 90) == 0 ? V - 1 : ng_rng_below(&r, V - 1));
	cr_assert_eq(ng_exec_submit(&e), NG_OK, "%s", ng_error_message());
	struct ng_metrics_record rec;
	int n;
	cr_assert_eq(ng_exec_collect(&e, &rec, NULL, 1, true, &n), NG_OK, "%s", ng_error_message());
	cr_assert_eq(n, 1);
	cr_assert(!rec.skipped, "the step was skipped (loss %g)", rec.loss);
	cr_assert_eq(ng_exec_download(&e, g->t_grads, grads), NG_OK);
	long long step, nsk;
	cr_assert_eq(ng_exec_snapshot(&e, p1, m1, v1, &step, &nsk), NG_OK, "%s", ng_error_message());
	cr_expect_eq(step, AT_STEP + 1);
	const double f = ng_muon_lr_factor(AT_STEP, TOTAL_STEPS, c.muon.cooldown_frac,
					   c.muon.final_frac);
	const double mu = ng_muon_momentum(AT_STEP, c.muon.mu_start, c.muon.mu_end,
					   c.muon.mu_warmup);
	cr_expect(fabs(rec.lr - c.muon.lr * f) < 1e-6, "lr gpu %g, Muon's %g", rec.lr,
		  c.muon.lr * f);
	mt_check_adam(g, &c.muon, AT_STEP, 1.0, p0, p1, grads, seed);
	mt_check_muon(g, mu, c.muon.lr * f, 1.0, p0, p1, grads, seed, "speedrun");
	free(p0), free(zero), free(grads), free(p1), free(m1), free(v1);
	ng_exec_free(&e);
}
