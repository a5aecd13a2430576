/*
 * tools/bench_kernels.c — times every memory-bound kernel of the step (encoder, layernorm,
 * GELU, bias grad, cross-entropy, loss accumulate, grad norm, AdamW, cast, token split, and the
 * speedrun model's scalar mixes and soft-capped cross-entropy) at the d12 (B=64, T=1024, C=768)
 * and d48 (B=16, T=1024, C=1600) shapes, V=50304.
 *
 * Method: CUDA events around each launch, 3 warm-ups, the median of 21 timed launches; inputs
 * rotate over enough copies that each launch's working set exceeds 256 MB (L2 is 60 MB), so the
 * figures are HBM figures. Bytes are the minimum traffic of the operation (each input read once,
 * each output written once), so "% of 4.28 TB/s" is against the copy bandwidth of docs/GPU.md;
 * encoder_bwd gets a second line counting what its sort-based implementation moves, and two more
 * with real-text-like tokens: Zipfian (p(rank r) ~ 1/r over V, so ',' and ' the'-like tokens
 * fill thousands of rows) and every token equal (the executor's warm-up batch).
 * Buffers hold a constant bit pattern (0x3c3c..: small finite values) except tokens and targets.
 * A first line per shape times cudaMemcpyAsync of an (N, C) bf16 tensor: what a plain copy of
 * that size reaches (d48's 105 MB: ~72%, the launch and the ramp weigh on a 25 us copy).
 * --gpu-time queues a ~100 us filler kernel ahead of each start event, so the interval holds GPU
 * time alone (as in the step's graph replay), not the host's launch latency. Each line ends with
 * the time per launch inside a captured graph of 21 back-to-back launches (rotating copies as
 * above; median of 7 replays): how the step's graph runs a kernel, without launch latency or
 * the events' own cost; copies of 1/4 to 8 times the (N, C) size show how the copy rate
 * depends on the size.
 * Usage: bench_kernels [--only SUBSTR] [--gpu-time] [d12|d24|d48]... (default d12, d48): one
 * line per kernel, only the kernels whose name contains SUBSTR with --only.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/gpt.h"
#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/encoder.h"
#include "kernels/fp8.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/mix.h"
#include "kernels/optim.h"
#include "kernels/softcap.h"
#include "util/rng.h"

#define REPS 21
#define WARMUP 3
#define ROTATE_BYTES (256u << 20)
#define COPY_BW 4.28e12

/* The problem of one shape, and a bump allocator over one device pool. */
struct bench {
	const char *name;       /* "d12" */
	int B, T, C, V, Vp;     /* shape */
	size_t N;               /* B*T tokens */
	size_t P;               /* parameters (flat buffer elements) */
	char *pool;             /* device pool */
	size_t pool_bytes;      /* its size */
	size_t used;            /* bump offset */
	int32_t *tokens;        /* device (N) tokens, random in [0, V) */
	int32_t *targets;       /* device (N) targets */
	int32_t *bwd_tokens;    /* device (N) tokens encoder_bwd reads (tokens, or a Zipf/equal set) */
	struct ng_step_state *st; /* device step state */
	int copies;             /* rotation copies of the kernel being timed */
};

static char *carve(struct bench *b, size_t bytes)
{
	size_t off = (b->used + 255) & ~(size_t)255;
	if (off + bytes > b->pool_bytes) {
		fprintf(stderr, "bench_kernels: pool too small (%zu + %zu > %zu)\n", off, bytes,
			b->pool_bytes);
		exit(1);
	}
	b->used = off + bytes;
	return b->pool + off;
}

/* Carve `copies` copies of an input of `bytes`, rotation-ready: returns the first. */
static char *carve_rot(struct bench *b, size_t bytes)
{
	char *p = carve(b, bytes * b->copies);
	return p;
}

static int copies_for(size_t working_set)
{
	if (working_set >= ROTATE_BYTES)
		return 1;
	size_t k = (ROTATE_BYTES + working_set - 1) / working_set;
	return k > 64 ? 64 : (int)k;
}

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

/* One kernel: a launcher taking the rotation index. */
typedef enum ng_status (*launch_fn)(struct bench *b, int rot, void *arg);

static const char *only_kernels; /* --only SUBSTR: time only the kernels whose name has it */
static void *filler_buf;         /* --gpu-time: (FILLER_FLOATS) fp32 read by the filler */
#define FILLER_FLOATS (64u << 20) /* 256 MB read + 128 MB written: ~100 us on an H200 */

#define GRAPH_LAUNCHES 21 /* launches captured in one graph for the "in a graph" figure */
#define GRAPH_REPLAYS 7

static cudaStream_t BS; /* the stream every launch goes to (capturable, unlike stream 0) */

static void filler(void)
{
	if (filler_buf) /* --gpu-time: the GPU is busy while the host submits */
		ng_cast_f32_to_bf16((ng_bf16 *)filler_buf + 2 * (size_t)FILLER_FLOATS,
				    (const float *)filler_buf, FILLER_FLOATS, BS);
}

/* The kernel's time per launch inside a captured graph of GRAPH_LAUNCHES back-to-back launches
 * (rotating over the copies, as above), median of GRAPH_REPLAYS replays: how the step's graph
 * runs it, without the host's launch latency or the events' own cost. 0 when it does not
 * capture (the launcher allocates or synchronises). */
static double time_in_graph(struct bench *b, launch_fn fn, void *arg, cudaEvent_t e0,
			    cudaEvent_t e1)
{
	cudaGraph_t g = NULL;
	cudaGraphExec_t ge = NULL;
	if (cudaStreamBeginCapture(BS, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
		return 0.0;
	enum ng_status st = NG_OK;
	for (int i = 0; i < GRAPH_LAUNCHES && st == NG_OK; i++)
		st = fn(b, i, arg);
	cudaError_t e = cudaStreamEndCapture(BS, &g);
	if (st != NG_OK || e != cudaSuccess || cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) {
		(void)cudaGetLastError();
		if (g)
			cudaGraphDestroy(g);
		return 0.0;
	}
	float ms[GRAPH_REPLAYS];
	cudaGraphLaunch(ge, BS); /* warm-up */
	for (int i = 0; i < GRAPH_REPLAYS; i++) {
		filler();
		cudaEventRecord(e0, BS);
		cudaGraphLaunch(ge, BS);
		cudaEventRecord(e1, BS);
		cudaEventSynchronize(e1);
		cudaEventElapsedTime(&ms[i], e0, e1);
	}
	cudaGraphExecDestroy(ge);
	cudaGraphDestroy(g);
	qsort(ms, GRAPH_REPLAYS, sizeof(float), cmp_float);
	return ms[GRAPH_REPLAYS / 2] * 1e-3 / GRAPH_LAUNCHES;
}

/* Times one kernel, prints its line and returns the median seconds (0 when --only skips it). */
static double time_kernel(struct bench *b, const char *kernel, double bytes, launch_fn fn,
			  void *arg)
{
	if (only_kernels && !strstr(kernel, only_kernels))
		return 0.0;
	cudaEvent_t e0, e1;
	cudaEventCreate(&e0);
	cudaEventCreate(&e1);
	float ms[REPS];
	for (int i = 0; i < WARMUP + REPS; i++) {
		filler();
		cudaEventRecord(e0, BS);
		if (fn(b, i, arg) != NG_OK) {
			fprintf(stderr, "bench_kernels: %s: %s\n", kernel, ng_error_message());
			exit(1);
		}
		cudaEventRecord(e1, BS);
		cudaEventSynchronize(e1);
		if (i >= WARMUP)
			cudaEventElapsedTime(&ms[i - WARMUP], e0, e1);
	}
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess) {
		fprintf(stderr, "bench_kernels: %s: %s\n", kernel, cudaGetErrorString(e));
		exit(1);
	}
	qsort(ms, REPS, sizeof(float), cmp_float);
	double t = ms[REPS / 2] * 1e-3;
	double tg = time_in_graph(b, fn, arg, e0, e1);
	printf("%-4s %-26s %10.1f us %9.1f GB/s %6.1f%% of 4.28 TB/s  (%.1f MB, %d cop%s)", b->name,
	       kernel, t * 1e6, bytes / t / 1e9, 100.0 * bytes / t / COPY_BW, bytes / 1e6, b->copies,
	       b->copies == 1 ? "y" : "ies");
	if (tg > 0)
		printf("  in a graph: %.1f us %.1f%%\n", tg * 1e6, 100.0 * bytes / tg / COPY_BW);
	else
		printf("  in a graph: n/a\n");
	cudaEventDestroy(e0);
	cudaEventDestroy(e1);
	return t;
}

/* Each kernel's buffers: rotation bases and per-copy strides. */
struct bufs {
	void *p[8];     /* bases */
	size_t sz[8];   /* bytes per copy */
	size_t n;       /* element count or rows */
	int oc;         /* columns (bias grad) */
};

#define AT(x, k, r) ((void *)((char *)(x)->p[k] + (size_t)((r) % b->copies) * (x)->sz[k]))

static enum ng_status l_encoder_fwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_encoder_fwd(AT(x, 0, r), b->tokens, AT(x, 1, r), AT(x, 2, r), b->B, b->T, b->C, BS);
}
static enum ng_status l_copy(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return NG_CUDA_CHECK(
		cudaMemcpyAsync(AT(x, 0, r), AT(x, 1, r), x->sz[0], cudaMemcpyDeviceToDevice, BS));
}
static enum ng_status l_encoder_bwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_encoder_bwd(AT(x, 0, r), AT(x, 1, r), AT(x, 2, r), b->bwd_tokens, b->B, b->T, b->C,
			      b->Vp, x->p[3], x->sz[3], BS);
}
/* the step's split (graph/ir.h ENCODER_SORT): the sort alone into p[5], and the gradients from
 * a sort done once before (p[5] sorted, p[6] work) */
static enum ng_status l_encoder_sort(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	(void)r;
	return ng_encoder_bwd_sort(x->p[5], x->sz[5], b->bwd_tokens, b->B, b->T, b->Vp, BS);
}
static enum ng_status l_encoder_sorted(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_encoder_bwd_sorted(AT(x, 0, r), AT(x, 1, r), AT(x, 2, r), x->p[5], b->B, b->T,
				     b->C, b->Vp, x->p[6], x->sz[6], BS);
}
static enum ng_status l_ln_fwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_layernorm_fwd(AT(x, 0, r), AT(x, 1, r), AT(x, 2, r), AT(x, 3, r), x->p[4],
				x->p[4], (int)b->N, b->C, BS);
}
/* --fp8: the E4M3 cast of an fcproj input (N x 4C), and LN2 with its E4M3 copy. The scale
 * (0x3c bytes: a finite float) and the maxima (NG_FP8_AMAX_FLOATS) have a buffer of their own,
 * apart from the LayerNorm's weights. */
static enum ng_status l_fp8_cast(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_fp8_cast_e4m3_seg(AT(x, 0, r), AT(x, 1, r), x->p[2], (float *)x->p[2] + 64,
				    x->n, 1, BS);
}
/* FP8_PREP's W and W^T in one read: 12 fc matrices (4C, C) with one scale each. */
static enum ng_status l_fp8_wt(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_fp8_cast_e4m3_wt_seg(AT(x, 1, r), AT(x, 2, r), AT(x, 0, r), x->p[3], 4 * b->C,
				       b->C, 12, BS);
}
static enum ng_status l_ln_fwd_fp8(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_layernorm_fwd_fp8(AT(x, 0, r), AT(x, 5, r), x->p[6], (float *)x->p[6] + 64,
				    AT(x, 1, r), AT(x, 2, r), AT(x, 3, r), x->p[4], x->p[4], (int)b->N,
				    b->C, BS);
}
static enum ng_status l_ln_bwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_layernorm_bwd(AT(x, 0, r), (float *)x->p[5], (float *)x->p[5] + b->C, AT(x, 1, r),
				AT(x, 2, r), x->p[4], AT(x, 3, r), AT(x, 3, r), (int)b->N, b->C,
				(char *)x->p[4] + 65536, BS);
}
static enum ng_status l_gelu_fwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_gelu_fwd(AT(x, 0, r), AT(x, 1, r), x->n, BS);
}
static enum ng_status l_gelu_bwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_gelu_bwd(AT(x, 0, r), AT(x, 1, r), AT(x, 0, r), x->n, BS);
}
/* p[0] dout -> dinp in place, p[1] the pre-activation, p[2] the recomputed GELU (when sz[2]),
 * p[3] dbias, p[4] the partials */
static enum ng_status l_gelu_bwd_bias(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_gelu_bwd_bias(AT(x, 0, r), x->sz[2] ? AT(x, 2, r) : NULL, (float *)x->p[3], 0,
				AT(x, 1, r), AT(x, 0, r), (int)x->n, x->oc, x->p[4], BS);
}
static enum ng_status l_bias_grad(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_bias_grad((float *)x->p[1], AT(x, 0, r), (int)x->n, x->oc, x->p[2], BS);
}
static enum ng_status l_ce(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_crossentropy(AT(x, 1, r), AT(x, 0, r), b->targets, (int)b->N, b->V, b->Vp,
			       1.0f / (float)b->N, BS);
}
static enum ng_status l_ce_fwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_crossentropy_fwd(AT(x, 1, r), AT(x, 0, r), b->targets, (int)b->N, b->V, b->Vp, BS);
}
static enum ng_status l_loss_acc(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_loss_accumulate(&b->st->loss_sum, AT(x, 0, r), (int)b->N, 1.0f / (float)b->N, NULL,
				  BS);
}
static enum ng_status l_norm(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_grad_norm_squared((float *)x->p[1], AT(x, 0, r), x->n, x->p[2], BS);
}
static enum ng_status l_adamw(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_adamw(AT(x, 0, r), AT(x, 1, r), AT(x, 2, r), AT(x, 3, r), AT(x, 4, r), x->n, 0.1f,
			0.9f, 0.95f, 1e-8f, b->st, BS);
}
static enum ng_status l_cast(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_cast_f32_to_bf16(AT(x, 0, r), AT(x, 1, r), x->n, BS);
}
static enum ng_status l_split(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_tokens_split(AT(x, 0, r), AT(x, 1, r), AT(x, 2, r), b->B, b->T, BS);
}
/* The speedrun model's kernels: p[3] holds their fp32 scalars (pool bytes, 0x3c3c3c3c: 0.0115),
 * p[5] the backward's partials. */
static enum ng_status l_mix_fwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	const float *s = x->p[3];
	return ng_mix2_fwd(AT(x, 0, r), b->C, s, AT(x, 1, r), b->C, s + 1, AT(x, 2, r), b->C,
			   (int)b->N, b->C, BS);
}
/* the value mixing: v inside qkv (p[0], ld 3C) in place, ve (p[1]) */
static enum ng_status l_mix_fwd_v(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	const float *s = x->p[3];
	ng_bf16 *v = (ng_bf16 *)AT(x, 0, r) + 2 * (size_t)b->C;
	return ng_mix2_fwd(v, 3 * b->C, s, v, 3 * b->C, s + 1, AT(x, 1, r), b->C, (int)b->N, b->C,
			   BS);
}
/* dout (p[0]) -> du in place, u (p[1]), w (p[2]), dw (p[4]) accumulated, da and db */
static enum ng_status l_mix_bwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	float *s = x->p[3];
	return ng_mix2_bwd(AT(x, 0, r), b->C, 0, AT(x, 4, r), b->C, 1, s + 2, s + 3, AT(x, 0, r),
			   b->C, s, AT(x, 1, r), b->C, s + 1, AT(x, 2, r), b->C, (int)b->N, b->C,
			   x->p[5], BS);
}
static enum ng_status l_softcap(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_softcap_crossentropy(AT(x, 1, r), AT(x, 0, r), b->targets, (int)b->N, b->Vp,
				       30.0f, (float)(7.5 * sqrt((double)b->C)), 1.0f, BS);
}
static enum ng_status l_softcap_fwd(struct bench *b, int r, void *a)
{
	struct bufs *x = a;
	return ng_softcap_crossentropy_fwd(AT(x, 1, r), AT(x, 0, r), b->targets, (int)b->N, b->Vp,
					   30.0f, (float)(7.5 * sqrt((double)b->C)), BS);
}

/* Sets up x with k inputs of the given sizes (bytes per copy) for a working set of `ws`. */
static void setup(struct bench *b, struct bufs *x, double ws, int k, const size_t *sz)
{
	b->used = 0;
	b->copies = copies_for((size_t)ws);
	memset(x, 0, sizeof(*x));
	for (int i = 0; i < k; i++) {
		x->sz[i] = (sz[i] + 255) & ~(size_t)255;
		x->p[i] = carve_rot(b, x->sz[i]);
	}
}

/* Fills h[0..n) with tokens p(rank r) ~ 1/r over [0, V) (mode 0) or all equal to a random token
 * (mode 1); returns the number of distinct tokens. */
static size_t zipf_or_equal_tokens(int32_t *h, size_t n, int V, int mode, struct ng_rng *rng)
{
	if (mode == 1) {
		int32_t v = (int32_t)ng_rng_below(rng, (uint64_t)V);
		for (size_t i = 0; i < n; i++)
			h[i] = v;
		return 1;
	}
	double *cdf = malloc((size_t)V * sizeof(double));
	char *seen = calloc((size_t)V, 1);
	double acc = 0.0;
	for (int v = 0; v < V; v++)
		cdf[v] = acc += 1.0 / (v + 1);
	size_t uniq = 0;
	for (size_t i = 0; i < n; i++) {
		double u = ng_rng_uniform(rng) * acc;
		int lo = 0, hi = V - 1;
		while (lo < hi) {
			int mid = (lo + hi) / 2;
			if (cdf[mid] >= u)
				hi = mid;
			else
				lo = mid + 1;
		}
		h[i] = lo;
		uniq += !seen[lo];
		seen[lo] = 1;
	}
	free(cdf);
	free(seen);
	return uniq;
}

static void run_shape(const char *preset, int B)
{
	struct ng_gpt_config cfg;
	struct ng_gpt_layout lay;
	if (ng_gpt_preset(&cfg, preset) || ng_gpt_check(&cfg)) {
		fprintf(stderr, "bench_kernels: %s\n", ng_error_message());
		exit(2);
	}
	ng_gpt_layout(&cfg, &lay);
	struct bench bb = {.name = preset, .B = B, .T = cfg.T, .C = cfg.C, .V = cfg.V,
			   .Vp = cfg.Vp, .N = (size_t)B * cfg.T, .P = lay.total};
	struct bench *b = &bb;
	size_t N = b->N, C = (size_t)b->C, P = b->P;
	/* the largest user: AdamW, 30 bytes per parameter, one copy */
	b->pool_bytes = 32 * P + (64u << 20);
	if (b->pool_bytes < 3 * N * (size_t)b->Vp + (512u << 20))
		b->pool_bytes = 3 * N * (size_t)b->Vp + (512u << 20);
	if (NG_CUDA_CHECK(cudaMalloc((void **)&b->pool, b->pool_bytes)) ||
	    NG_CUDA_CHECK(cudaMemset(b->pool, 0x3c, b->pool_bytes))) {
		fprintf(stderr, "bench_kernels: %s\n", ng_error_message());
		exit(1);
	}
	/* tokens/targets and state live outside the pool */
	int32_t *h = malloc(N * 4);
	struct ng_rng rng;
	ng_rng_seed(&rng, 1234);
	char *seen = calloc((size_t)b->Vp, 1);
	size_t uniq = 0;
	for (size_t i = 0; i < N; i++) {
		h[i] = (int32_t)ng_rng_below(&rng, (uint64_t)b->V);
		uniq += !seen[h[i]];
		seen[h[i]] = 1;
	}
	cudaMalloc((void **)&b->tokens, N * 4);
	cudaMalloc((void **)&b->targets, N * 4);
	cudaMalloc((void **)&b->st, sizeof(struct ng_step_state));
	cudaMemcpy(b->tokens, h, N * 4, cudaMemcpyHostToDevice);
	cudaMemcpy(b->targets, h, N * 4, cudaMemcpyHostToDevice);
	struct ng_step_state st = {0};
	st.lr = 1e-4f;
	st.clip_scale = 1.0f;
	cudaMemcpy(b->st, &st, sizeof(st), cudaMemcpyHostToDevice);
	free(h);
	free(seen);

	struct bufs x;
	size_t act = N * C * 2, wte = (size_t)b->Vp * C, wpe = (size_t)b->T * C;
	double by;

	by = 2.0 * act;
	setup(b, &x, by, 2, (size_t[]){act, act});
	time_kernel(b, "copy (N x C bf16, cudaMemcpy)", by, l_copy, &x);
	/* the same copy at 1/4 to 8 times that size: where the copy rate stops depending on size */
	for (int k = -2; k <= 3; k++) {
		if (k == 0)
			continue;
		size_t sz = k < 0 ? act >> -k : act << k;
		char name[40];
		snprintf(name, sizeof(name), "copy %.0f MB", 2.0 * sz / 1e6);
		by = 2.0 * sz;
		setup(b, &x, by, 2, (size_t[]){sz, sz});
		time_kernel(b, name, by, l_copy, &x);
	}

	by = 2.0 * act + wpe * 2 + N * 4;
	setup(b, &x, by, 3, (size_t[]){act, wte * 2, wpe * 2});
	time_kernel(b, "encoder_fwd", by, l_encoder_fwd, &x);

	by = act + 2.0 * uniq * C * 4 + 2.0 * wpe * 4;
	setup(b, &x, by, 4, (size_t[]){wte * 4, wpe * 4, act, 0});
	x.sz[3] = ng_encoder_bwd_scratch_bytes(b->B, b->T, b->C);
	x.p[3] = carve(b, x.sz[3]);
	b->bwd_tokens = b->tokens;
	double t = time_kernel(b, "encoder_bwd (sort+windows)", by, l_encoder_bwd, &x);
	/* What this implementation moves: dout twice (the dwte gather and the dwpe sum), dwte and
	 * dwpe read and written, and the sort's traffic (packed 32-bit keys at these shapes): keys
	 * built (8n), histogram (4n), two 8-bit onesweep passes over the keys (2 x 8n), the window
	 * kernel's keys (5 slots read per slot: ~20n). */
	double impl = 2.0 * act + 2.0 * uniq * C * 4 + 2.0 * wpe * 4 + 48.0 * N;
	if (t > 0)
		printf("%-4s %-26s %10.1f us %9.1f GB/s %6.1f%% of 4.28 TB/s  (%.1f MB moved by this "
		       "implementation)\n", b->name, "  same, implementation bytes", t * 1e6,
		       impl / t / 1e9, 100.0 * impl / t / COPY_BW, impl / 1e6);
	/* the step runs it in two parts (graph/ir.h ENCODER_SORT): the sort beside the forward on
	 * a second stream, the gradients at the end of the backward */
	by = act + 2.0 * uniq * C * 4 + 2.0 * wpe * 4;
	x.sz[5] = ng_encoder_bwd_sorted_bytes(b->B, b->T);
	x.p[5] = carve(b, x.sz[5]);
	x.sz[6] = ng_encoder_bwd_work_bytes(b->B, b->T, b->C);
	x.p[6] = carve(b, x.sz[6]);
	time_kernel(b, "encoder_bwd sort (cub; latency-bound: 4 B a token)", 4.0 * N, l_encoder_sort,
		    &x);
	time_kernel(b, "encoder_bwd sorted (the step's, after the sort)", by, l_encoder_sorted, &x);
	/* real-text-like token sets: Zipfian over V, and every token equal */
	for (int mode = 0; mode < 2; mode++) {
		int32_t *h2 = malloc(N * 4);
		size_t uq = zipf_or_equal_tokens(h2, N, b->V, mode, &rng);
		cudaMemcpy(b->bwd_tokens = b->targets, h2, N * 4, cudaMemcpyHostToDevice);
		free(h2);
		by = act + 2.0 * uq * C * 4 + 2.0 * wpe * 4;
		time_kernel(b, mode == 0 ? "encoder_bwd zipf tokens" : "encoder_bwd all equal tokens", by,
			    l_encoder_bwd, &x);
		if (ng_encoder_bwd_sort(x.p[5], x.sz[5], b->bwd_tokens, b->B, b->T, b->Vp, BS) ||
		    NG_CUDA_CHECK(cudaStreamSynchronize(BS))) {
			fprintf(stderr, "bench_kernels: %s\n", ng_error_message());
			exit(1);
		}
		time_kernel(b, mode == 0 ? "encoder_bwd sorted, zipf" : "encoder_bwd sorted, all equal",
			    by, l_encoder_sorted, &x);
	}
	cudaMemcpy(b->targets, b->tokens, N * 4, cudaMemcpyDeviceToDevice);
	b->bwd_tokens = b->tokens;

	by = 2.0 * act + 8.0 * N;
	setup(b, &x, by, 5, (size_t[]){act, N * 4, N * 4, act, 0});
	x.p[4] = carve(b, (64u << 20));
	time_kernel(b, "layernorm_fwd", by, l_ln_fwd, &x);

	by = 2.0 * act + 8.0 * N + act / 2; /* + the E4M3 copy, a byte an element */
	setup(b, &x, by, 6, (size_t[]){act, N * 4, N * 4, act, 0, act / 2});
	x.p[4] = carve(b, C * 4);
	x.p[6] = carve(b, 64 * 4 + NG_FP8_AMAX_FLOATS * 4);
	time_kernel(b, "layernorm_fwd + E4M3 copy (--fp8)", by, l_ln_fwd_fp8, &x);

	by = 6.0 * act; /* N x 4C elements: 2 bytes in, 1 out */
	setup(b, &x, by, 3, (size_t[]){act * 2, act * 4, 0});
	x.p[2] = carve(b, 64 * 4 + 256);
	x.n = N * C * 4;
	time_kernel(b, "fp8 cast N x 4C (--fp8 fcproj input)", by, l_fp8_cast, &x);

	size_t nw = (size_t)12 * 4 * C * C; /* 12 layers of fc weights */
	by = 4.0 * (double)nw;               /* 2 bytes in, 1 for W, 1 for W^T */
	setup(b, &x, by, 4, (size_t[]){nw * 2, nw, nw, 0});
	x.p[3] = carve(b, 64 * 4);
	cudaMemset(x.p[3], 0x3c, 64 * 4); /* scales: a finite float */
	time_kernel(b, "fp8 W + W^T cast, 12 x (4C, C) (--fp8 FP8_PREP)", by, l_fp8_wt, &x);

	by = 4.0 * act + 8.0 * N;
	setup(b, &x, by, 6, (size_t[]){act, act, act, N * 4, 0, 0});
	x.p[4] = carve(b, 65536 + ng_layernorm_bwd_scratch_bytes((int)N, b->C));
	x.p[5] = carve(b, 2 * C * 4);
	time_kernel(b, "layernorm_bwd", by, l_ln_bwd, &x);

	x.n = N * 4 * C;
	by = 4.0 * x.n;
	setup(b, &x, by, 2, (size_t[]){x.n * 2, x.n * 2});
	x.n = N * 4 * C;
	time_kernel(b, "gelu_fwd (N x 4C)", by, l_gelu_fwd, &x);
	by = 6.0 * x.n;
	time_kernel(b, "gelu_bwd (N x 4C, in place)", by, l_gelu_bwd, &x);

	for (int recompute = 0; recompute < 2; recompute++) { /* the step's GELU_BWD op */
		size_t n4 = N * 4 * C;
		by = (6.0 + 2.0 * recompute) * (double)n4;
		setup(b, &x, by, 3, (size_t[]){n4 * 2, n4 * 2, recompute ? n4 * 2 : 0});
		x.n = N;
		x.oc = 4 * b->C;
		x.p[3] = carve(b, 4 * C * 4);
		x.p[4] = carve(b, ng_bias_grad_scratch_bytes((int)N, x.oc));
		time_kernel(b, recompute ? "gelu_bwd_bias + recomputed GELU (N x 4C)" :
			    "gelu_bwd_bias (N x 4C, in place)", by, l_gelu_bwd_bias, &x);
	}

	by = 2.0 * N * 4 * C;
	setup(b, &x, by, 1, (size_t[]){N * 4 * C * 2});
	x.n = N;
	x.oc = 4 * b->C;
	x.p[1] = carve(b, 4 * C * 4);
	x.p[2] = carve(b, ng_bias_grad_scratch_bytes((int)N, x.oc));
	time_kernel(b, "bias_grad (OC = 4C)", by, l_bias_grad, &x);

	size_t logits = N * (size_t)b->Vp * 2;
	by = 2.0 * logits + 8.0 * N;
	setup(b, &x, by, 2, (size_t[]){logits, N * 4});
	time_kernel(b, "crossentropy (fwd+dlogits)", by, l_ce, &x);
	by = 1.0 * logits + 8.0 * N;
	time_kernel(b, "crossentropy_fwd (eval)", by, l_ce_fwd, &x);

	by = 4.0 * N;
	setup(b, &x, by, 1, (size_t[]){N * 4});
	time_kernel(b, "loss_accumulate", by, l_loss_acc, &x);

	x.n = P;
	by = 4.0 * P;
	setup(b, &x, by, 1, (size_t[]){P * 4});
	x.n = P;
	x.p[1] = carve(b, 4);
	x.p[2] = carve(b, ng_grad_norm_scratch_bytes(P));
	time_kernel(b, "grad_norm_squared (all P)", by, l_norm, &x);

	by = 28.0 * P; /* hi, lo, m, v read and written, grad read */
	setup(b, &x, by, 5, (size_t[]){P * 2, P * 2, P * 4, P * 4, P * 4});
	x.n = P;
	time_kernel(b, "adamw (all P, one launch)", by, l_adamw, &x);

	by = 6.0 * P;
	setup(b, &x, by, 2, (size_t[]){P * 2, P * 4});
	x.n = P;
	time_kernel(b, "cast_f32_to_bf16 (all P)", by, l_cast, &x);

	by = 10.0 * N;
	setup(b, &x, by, 3, (size_t[]){N * 4, N * 4, (size_t)b->B * (b->T + 1) * 2});
	time_kernel(b, "tokens_split", by, l_split, &x);

	/* the speedrun model's kernels at this shape (its own: N = 49152, C = 768) */
	by = 3.0 * act;
	setup(b, &x, by, 3, (size_t[]){act, act, act});
	x.p[3] = carve(b, 256);
	time_kernel(b, "mix2_fwd (x0 mixing)", by, l_mix_fwd, &x);
	setup(b, &x, by, 2, (size_t[]){3 * act, act});
	x.p[3] = carve(b, 256);
	time_kernel(b, "mix2_fwd (v in qkv, ld 3C, in place)", by, l_mix_fwd_v, &x);
	by = 6.0 * act; /* dout, u, w read; dw read and written; du written */
	setup(b, &x, by, 5, (size_t[]){act, act, act, 0, act});
	x.p[3] = carve(b, 256);
	x.p[5] = carve(b, ng_mix2_bwd_scratch_bytes((int)N, b->C));
	time_kernel(b, "mix2_bwd (du in place, dw +=, da, db)", by, l_mix_bwd, &x);
	by = 2.0 * logits + 8.0 * N;
	setup(b, &x, by, 2, (size_t[]){logits, N * 4});
	time_kernel(b, "softcap_crossentropy (fwd+dz)", by, l_softcap, &x);
	by = 1.0 * logits + 8.0 * N;
	time_kernel(b, "softcap_crossentropy_fwd (eval)", by, l_softcap_fwd, &x);

	cudaFree(b->pool);
	cudaFree(b->tokens);
	cudaFree(b->targets);
	cudaFree(b->st);
}

int main(int argc, char **argv)
{
	if (ng_cuda_device_count() == 0) {
		fprintf(stderr, "bench_kernels: no CUDA device\n");
		return 1;
	}
	printf("# shape kernel  median-time  GB/s  %%-of-copy-bandwidth  (bytes moved, rotation)  "
	       "time and %% per launch in a graph of %d\n", GRAPH_LAUNCHES);
	if (NG_CUDA_CHECK(cudaStreamCreate(&BS))) {
		fprintf(stderr, "bench_kernels: %s\n", ng_error_message());
		return 1;
	}
	int first = 1;
	while (first < argc && strncmp(argv[first], "--", 2) == 0) {
		if (strcmp(argv[first], "--only") == 0 && first + 1 < argc) {
			only_kernels = argv[first + 1];
			first += 2;
		} else if (strcmp(argv[first], "--gpu-time") == 0) {
			if (NG_CUDA_CHECK(cudaMalloc(&filler_buf, 4 * (size_t)FILLER_FLOATS +
								     2 * (size_t)FILLER_FLOATS))) {
				fprintf(stderr, "bench_kernels: %s\n", ng_error_message());
				return 1;
			}
			cudaMemset(filler_buf, 0, 6 * (size_t)FILLER_FLOATS);
			first++;
		} else {
			fprintf(stderr, "bench_kernels: unknown option %s\n"
				"---> HINT: bench_kernels [--only SUBSTR] [--gpu-time] [d12|d48]...\n",
				argv[first]);
			return 2;
		}
	}
	if (argc <= first) {
		run_shape("d12", 64);
		run_shape("d48", 16);
	}
	for (int i = first; i < argc; i++)
		run_shape(argv[i], !strcmp(argv[i], "d12") ? 64 : !strcmp(argv[i], "d24") ? 32 : 16);
	return 0;
}
