/*
 * tests/test_attention.c — causal attention (kernels/attention.h), both backends, against the
 * double-precision reference of graph/cpu_ops.h.
 *
 * Tolerance: the FlashAttention rule of docs/CONTRIBUTING.md. Next to the kernel we run a naive
 * bf16 computation on the CPU (tests/attention_testing.h: what PyTorch's bf16 math path does,
 * every matmul output, the scaled scores, the probabilities and the gradients rounded to bf16,
 * fp32 accumulation) and require
 *     max|kernel - fp64| <= 2 * max|naive bf16 - fp64| + atol,
 * atol = one bf16 ulp at the largest reference magnitude (2^-8 * max|ref|) for bf16 outputs and
 * 1e-5 * max(1, max|ref|) for the fp32 log-sum-exp.
 * Shapes: T in {1, 64, 257, 1024, 2048}, D in {64, 128}, H in {1, 12, 25} (the GPT-2 1.5B shape
 * H=25 D=64 T=1024 included), plus naive-only odd shapes (D = 24, 40, 72, 256). The references
 * stay affordable with B=1 and few heads at large T (OpenMP over (b, h)).
 * Also: CUDA graph replay equals eager execution (byte for byte where the backward is
 * deterministic), the deterministic variant gives the same bytes twice, plan-time fallbacks and
 * errors. Inputs are fresh N(0,1) bf16 each run; the seed is printed in failure messages.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graph/cpu_ops.h"
#include "kernels/attention.h"
#include "kernels/check.h"
#include "tests/attention_testing.h"
#include "util/rng.h"

static ng_bf16 f2bf(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return 0x7fc0;
	u += 0x7fffu + ((u >> 16) & 1u);
	return (ng_bf16)(u >> 16);
}

static float bf2f(ng_bf16 b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static uint64_t fresh_seed(void)
{
	static uint64_t n;
	return (uint64_t)time(NULL) * 1000003u + (uint64_t)clock() + 7919u * ++n;
}

/* Device buffers of one problem. */
struct dev {
	ng_bf16 *qkv, *out, *dout, *dqkv;
	float *lse;
	void *wsf, *wsb;
};

static void dev_alloc(struct dev *d, const struct ng_attention *att)
{
	size_t n_qkv = (size_t)att->B * att->T * 3 * att->H * att->D, n_o = n_qkv / 3;
	cr_assert(!cudaMalloc((void **)&d->qkv, n_qkv * 2));
	cr_assert(!cudaMalloc((void **)&d->dqkv, n_qkv * 2));
	cr_assert(!cudaMalloc((void **)&d->out, n_o * 2));
	cr_assert(!cudaMalloc((void **)&d->dout, n_o * 2));
	cr_assert(!cudaMalloc((void **)&d->lse, (size_t)att->B * att->H * att->T * 4));
	cr_assert(!cudaMalloc(&d->wsf, ng_attention_fwd_workspace(att) + 256));
	cr_assert(!cudaMalloc(&d->wsb, ng_attention_bwd_workspace(att) + 256));
}

static void dev_free(struct dev *d)
{
	cudaFree(d->qkv), cudaFree(d->dqkv), cudaFree(d->out), cudaFree(d->dout), cudaFree(d->lse);
	cudaFree(d->wsf), cudaFree(d->wsb);
}

static void run_step(const struct ng_attention *att, struct dev *d, cudaStream_t s)
{
	cr_assert_eq(ng_attention_fwd(att, d->out, d->lse, d->qkv, d->wsf, s), NG_OK, "fwd: %s",
		     ng_error_message());
	cr_assert_eq(ng_attention_bwd(att, d->dqkv, d->dout, d->qkv, d->out, d->lse, d->wsb, s), NG_OK,
		     "bwd: %s", ng_error_message());
}

static void fill_random(ng_bf16 *x, size_t n, struct ng_rng *r)
{
	for (size_t i = 0; i < n; i++)
		x[i] = f2bf((float)ng_rng_normal(r));
}

struct acase {
	int B, H, T, D;
	int naive;         /* 1: force the plain CUDA kernels */
	int deterministic; /* 1: the deterministic backward */
};

/* Draws the case's seed, names the case in ctx, creates the cuDNN handle and plans (printing the
 * plan's description). Returns the seed. */
static uint64_t setup_case(const struct acase *c, char *ctx, size_t n, cudnnHandle_t *h,
			   struct ng_attention *att)
{
	uint64_t seed = fresh_seed();
	snprintf(ctx, n, "[%s%s B=%d H=%d T=%d D=%d seed=%llu]", c->naive ? "naive" : "cuDNN",
		 c->deterministic ? " deterministic" : "", c->B, c->H, c->T, c->D,
		 (unsigned long long)seed);
	cr_assert_eq(cudnnCreate(h), CUDNN_STATUS_SUCCESS);
	cr_assert_eq(ng_attention_plan(att, *h, c->B, c->H, c->T, c->D, c->deterministic, c->naive),
		     NG_OK, "%s plan: %s", ctx, ng_error_message());
	fprintf(stderr, "%s %s\n", ctx, ng_attention_describe(att));
	return seed;
}

ParameterizedTestParameters(attention, matches_reference)
{
	static struct acase cases[] = {
		{ .B = 2, .H = 12, .T = 1, .D = 64 },
		{ .B = 2, .H = 12, .T = 64, .D = 64 },
		{ .B = 2, .H = 1, .T = 64, .D = 128 },
		{ .B = 1, .H = 25, .T = 257, .D = 64 },
		{ .B = 1, .H = 12, .T = 257, .D = 128 },
		{ .B = 1, .H = 25, .T = 1024, .D = 64 },
		{ .B = 1, .H = 1, .T = 1024, .D = 128 },
		{ .B = 1, .H = 1, .T = 2048, .D = 128 },
		{ .B = 1, .H = 4, .T = 2048, .D = 64 },
		{ .B = 2, .H = 12, .T = 64, .D = 64, .deterministic = 1 },
		{ .B = 1, .H = 25, .T = 1024, .D = 64, .deterministic = 1 },
		{ .B = 1, .H = 4, .T = 2048, .D = 64, .deterministic = 1 },
		{ .B = 2, .H = 12, .T = 1, .D = 64, .naive = 1 },
		{ .B = 2, .H = 12, .T = 64, .D = 64, .naive = 1 },
		{ .B = 2, .H = 1, .T = 64, .D = 128, .naive = 1 },
		{ .B = 1, .H = 25, .T = 257, .D = 64, .naive = 1 },
		{ .B = 1, .H = 12, .T = 257, .D = 128, .naive = 1 },
		{ .B = 1, .H = 25, .T = 1024, .D = 64, .naive = 1 },
		{ .B = 1, .H = 1, .T = 2048, .D = 128, .naive = 1 },
		{ .B = 1, .H = 3, .T = 300, .D = 256, .naive = 1 },
		{ .B = 2, .H = 5, .T = 33, .D = 40, .naive = 1 },
		{ .B = 1, .H = 2, .T = 1, .D = 24, .naive = 1 },
		{ .B = 1, .H = 7, .T = 130, .D = 72, .naive = 1 },
	};
	return cr_make_param_array(struct acase, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(struct acase *c, attention, matches_reference, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	int B = c->B, H = c->H, T = c->T, D = c->D;
	char ctx[160];
	cudnnHandle_t h;
	struct ng_attention att;
	uint64_t seed = setup_case(c, ctx, sizeof(ctx), &h, &att);
	if (c->naive) {
		cr_assert_eq(att.fwd_backend, NG_ATTENTION_BACKEND_NAIVE);
		cr_assert_eq(att.bwd_backend, NG_ATTENTION_BACKEND_NAIVE);
	} else if (T >= 64) {
		cr_assert_eq(att.fwd_backend, NG_ATTENTION_BACKEND_CUDNN, "%s %s", ctx,
			     ng_attention_describe(&att));
		/* cuDNN <= 9.15.0 with T % 128 != 0: the padding-mask workaround */
		int workaround = att.cudnn_version < 91501 && T % 128;
		cr_assert_eq(att.bwd_backend, NG_ATTENTION_BACKEND_CUDNN, "%s %s", ctx,
			     ng_attention_describe(&att));
		cr_assert_eq(att.bwd_seqlen, workaround, "%s %s", ctx, ng_attention_describe(&att));
	}

	size_t n_qkv = (size_t)B * T * 3 * H * D, n_o = n_qkv / 3, n_l = (size_t)B * H * T;
	struct ng_rng rng;
	ng_rng_seed(&rng, seed);
	ng_bf16 *qkv = malloc(n_qkv * 2), *dout = malloc(n_o * 2), *out = malloc(n_o * 2);
	ng_bf16 *dqkv = malloc(n_qkv * 2);
	float *lse = malloc(n_l * 4);
	fill_random(qkv, n_qkv, &rng);
	fill_random(dout, n_o, &rng);

	struct dev d;
	dev_alloc(&d, &att);
	cr_assert(!cudaMemcpy(d.qkv, qkv, n_qkv * 2, cudaMemcpyHostToDevice));
	cr_assert(!cudaMemcpy(d.dout, dout, n_o * 2, cudaMemcpyHostToDevice));
	run_step(&att, &d, 0);
	cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess, "%s %s", ctx,
		     cudaGetErrorString(cudaGetLastError()));
	cr_assert(!cudaMemcpy(out, d.out, n_o * 2, cudaMemcpyDeviceToHost));
	cr_assert(!cudaMemcpy(lse, d.lse, n_l * 4, cudaMemcpyDeviceToHost));
	cr_assert(!cudaMemcpy(dqkv, d.dqkv, n_qkv * 2, cudaMemcpyDeviceToHost));

	/* fp64 reference and the naive bf16 witness, from the same bf16 inputs */
	double *qkv_d = malloc(n_qkv * 8), *dout_d = malloc(n_o * 8), *out_r = malloc(n_o * 8);
	double *lse_r = malloc(n_l * 8), *dqkv_r = calloc(n_qkv, 8);
	float *qkv_f = malloc(n_qkv * 4), *dout_f = malloc(n_o * 4), *out_l = malloc(n_o * 4);
	float *lse_l = malloc(n_l * 4), *dqkv_l = malloc(n_qkv * 4);
	float *out_g = malloc(n_o * 4), *dqkv_g = malloc(n_qkv * 4);
	for (size_t i = 0; i < n_qkv; i++)
		qkv_f[i] = bf2f(qkv[i]), qkv_d[i] = qkv_f[i], dqkv_g[i] = bf2f(dqkv[i]);
	for (size_t i = 0; i < n_o; i++)
		dout_f[i] = bf2f(dout[i]), dout_d[i] = dout_f[i], out_g[i] = bf2f(out[i]);
	ng_ref_attention_fwd(out_r, lse_r, qkv_d, B, T, H, D);
	ng_ref_attention_bwd(dqkv_r, dout_d, qkv_d, B, T, H, D);
	at_lowp_attention(out_l, lse_l, dqkv_l, qkv_f, dout_f, NULL, 1.0f / sqrtf((float)D), B, H, T,
			  D);

	at_check_rule("out", out_g, out_l, out_r, n_o, 0x1p-8, 0.0, ctx);
	at_check_rule("lse", lse, lse_l, lse_r, n_l, 1e-5, 1e-5, ctx);
	double se = 0.0, ss = 0.0; /* fp32 output: also NMSE <= 1e-7 (docs/CONTRIBUTING.md) */
	for (size_t i = 0; i < n_l; i++)
		se += (lse[i] - lse_r[i]) * (lse[i] - lse_r[i]), ss += lse_r[i] * lse_r[i];
	cr_expect(se <= 1e-7 * ss, "%s lse: NMSE %.3e > 1e-7", ctx, se / ss);
	at_check_rule("dqkv", dqkv_g, dqkv_l, dqkv_r, n_qkv, 0x1p-8, 0.0, ctx);

	dev_free(&d);
	ng_attention_free(&att);
	cudnnDestroy(h);
	free(qkv), free(dout), free(out), free(dqkv), free(lse), free(qkv_d), free(dout_d);
	free(out_r), free(lse_r), free(dqkv_r), free(qkv_f), free(dout_f), free(out_l), free(lse_l);
	free(dqkv_l), free(out_g), free(dqkv_g);
}

ParameterizedTestParameters(attention, graph_replay_equals_eager)
{
	static struct acase cases[] = {
		{ .B = 2, .H = 12, .T = 1024, .D = 64 },
		{ .B = 2, .H = 12, .T = 1024, .D = 64, .deterministic = 1 },
		{ .B = 1, .H = 4, .T = 257, .D = 64, .deterministic = 1 },
		{ .B = 3, .H = 4, .T = 257, .D = 64 },
		{ .B = 2, .H = 12, .T = 1024, .D = 64, .naive = 1 },
		{ .B = 2, .H = 3, .T = 100, .D = 40, .naive = 1 },
	};
	return cr_make_param_array(struct acase, cases, sizeof(cases) / sizeof(cases[0]));
}

/* Eager twice (the deterministic variants give the same bytes), then fwd+bwd captured into one
 * CUDA graph and replayed twice: O and LSE byte-identical to eager, and dQKV too whenever the
 * backward is deterministic (otherwise within a small tolerance). */
ParameterizedTest(struct acase *c, attention, graph_replay_equals_eager, .timeout = 300)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	char ctx[160];
	cudnnHandle_t h;
	struct ng_attention att;
	uint64_t seed = setup_case(c, ctx, sizeof(ctx), &h, &att);
	int bwd_det = c->deterministic || att.bwd_backend == NG_ATTENTION_BACKEND_NAIVE;
	size_t n_qkv = (size_t)c->B * c->T * 3 * c->H * c->D, n_o = n_qkv / 3;
	size_t n_l = (size_t)c->B * c->H * c->T;
	struct ng_rng rng;
	ng_rng_seed(&rng, seed);
	ng_bf16 *qkv = malloc(n_qkv * 2), *dout = malloc(n_o * 2);
	fill_random(qkv, n_qkv, &rng);
	fill_random(dout, n_o, &rng);
	struct dev d;
	dev_alloc(&d, &att);
	cudaStream_t s;
	cr_assert(!cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	cr_assert(!cudaMemcpy(d.qkv, qkv, n_qkv * 2, cudaMemcpyHostToDevice));
	cr_assert(!cudaMemcpy(d.dout, dout, n_o * 2, cudaMemcpyHostToDevice));

	ng_bf16 *o[3], *g[3];
	float *l[3];
	for (int r = 0; r < 3; r++) {
		o[r] = malloc(n_o * 2), g[r] = malloc(n_qkv * 2), l[r] = malloc(n_l * 4);
	}
	/* r = 0, 1: eager runs; r = 2: graph replays (compared after the second one) */
	for (int r = 0; r < 2; r++) {
		run_step(&att, &d, s);
		cr_assert(!cudaStreamSynchronize(s), "%s eager", ctx);
		cudaMemcpy(o[r], d.out, n_o * 2, cudaMemcpyDeviceToHost);
		cudaMemcpy(l[r], d.lse, n_l * 4, cudaMemcpyDeviceToHost);
		cudaMemcpy(g[r], d.dqkv, n_qkv * 2, cudaMemcpyDeviceToHost);
	}
	cudaGraph_t graph;
	cudaGraphExec_t exec;
	cr_assert(!cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
	run_step(&att, &d, s);
	cr_assert_eq(cudaStreamEndCapture(s, &graph), cudaSuccess, "%s capture", ctx);
	cr_assert_eq(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess, "%s instantiate", ctx);
	for (int r = 0; r < 2; r++) {
		cudaMemsetAsync(d.out, 0xff, n_o * 2, s);
		cudaMemsetAsync(d.lse, 0xff, n_l * 4, s);
		cudaMemsetAsync(d.dqkv, 0xff, n_qkv * 2, s);
		cr_assert_eq(cudaGraphLaunch(exec, s), cudaSuccess, "%s launch", ctx);
		cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess, "%s replay", ctx);
	}
	cudaMemcpy(o[2], d.out, n_o * 2, cudaMemcpyDeviceToHost);
	cudaMemcpy(l[2], d.lse, n_l * 4, cudaMemcpyDeviceToHost);
	cudaMemcpy(g[2], d.dqkv, n_qkv * 2, cudaMemcpyDeviceToHost);

	for (int r = 1; r < 3; r++) {
		const char *what = r == 1 ? "second eager run" : "graph replay";
		cr_expect(!memcmp(o[0], o[r], n_o * 2), "%s out of %s differs from eager", ctx, what);
		cr_expect(!memcmp(l[0], l[r], n_l * 4), "%s lse of %s differs from eager", ctx, what);
		double worst = 0.0, mx = 0.0;
		size_t wi = 0;
		for (size_t i = 0; i < n_qkv; i++) {
			double a = bf2f(g[0][i]), b = bf2f(g[r][i]);
			if (!(fabs(a - b) <= worst))
				worst = fabs(a - b), wi = i;
			mx = fmax(mx, fabs(a));
		}
		if (bwd_det)
			cr_expect(!memcmp(g[0], g[r], n_qkv * 2),
				  "%s dqkv of %s differs from eager: max abs diff %.3e at %zu", ctx,
				  what, worst, wi);
		else
			cr_expect(worst <= 0x1p-7 * mx, "%s dqkv of %s: max abs diff %.3e at %zu "
				  "(max |dqkv| %.3e)", ctx, what, worst, wi, mx);
		fprintf(stderr, "%s %s: dqkv max abs diff vs eager %.3e\n", ctx, what, worst);
	}
	cudaGraphExecDestroy(exec);
	cudaGraphDestroy(graph);
	cudaStreamDestroy(s);
	dev_free(&d);
	ng_attention_free(&att);
	cudnnDestroy(h);
	for (int r = 0; r < 3; r++)
		free(o[r]), free(g[r]), free(l[r]);
	free(qkv), free(dout);
}

Test(attention, plan_rejects_huge_head)
{
	struct ng_attention att;
	ng_clear_error();
	cr_assert_eq(ng_attention_plan(&att, NULL, 2, 3, 64, 300, 0, 0), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "D=300"), "message: %s", ng_error_message());
	ng_clear_error();
	cr_assert_eq(ng_attention_plan(&att, NULL, 0, 3, 64, 64, 0, 0), NG_ERR_INPUT);
	ng_clear_error();
}

Test(attention, plan_without_cudnn_uses_naive)
{
	struct ng_attention att;
	cr_assert_eq(ng_attention_plan(&att, NULL, 2, 3, 64, 64, 0, 0), NG_OK);
	cr_assert_eq(att.fwd_backend, NG_ATTENTION_BACKEND_NAIVE);
	cr_assert(strstr(ng_attention_describe(&att), "no cuDNN handle"), "%s",
		  ng_attention_describe(&att));
	ng_attention_free(&att);
}

Test(attention, plan_reports_unsupported_head_size)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	cudnnHandle_t h;
	cr_assert_eq(cudnnCreate(&h), CUDNN_STATUS_SUCCESS);
	struct ng_attention att;
	cr_assert_eq(ng_attention_plan(&att, h, 2, 4, 128, 36, 0, 0), NG_OK);
	const char *txt = ng_attention_describe(&att);
	fprintf(stderr, "%s\n", txt);
	cr_assert_eq(att.fwd_backend, NG_ATTENTION_BACKEND_NAIVE);
	cr_assert(strstr(txt, "multiple of 8") && strstr(txt, "D=36") && strstr(txt, "cuDNN"), "%s",
		  txt);
	ng_attention_free(&att);
	cudnnDestroy(h);
}
