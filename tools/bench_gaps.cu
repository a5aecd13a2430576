/*
 * tools/bench_gaps.cu — what a kernel boundary costs inside a captured CUDA Graph on this GPU,
 * with and without programmatic dependent launch (PDL): the number that says whether the
 * step's ~470 ops lose anything between them. Four graphs, each a chain of N kernels captured
 * from one stream and replayed (2 warm-up replays, then the median of 9):
 *   - empty kernels of one block (the launch alone);
 *   - empty kernels of a full wave (2 blocks of 256 threads per SM: fill and drain too);
 *   - the same with PDL (each kernel waits with griddepcontrol.wait, sm_90 and later);
 *   - kernels that spin ~SPIN_US on every SM, against one kernel that spins N times as long:
 *     the difference over N is what a boundary costs between busy kernels.
 * Usage: bench_gaps [N] (default 469, about the op count of a d24 step).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(x)                                                                               \
	do {                                                                                   \
		cudaError_t err_ = (x);                                                        \
		if (err_ != cudaSuccess) {                                                     \
			fprintf(stderr, "bench_gaps: %s: %s\n", #x, cudaGetErrorString(err_)); \
			exit(1);                                                               \
		}                                                                              \
	} while (0)

static const float SPIN_US = 20.0f;

__device__ __forceinline__ void wait_for_producer(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__global__ void empty_kernel(int *sink, int pdl)
{
	if (pdl)
		wait_for_producer();
	if (sink && threadIdx.x == 0 && blockIdx.x == 0)
		sink[0] += 1;
}

__global__ void spin_kernel(long long cycles)
{
	long long t0 = clock64();
	while (clock64() - t0 < cycles)
		;
}

enum kind { EMPTY_ONE, EMPTY_WAVE, EMPTY_WAVE_PDL, SPIN };

static void launch(enum kind k, int sms, int *sink, long long cycles, cudaStream_t s)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute attr[1];
	cfg.stream = s;
	cfg.blockDim = dim3(k == EMPTY_ONE ? 32 : 256);
	cfg.gridDim = dim3(k == EMPTY_ONE ? 1 : 2 * sms);
	if (k == EMPTY_WAVE_PDL) {
		attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
		attr[0].val.programmaticStreamSerializationAllowed = 1;
		cfg.attrs = attr;
		cfg.numAttrs = 1;
	}
	if (k == SPIN)
		CHECK(cudaLaunchKernelEx(&cfg, spin_kernel, cycles));
	else
		CHECK(cudaLaunchKernelEx(&cfg, empty_kernel, sink, k == EMPTY_WAVE_PDL ? 1 : 0));
}

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

/* Median ms of one replay of a chain of n launches of kind k. */
static float time_chain(enum kind k, int n, int sms, int *sink, long long cycles, cudaStream_t s)
{
	enum { REPLAYS = 9 };
	cudaGraph_t g;
	cudaGraphExec_t ge;
	cudaEvent_t e0, e1;
	float ms[REPLAYS];
	CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
	for (int i = 0; i < n; i++)
		launch(k, sms, sink, cycles, s);
	CHECK(cudaStreamEndCapture(s, &g));
	CHECK(cudaGraphInstantiate(&ge, g, 0));
	CHECK(cudaEventCreate(&e0));
	CHECK(cudaEventCreate(&e1));
	for (int r = -2; r < REPLAYS; r++) {
		CHECK(cudaEventRecord(e0, s));
		CHECK(cudaGraphLaunch(ge, s));
		CHECK(cudaEventRecord(e1, s));
		CHECK(cudaEventSynchronize(e1));
		if (r >= 0)
			CHECK(cudaEventElapsedTime(&ms[r], e0, e1));
	}
	CHECK(cudaEventDestroy(e0));
	CHECK(cudaEventDestroy(e1));
	CHECK(cudaGraphExecDestroy(ge));
	CHECK(cudaGraphDestroy(g));
	qsort(ms, REPLAYS, sizeof(float), cmp_float);
	return ms[REPLAYS / 2];
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 469;
	int dev_count = 0;
	if (n < 1 || n > 100000) {
		fprintf(stderr, "bench_gaps: N must be 1..100000, not '%s'\n", argv[1]);
		return 2;
	}
	if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
		fprintf(stderr, "bench_gaps: no CUDA device (hint: run it on the GPU machine)\n");
		return 1;
	}
	cudaDeviceProp p;
	CHECK(cudaGetDeviceProperties(&p, 0));
	int clock_khz = 0;
	CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
	int *sink;
	cudaStream_t s;
	CHECK(cudaMalloc((void **)&sink, sizeof(int)));
	CHECK(cudaMemset(sink, 0, sizeof(int)));
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	const int sms = p.multiProcessorCount;
	const long long cycles = (long long)(SPIN_US * 1e-3f * (float)clock_khz);
	printf("%s, %d SMs, sm_%d%d; chains of %d kernels in one graph, median of 9 replays\n",
	       p.name, sms, p.major, p.minor, n);
	const char *name[] = { "empty, 1 block", "empty, full wave (2 x 256 a SM)",
			       "empty, full wave, PDL" };
	for (int k = EMPTY_ONE; k <= EMPTY_WAVE_PDL; k++) {
		if (k == EMPTY_WAVE_PDL && p.major < 9) {
			printf("  %-34s (needs sm_90)\n", name[k]);
			continue;
		}
		float ms = time_chain((enum kind)k, n, sms, sink, 0, s);
		printf("  %-34s %8.3f us a kernel (%.3f ms the chain)\n", name[k], 1e3f * ms / n, ms);
	}
	float one = time_chain(SPIN, 1, sms, sink, cycles * n, s);
	float chain = time_chain(SPIN, n, sms, sink, cycles, s);
	printf("  spin ~%.0f us a kernel at the base clock, full wave: %.3f ms as %d kernels, %.3f ms "
	       "as one: %.3f us a boundary\n", SPIN_US, chain, n, one, 1e3f * (chain - one) / n);
	printf("  so %d boundaries cost ~%.3f ms of a step\n", n, chain - one);
	CHECK(cudaStreamDestroy(s));
	CHECK(cudaFree(sink));
	return 0;
}
