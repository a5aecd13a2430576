/*
 * tests/test_train_gpu.c — the whole GPU step (graph/exec.c) against the double-precision CPU
 * reference (graph/cpu_ref.c) on tiny models, and graph replay against eager launches.
 *
 * Tolerances: the GPU step runs bf16 activations and weights (unit roundoff 2^-8 = 3.9e-3) with
 * fp32 accumulation; the reference is double. We compare whole tensors by relative L2 error
 * ||gpu - ref|| / ||ref||, which for a chain of ~10 bf16-rounded ops per layer stays a few
 * times the unit roundoff: bound 4e-2 for gradients, 1e-2 for the loss. The AdamW update is
 * checked exactly instead: the reference update applied to the GPU's own gradients (fp32 master
 * weights, stored split as the bf16 copy and a low half: relative error 1e-5); the bf16 copy is
 * the master's split high half, and a restore + snapshot gives the master back bit for bit.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "data/synth.h"
#include "graph/cpu_muon.h"
#include "graph/cpu_ops.h"
#include "graph/cpu_ref.h"
#include "graph/exec.h"
#include "kernels/check.h"
#include "kernels/gemm_sm90.h"
#include "kernels/split.h"
#include "tests/muon_testing.h"

/* The fp32 master after the step (p1, lay.total floats): the split master (kernels/split.h)
 * joined by ng_exec_snapshot; its bf16 copy on the device is the split's high half; a restore
 * of it and a second snapshot give the same bits back. */
static void check_split_master(struct ng_exec *e, float *p1)
{
	const struct ng_graph *g = &e->train;
	size_t total = g->lay.total;
	long long step, nsk;
	float *m = malloc(total * 4), *v = malloc(total * 4), *p2 = malloc(total * 4);
	ng_bf16 *hi = malloc(total * 2);
	cr_assert(m && v && p2 && hi);
	cr_assert_eq(ng_exec_snapshot(e, p1, m, v, &step, &nsk), NG_OK, "%s", ng_error_message());
	cr_assert_eq(ng_exec_download(e, g->t_params_bf16, hi), NG_OK);
	size_t bad = total;
	ng_bf16 want = 0;
	uint16_t lo;
	for (size_t i = 0; i < total && bad == total; i++) {
		ng_split_encode(p1[i], &want, &lo);
		if (want != hi[i])
			bad = i;
	}
	cr_expect(bad == total, "bf16 copy at %zu is %#x, the split of the master %.9g says %#x",
		  bad, bad < total ? hi[bad] : 0u, bad < total ? p1[bad] : 0.0f, want);
	cr_assert_eq(ng_exec_restore(e, p1, m, v, step, nsk), NG_OK, "%s", ng_error_message());
	cr_assert_eq(ng_exec_snapshot(e, p2, NULL, NULL, &step, &nsk), NG_OK);
	cr_expect(memcmp(p1, p2, total * 4) == 0, "restore + snapshot changed the fp32 master");
	free(m), free(v), free(p2), free(hi);
}

static int use_muon; /* 1: tiny_config asks for --optimizer muon */

static void tiny_config(struct ng_exec_config *c, int T, int C, int H, int V, int B, int K)
{
	memset(c, 0, sizeof(*c));
	c->model = (struct ng_gpt_config){ .L = 2, .H = H, .C = C, .T = T, .V = V };
	cr_assert_eq(ng_gpt_check(&c->model), NG_OK, "%s", ng_error_message());
	c->B = B;
	c->T = T;
	c->K = K;
	ng_step_default_options(&c->step);
	c->sched = (struct ng_schedule){ 1e-3f, 0.1f, 0, 10, 1 };
	c->clip = 1.0f;
	c->wd = 0.1f;
	c->beta1 = 0.9f;
	c->beta2 = 0.95f;
	c->eps = 1e-8f;
	c->seed = 7;
	c->step.muon = use_muon;
	c->muon = ng_muon_config_default(10);
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

/* One step of the planned GPU graph against the double-precision CPU reference, GELU fused into
 * the matmuls as `fuse` says (NG_GELU_FUSE_* bits; AUTO: as timed on this device), the GELU
 * outputs recomputed in the backward when recompute_gelu is 1; 2: GELU and LayerNorm outputs
 * recomputed in the first layer only, the last keeping theirs (--recompute auto's finer
 * steps, where kept and recomputed layers meet). */
static void step_matches(int fuse, int fp8, int recompute_gelu)
{
	uint64_t seed = (uint64_t)time(NULL);
	struct ng_exec_config c;
	tiny_config(&c, 64, 64, 2, 500, 4, 2);
	c.step.fuse_gelu = fuse;
	/* every kind, untimed; 3: the weight gradients too (--fp8-dw) */
	c.step.fp8 = fp8 ? NG_FP8_EVERY | (fp8 == 3 ? NG_FP8_DW_ALL : 0) : 0;
	c.step.recompute_fp8 = fp8 == 2; /* 2: the matmuls cast their own weights */
	c.step.recompute_gelu = recompute_gelu != 0;
	if (recompute_gelu == 2) {
		c.step.keep_gelu = 1;
		c.step.recompute_layernorm = 1;
		c.step.keep_layernorm = 1;
	}
	/* bounds: bf16 as the file's comment says; fp8 forward matmuls see both operands rounded
	 * to E4M3 (unit roundoff u8 = 2^-4), a relative error of about sqrt(2/3) u8 = 0.051 per
	 * matmul output, and the loss (near log V at init, its logits small) 2e-2. The dinp
	 * matmuls round dout to E5M2 (u5 = 2^-3) and W to E4M3: sqrt((u5^2 + u8^2) / 3) = 0.081
	 * per input gradient, which the backward carries down into every gradient: 4x that. The
	 * fp8 dW matmuls (3) round dout to E5M2 and the input to E4M3: the same 0.081 per weight
	 * gradient, inside that bound */
	const double tol_grad = fp8 ? 0.33 : 4e-2, tol_loss = fp8 ? 2e-2 : 1e-2;
	struct ng_exec e;
	enum ng_status st = ng_exec_init(&e, &c, NULL);
	cr_assert_eq(st, NG_OK, "init: %s", ng_error_message());
	fprintf(stderr, "step_matches_cpu_reference (gelu fusion %s%s%s): planned, %s\n",
		ng_step_gelu_fusion_name(e.train.fuse_gelu),
		fp8 == 3 ? ", fp8 with dW" : fp8 ? ", fp8" : "",
		recompute_gelu == 2 ? ", --recompute gelu,layernorm in layer 0 only"
		: recompute_gelu ? ", --recompute gelu" : "", ng_attention_describe(&e.att));

	/* K micro-batches of fresh random tokens */
	int B = c.B, T = c.T, K = c.K, V = c.model.V;
	uint16_t *tok;
	cr_assert_eq(ng_exec_input(&e, &tok), NG_OK);
	srand((unsigned)seed);
	for (int i = 0; i < K * B * (T + 1); i++)
		tok[i] = (uint16_t)(rand() % V);
	cr_assert_eq(ng_exec_submit(&e), NG_OK, "%s", ng_error_message());
	struct ng_metrics_record rec;
	int n;
	cr_assert_eq(ng_exec_collect(&e, &rec, NULL, 1, true, &n), NG_OK, "%s", ng_error_message());
	cr_assert_eq(n, 1);
	fprintf(stderr, "step_matches_cpu_reference: one step ran, loss %g\n", rec.loss);

	const struct ng_graph *g = &e.train;
	size_t total = g->lay.total;
	float *grads = malloc(total * 4), *p1 = malloc(total * 4), *p0 = malloc(total * 4);
	cr_assert_eq(ng_exec_download(&e, g->t_grads, grads), NG_OK);
	check_split_master(&e, p1);
	ng_gpt_init(&g->cfg, &g->lay, c.seed, p0);

	/* the reference: same init, same tokens, K micro-batches */
	struct ng_cpu_model m;
	cr_assert_eq(ng_cpu_model_init(&m, &c.model, B, T, c.seed), NG_OK);
	int32_t *in = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
	double loss = 0;
	ng_cpu_zero_grad(&m);
	for (int k = 0; k < K; k++) {
		for (int b = 0; b < B; b++)
			for (int t = 0; t < T; t++) {
				in[b * T + t] = tok[(k * B + b) * (T + 1) + t];
				tg[b * T + t] = tok[(k * B + b) * (T + 1) + t + 1];
			}
		double l;
		cr_assert_eq(ng_cpu_forward(&m, in, tg, &l), NG_OK);
		cr_assert_eq(ng_cpu_backward(&m, 1.0 / K), NG_OK);
		loss += l / K;
	}
	double lerr = fabs(rec.loss - loss) / loss;
	cr_expect(lerr < tol_loss, "loss gpu %.6f ref %.6f rel err %.2e (seed %llu)", rec.loss,
		  loss, lerr, (unsigned long long)seed);
	double norm = ng_cpu_grad_norm(&m);
	cr_expect(fabs(rec.grad_norm - norm) / norm < tol_grad, "grad norm gpu %.6f ref %.6f",
		  rec.grad_norm, norm);
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &g->lay.p[i];
		if (!ng_param_present(p))
			continue;
		double err = rel_l2(grads + p->offset, m.grads + p->offset, p->numel);
		cr_expect(err < tol_grad, "grad %s%s: rel L2 err %.3e (seed %llu)", p->name,
			  fp8 ? " (fp8)" : "", err, (unsigned long long)seed);
		printf("grad %-9s%s rel L2 err %.3e\n", p->name, fp8 ? " fp8" : "", err);
	}
	/* AdamW: the reference update applied to the GPU's gradients */
	double clip_scale = rec.grad_norm > c.clip ? c.clip / (rec.grad_norm + 1e-6) : 1.0;
	double lr = ng_ref_lr(0, c.sched.warmup, c.sched.total, c.sched.lr_max,
			      c.sched.final_frac, 1);
	cr_expect(fabs(rec.lr - lr) < 1e-6 * lr, "lr gpu %g ref %g", rec.lr, lr);
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &g->lay.p[i];
		size_t nn = p->numel;
		if (nn == 0)
			continue;
		double *pd = malloc(nn * 8), *md = calloc(nn, 8), *vd = calloc(nn, 8),
		       *gd = malloc(nn * 8);
		for (size_t j = 0; j < nn; j++) {
			pd[j] = p0[p->offset + j];
			gd[j] = grads[p->offset + j];
		}
		ng_ref_adamw(pd, md, vd, gd, nn, lr, c.beta1, c.beta2, c.eps,
			     p->decay ? c.wd : 0.0, clip_scale, 1);
		double worst = 0;
		for (size_t j = 0; j < nn; j++) {
			double d = fabs(p1[p->offset + j] - pd[j]) / (fabs(pd[j]) + lr);
			if (d > worst)
				worst = d;
		}
		cr_expect(worst < 1e-4, "adamw %s: worst rel err %.3e", p->name, worst);
		free(pd), free(md), free(vd), free(gd);
	}
	ng_cpu_model_free(&m);
	free(in), free(tg), free(grads), free(p1), free(p0);
	ng_exec_free(&e);
}

Test(train_gpu, step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	int masks[] = { NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD | NG_GELU_FUSE_AUTO,
			NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD, NG_GELU_FUSE_FWD, NG_GELU_FUSE_BWD, 0 };
	for (size_t i = 0; i < sizeof(masks) / sizeof(masks[0]); i++)
		step_matches(masks[i], 0, 0);
	/* the GELU backward that recomputes the activation (unfused DGELU), and the fused one */
	step_matches(NG_GELU_FUSE_FWD, 0, 1);
	step_matches(NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD, 0, 1);
	/* recompute in some layers only: unfused and fused DGELU */
	step_matches(NG_GELU_FUSE_FWD, 0, 2);
	step_matches(NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD, 0, 2);
}

/* The DGELU on our own GEMM (--gelu-fusion own): the same step, with and without --recompute
 * gelu (where it writes the activation too). Needs an sm_90 GPU and the sm_90a build. */
Test(train_gpu, own_dgelu_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	if (!ng_gemm_sm90_available())
		cr_skip_test("not an sm_90 GPU (or no sm_90a build): no own GEMM here");
	const int own = NG_GELU_FUSE_BWD | NG_GELU_FUSE_OWN;
	step_matches(own, 0, 0);
	step_matches(NG_GELU_FUSE_FWD | own, 0, 1);
	step_matches(NG_GELU_FUSE_FWD | own, 0, 2);
}

static void sm_version(int *major, int *minor)
{
	int dev = 0;
	*major = *minor = 0;
	cudaGetDevice(&dev);
	cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev);
	cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, dev);
}

/* --fp8: the E4M3 forward and the E5M2 x E4M3 dinp (and with --fp8-dw the dW) against the same double reference, with the fp8 bounds above; a GPU
 * without FP8 (before sm_89) must refuse it at init with NG_ERR_INPUT, which is a skip. */
Test(train_gpu, fp8_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	int major, minor;
	sm_version(&major, &minor);
	if (major * 10 + minor < 89) {
		struct ng_exec_config c;
		tiny_config(&c, 64, 64, 2, 500, 4, 2);
		c.step.fp8 = NG_FP8_EVERY;
		struct ng_exec e;
		cr_assert_eq(ng_exec_init(&e, &c, NULL), NG_ERR_INPUT);
		ng_exec_free(&e);
		cr_skip_test("no FP8 on sm_%d%d (init refused it, as it should)", major, minor);
	}
	step_matches(NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD, 1, 0);
	step_matches(NG_GELU_FUSE_FWD, 1, 0);
	step_matches(NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD, 2, 0);
	/* --fp8-dw: each dW shares its cast with the dinp after it; unfused, the fcproj dW
	 * comes after its dinp and casts dout again */
	step_matches(NG_GELU_FUSE_FWD | NG_GELU_FUSE_BWD, 3, 0);
	step_matches(NG_GELU_FUSE_FWD, 3, 0);
}

/* 20 steps, deterministic: graph replay and eager launches give bit-identical losses. */
static void run_losses(int no_graph, int T, float *losses, int steps, int fp8)
{
	struct ng_exec_config c;
	tiny_config(&c, T, 128, 2, 512, 2, 2);
	c.deterministic = 1;
	/* every kind, untimed; 3: the weight gradients too (--fp8-dw) */
	c.step.fp8 = fp8 ? NG_FP8_EVERY | (fp8 == 3 ? NG_FP8_DW_ALL : 0) : 0;
	c.step.recompute_fp8 = fp8 == 2; /* 2: --recompute fp8 */
	c.no_graph = no_graph;
	c.sched.total = steps;
	c.muon.total = steps;
	struct ng_exec e;
	cr_assert_eq(ng_exec_init(&e, &c, NULL), NG_OK, "init: %s", ng_error_message());
	struct ng_synth s;
	cr_assert_eq(ng_synth_init(&s, c.model.V, 3), NG_OK);
	int got = 0;
	for (int i = 0; i < steps; i++) {
		uint16_t *tok;
		cr_assert_eq(ng_exec_input(&e, &tok), NG_OK);
		for (int k = 0; k < c.K; k++)
			ng_synth_batch(&s, 0, (uint64_t)(i * c.K + k), c.B, c.T,
				       tok + (size_t)k * c.B * (c.T + 1));
		cr_assert_eq(ng_exec_submit(&e), NG_OK, "%s", ng_error_message());
		struct ng_metrics_record r[NG_EXEC_RING];
		int n;
		cr_assert_eq(ng_exec_collect(&e, r, NULL, NG_EXEC_RING, false, &n), NG_OK);
		for (int j = 0; j < n; j++)
			losses[got++] = r[j].loss;
	}
	struct ng_metrics_record r[NG_EXEC_RING];
	int n;
	cr_assert_eq(ng_exec_collect(&e, r, NULL, NG_EXEC_RING, true, &n), NG_OK);
	for (int j = 0; j < n; j++)
		losses[got++] = r[j].loss;
	cr_assert_eq(got, steps);
	ng_synth_free(&s);
	ng_exec_free(&e);
}

Test(train_gpu, graph_equals_eager_deterministic)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	enum { STEPS = 20 };
	int Ts[] = { 128, 64 }; /* cuDNN attention (T multiple of 128), and the naive fallback */
	for (int t = 0; t < 2; t++) {
		float a[STEPS], b[STEPS];
		run_losses(0, Ts[t], a, STEPS, 0);
		run_losses(1, Ts[t], b, STEPS, 0);
		for (int i = 0; i < STEPS; i++)
			cr_expect(memcmp(&a[i], &b[i], sizeof(float)) == 0,
				  "T=%d step %d: graph %.9g eager %.9g", Ts[t], i + 1, a[i], b[i]);
		cr_expect(a[STEPS - 1] < a[0], "T=%d: loss did not fall: %g -> %g", Ts[t], a[0],
			  a[STEPS - 1]);
		printf("T=%d graph vs eager: %d steps bit-identical, loss %.4f -> %.4f\n", Ts[t],
		       STEPS, a[0], a[STEPS - 1]);
	}
}

/* Graph (g) and eager (e) runs of the same configuration agree bit for bit at every step, and
 * the loss follows the bf16 run's (r): each step within 2e-2 relative (the bound of
 * fp8_step_matches_cpu_reference), and falling. Returns the worst relative gap. */
static double follows_bf16(const char *what, const float *g, const float *e, const float *r,
			   int steps)
{
	double worst = 0;
	for (int i = 0; i < steps; i++) {
		cr_expect(memcmp(&g[i], &e[i], sizeof(float)) == 0, "%s step %d: graph %.9g eager "
			  "%.9g", what, i + 1, g[i], e[i]);
		double d = fabs(g[i] - r[i]) / r[i];
		worst = d > worst ? d : worst;
	}
	cr_expect(worst < 2e-2, "%s loss strays from bf16's by %.3e (relative)", what, worst);
	cr_expect(g[steps - 1] < g[0], "%s: loss did not fall: %g -> %g", what, g[0], g[steps - 1]);
	printf("%s graph vs eager: %d steps bit-identical, loss %.4f -> %.4f (bf16 %.4f -> %.4f, "
	       "worst relative gap %.2e)\n", what, steps, g[0], g[steps - 1], r[0], r[steps - 1],
	       worst);
	return worst;
}

/* --fp8 over 20 steps: the scales roll from step to step inside the graph, so graph and eager
 * must still agree bit for bit, and so must --recompute fp8 (each matmul casts its weights), and
 * the loss must follow the bf16 run's (follows_bf16); the same with --fp8-dw. */
Test(train_gpu, fp8_graph_equals_eager_and_follows_bf16)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	int major, minor;
	sm_version(&major, &minor);
	if (major * 10 + minor < 89)
		cr_skip_test("no FP8 on sm_%d%d", major, minor);
	enum { STEPS = 20 };
	float a[STEPS], b[STEPS], r[STEPS], w[STEPS], dg[STEPS], de[STEPS];
	run_losses(0, 128, a, STEPS, 1);
	run_losses(1, 128, b, STEPS, 1);
	run_losses(0, 128, r, STEPS, 0);
	run_losses(0, 128, w, STEPS, 2); /* weights cast at each use: the same bytes */
	run_losses(0, 128, dg, STEPS, 3); /* --fp8-dw */
	run_losses(1, 128, de, STEPS, 3);
	for (int i = 0; i < STEPS; i++)
		cr_expect(memcmp(&a[i], &w[i], sizeof(float)) == 0, "fp8 step %d: copies %.9g, "
			  "--recompute fp8 %.9g", i + 1, a[i], w[i]);
	follows_bf16("fp8", a, b, r, STEPS);
	follows_bf16("fp8 with dW", dg, de, r, STEPS);
}

/* --optimizer muon: one step of the GPU graph, the gradients against the CPU reference as above,
 * then the update against the reference applied to the GPU's own gradients: Adam's parameters
 * within 1e-4 (fp32 against double); each Muon group's update (W1 - W0) by the FlashAttention
 * rule in relative L2: error(gpu vs double Newton-Schulz) <= 2 x error(the bf16 emulation of
 * graph/cpu_muon.h vs double) + 1e-3. Then 20 deterministic steps: graph equals eager. */
Test(train_gpu, muon_step_matches_cpu_reference)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = (uint64_t)time(NULL);
	use_muon = 1;
	struct ng_exec_config c;
	tiny_config(&c, 64, 64, 2, 500, 4, 2);
	struct ng_exec e;
	cr_assert_eq(ng_exec_init(&e, &c, NULL), NG_OK, "init: %s", ng_error_message());
	int B = c.B, T = c.T, K = c.K, V = c.model.V;
	uint16_t *tok;
	cr_assert_eq(ng_exec_input(&e, &tok), NG_OK);
	srand((unsigned)seed);
	for (int i = 0; i < K * B * (T + 1); i++)
		tok[i] = (uint16_t)(rand() % V);
	cr_assert_eq(ng_exec_submit(&e), NG_OK, "%s", ng_error_message());
	struct ng_metrics_record rec;
	int n;
	cr_assert_eq(ng_exec_collect(&e, &rec, NULL, 1, true, &n), NG_OK, "%s", ng_error_message());
	const struct ng_graph *g = &e.train;
	size_t total = g->lay.total;
	float *grads = malloc(total * 4), *p1 = malloc(total * 4), *p0 = malloc(total * 4);
	cr_assert_eq(ng_exec_download(&e, g->t_grads, grads), NG_OK);
	check_split_master(&e, p1);
	ng_gpt_init(&g->cfg, &g->lay, c.seed, p0);
	double gs = rec.grad_norm > c.clip ? c.clip / (rec.grad_norm + 1e-6) : 1.0;
	cr_expect(fabs(rec.lr - c.muon.lr) < 1e-6, "lr gpu %g, Muon's %g", rec.lr, c.muon.lr);
	mt_check_adam(g, &c.muon, 0, gs, p0, p1, grads, seed);
	mt_check_muon(g, c.muon.mu_start, c.muon.lr, gs, p0, p1, grads, seed, "gpt2");
	free(grads), free(p1), free(p0);
	ng_exec_free(&e);
	enum { STEPS = 20 };
	float a[STEPS], b[STEPS];
	run_losses(0, 128, a, STEPS, 0);
	run_losses(1, 128, b, STEPS, 0);
	for (int i = 0; i < STEPS; i++)
		cr_expect(memcmp(&a[i], &b[i], sizeof(float)) == 0, "muon step %d: graph %.9g eager "
			  "%.9g", i + 1, a[i], b[i]);
	cr_expect(a[STEPS - 1] < a[0], "muon: loss did not fall: %g -> %g", a[0], a[STEPS - 1]);
	printf("muon graph vs eager: %d steps bit-identical, loss %.4f -> %.4f\n", STEPS, a[0],
	       a[STEPS - 1]);
	use_muon = 0;
}
