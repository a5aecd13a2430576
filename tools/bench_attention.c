/*
 * tools/bench_attention.c — speed of causal attention forward + backward (kernels/attention.h).
 *
 * For each shape and backend: plan (timed: cuDNN compiles runtime engines here), warm up, then
 * time every iteration with CUDA events and report medians of forward, backward and
 * forward + backward (the two timed back to back, as in a training step). The target:
 * forward + backward at B=64, H=12, T=1024, D=64 within 1.40 ms on the H200 (PyTorch's cuDNN
 * attention: 1.364 ms). Usage: bench_attention [iterations]   (default 100)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/attention.h"
#include "kernels/check.h"
#include "util/rng.h"

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

static float median(float *v, int n)
{
	qsort(v, (size_t)n, sizeof(float), cmp_float);
	return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* Benchmarks one configuration; returns the fwd+bwd median in ms (negative on failure). */
static float bench(cudnnHandle_t h, int B, int H, int T, int D, int det, int naive, int iters)
{
	struct ng_attention att;
	double t0 = now_s();
	if (ng_attention_plan(&att, h, B, H, T, D, det, naive)) {
		ng_print_error();
		return -1.0f;
	}
	double plan_s = now_s() - t0;
	size_t n_qkv = (size_t)B * T * 3 * H * D, n_o = n_qkv / 3;
	ng_bf16 *qkv, *dqkv, *out, *dout;
	float *lse;
	void *wsf, *wsb;
	if (NG_CUDA_CHECK(cudaMalloc((void **)&qkv, n_qkv * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&dqkv, n_qkv * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&out, n_o * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&dout, n_o * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc((void **)&lse, (size_t)B * H * T * 4)) ||
	    NG_CUDA_CHECK(cudaMalloc(&wsf, ng_attention_fwd_workspace(&att) + 256)) ||
	    NG_CUDA_CHECK(cudaMalloc(&wsb, ng_attention_bwd_workspace(&att) + 256))) {
		ng_print_error();
		return -1.0f;
	}
	/* N(0,1) bf16 inputs (the top 16 bits of the float) */
	ng_bf16 *host = malloc(n_qkv * 2);
	struct ng_rng r;
	ng_rng_seed(&r, 1234);
	for (size_t i = 0; i < n_qkv; i++) {
		float f = (float)ng_rng_normal(&r);
		uint32_t u;
		memcpy(&u, &f, 4);
		host[i] = (ng_bf16)(u >> 16);
	}
	cudaMemcpy(qkv, host, n_qkv * 2, cudaMemcpyHostToDevice);
	cudaMemcpy(dout, host, n_o * 2, cudaMemcpyHostToDevice);
	free(host);

	cudaStream_t s;
	cudaEvent_t ev[3];
	cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
	for (int i = 0; i < 3; i++)
		cudaEventCreate(&ev[i]);
	float *tf = malloc(sizeof(float) * iters * 3), *tb = tf + iters, *tt = tf + 2 * iters;
	int warm = naive ? 1 : 10, ok = 1;
	for (int it = -warm; it < iters && ok; it++) {
		cudaEventRecord(ev[0], s);
		ok = !ng_attention_fwd(&att, out, lse, qkv, wsf, s);
		cudaEventRecord(ev[1], s);
		ok = ok && !ng_attention_bwd(&att, dqkv, dout, qkv, out, lse, wsb, s);
		cudaEventRecord(ev[2], s);
		if (NG_CUDA_CHECK(cudaEventSynchronize(ev[2])))
			ok = 0;
		if (it >= 0) {
			cudaEventElapsedTime(&tf[it], ev[0], ev[1]);
			cudaEventElapsedTime(&tb[it], ev[1], ev[2]);
			cudaEventElapsedTime(&tt[it], ev[0], ev[2]);
		}
	}
	/* The same step captured once into a CUDA graph and replayed, as the trainer runs it. */
	float *tg = malloc(sizeof(float) * iters), mg = -1.0f;
	cudaGraph_t graph = NULL;
	cudaGraphExec_t exec = NULL;
	if (ok && !naive && !NG_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal))) {
		ok = !ng_attention_fwd(&att, out, lse, qkv, wsf, s);
		ok = ok && !ng_attention_bwd(&att, dqkv, dout, qkv, out, lse, wsb, s);
		ok = !NG_CUDA_CHECK(cudaStreamEndCapture(s, &graph)) && ok;
		ok = ok && !NG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
		for (int it = -warm; it < iters && ok; it++) {
			cudaEventRecord(ev[0], s);
			ok = !NG_CUDA_CHECK(cudaGraphLaunch(exec, s));
			cudaEventRecord(ev[1], s);
			ok = ok && !NG_CUDA_CHECK(cudaEventSynchronize(ev[1]));
			if (it >= 0)
				cudaEventElapsedTime(&tg[it], ev[0], ev[1]);
		}
		if (ok)
			mg = median(tg, iters);
	}
	float result = -1.0f;
	if (!ok) {
		ng_print_error();
	} else {
		float mf = median(tf, iters), mb = median(tb, iters);
		result = median(tt, iters);
		printf("B=%d H=%d T=%d D=%d %-6s%-11s fwd %.3f ms  bwd %.3f ms  fwd+bwd %.3f ms  "
		       "graph replay %.3f ms  (medians of %d; plan %.2f s)\n",
		       B, H, T, D, naive ? "naive" : "cuDNN", det ? " determin." : "", mf, mb, result,
		       mg, iters, plan_s);
		printf("    %s\n", ng_attention_describe(&att));
	}
	if (exec)
		cudaGraphExecDestroy(exec);
	if (graph)
		cudaGraphDestroy(graph);
	free(tg);
	free(tf);
	for (int i = 0; i < 3; i++)
		cudaEventDestroy(ev[i]);
	cudaStreamDestroy(s);
	cudaFree(qkv), cudaFree(dqkv), cudaFree(out), cudaFree(dout), cudaFree(lse);
	cudaFree(wsf), cudaFree(wsb);
	ng_attention_free(&att);
	return result;
}

int main(int argc, char **argv)
{
	int iters = argc > 1 ? atoi(argv[1]) : 100;
	if (iters < 1) {
		fprintf(stderr, "bench_attention: iterations must be >= 1, got %s\n", argv[1]);
		return 2;
	}
	if (ng_cuda_device_count() == 0) {
		fprintf(stderr, "bench_attention: no CUDA device\n");
		return 1;
	}
	cudnnHandle_t h;
	if (NG_CUDNN_CHECK(cudnnCreate(&h))) {
		ng_print_error();
		return 1;
	}
	printf("cuDNN %zu\n", cudnnGetVersion());
	float main_ms = bench(h, 64, 12, 1024, 64, 0, 0, iters);
	bench(h, 64, 12, 1024, 64, 1, 0, iters);
	bench(h, 16, 25, 1024, 64, 0, 0, iters);
	bench(h, 16, 25, 1024, 64, 1, 0, iters);
	bench(h, 64, 12, 1024, 64, 0, 1, iters < 5 ? iters : 5);
	printf("target: fwd+bwd at B=64 H=12 T=1024 D=64 within 1.40 ms: %.3f ms -> %s\n", main_ms,
	       main_ms > 0 && main_ms <= 1.40f ? "PASS" : "FAIL");
	cudnnDestroy(h);
	return main_ms > 0 && main_ms <= 1.40f ? 0 : 1;
}
