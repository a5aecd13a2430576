/*
 * tests/test_optim.c — gradient norm, schedule, AdamW and step finish (kernels/optim.h) against
 * graph/cpu_ops.h (ng_ref_lr, ng_ref_adamw, double).
 * Grad norm: the FlashAttention rule against a naive fp32 loop, identical over two runs, n with
 * a tail (n % 4 != 0). Schedule: lr(step) for warmup, cosine and linear decay, step read from the
 * device; clip scale and grad norm; skipped on a NaN norm or an infinite loss. AdamW: five steps
 * on the split master (kernels/split.h) with lr, clip scale and step taken from the device
 * struct: the joined master and the moments bit for bit those of an fp32-master AdamW
 * (tests/optim_fp32_ref.cu), NMSE <= 1e-7 against the double reference, the bf16 copy the
 * split's high half; a NaN gradient skips the update (bytes unchanged).
 * Step finish: the record in a host-mapped ring, counters.
 */
#include <criterion/criterion.h>

#include "graph/cpu_ops.h"
#include "kernels/optim.h"
#include "kernels/split.h"
#include "tests/kernel_testing.h"

static void norm_case(size_t n)
{
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	float *g = kt_xmalloc(n * 4);
	double ref = 0;
	float naive = 0;
	for (size_t i = 0; i < n; i++) {
		g[i] = (float)(ng_rng_normal(&r) * 1e-2);
		ref += (double)g[i] * g[i];
		naive += g[i] * g[i];
	}
	double naive_d = naive;
	size_t sb = ng_grad_norm_scratch_bytes(n);
	float *d_g = kt_upload(g, n * 4), *d_o = kt_upload(NULL, 4), got[2];
	void *d_s = kt_upload(NULL, sb);
	for (int run = 0; run < 2; run++) {
		kt_ok(ng_grad_norm_squared(d_o, d_g, n, d_s, 0), "ng_grad_norm_squared");
		kt_download(&got[run], d_o, 4);
	}
	double gd = got[0];
	char what[64];
	snprintf(what, sizeof(what), "grad_norm_squared n=%zu", n);
	check_fa_(what, seed, &gd, &naive_d, &ref, 1, 2e-7 * ref);
	cr_expect(fabs(gd - ref) <= 1e-5 * ref, "grad_norm_squared n=%zu: %.9g vs %.9g (rel %.3g > "
		  "1e-5); seed %llu", n, gd, ref, fabs(gd - ref) / ref, (unsigned long long)seed);
	cr_expect(memcmp(&got[0], &got[1], 4) == 0, "grad_norm_squared n=%zu not deterministic", n);
	cudaFree(d_g), cudaFree(d_o), cudaFree(d_s);
	free(g);
}

Test(optim, grad_norm)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	norm_case(3);
	norm_case(10000019);
	norm_case(124475904);
}

/* Runs ng_schedule_update for one state; returns the new state. */
static struct ng_step_state run_schedule(struct ng_step_state st, float norm_sq,
					 struct ng_schedule sc, float clip)
{
	struct ng_step_state *d_st = kt_upload(&st, sizeof(st));
	float *d_n = kt_upload(&norm_sq, 4);
	kt_ok(ng_schedule_update(d_st, d_n, sc, clip, 0), "ng_schedule_update");
	kt_download(&st, d_st, sizeof(st));
	cudaFree(d_st), cudaFree(d_n);
	return st;
}

Test(optim, schedule)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_schedule scs[3] = {{6e-4f, 0.1f, 10, 100, 1}, {1e-3f, 0.0f, 5, 50, 0},
				     {3e-4f, 0.5f, 0, 1, 1}};
	int steps[] = {0, 1, 4, 9, 10, 11, 30, 49, 54, 98, 99, 150};
	for (int k = 0; k < 3; k++)
		for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
			struct ng_schedule sc = scs[k];
			struct ng_step_state st = {0};
			st.step = steps[i];
			st.loss_sum = 3.5f;
			st = run_schedule(st, 4.0f, sc, 1.0f);
			double ref = ng_ref_lr(steps[i], sc.warmup, sc.total, sc.lr_max, sc.final_frac,
					       sc.cosine);
			cr_expect(fabs(st.lr - ref) <= 1e-6 * ref + 1e-12,
				  "schedule %d step %d: lr %.9g, ref %.9g", k, steps[i], st.lr, ref);
			cr_expect(st.step == steps[i], "schedule must not change the step");
			cr_expect(fabsf(st.grad_norm - 2.0f) < 1e-6f && fabsf(st.clip_scale - 0.5f) < 1e-6f &&
				  st.skipped == 0,
				  "norm 2, clip 1: got norm %g clip_scale %g skipped %d", st.grad_norm,
				  st.clip_scale, st.skipped);
		}
	struct ng_step_state st = {0};
	st.loss_sum = 1.0f;
	st = run_schedule(st, 0.25f, scs[0], 1.0f);
	cr_expect(st.clip_scale == 1.0f && st.skipped == 0, "norm 0.5 < clip 1: scale %g",
		  st.clip_scale);
	st = run_schedule(st, 100.0f, scs[0], 0.0f);
	cr_expect(st.clip_scale == 1.0f, "clip 0 means no clipping: scale %g", st.clip_scale);
	st = run_schedule(st, NAN, scs[0], 1.0f);
	cr_expect(st.skipped == 1, "NaN norm must skip");
	st.loss_sum = INFINITY;
	st = run_schedule(st, 1.0f, scs[0], 1.0f);
	cr_expect(st.skipped == 1, "infinite loss must skip");
}

/* The fp32-master AdamW of tests/optim_fp32_ref.cu (the arithmetic before the split). */
cudaError_t kt_adamw_fp32_master(float *p, const float *g, float *m, float *v, size_t n,
				 float wd, float b1, float b2, float eps,
				 const struct ng_step_state *st);

/* First index where two byte arrays of n elements of `el` bytes differ, or n. */
static size_t first_diff(const void *a, const void *b, size_t n, size_t el)
{
	for (size_t i = 0; i < n; i++)
		if (memcmp((const char *)a + i * el, (const char *)b + i * el, el))
			return i;
	return n;
}

/* Five steps of ng_adamw on the split master (hi = bf16 copy, lo = low half) with lr, clip scale
 * and step from the device struct: the joined master is bit for bit the fp32-master AdamW's
 * (and its moments too), within NMSE 1e-7 of the double reference; hi is the split's high half.
 * n = 100003: a tail (n % 4 != 0). */
Test(optim, adamw_steps_from_device_state)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	uint64_t seed = kt_seed();
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t n = 100003;
	float *p = kt_xmalloc(n * 4), *g = kt_xmalloc(n * 4), *m = kt_xmalloc(n * 4),
	      *v = kt_xmalloc(n * 4), *p32 = kt_xmalloc(n * 4), *m32 = kt_xmalloc(n * 4),
	      *v32 = kt_xmalloc(n * 4);
	double *pr = kt_xmalloc(n * 8), *mr = kt_xmalloc(n * 8), *vr = kt_xmalloc(n * 8),
	       *gr = kt_xmalloc(n * 8);
	ng_bf16 *hi = kt_xmalloc(n * 2);
	uint16_t *lo = kt_xmalloc(n * 2);
	for (size_t i = 0; i < n; i++) {
		p[i] = (float)ng_rng_normal(&r);
		if (i % 97 == 0) /* exact ties of the split (lo == 0x8000), both signs */
			p[i] = ng_split_float_((ng_split_bits_(p[i]) & 0xFFFF0000u) | 0x8000u);
		ng_split_encode(p[i], &hi[i], &lo[i]);
		pr[i] = p[i];
		mr[i] = vr[i] = 0.0;
	}
	float *d_p32 = kt_upload(p, n * 4), *d_g = kt_upload(NULL, n * 4);
	float *d_m = kt_upload(NULL, n * 4), *d_v = kt_upload(NULL, n * 4);
	float *d_m32 = kt_upload(NULL, n * 4), *d_v32 = kt_upload(NULL, n * 4);
	ng_bf16 *d_hi = kt_upload(hi, n * 2);
	uint16_t *d_lo = kt_upload(lo, n * 2);
	float *moments[4] = { d_m, d_v, d_m32, d_v32 };
	for (int k = 0; k < 4; k++)
		kt_cuda(cudaMemset(moments[k], 0, n * 4), "memset");
	struct ng_step_state *d_st = kt_upload(NULL, sizeof(struct ng_step_state));
	const float wd = 0.1f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
	for (int step = 0; step < 5; step++) {
		for (size_t i = 0; i < n; i++) {
			g[i] = (float)(ng_rng_normal(&r) * 0.1);
			gr[i] = g[i];
		}
		kt_cuda(cudaMemcpy(d_g, g, n * 4, cudaMemcpyHostToDevice), "H2D");
		struct ng_step_state st = {0};
		st.step = step;
		st.lr = 1e-3f * (float)(step + 1);
		st.clip_scale = step % 2 ? 0.5f : 1.0f;
		kt_cuda(cudaMemcpy(d_st, &st, sizeof(st), cudaMemcpyHostToDevice), "H2D");
		kt_ok(ng_adamw(d_hi, d_lo, d_g, d_m, d_v, n, wd, b1, b2, eps, d_st, 0), "ng_adamw");
		kt_cuda(kt_adamw_fp32_master(d_p32, d_g, d_m32, d_v32, n, wd, b1, b2, eps, d_st),
			"kt_adamw_fp32_master");
		ng_ref_adamw(pr, mr, vr, gr, n, st.lr, b1, b2, eps, wd, st.clip_scale, step + 1);
	}
	kt_download(hi, d_hi, n * 2);
	kt_download(lo, d_lo, n * 2);
	kt_download(m, d_m, n * 4);
	kt_download(v, d_v, n * 4);
	kt_download(p32, d_p32, n * 4);
	kt_download(m32, d_m32, n * 4);
	kt_download(v32, d_v32, n * 4);
	size_t bad_hi = n;
	for (size_t i = 0; i < n; i++) {
		p[i] = ng_split_decode(hi[i], lo[i]);
		ng_bf16 h;
		uint16_t l;
		ng_split_encode(p[i], &h, &l);
		if ((h != hi[i] || l != lo[i]) && bad_hi == n)
			bad_hi = i;
	}
	size_t bp = first_diff(p, p32, n, 4), bm = first_diff(m, m32, n, 4),
	       bv = first_diff(v, v32, n, 4);
	cr_expect(bp == n, "adamw: split master at %zu is %.9g, the fp32-master AdamW %.9g; "
		  "seed %llu", bp, bp < n ? p[bp] : 0.0f, bp < n ? p32[bp] : 0.0f, (unsigned long long)seed);
	cr_expect(bm == n && bv == n, "adamw: moments differ from the fp32-master AdamW at m[%zu] "
		  "v[%zu] (n = %zu); seed %llu", bm, bv, n, (unsigned long long)seed);
	cr_expect(bad_hi == n, "adamw: (hi, lo) at %zu = (%#x, %#x) is not the split of its master; "
		  "seed %llu", bad_hi, bad_hi < n ? hi[bad_hi] : 0u, bad_hi < n ? lo[bad_hi] : 0u,
		  (unsigned long long)seed);
	double *pd = kt_f2d(p, n), *md = kt_f2d(m, n), *vd = kt_f2d(v, n);
	check_nmse_("adamw param after 5 steps", seed, pd, pr, n);
	check_nmse_("adamw m after 5 steps", seed, md, mr, n);
	check_nmse_("adamw v after 5 steps", seed, vd, vr, n);

	/* A NaN in the gradient: norm -> NaN -> skipped -> nothing changes. */
	g[n / 2] = NAN;
	kt_cuda(cudaMemcpy(d_g, g, n * 4, cudaMemcpyHostToDevice), "H2D");
	size_t sb = ng_grad_norm_scratch_bytes(n);
	void *d_s = kt_upload(NULL, sb);
	float *d_nsq = kt_upload(NULL, 4);
	struct ng_step_state st = {0};
	st.step = 5;
	st.loss_sum = 2.0f;
	kt_cuda(cudaMemcpy(d_st, &st, sizeof(st), cudaMemcpyHostToDevice), "H2D");
	struct ng_schedule sc = {1e-3f, 0.1f, 2, 100, 1};
	kt_ok(ng_grad_norm_squared(d_nsq, d_g, n, d_s, 0), "ng_grad_norm_squared");
	kt_ok(ng_schedule_update(d_st, d_nsq, sc, 1.0f, 0), "ng_schedule_update");
	kt_ok(ng_adamw(d_hi, d_lo, d_g, d_m, d_v, n, wd, b1, b2, eps, d_st, 0), "ng_adamw");
	float *m2 = kt_xmalloc(n * 4);
	ng_bf16 *hi2 = kt_xmalloc(n * 2);
	uint16_t *lo2 = kt_xmalloc(n * 2);
	kt_download(hi2, d_hi, n * 2);
	kt_download(lo2, d_lo, n * 2);
	kt_download(m2, d_m, n * 4);
	kt_download(&st, d_st, sizeof(st));
	cr_expect(st.skipped == 1, "a NaN gradient must mark the step skipped");
	cr_expect(memcmp(hi, hi2, n * 2) == 0 && memcmp(lo, lo2, n * 2) == 0 &&
		  memcmp(m, m2, n * 4) == 0, "a skipped step must not change params or moments");
	cudaFree(d_p32), cudaFree(d_g), cudaFree(d_m), cudaFree(d_v), cudaFree(d_m32);
	cudaFree(d_v32), cudaFree(d_hi), cudaFree(d_lo), cudaFree(d_st), cudaFree(d_s);
	cudaFree(d_nsq);
	free(p), free(g), free(m), free(v), free(p32), free(m32), free(v32), free(pr), free(mr);
	free(vr), free(gr), free(hi), free(lo), free(pd), free(md), free(vd), free(m2), free(hi2);
	free(lo2);
}

Test(optim, step_finish_ring)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	struct ng_metrics_record *ring = NULL, *d_ring = NULL;
	kt_cuda(cudaHostAlloc((void **)&ring, 4 * sizeof(*ring), cudaHostAllocMapped), "cudaHostAlloc");
	memset(ring, 0, 4 * sizeof(*ring));
	kt_cuda(cudaHostGetDevicePointer((void **)&d_ring, ring, 0), "cudaHostGetDevicePointer");
	struct ng_step_state st = {0};
	st.step = 6;
	st.lr = 5e-4f;
	st.grad_norm = 1.5f;
	st.loss_sum = 3.25f;
	st.skipped = 1;
	st.n_skipped = 2;
	struct ng_step_state *d_st = kt_upload(&st, sizeof(st));
	kt_ok(ng_step_finish(d_st, d_ring, 4, 0), "ng_step_finish");
	kt_download(&st, d_st, sizeof(st));
	struct ng_metrics_record rec = ring[6 % 4];
	cr_expect(rec.step == 7 && rec.skipped == 1 && rec.loss == 3.25f && rec.grad_norm == 1.5f &&
		  rec.lr == 5e-4f,
		  "record: step %d skipped %d loss %g norm %g lr %g", rec.step, rec.skipped, rec.loss,
		  rec.grad_norm, rec.lr);
	cr_expect(st.step == 7 && st.n_skipped == 3 && st.loss_sum == 0.0f,
		  "state after finish: step %d n_skipped %d loss_sum %g", st.step, st.n_skipped,
		  st.loss_sum);
	cudaFree(d_st);
	cudaFreeHost(ring);
}
