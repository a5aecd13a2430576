/*
 * tools/bench_muon.c — where the time of the MUON op goes, at a preset's shapes (default
 * speedrun): per Muon group the momentum, the normalisation, the Newton-Schulz GEMMs (the
 * heuristic's first algorithm, then the fastest offered one: ng_muon_ns_tune) and the apply;
 * the Adam of every other parameter; then the whole optimizer as captured graphs three ways:
 *   serial    the op as it runs today: Adam, then each group in turn, one stream
 *   adam||    Adam on a second stream beside the groups
 *   streams   Adam and each group on a stream of its own, each group with its own scratch
 * Method: CUDA events around 10 launches after 2 warm-ups (kernels); graph replays, the median
 * of 9 (whole op). Buffers hold small random values; the step state says "not skipped".
 * Usage: bench_muon [PRESET]
 */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_muon.h"
#include "graph/gpt.h"
#include "kernels/check.h"
#include "kernels/muon.h"
#include "kernels/muon_ns.h"

#define WS_BYTES (32u << 20)
#define REPS 10

#define CK(x)                                                                              \
	do {                                                                               \
		if ((x) != 0) {                                                            \
			fprintf(stderr, "bench_muon: %s failed (line %d)\n", #x, __LINE__);  \
			exit(1);                                                           \
		}                                                                          \
	} while (0)

static void *dev(size_t bytes)
{
	void *p = NULL;
	CK(cudaMalloc(&p, bytes));
	CK(cudaMemset(p, 0, bytes));
	return p;
}

static void fill_f32(float *d, size_t n, float scale, unsigned seed)
{
	float *h = malloc(n * 4);
	for (size_t i = 0; i < n; i++) {
		seed = seed * 1664525u + 1013904223u;
		h[i] = ((float)(seed >> 8) / 16777216.0f - 0.5f) * scale;
	}
	CK(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice));
	free(h);
}

/* One Muon group's buffers and plan. */
struct grp {
	struct ng_muon_group g;
	size_t numel, all, nn;
	float *grad, *m;
	ng_bf16 *hi, *x0, *x1, *a, *b;
	uint16_t *lo;
	double *part;
	void *ws;
	struct ng_muon_ns ns;
	cudaStream_t s;
};

struct adam_buf {
	size_t n;
	float *grad, *m, *v;
	ng_bf16 *hi;
	uint16_t *lo;
};

static struct ng_muon_scalars *sc;
static struct ng_step_state *st;
static struct ng_muon_config cfg;

static void run_group(struct grp *q, cudaStream_t s)
{
	ng_bf16 *res;
	CK(ng_muon_momentum_update(q->x0, q->m, q->grad, q->all, sc, st, s));
	CK(ng_muon_normalize(q->x0, q->part, q->numel, q->numel, q->g.batch, s));
	CK(ng_muon_ns_run(&q->ns, q->x0, q->x1, q->a, q->b, q->ws, &res, s));
	CK(ng_muon_apply(q->hi, q->lo, res, q->all, (float)q->g.scale, sc, st, s));
}

static void run_adam(struct adam_buf *ab, cudaStream_t s)
{
	CK(ng_muon_adam(ab->hi, ab->lo, ab->m, ab->v, ab->grad, ab->n, NG_MUON_ADAM_EMBED, 0.8f,
			0.95f, 1e-10f, sc, st, s));
}

/* ms a launch of f over REPS after 2 warm-ups. */
#define TIME(ms, s, body)                                                                  \
	do {                                                                               \
		cudaEvent_t e0_, e1_;                                                      \
		CK(cudaEventCreate(&e0_));                                                 \
		CK(cudaEventCreate(&e1_));                                                 \
		for (int w_ = 0; w_ < 2; w_++) {                                           \
			body;                                                              \
		}                                                                          \
		CK(cudaEventRecord(e0_, s));                                               \
		for (int r_ = 0; r_ < REPS; r_++) {                                        \
			body;                                                              \
		}                                                                          \
		CK(cudaEventRecord(e1_, s));                                               \
		CK(cudaEventSynchronize(e1_));                                             \
		float t_;                                                                  \
		CK(cudaEventElapsedTime(&t_, e0_, e1_));                                   \
		(ms) = t_ / REPS;                                                          \
		cudaEventDestroy(e0_);                                                     \
		cudaEventDestroy(e1_);                                                     \
	} while (0)

static int cmpf(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

static float time_graph(cudaGraphExec_t ge, cudaStream_t s)
{
	float t[9];
	cudaEvent_t e0, e1;
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	CK(cudaGraphLaunch(ge, s));
	CK(cudaGraphLaunch(ge, s));
	for (int i = 0; i < 9; i++) {
		CK(cudaEventRecord(e0, s));
		CK(cudaGraphLaunch(ge, s));
		CK(cudaEventRecord(e1, s));
		CK(cudaEventSynchronize(e1));
		CK(cudaEventElapsedTime(&t[i], e0, e1));
	}
	qsort(t, 9, sizeof(float), cmpf);
	cudaEventDestroy(e0);
	cudaEventDestroy(e1);
	return t[4];
}

int main(int argc, char **argv)
{
	const char *preset = argc > 1 ? argv[1] : "speedrun";
	struct ng_gpt_config mc;
	if (ng_gpt_preset(&mc, preset) || ng_gpt_check(&mc)) {
		fprintf(stderr, "bench_muon: unknown preset %s\n", preset);
		return 1;
	}
	struct ng_gpt_layout lay;
	ng_gpt_layout(&mc, &lay);
	cfg = ng_muon_config_default(1000);
	cudaStream_t s;
	CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	cublasLtHandle_t lt;
	CK(cublasLtCreate(&lt));
	sc = dev(sizeof(*sc));
	st = dev(sizeof(*st));
	struct ng_step_state h0 = { 0 };
	h0.clip_scale = 1.0f;
	CK(cudaMemcpy(st, &h0, sizeof(h0), cudaMemcpyHostToDevice));
	CK(ng_muon_schedule(sc, st, cfg, s));

	struct grp q[NG_MUON_GROUPS];
	struct ng_muon_group mg[NG_MUON_GROUPS];
	ng_muon_groups(&mc, mg);
	double flop_all = 0.0;
	float t_sum = 0.0f, t_sum_tuned = 0.0f;
	printf("preset %s: L=%d C=%d; per group, ms\n", preset, mc.L, mc.C);
	printf("%-10s %6s %11s %9s %9s %9s %9s %9s %8s\n", "group", "batch", "shape", "momentum",
	       "normalize", "ns-heur", "ns-tuned", "apply", "TFLOP/s");
	for (int k = 0; k < NG_MUON_GROUPS; k++) {
		struct grp *g = &q[k];
		memset(g, 0, sizeof(*g));
		g->g = mg[k];
		g->numel = (size_t)g->g.rows * g->g.cols;
		g->all = g->numel * g->g.batch;
		int n = g->g.rows < g->g.cols ? g->g.rows : g->g.cols;
		g->nn = (size_t)n * n;
		g->grad = dev(g->all * 4);
		g->m = dev(g->all * 4);
		g->hi = dev(g->all * 2);
		g->lo = dev(g->all * 2);
		g->x0 = dev(g->all * 2);
		g->x1 = dev(g->all * 2);
		g->a = dev(g->nn * g->g.batch * 2);
		g->b = dev(g->nn * g->g.batch * 2);
		g->ws = dev(WS_BYTES);
		g->part = dev(ng_muon_normalize_scratch_bytes(g->numel, g->g.batch));
		fill_f32(g->grad, g->all, 0.02f, 17u + k);
		CK(cudaStreamCreateWithFlags(&g->s, cudaStreamNonBlocking));
		CK(ng_muon_ns_plan(&g->ns, lt, g->g.batch, g->g.rows, g->g.cols, g->numel,
				   NG_MUON_NS_STEPS, WS_BYTES));
		float tm, tn, th, tt, ta;
		TIME(tm, s, CK(ng_muon_momentum_update(g->x0, g->m, g->grad, g->all, sc, st, s)));
		TIME(tn, s, CK(ng_muon_normalize(g->x0, g->part, g->numel, g->numel, g->g.batch, s)));
		ng_bf16 *res;
		CK(ng_muon_momentum_update(g->x0, g->m, g->grad, g->all, sc, st, s));
		CK(ng_muon_normalize(g->x0, g->part, g->numel, g->numel, g->g.batch, s));
		TIME(th, s, CK(ng_muon_ns_run(&g->ns, g->x0, g->x1, g->a, g->b, g->ws, &res, s)));
		float part[3];
		CK(ng_muon_ns_tune(&g->ns, g->x0, g->x1, g->a, g->b, g->ws, s, part));
		CK(ng_muon_momentum_update(g->x0, g->m, g->grad, g->all, sc, st, s));
		CK(ng_muon_normalize(g->x0, g->part, g->numel, g->numel, g->g.batch, s));
		TIME(tt, s, CK(ng_muon_ns_run(&g->ns, g->x0, g->x1, g->a, g->b, g->ws, &res, s)));
		TIME(ta, s, CK(ng_muon_apply(g->hi, g->lo, g->x1, g->all, 1.0f, sc, st, s)));
		int big = g->g.rows > g->g.cols ? g->g.rows : g->g.cols;
		double flop = (double)g->g.batch * NG_MUON_NS_STEPS *
			      (4.0 * n * n * big + 2.0 * n * n * n);
		flop_all += flop;
		char shape[32];
		snprintf(shape, sizeof(shape), "%dx%d", g->g.rows, g->g.cols);
		printf("%-10s %6d %11s %9.3f %9.3f %9.3f %9.3f %9.3f %8.1f   (gram %.3f poly %.3f "
		       "update %.3f a step)\n", k == 0 ? "qkv" : k == 1 ? "attproj" : k == 2 ? "fc"
		       : "fcproj", g->g.batch, shape, tm, tn, th, tt, ta, flop / (tt * 1e9),
		       part[0], part[1], part[2]);
		t_sum += tm + tn + th + ta;
		t_sum_tuned += tm + tn + tt + ta;
	}
	struct adam_buf ab = { 0 };
	for (int i = 0; i < NG_P_COUNT; i++)
		if (ng_muon_adam_group_of((enum ng_param_id)i) >= 0)
			ab.n += lay.p[i].numel;
	ab.grad = dev(ab.n * 4);
	ab.m = dev(ab.n * 4);
	ab.v = dev(ab.n * 4);
	ab.hi = dev(ab.n * 2);
	ab.lo = dev(ab.n * 2);
	float tadam;
	TIME(tadam, s, run_adam(&ab, s));
	printf("adam over %zu parameters (one launch): %.3f ms, %.0f GB/s at 28 B a parameter\n",
	       ab.n, tadam, ab.n * 28.0 / (tadam * 1e6));
	printf("Newton-Schulz: %.3f TFLOP a step\n", flop_all / 1e12);
	printf("sum of the parts: %.3f ms (heuristic), %.3f ms (tuned), + adam %.3f\n", t_sum,
	       t_sum_tuned, tadam);

	/* The whole op, three ways, as captured graphs. */
	cudaStream_t sa;
	CK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
	cudaEvent_t fork, join[NG_MUON_GROUPS + 1];
	CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
	for (int i = 0; i <= NG_MUON_GROUPS; i++)
		CK(cudaEventCreateWithFlags(&join[i], cudaEventDisableTiming));
	const char *names[3] = { "serial", "adam||", "streams" };
	for (int way = 0; way < 3; way++) {
		cudaGraph_t gr;
		cudaGraphExec_t ge;
		CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
		CK(ng_muon_schedule(sc, st, cfg, s));
		if (way == 0) {
			run_adam(&ab, s);
			for (int k = 0; k < NG_MUON_GROUPS; k++)
				run_group(&q[k], s);
		} else {
			CK(cudaEventRecord(fork, s));
			CK(cudaStreamWaitEvent(sa, fork, 0));
			run_adam(&ab, sa);
			CK(cudaEventRecord(join[NG_MUON_GROUPS], sa));
			for (int k = 0; k < NG_MUON_GROUPS; k++) {
				if (way == 1) {
					run_group(&q[k], s);
					continue;
				}
				CK(cudaStreamWaitEvent(q[k].s, fork, 0));
				run_group(&q[k], q[k].s);
				CK(cudaEventRecord(join[k], q[k].s));
				CK(cudaStreamWaitEvent(s, join[k], 0));
			}
			CK(cudaStreamWaitEvent(s, join[NG_MUON_GROUPS], 0));
		}
		CK(cudaStreamEndCapture(s, &gr));
		CK(cudaGraphInstantiate(&ge, gr, 0));
		printf("whole op, %-8s %.3f ms\n", names[way], time_graph(ge, s));
		cudaGraphExecDestroy(ge);
		cudaGraphDestroy(gr);
	}
	return 0;
}
