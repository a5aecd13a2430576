/*
 * kernels/rmsnorm.cu — the speedrun model's weightless RMSNorm, its QK-norm fused with the
 * half-truncated rotary, and relu^2 (kernels/rmsnorm.h), forward and backward. All of them are
 * memory-bound and make one pass over their operands, in fp32 registers, rounding once.
 *
 * RMSNorm, rmsnorm_fwd_warp_per_row<NCH> / rmsnorm_bwd_warp_per_row<NCH>: one warp per row; lane
 * l owns channels l*8 + 256 j (16-byte loads), j < NCH = ceil(C / 256), so the row lives in
 * registers as packed bf16 and all of its loads are issued before any is used (the memory-level
 * parallelism that lets a warp per row reach HBM bandwidth, as kernels/layernorm.cu). A row is
 * read before it is written, and rows are disjoint, so the forward may run in place. The
 * backward has no weight, so no cross-row reduction either: the warp-per-row form serves every
 * C up to 4096 (the largest classes are register-bound, see the kernel; C = 4096 is not a shape
 * of the model).
 * QK-norm + rotary, qk_norm_rotary_warp_per_row<V, BWD>: one warp per row of qkv (N, 3, H,
 * D), striding over rows. Each head's vector of D channels is split into G = D / (2V) chunks,
 * chunk k holding the V channels kV.. of the first half and the same V of the second half, so
 * the rotary's pairs (i, i + D/2) sit in one lane and need no shuffle; V = 8 (16-byte loads)
 * when D % 16 == 0, else 4 (8-byte loads). A vector takes P = G rounded up to a power of two
 * lanes, so its P lanes are aligned inside one warp pass and its sum is a P-lane butterfly; the
 * q and k vectors of the row (2H of them) run through the warp in passes of 32 / P. The angles
 * depend on the row only: the warp computes the D/4 (cos, sin) of its row once, with one sincosf
 * a lane (D <= 128), into its shared slice, not once per head and per q|k (12x fewer at H = 6);
 * the fp32 frequencies are computed once per block in double and rounded.
 * The backward works from the forward's output o = R y (R the rotation of the pairs). R is
 * orthogonal, so (R^T dout) . y = dout . o over each vector, and the RMSNorm backward of
 * R^T dout, rstd * (R^T dout - y * mean(R^T dout * y)), is rstd * R^T (dout - o * mean(dout *
 * o)): one rotation back per pair, and y is never formed.
 * relu^2, relu2_{fwd,bwd}_vec8: one thread per 8 elements (16-byte loads), a scalar tail. Both
 * are exact in fp32 (the square of a bf16 has 16 significant bits), then rounded once; a NaN
 * input stays NaN (x < 0 ? 0 : x), as torch.relu does.
 *
 * Bandwidth (not measured here: the estimates of one pass at the H200's 4.8 TB/s, the figure the
 * >= 80% aim is against), at the speedrun's N = 49152 rows, C = 768, H = 6, D = 128:
 *   rmsnorm fwd: 75.5 MB read + 75.5 MB written = 151 MB, 31 us (80%: 39 us);
 *   rmsnorm bwd: 151 MB read (226 MB accumulating) + 75.5 MB written, 47 us (63 us);
 *   qk fwd in place: q and k, 151 MB read + 151 MB written, 63 us (v copied: +151 MB, 94 us);
 *   qk bwd: the output's and the gradient's q and k read (302 MB), 151 MB written, 94 us;
 *   relu2 at the MLP's (N, 4C): fwd 604 MB, 126 us; bwd 906 MB, 189 us.
 * Bytes in flight, the other half of reaching that bandwidth (Little's law: ~4.8 TB/s x ~700 ns
 * of latency is ~3.4 MB, ~26 KB per SM): a row of the RMSNorm forward is 1.5 KB of loads
 * issued at once, 64 resident warps an SM (4-warp blocks, few registers at NCH 3) put ~96 KB in
 * flight; a QK pass is 32 bytes a lane, 64 KB an SM.
 * References: Zhang & Sennrich 2019 "Root Mean Square Layer Normalization"; Su et al. 2021
 * "RoFormer" (rotary embeddings); So et al. 2021 "Primer" (squared ReLU); CUDA C++ Programming
 * Guide, "Mathematical Functions" (sincosf: 2 ulp maximum error over the full range, without
 * -use_fast_math; rsqrtf: 2 ulp).
 */
#include "kernels/common.cuh"

#include "kernels/rmsnorm.h"

#define RMS_MAX_C 4096 /* rows live in registers: 16 chunks of 8 per lane at most */
#define RMS_WARPS 4    /* warps (rows) per block */
#define QK_WARPS 4     /* QK-norm + rotary: warps (rows at a time) per block */
#define QK_MAX_D 256
#define QK_MAX_BLOCKS 4096 /* the QK grid's cap: the warps stride over the rows beyond it, so the
			    * frequencies a block computes serve several rows */
#define EW_THREADS 256 /* relu^2: threads per block */

/* ---------------------------------------------------------------- RMSNorm */

template <int NCH>
static __global__ void __launch_bounds__(RMS_WARPS *NG_WARP)
rmsnorm_fwd_warp_per_row(__nv_bfloat16 *out, float *rstd, const __nv_bfloat16 *inp, int N, int C,
			 float eps)
{
	int warp = threadIdx.x / NG_WARP, lane = threadIdx.x % NG_WARP;
	long long row = (long long)blockIdx.x * RMS_WARPS + warp;
	if (row >= N)
		return;
	size_t off = (size_t)row * C;
	struct ng_bf16x8 ra[NCH];
	ng_load_row8_<NCH>(ra, inp + off, C, lane);
	float ss = 0.0f;
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		if (lane * 8 + j * NG_WARP * 8 >= C)
			continue;
		float x[8];
		ng_unpack8_(x, ra[j]);
#pragma unroll
		for (int k = 0; k < 8; k++)
			ss = fmaf(x[k], x[k], ss);
	}
	float rs = rsqrtf(ng_warp_sum_(ss) / (float)C + eps);
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		int c = lane * 8 + j * NG_WARP * 8;
		if (c >= C)
			continue;
		float x[8];
		ng_unpack8_(x, ra[j]);
#pragma unroll
		for (int k = 0; k < 8; k++)
			x[k] *= rs;
		ng_store8_(out + off + c, ng_pack8_(x));
	}
	if (lane == 0 && rstd)
		rstd[row] = rs;
}

/* dinp (=, or += when accumulate) rs * (d - y * m), y = x * rs, m = mean(d * y) = rs mean(d * x).
 * The rows' loads (the old dinp's too when accumulating, PRE) are issued before any is used;
 * above NCH 8 the old dinp is loaded where it is added instead (ptxas at NCH 16, sm_90a: three
 * rows in registers spilled 28 bytes at the 255-register limit, two spill 2). */
template <int NCH>
static __global__ void __launch_bounds__(RMS_WARPS *NG_WARP)
rmsnorm_bwd_warp_per_row(__nv_bfloat16 *dinp, const __nv_bfloat16 *dout,
			 const __nv_bfloat16 *inp, const float *rstd, int N, int C, int accumulate)
{
	int warp = threadIdx.x / NG_WARP, lane = threadIdx.x % NG_WARP;
	long long row = (long long)blockIdx.x * RMS_WARPS + warp;
	if (row >= N)
		return;
	size_t off = (size_t)row * C;
	constexpr bool PRE = NCH <= 8;
	struct ng_bf16x8 rd[NCH], rx[NCH], rg[PRE ? NCH : 1];
	ng_load_row8_<NCH>(rd, dout + off, C, lane);
	ng_load_row8_<NCH>(rx, inp + off, C, lane);
	if (PRE && accumulate)
		ng_load_row8_<PRE ? NCH : 1>(rg, dinp + off, C, lane);
	float rs = rstd[row];
	float s = 0.0f;
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		if (lane * 8 + j * NG_WARP * 8 >= C)
			continue;
		float d[8], x[8];
		ng_unpack8_(d, rd[j]);
		ng_unpack8_(x, rx[j]);
#pragma unroll
		for (int k = 0; k < 8; k++)
			s = fmaf(d[k], x[k], s);
	}
	float m = ng_warp_sum_(s) / (float)C * rs;
#pragma unroll
	for (int j = 0; j < NCH; j++) {
		int c = lane * 8 + j * NG_WARP * 8;
		if (c >= C)
			continue;
		float d[8], x[8], g[8];
		ng_unpack8_(d, rd[j]);
		ng_unpack8_(x, rx[j]);
		if (accumulate)
			ng_unpack8_(g, PRE ? rg[PRE ? j : 0] : ng_load8_stream_(dinp + off + c));
		else
#pragma unroll
			for (int k = 0; k < 8; k++)
				g[k] = 0.0f;
#pragma unroll
		for (int k = 0; k < 8; k++)
			g[k] += fmaf(-x[k] * rs, m, d[k]) * rs;
		ng_store8_(dinp + off + c, ng_pack8_(g));
	}
}

static int nch_of(int C) { return (C + NG_WARP * 8 - 1) / (NG_WARP * 8); }

/* The arguments of both directions, so the NCH dispatch is written once. */
struct rms_args {
	__nv_bfloat16 *out;        /* forward: (N, C) output; backward: dinp */
	float *rstd;               /* forward: (N) statistics out, or NULL */
	const __nv_bfloat16 *inp;  /* (N, C), the forward's input */
	const __nv_bfloat16 *dout; /* backward: (N, C) */
	const float *crstd;        /* backward: (N), the forward's statistics */
	int N, C, accumulate;
	float eps;
};

/* BWD 0: forward, 1: backward. */
template <int NCH, int BWD>
static enum ng_status rms_launch_nch(const struct rms_args *x, cudaStream_t s)
{
	unsigned grid = (unsigned)(((long long)x->N + RMS_WARPS - 1) / RMS_WARPS);
	if (BWD) {
		rmsnorm_bwd_warp_per_row<NCH><<<grid, RMS_WARPS * NG_WARP, 0, s>>>(
			x->out, x->dout, x->inp, x->crstd, x->N, x->C, x->accumulate);
		return NG_LAUNCH_CHECK("rmsnorm_bwd_warp_per_row");
	}
	rmsnorm_fwd_warp_per_row<NCH><<<grid, RMS_WARPS * NG_WARP, 0, s>>>(x->out, x->rstd, x->inp,
									   x->N, x->C, x->eps);
	return NG_LAUNCH_CHECK("rmsnorm_fwd_warp_per_row");
}

/* The launch at the smallest instantiated NCH >= C / 256 (C <= RMS_MAX_C, checked by the
 * caller). */
template <int BWD> struct rms_launcher {
	const struct rms_args *x;
	cudaStream_t s;
	template <int NCH> enum ng_status run() const { return rms_launch_nch<NCH, BWD>(x, s); }
};
template <int BWD> static enum ng_status rms_launch(const struct rms_args *x, cudaStream_t s)
{
	return ng_nch_dispatch_(nch_of(x->C), rms_launcher<BWD>{x, s});
}

static enum ng_status rms_check(const char *who, int N, int C, const void *p0, const void *p1,
				const void *p2)
{
	if (N <= 0 || C <= 0 || C % 8 != 0 || C > RMS_MAX_C)
		return ng_check_arg_fail(who, "need N > 0, 0 < C <= %d and C %% 8 == 0, got N=%d C=%d",
					 RMS_MAX_C, N, C);
	const void *ps[3] = {p0, p1, p2};
	for (int i = 0; i < 3; i++)
		if (!ng_aligned16_(ps[i]))
			return ng_check_arg_fail(who, "bf16 pointer %d (%p) is not 16-byte aligned", i,
						 ps[i]);
	return NG_OK;
}

extern "C" enum ng_status ng_rmsnorm_fwd(ng_bf16 *out, float *rstd, const ng_bf16 *inp, int N,
					 int C, float eps, cudaStream_t s)
{
	enum ng_status st = rms_check("ng_rmsnorm_fwd", N, C, out, inp, inp);
	if (st)
		return st;
	if (!(eps >= 0.0f))
		return ng_check_arg_fail("ng_rmsnorm_fwd", "eps must be >= 0, got %g", (double)eps);
	struct rms_args x = {};
	x.out = (__nv_bfloat16 *)out;
	x.rstd = rstd;
	x.inp = (const __nv_bfloat16 *)inp;
	x.N = N;
	x.C = C;
	x.eps = eps;
	return rms_launch<0>(&x, s);
}

extern "C" enum ng_status ng_rmsnorm_bwd(ng_bf16 *dinp, const ng_bf16 *dout, const ng_bf16 *inp,
					 const float *rstd, int N, int C, int accumulate,
					 cudaStream_t s)
{
	enum ng_status st = rms_check("ng_rmsnorm_bwd", N, C, dinp, dout, inp);
	if (st)
		return st;
	if (!rstd)
		return ng_check_arg_fail("ng_rmsnorm_bwd", "the forward's rstd is NULL");
	if (accumulate && (const void *)dinp == (const void *)dout)
		return ng_check_arg_fail("ng_rmsnorm_bwd", "dinp (%p) may equal dout only when not "
					 "accumulating", (void *)dinp);
	struct rms_args x = {};
	x.out = (__nv_bfloat16 *)dinp;
	x.inp = (const __nv_bfloat16 *)inp;
	x.dout = (const __nv_bfloat16 *)dout;
	x.crstd = rstd;
	x.N = N;
	x.C = C;
	x.accumulate = accumulate != 0;
	return rms_launch<1>(&x, s);
}

/* ---------------------------------------------------------------- QK-norm + rotary */

/* The V bf16 of a half-chunk as one load: 16 bytes (V = 8) or 8 (V = 4). */
template <int V> struct qk_bits;
template <> struct qk_bits<8> {
	typedef int4 t;
};
template <> struct qk_bits<4> {
	typedef uint2 t;
};

template <int V>
static __device__ __forceinline__ void qk_load_(float f[V], const __nv_bfloat16 *p)
{
	typedef typename qk_bits<V>::t B;
	B u = __ldcs(reinterpret_cast<const B *>(p));
	const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
	for (int i = 0; i < V / 2; i++) {
		float2 t = __bfloat1622float2(h[i]);
		f[2 * i] = t.x;
		f[2 * i + 1] = t.y;
	}
}

template <int V>
static __device__ __forceinline__ void qk_store_(__nv_bfloat16 *p, const float f[V])
{
	typedef typename qk_bits<V>::t B;
	B u;
	__nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
	for (int i = 0; i < V / 2; i++)
		h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
	*reinterpret_cast<B *>(p) = u;
}

/* Lanes a head's vector takes: G = D / (2V) chunks rounded up to a power of two (<= 32). */
static __host__ __device__ __forceinline__ int qk_lanes(int D, int V)
{
	int g = D / (2 * V), p = 1;
	while (p < g)
		p *= 2;
	return p;
}

/* The sum over the P aligned lanes of a vector (P a power of two; every lane of the warp calls
 * it, so the shuffles are convergent). */
static __device__ __forceinline__ float qk_group_sum_(float x, int P)
{
	for (int o = P / 2; o > 0; o >>= 1)
		x += __shfl_xor_sync(0xffffffffu, x, o);
	return x;
}

/* The block's fp32 frequencies, freq[i] = (1/1024)^(i / (D/4 - 1)) (1 for D/4 == 1) computed in
 * double and rounded once (ng_ref_rotary_freqs's values in fp32). Every thread must call it. */
static __device__ __forceinline__ void qk_freqs_(float *freq, int q)
{
	int i = threadIdx.x;
	if (i < q)
		freq[i] = q == 1 ? 1.0f : (float)exp2(-10.0 * i / (q - 1));
	__syncthreads();
}

/* The warp's (cos, sin) of its row's D/4 rotated pairs: theta = pos * freq[i], one fp32
 * product, then the precise sincosf. cs is the warp's slice; the caller __syncwarp()s before
 * reading it and again before the next row rewrites it. */
static __device__ __forceinline__ void qk_angles_(float2 *cs, const float *freq, float pos, int q,
						  int lane)
{
	for (int i = lane; i < q; i += NG_WARP) {
		float sn, cn;
		sincosf(__fmul_rn(pos, freq[i]), &sn, &cn);
		cs[i] = make_float2(cn, sn);
	}
}

/* Both directions, one warp per row (BWD 0: the forward, 1: the backward):
 *   forward:  src = qkv, dst = out; rs = rsqrtf(mean(x^2) + eps); dst = R (x rs);
 *   backward: src = the forward's output o, dst = dqkv (d in, dx out, in place); rs = the
 *             forward's; m = mean(d . o); dst = rs R^T (d - o m).
 * R rotates pair i < D/4 by theta_i: (u1, u2) -> (u1 c + u2 s, -u1 s + u2 c); R^T by -theta_i.
 * Each lane reads its chunk before the vector's reduction and writes the same chunk after it,
 * so both run in place. */
template <int V, int BWD>
static __global__ void __launch_bounds__(QK_WARPS *NG_WARP)
qk_norm_rotary_warp_per_row(__nv_bfloat16 *dst, float *rstd_out, const __nv_bfloat16 *src,
			    const float *rstd_in, int N, int T, int H, int D, float eps)
{
	__shared__ float freq[QK_MAX_D / 4];
	__shared__ float2 cs_all[QK_WARPS][QK_MAX_D / 4];
	int warp = threadIdx.x / NG_WARP, lane = threadIdx.x % NG_WARP;
	int q = D / 4, half = D / 2, G = half / V, P = qk_lanes(D, V), slots = 2 * H * P;
	qk_freqs_(freq, q);
	float2 *cs = cs_all[warp];
	size_t HD = (size_t)H * D;
	bool copy_v = !BWD && dst != src;
	for (long long row = (long long)blockIdx.x * QK_WARPS + warp; row < N;
	     row += (long long)gridDim.x * QK_WARPS) {
		size_t off = (size_t)row * 3 * HD;
		qk_angles_(cs, freq, (float)(row % T), q, lane);
		__syncwarp();
		for (int s0 = 0; s0 < slots; s0 += NG_WARP) {
			int sl = s0 + lane, vec = sl / P, k = sl % P; /* vec = part * H + head */
			bool on = vec < 2 * H && k < G;
			size_t e = off + (size_t)vec * D + k * V;
			float a1[V], a2[V], d1[V], d2[V], acc = 0.0f, rs = 0.0f;
			if (on) {
				qk_load_<V>(a1, src + e);
				qk_load_<V>(a2, src + e + half);
				if (BWD) {
					qk_load_<V>(d1, dst + e);
					qk_load_<V>(d2, dst + e + half);
					rs = rstd_in[(size_t)row * 2 * H + vec];
				} else {
#pragma unroll
					for (int j = 0; j < V; j++)
						d1[j] = a1[j], d2[j] = a2[j];
				}
#pragma unroll
				for (int j = 0; j < V; j++) /* fwd: sum x^2; bwd: sum d . o */
					acc = fmaf(d2[j], a2[j], fmaf(d1[j], a1[j], acc));
			}
			float mean = qk_group_sum_(acc, P) / (float)D;
			if (!on)
				continue;
			float m = 0.0f;
			if (BWD)
				m = mean;
			else
				rs = rsqrtf(mean + eps);
#pragma unroll
			for (int j = 0; j < V; j++) {
				/* (u1, u2): the forward's normalised pair, the backward's d - o m */
				float u1 = BWD ? fmaf(-a1[j], m, d1[j]) : a1[j] * rs;
				float u2 = BWD ? fmaf(-a2[j], m, d2[j]) : a2[j] * rs;
				int i = k * V + j;
				if (i < q) {
					float c = cs[i].x, sn = BWD ? -cs[i].y : cs[i].y;
					float r1 = fmaf(u1, c, u2 * sn), r2 = fmaf(u2, c, -u1 * sn);
					u1 = r1, u2 = r2;
				}
				a1[j] = BWD ? u1 * rs : u1;
				a2[j] = BWD ? u2 * rs : u2;
			}
			qk_store_<V>(dst + e, a1);
			qk_store_<V>(dst + e + half, a2);
			if (!BWD && k == 0 && rstd_out)
				rstd_out[(size_t)row * 2 * H + vec] = rs;
		}
		if (copy_v) /* D % 8 == 0: the v part is whole 16-byte chunks */
			for (size_t c = (size_t)lane * 8; c < HD; c += NG_WARP * 8)
				ng_store8_(dst + off + 2 * HD + c, ng_load8_stream_(src + off + 2 * HD + c));
		__syncwarp();
	}
}

static enum ng_status qk_check(const char *who, int N, int T, int H, int D, const void *p0,
			       const void *p1)
{
	if (N <= 0 || T <= 0 || H <= 0 || H > 65536)
		return ng_check_arg_fail(who, "need N > 0, T > 0 and 0 < H <= 65536, got N=%d T=%d "
					 "H=%d", N, T, H);
	if (D < 8 || D > QK_MAX_D || D % 8 != 0)
		return ng_check_arg_fail(who, "head size D=%d must be a multiple of 8 in 8..%d", D,
					 QK_MAX_D);
	if (!ng_aligned16_(p0) || !ng_aligned16_(p1))
		return ng_check_arg_fail(who, "bf16 pointers must be 16-byte aligned (%p %p)", p0, p1);
	return NG_OK;
}

static unsigned qk_grid(int N)
{
	long long nb = ((long long)N + QK_WARPS - 1) / QK_WARPS;
	return (unsigned)(nb < QK_MAX_BLOCKS ? nb : QK_MAX_BLOCKS);
}

/* V = 8 (16-byte halves) when D % 16 == 0, else 4. */
template <int BWD>
static enum ng_status qk_launch(__nv_bfloat16 *dst, float *rstd_out, const __nv_bfloat16 *src,
				const float *rstd_in, int N, int T, int H, int D, float eps,
				cudaStream_t s)
{
	if (D % 16 == 0)
		qk_norm_rotary_warp_per_row<8, BWD><<<qk_grid(N), QK_WARPS * NG_WARP, 0, s>>>(
			dst, rstd_out, src, rstd_in, N, T, H, D, eps);
	else
		qk_norm_rotary_warp_per_row<4, BWD><<<qk_grid(N), QK_WARPS * NG_WARP, 0, s>>>(
			dst, rstd_out, src, rstd_in, N, T, H, D, eps);
	return NG_LAUNCH_CHECK(BWD ? "qk_norm_rotary_warp_per_row (bwd)"
				   : "qk_norm_rotary_warp_per_row (fwd)");
}

extern "C" enum ng_status ng_qk_norm_rotary_fwd(ng_bf16 *out, float *rstd, const ng_bf16 *qkv,
						int N, int T, int H, int D, float eps,
						cudaStream_t s)
{
	enum ng_status st = qk_check("ng_qk_norm_rotary_fwd", N, T, H, D, out, qkv);
	if (st)
		return st;
	if (!(eps >= 0.0f))
		return ng_check_arg_fail("ng_qk_norm_rotary_fwd", "eps must be >= 0, got %g",
					 (double)eps);
	return qk_launch<0>((__nv_bfloat16 *)out, rstd, (const __nv_bfloat16 *)qkv, NULL, N, T, H,
			    D, eps, s);
}

extern "C" enum ng_status ng_qk_norm_rotary_bwd(ng_bf16 *dqkv, const ng_bf16 *qkv_out,
						const float *rstd, int N, int T, int H, int D,
						cudaStream_t s)
{
	enum ng_status st = qk_check("ng_qk_norm_rotary_bwd", N, T, H, D, dqkv, qkv_out);
	if (st)
		return st;
	if (!rstd)
		return ng_check_arg_fail("ng_qk_norm_rotary_bwd", "the forward's rstd is NULL");
	return qk_launch<1>((__nv_bfloat16 *)dqkv, NULL, (const __nv_bfloat16 *)qkv_out, rstd, N, T,
			    H, D, 0.0f, s);
}

/* ---------------------------------------------------------------- relu^2 */

static __device__ __forceinline__ float relu_f(float x) { return x < 0.0f ? 0.0f : x; }

struct relu2_op { /* max(x, 0)^2 */
	__device__ float operator()(float x) const { return relu_f(x) * relu_f(x); }
};
struct relu2_grad_op { /* 2 max(x, 0) d */
	__device__ float operator()(float x, float d) const { return 2.0f * relu_f(x) * d; }
};

struct relu2_grad_out_op { /* 2 sqrt(y) d, y = max(x, 0)^2 */
	__device__ float operator()(float y, float d) const { return 2.0f * sqrtf(y) * d; }
};

static __global__ void relu2_bwd_out_vec8(__nv_bfloat16 *dinp, const __nv_bfloat16 *out,
					  const __nv_bfloat16 *dout, size_t n)
{
	ng_map2_vec8_(dinp, out, dout, n, relu2_grad_out_op());
}

static __global__ void relu2_fwd_vec8(__nv_bfloat16 *out, const __nv_bfloat16 *inp, size_t n)
{
	ng_map1_vec8_(out, inp, n, relu2_op());
}

static __global__ void relu2_bwd_vec8(__nv_bfloat16 *dinp, const __nv_bfloat16 *inp,
				      const __nv_bfloat16 *dout, size_t n)
{
	ng_map2_vec8_(dinp, inp, dout, n, relu2_grad_op());
}

extern "C" enum ng_status ng_relu2_fwd(ng_bf16 *out, const ng_bf16 *inp, size_t n, cudaStream_t s)
{
	enum ng_status st = ng_check_vec8_("ng_relu2_fwd", n, EW_THREADS, out, inp, inp);
	if (st)
		return st;
	relu2_fwd_vec8<<<ng_vec8_grid_(n, EW_THREADS), EW_THREADS, 0, s>>>((__nv_bfloat16 *)out,
							   (const __nv_bfloat16 *)inp, n);
	return NG_LAUNCH_CHECK("relu2_fwd_vec8");
}

extern "C" enum ng_status ng_relu2_bwd(ng_bf16 *dinp, const ng_bf16 *inp, const ng_bf16 *dout,
				       size_t n, cudaStream_t s)
{
	enum ng_status st = ng_check_vec8_("ng_relu2_bwd", n, EW_THREADS, dinp, inp, dout);
	if (st)
		return st;
	relu2_bwd_vec8<<<ng_vec8_grid_(n, EW_THREADS), EW_THREADS, 0, s>>>((__nv_bfloat16 *)dinp,
							   (const __nv_bfloat16 *)inp,
							   (const __nv_bfloat16 *)dout, n);
	return NG_LAUNCH_CHECK("relu2_bwd_vec8");
}

extern "C" enum ng_status ng_relu2_bwd_from_out(ng_bf16 *dinp, const ng_bf16 *out,
						const ng_bf16 *dout, size_t n, cudaStream_t s)
{
	enum ng_status st = ng_check_vec8_("ng_relu2_bwd_from_out", n, EW_THREADS, dinp, out, dout);
	if (st)
		return st;
	relu2_bwd_out_vec8<<<ng_vec8_grid_(n, EW_THREADS), EW_THREADS, 0, s>>>(
		(__nv_bfloat16 *)dinp, (const __nv_bfloat16 *)out, (const __nv_bfloat16 *)dout, n);
	return NG_LAUNCH_CHECK("relu2_bwd_out_vec8");
}
