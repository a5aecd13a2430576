/*
 * tests/test_loss.c — fused softmax cross-entropy and loss accumulation (kernels/loss.h) against
 * ng_ref_crossentropy (graph/cpu_ops.h, double).
 * Losses (fp32): NMSE <= 1e-7. dlogits (bf16, in place): the rounded reference, 2 ulp + an atol
 * of 2^-12 of the largest |dlogit|. Padded columns hold huge logits (they must never win) and
 * must come back exactly 0. The no-gradient variant must leave the logits untouched. Loss
 * accumulation: the FlashAttention rule against a naive fp32 loop, identical over two runs.
 * Shapes: V = 50257 / Vp = 50304, V = Vp = 50304, N = 1, N = 64, V = 1000 / Vp = 1024.
 */
#include <criterion/criterion.h>

#include "graph/cpu_ops.h"
#include "kernels/loss.h"
#include "tests/kernel_testing.h"

static void ce_case(int N, int V, int Vp, double mean, int grad)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = (size_t)N * Vp;
	ng_bf16 *z = kt_xmalloc(n * 2), *got = kt_xmalloc(n * 2);
	double *z_d = kt_xmalloc(n * 8), *dref = kt_xmalloc(n * 8), *lref = kt_xmalloc(N * 8);
	kt_fill_bf16(&r, z, z_d, n, mean, 2.0);
	for (int i = 0; i < N; i++)
		for (int v = V; v < Vp; v++) { /* padding that would win if it were counted */
			z[(size_t)i * Vp + v] = kt_f32_to_bf16(1e4f);
			z_d[(size_t)i * Vp + v] = 1e4;
		}
	int32_t *tg = kt_xmalloc(N * 4);
	for (int i = 0; i < N; i++)
		tg[i] = (int32_t)ng_rng_below(&r, (uint64_t)V);
	double dloss = 1.0 / (N * 3.0);
	ng_ref_crossentropy(lref, dref, z_d, tg, N, V, Vp, dloss);

	void *d_z = kt_upload(z, n * 2), *d_tg = kt_upload(tg, N * 4);
	float *d_l = kt_upload(NULL, N * 4), *l = kt_xmalloc(N * 4);
	if (grad)
		kt_ok(ng_crossentropy(d_l, d_z, d_tg, N, V, Vp, (float)dloss, 0), "ng_crossentropy");
	else
		kt_ok(ng_crossentropy_fwd(d_l, d_z, d_tg, N, V, Vp, 0), "ng_crossentropy_fwd");
	kt_download(l, d_l, N * 4);
	kt_download(got, d_z, n * 2);
	char what[128];
	snprintf(what, sizeof(what), "crossentropy%s losses N=%d V=%d Vp=%d mean=%g",
		 grad ? "" : "_fwd", N, V, Vp, mean);
	double *ld = kt_f2d(l, N);
	check_nmse_(what, seed, ld, lref, N);
	if (grad) {
		double dmax = 0;
		size_t pad_bad = n;
		for (size_t i = 0; i < n; i++) {
			dmax = fmax(dmax, fabs(dref[i]));
			if ((int)(i % Vp) >= V && got[i] != 0 && pad_bad == n)
				pad_bad = i;
		}
		snprintf(what, sizeof(what), "crossentropy dlogits N=%d V=%d Vp=%d mean=%g", N, V, Vp,
			 mean);
		check_bf16_(what, seed, got, dref, n, 2.0, dmax / 4096.0);
		cr_expect(pad_bad == n, "crossentropy: padded dlogit %zu is not 0; seed %llu", pad_bad,
			  (unsigned long long)seed);
	} else {
		cr_expect(memcmp(got, z, n * 2) == 0,
			  "crossentropy_fwd changed the logits; seed %llu", (unsigned long long)seed);
	}
	cudaFree(d_z), cudaFree(d_tg), cudaFree(d_l);
	free(z), free(got), free(z_d), free(dref), free(lref), free(tg), free(l), free(ld);
}

Test(loss, crossentropy_shapes)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	ce_case(5, 50257, 50304, 0.0, 1);
	ce_case(64, 50304, 50304, 0.0, 1);
	ce_case(1, 50257, 50304, 30.0, 1);
	ce_case(33, 1000, 1024, -5.0, 1);
}

Test(loss, crossentropy_fwd_only)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	ce_case(7, 50257, 50304, 0.0, 0);
	ce_case(1, 1000, 1024, 3.0, 0);
}

static void accumulate_case(int N)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	float *l = kt_xmalloc(N * 4);
	for (int i = 0; i < N; i++)
		l[i] = (float)(10.0 * ng_rng_uniform(&r) + 0.01);
	float start = 1.25f, scale = 1.0f / (float)N;
	double ref = start, sum = 0;
	float naive = 0.0f;
	for (int i = 0; i < N; i++) {
		sum += l[i];
		naive += l[i];
	}
	ref += sum * scale;
	double naive_d = start + (double)(naive * scale);
	float *d_l = kt_upload(l, N * 4), *d_s = kt_upload(NULL, 4), got[2];
	for (int run = 0; run < 2; run++) {
		kt_cuda(cudaMemcpy(d_s, &start, 4, cudaMemcpyHostToDevice), "H2D");
		kt_ok(ng_loss_accumulate(d_s, d_l, N, scale, NULL, 0), "ng_loss_accumulate");
		kt_download(&got[run], d_s, 4);
	}
	double g = got[0];
	char what[64];
	snprintf(what, sizeof(what), "loss_accumulate N=%d", N);
	check_fa_(what, seed, &g, &naive_d, &ref, 1, 1e-6 * fabs(ref));
	cr_expect(memcmp(&got[0], &got[1], 4) == 0, "loss_accumulate N=%d not deterministic", N);
	cudaFree(d_l), cudaFree(d_s);
	free(l);
}

Test(loss, accumulate)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	accumulate_case(1);
	accumulate_case(65536);
	accumulate_case(4097);
}
