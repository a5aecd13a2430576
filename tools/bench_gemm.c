/*
 * tools/bench_gemm.c — our Hopper GEMM (kernels/gemm_sm90.h) against cuBLASLt's autotuned plan
 * (kernels/matmul.h) on the forward matmuls of the step, at the d12 (B=64, C=768), d24 (B=32,
 * C=1024) and d48 (B=16, C=1600) shapes, T = 1024.
 *
 * Each kernel is timed under sustained load, as the autotune ranks candidates: ~150 ms of
 * launches back to back to reach the power-limited clock, then ~150 ms between two events; the
 * kernels of one matmul take turns three times and the best of each is kept. Inputs are random
 * (activations N(0, 1), weights N(0, 1/IC): the GPU's power, and so its clock, depends on the
 * values). The own kernel's outputs are compared with cuBLASLt's: the largest difference
 * relative to the largest output, which two correct bf16 results keep near a bf16 ulp.
 *
 * Usage: bench_gemm [--fc | --dgelu] [d12|d24|d48 ...]   (all three by default; --fc: the fc
 * matmul only; --dgelu: the FC-proj input gradient with the GELU backward, each way the step
 * can run it: cuBLASLt's plain matmul and ng_gelu_bwd_bias, our own GEMM's DGELU with and without
 * the recomputed GELU (and the fc bias gradient from its column sums), the W^T transpose it
 * needs, and our own forward GELU GEMM of the same shape for comparison; with the energy a
 * launch where NVML's counter can be read)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/gemm_sm90.h"
#include "kernels/matmul.h"
#include "tools/bench_sustained.h"
#include "util/rng.h"

static int only_fc; /* --fc: the fc matmul alone */
static int dgelu;   /* --dgelu: the FC-proj input gradient with the GELU backward */

struct bufs {
	void *a, *w, *bias, *out, *aux, *out2, *aux2, *ws;
};

/* One candidate: cuBLASLt's plan (own 0) or our own kernel (own 1). */
struct cand {
	const struct ng_matmul *mm;
	int own;
	int M, N, K, gelu;
};

static int run_(const struct cand *c, const struct bufs *b, int second)
{
	void *out = second ? b->out2 : b->out, *aux = second ? b->aux2 : b->aux;
	if (!c->own)
		return ng_matmul_run(c->mm, out, b->a, b->w, b->bias, c->gelu ? aux : NULL, NULL,
				     b->ws, 0) != NG_OK;
	return ng_gemm_sm90_fwd(out, c->gelu ? aux : NULL, b->a, b->w, b->bias, c->M, c->N, c->K,
				c->gelu, 0) != NG_OK;
}

/* Sustained timing (tools/bench_sustained.h) of one candidate. */
struct launch_arg {
	const struct cand *c;
	const struct bufs *b;
};

static int launch_(const void *arg)
{
	const struct launch_arg *la = arg;
	return run_(la->c, la->b, 0);
}

static int time_(const struct cand *c, const struct bufs *b, cudaEvent_t *ev, float *ms)
{
	struct launch_arg la = { c, b };
	return ng_time_sustained(launch_, &la, ev, 0.0f, ms);
}

static float bf_(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* max |x - y| / max |y| over n bf16 values on the device. */
static double rel_diff_(const void *x, const void *y, size_t n)
{
	uint16_t *hx = malloc(n * 2), *hy = malloc(n * 2);
	double dmax = 0, ymax = 0;
	if (!hx || !hy || cudaMemcpy(hx, x, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
	    cudaMemcpy(hy, y, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
		free(hx);
		free(hy);
		return INFINITY;
	}
	for (size_t i = 0; i < n; i++) {
		double a = bf_(hx[i]), b = bf_(hy[i]);
		double d = fabs(a - b);
		if (!(d <= dmax))
			dmax = isnan(d) ? INFINITY : d;
		if (fabs(b) > ymax)
			ymax = fabs(b);
	}
	free(hx);
	free(hy);
	return ymax > 0 ? dmax / ymax : dmax;
}

static int fill_(void *dst, size_t n, double sd, struct ng_rng *r)
{
	uint16_t *h = malloc(n * 2);
	if (!h)
		return 1;
	for (size_t i = 0; i < n; i++) {
		float f = (float)(sd * ng_rng_normal(r));
		uint32_t u;
		memcpy(&u, &f, 4);
		h[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
	}
	int bad = NG_CUDA_CHECK(cudaMemcpy(dst, h, n * 2, cudaMemcpyHostToDevice)) != NG_OK;
	free(h);
	return bad;
}

static int config_(const char *name, int B, int C, int L, struct ng_matmul_ctx *ctx, cudaEvent_t *ev,
		   double *sum_lt, double *sum_own)
{
	const int T = 1024, M = B * T;
	struct { const char *name; int OC, IC, gelu; } mms[] = {
		{ "qkv", 3 * C, C, 0 }, { "attproj", C, C, 0 },
		{ "fc (GELU)", 4 * C, C, 1 }, { "fcproj", C, 4 * C, 0 },
	};
	struct bufs b;
	struct ng_rng r;
	memset(&b, 0, sizeof(b));
	ng_rng_seed(&r, 1234);
	size_t big = (size_t)M * 4 * C;
	if (NG_CUDA_CHECK(cudaMalloc(&b.a, big * 2)) || NG_CUDA_CHECK(cudaMalloc(&b.w, (size_t)16 * C * C * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc(&b.bias, (size_t)4 * C * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc(&b.out, big * 2)) || NG_CUDA_CHECK(cudaMalloc(&b.aux, big * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc(&b.out2, big * 2)) || NG_CUDA_CHECK(cudaMalloc(&b.aux2, big * 2)) ||
	    NG_CUDA_CHECK(cudaMalloc(&b.ws, ctx->workspace_bytes + (1 << 20))))
		return 1;
	printf("\n== %s: M = %d, C = %d; sustained ms (TFLOP/s); own vs cuBLASLt max rel diff ==\n",
	       name, M, C);
	int rc = 0;
	for (int i = 0; i < 4 && !rc; i++) {
		const int OC = mms[i].OC, IC = mms[i].IC;
		if (only_fc && !mms[i].gelu)
			continue;
		if (fill_(b.a, (size_t)M * IC, 1.0, &r) || fill_(b.w, (size_t)OC * IC, 1.0 / sqrt(IC), &r) ||
		    fill_(b.bias, (size_t)OC, 0.5, &r))
			return 1;
		struct ng_matmul mm;
		struct ng_matmul_spec s = {NG_MATMUL_FWD, M, IC, OC, mms[i].gelu, 1, 0, 1, 0, 0, 0};
		if (ng_matmul_plan(&mm, ctx, &s)) {
			fprintf(stderr, "bench_gemm: %s\n", ng_error_message());
			return 1;
		}
		enum { NC = 2 }; /* cuBLASLt's, ours */
		struct cand c[NC];
		float best[NC];
		for (int k = 0; k < NC; k++) {
			c[k] = (struct cand){ .mm = k ? NULL : &mm, .own = k, .M = M, .N = OC, .K = IC,
					      .gelu = mms[i].gelu };
			best[k] = 1e30f;
		}
		for (int round = 0; round < 3 && !rc; round++)
			for (int k = 0; k < NC && !rc; k++) {
				float ms;
				rc = time_(&c[k], &b, ev, &ms);
				if (!rc && ms < best[k])
					best[k] = ms;
			}
		if (rc) {
			fprintf(stderr, "bench_gemm: %s\n", ng_error_message());
			break;
		}
		double flop = 2.0 * M * OC * IC;
		printf("%-10s cuBLASLt %.4f (%.0f) | own %.4f (%.0f)", mms[i].name, best[0],
		       flop / best[0] / 1e9, best[1], flop / best[1] / 1e9);
		/* the outputs: cuBLASLt's into out/aux, ours into out2/aux2 */
		size_t n = (size_t)M * OC;
		rc = run_(&c[0], &b, 0) || run_(&c[1], &b, 1) || NG_CUDA_CHECK(cudaDeviceSynchronize());
		if (!rc) {
			printf(" | diff out %.2e", rel_diff_(b.out2, b.out, n));
			if (mms[i].gelu)
				printf(" aux %.2e", rel_diff_(b.aux2, b.aux, n));
		}
		printf("\n");
		float own = best[1];
		*sum_lt += L * best[0];
		*sum_own += L * (own < best[0] ? own : best[0]);
		ng_matmul_free(&mm);
	}
	cudaFree(b.a); cudaFree(b.w); cudaFree(b.bias); cudaFree(b.out); cudaFree(b.aux);
	cudaFree(b.out2); cudaFree(b.aux2); cudaFree(b.ws);
	return rc;
}

/* --dgelu: one way of the FC-proj input gradient with the GELU backward (what `way` says). */
struct dg_arg {
	const struct ng_matmul *mm;
	int way, M, N, K; /* (M, N = 4C) = (M, K = C) @ W2 (K, N) */
	void *dout, *w, *wt, *pre, *dpre, *post, *dbias, *part, *ws;
};

enum { DG_PAIR, DG_DINP, DG_GELU_BWD, DG_TRANSPOSE, DG_OWN_POST, DG_OWN, DG_OWN_POST_T,
       DG_OWN_FWD_GELU, DG_OWN_POST_X, DG_DINP_X, DG_OWN_POST_M, DG_OWN_POST_BIAS, DG_WAYS };
static const char *dg_name[DG_WAYS] = {
	"cuBLASLt dinp + gelu_bwd_bias (recompute)", "  cuBLASLt dinp alone",
	"  gelu_bwd_bias + recompute alone", "W^T transpose alone", "own DGELU + post",
	"own DGELU (no post)", "own DGELU + post + W^T transpose", "own forward GELU, same shape",
	"own DGELU + post after a transpose elsewhere", "cuBLASLt dinp after a transpose elsewhere",
	"own DGELU + post after a 1 MiB memset", "own DGELU + post + bias gradient (reduced)" };

static int dg_launch_(const void *arg)
{
	const struct dg_arg *d = arg;
	enum ng_status st = NG_OK;
	switch (d->way) {
	case DG_PAIR: case DG_DINP: case DG_GELU_BWD:
		if (d->way != DG_GELU_BWD)
			st = ng_matmul_run(d->mm, d->dpre, d->dout, d->w, NULL, NULL, NULL, d->ws, 0);
		if (!st && d->way != DG_DINP)
			st = ng_gelu_bwd_bias(d->dpre, d->post, d->dbias, 0, d->pre, d->dpre, d->M, d->N,
					      d->part, 0);
		break;
	case DG_TRANSPOSE:
		st = ng_transpose_bf16(d->wt, d->w, d->K, d->N, 1, 0);
		break;
	case DG_OWN_POST_X: case DG_DINP_X: case DG_OWN_POST_M: /* is it the kernel before? */
		if (d->way == DG_OWN_POST_M)
			st = NG_CUDA_CHECK(cudaMemsetAsync(d->ws, 0, 1 << 20, 0));
		else
			st = ng_transpose_bf16(d->ws, d->w, d->K, d->N, 1, 0);
		if (!st && d->way == DG_DINP_X)
			st = ng_matmul_run(d->mm, d->dpre, d->dout, d->w, NULL, NULL, NULL,
					   (char *)d->ws + ((size_t)24 << 20), 0);
		else if (!st)
			st = ng_gemm_sm90_dgelu(d->dpre, d->post, NULL, d->pre, d->dout, d->wt, d->M,
						d->N, d->K, 0);
		break;
	case DG_OWN_POST_T:
		st = ng_transpose_bf16(d->wt, d->w, d->K, d->N, 1, 0);
		/* fall through */
	case DG_OWN_POST: case DG_OWN: case DG_OWN_POST_BIAS:
		if (!st)
			st = ng_gemm_sm90_dgelu(d->dpre, d->way == DG_OWN ? NULL : d->post,
						d->way == DG_OWN_POST_BIAS ? d->part : NULL, d->pre,
						d->dout, d->wt, d->M, d->N, d->K, 0);
		if (!st && d->way == DG_OWN_POST_BIAS)
			st = ng_bias_grad_reduce(d->dbias, d->part, ng_gemm_sm90_dgelu_parts(d->M),
						 d->N, 0, 0);
		break;
	default: /* the forward: (M, N) = (M, K) @ (N, K)^T with GELU */
		st = ng_gemm_sm90_fwd(d->post, d->dpre, d->dout, d->wt, NULL, d->M, d->N, d->K, 1, 0);
	}
	return st != NG_OK;
}

static int dgelu_config_(const char *name, int B, int C, int L, struct ng_matmul_ctx *ctx,
			 cudaEvent_t *ev)
{
	const int M = B * 1024, N = 4 * C, K = C;
	struct ng_rng r;
	ng_rng_seed(&r, 1234);
	struct dg_arg d = { NULL, 0, M, N, K, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL };
	size_t big = (size_t)M * N;
	int rc = NG_CUDA_CHECK(cudaMalloc(&d.dout, (size_t)M * K * 2)) ||
		 NG_CUDA_CHECK(cudaMalloc(&d.w, (size_t)N * K * 2)) ||
		 NG_CUDA_CHECK(cudaMalloc(&d.wt, (size_t)N * K * 2)) ||
		 NG_CUDA_CHECK(cudaMalloc(&d.pre, big * 2)) || NG_CUDA_CHECK(cudaMalloc(&d.dpre, big * 2)) ||
		 NG_CUDA_CHECK(cudaMalloc(&d.post, big * 2)) ||
		 NG_CUDA_CHECK(cudaMalloc(&d.dbias, (size_t)N * 4)) ||
		 NG_CUDA_CHECK(cudaMalloc(&d.part, (size_t)N * 4 *
				 (size_t)ng_gemm_sm90_dgelu_parts(M) +
				 ng_bias_grad_scratch_bytes(M, N))) ||
		 NG_CUDA_CHECK(cudaMalloc(&d.ws, ctx->workspace_bytes + ((size_t)48 << 20)));
	rc = rc || fill_(d.dout, (size_t)M * K, 1.0, &r) ||
	     fill_(d.w, (size_t)N * K, 1.0 / sqrt(K), &r) || fill_(d.pre, big, 1.5, &r) ||
	     ng_transpose_bf16(d.wt, d.w, K, N, 1, 0) != NG_OK;
	struct ng_matmul mm;
	struct ng_matmul_spec sp = {NG_MATMUL_DINP, M, N, K, 0, 0, 0, 1, 0, 0, 0};
	if (!rc && ng_matmul_plan(&mm, ctx, &sp)) {
		fprintf(stderr, "bench_gemm: %s\n", ng_error_message());
		rc = 1;
	}
	if (rc)
		return 1;
	d.mm = &mm;
	printf("\n== %s --dgelu: M = %d, N = 4C = %d, K = C = %d; sustained ms, best of 3; energy, "
	       "median of 3 ==\n", name, M, N, K);
	float best[DG_WAYS];
	double mj[DG_WAYS][3];
	for (int w = 0; w < DG_WAYS; w++)
		best[w] = 1e30f;
	for (int round = 0; round < 3 && !rc; round++)
		for (int w = 0; w < DG_WAYS && !rc; w++) {
			float ms;
			d.way = w;
			rc = ng_time_energy(dg_launch_, &d, ev, &ms, &mj[w][round]);
			if (!rc && ms < best[w])
				best[w] = ms;
		}
	for (int w = 0; w < DG_WAYS && !rc; w++) {
		/* energy: the median of the three rounds */
		double *e = mj[w], lo = fmin(e[0], fmin(e[1], e[2])), hi = fmax(e[0], fmax(e[1], e[2]));
		double med = e[0] + e[1] + e[2] - lo - hi;
		printf("%-44s %.4f ms  (x %d layers: %.2f ms a step)", dg_name[w], best[w], L,
		       best[w] * L);
		if (med >= 0)
			printf("  %.1f mJ a launch (%.0f W)", med, med / best[w]);
		printf("\n");
	}
	ng_matmul_free(&mm);
	void *p[] = { d.dout, d.w, d.wt, d.pre, d.dpre, d.post, d.dbias, d.part, d.ws };
	for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
		cudaFree(p[i]);
	return rc;
}

int main(int argc, char **argv)
{
	if (ng_cuda_device_count() < 1 || !ng_gemm_sm90_available()) {
		fprintf(stderr, "bench_gemm: needs an sm_90 GPU and a build for sm_90a\n");
		return 1;
	}
	struct ng_matmul_ctx ctx;
	if (ng_matmul_ctx_init(&ctx, (size_t)32 << 20)) {
		fprintf(stderr, "bench_gemm: %s\n", ng_error_message());
		return 1;
	}
	ctx.own_gemm = 0; /* the cuBLASLt column is cuBLASLt's alone */
	cudaEvent_t ev[2];
	cudaEventCreate(&ev[0]);
	cudaEventCreate(&ev[1]);
	struct { const char *name; int B, C, L; } cfg[] = {
		{ "d12", 64, 768, 12 }, { "d24", 32, 1024, 24 }, { "d48", 16, 1600, 48 } };
	int rc = 0;
	if (argc > 1 && !strcmp(argv[1], "--fc"))
		only_fc = 1, argc--, argv++;
	else if (argc > 1 && !strcmp(argv[1], "--dgelu"))
		dgelu = 1, argc--, argv++;
	for (int i = 0; i < 3 && !rc; i++) {
		int want = argc < 2;
		for (int a = 1; a < argc; a++)
			want |= !strcmp(argv[a], cfg[i].name);
		if (!want)
			continue;
		if (dgelu) {
			rc = dgelu_config_(cfg[i].name, cfg[i].B, cfg[i].C, cfg[i].L, &ctx, ev);
			continue;
		}
		double lt = 0, own = 0;
		rc = config_(cfg[i].name, cfg[i].B, cfg[i].C, cfg[i].L, &ctx, ev, &lt, &own);
		if (!rc)
			printf("%s: forward matmuls a step: cuBLASLt %.2f ms, with the faster of each %.2f ms\n",
			       cfg[i].name, lt, own);
	}
	ng_matmul_ctx_free(&ctx);
	return rc;
}
