/*
 * kernels/decode.cu — one-token generation kernels (see decode.h): embedding, one-row
 * LayerNorm, warp-per-row GEMV with bias/GELU/relu^2/residual epilogue, attention over the KV
 * cache (causal, or with the speedrun model's document and window bound and scale),
 * and top-k / temperature sampling with a counter-based RNG. Generation is memory-bound (every
 * weight read once per token), so a warp per output row with 16-byte loads is the right shape;
 * cuBLASLt with N=1 would add a plan per shape for no gain.
 * References: Radford et al. 2019 (GPT-2); GELU tanh form as in kernels/elementwise.cu;
 * splitmix64 (Steele, Lea, Flood 2014) as the hash of the counter-based RNG.
 */
#include "kernels/common.cuh"
#include "kernels/decode.h"
#include "kernels/window.h"

#define DECODE_THREADS 256

struct op_max { /* max(a, b), for ng_block_reduce_ */
	__device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

static __global__ void embed_row(float *x, const __nv_bfloat16 *wte, const __nv_bfloat16 *wpe,
				 const int32_t *tokens, const int *pos, int C)
{
	int p = *pos, tok = tokens[p];
	for (int c = threadIdx.x; c < C; c += blockDim.x)
		x[c] = __bfloat162float(wte[(size_t)tok * C + c]) +
		       __bfloat162float(wpe[(size_t)p * C + c]);
}

static __global__ void layernorm_one_row(float *out, const float *x, const __nv_bfloat16 *w,
					 const __nv_bfloat16 *b, int C)
{
	__shared__ float sh[32];
	float s = 0;
	for (int c = threadIdx.x; c < C; c += blockDim.x)
		s += x[c];
	float mean = ng_block_reduce_(s, sh, 0.0f, ng_op_sum_()) / C;
	float v = 0;
	for (int c = threadIdx.x; c < C; c += blockDim.x)
		v += (x[c] - mean) * (x[c] - mean);
	float rstd = rsqrtf(ng_block_reduce_(v, sh, 0.0f, ng_op_sum_()) / C + 1e-5f);
	for (int c = threadIdx.x; c < C; c += blockDim.x)
		out[c] = (x[c] - mean) * rstd * __bfloat162float(w[c]) + __bfloat162float(b[c]);
}

static __device__ __forceinline__ float gelu_tanh(float x)
{
	const float k = 0.7978845608028654f; /* sqrt(2/pi) */
	return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

static __global__ void gemv_warp_per_row(float *out, const __nv_bfloat16 *W,
					 const __nv_bfloat16 *bias, const float *x, int IC, int OC,
					 int act, int accumulate)
{
	int row = blockIdx.x * (blockDim.x / NG_WARP) + threadIdx.x / NG_WARP;
	int lane = threadIdx.x % NG_WARP;
	if (row >= OC)
		return;
	const __nv_bfloat16 *w = W + (size_t)row * IC;
	float acc = 0;
	for (int i = lane * 8; i < IC; i += NG_WARP * 8) {
		float f[8];
		ng_unpack8_(f, ng_load8_stream_(w + i));
		float4 a = *reinterpret_cast<const float4 *>(x + i);
		float4 b = *reinterpret_cast<const float4 *>(x + i + 4);
		acc += f[0] * a.x + f[1] * a.y + f[2] * a.z + f[3] * a.w + f[4] * b.x + f[5] * b.y +
		       f[6] * b.z + f[7] * b.w;
	}
	acc = ng_warp_sum_(acc);
	if (lane == 0) {
		if (bias)
			acc += __bfloat162float(bias[row]);
		if (act == NG_DECODE_ACT_GELU)
			acc = gelu_tanh(acc);
		else if (act == NG_DECODE_ACT_RELU2)
			acc = acc > 0.0f ? acc * acc : 0.0f;
		out[row] = accumulate ? out[row] + acc : acc;
	}
}

/* One block per head; dynamic shared memory: D (q) + span (scores) floats, span the most keys a
 * query sees. The query at p sees keys [lo, p]: lo = 0 for GPT-2; max(*doc_start,
 * ng_attention_window_first(p, window, block)) for the speedrun model (doc_start NULL: 0;
 * window <= 0: no window; kernels/decode.h). scale <= 0 stands for 1 / sqrt(D), computed here
 * in fp32. */
static __global__ void attention_over_cache(float *out, float *kc, float *vc, const float *qkv,
					    const int *pos, const int *doc_start, int window,
					    int block, float scale, int H, int D)
{
	extern __shared__ float smem[];
	__shared__ float sh[32];
	float *q = smem, *sc = smem + D;
	int h = blockIdx.x, C = H * D, p = *pos;
	int lo = doc_start ? *doc_start : 0;
	if (window > 0 && ng_attention_window_first(p, window, block) > lo)
		lo = ng_attention_window_first(p, window, block);
	for (int d = threadIdx.x; d < D; d += blockDim.x) {
		q[d] = qkv[h * D + d];
		kc[(size_t)p * C + h * D + d] = qkv[C + h * D + d];
		vc[(size_t)p * C + h * D + d] = qkv[2 * C + h * D + d];
	}
	__syncthreads();
	float mx = -INFINITY;
	if (scale <= 0.0f)
		scale = rsqrtf((float)D);
	for (int t = lo + threadIdx.x; t <= p; t += blockDim.x) {
		const float *k = kc + (size_t)t * C + h * D;
		float s = 0;
		for (int d = 0; d < D; d++)
			s += q[d] * k[d];
		sc[t - lo] = s * scale;
		mx = fmaxf(mx, sc[t - lo]);
	}
	mx = ng_block_reduce_(mx, sh, -INFINITY, op_max());
	float sum = 0;
	for (int t = lo + threadIdx.x; t <= p; t += blockDim.x) {
		sc[t - lo] = expf(sc[t - lo] - mx);
		sum += sc[t - lo];
	}
	sum = ng_block_reduce_(sum, sh, 0.0f, ng_op_sum_());
	for (int d = threadIdx.x; d < D; d += blockDim.x) {
		float acc = 0;
		for (int t = lo; t <= p; t++)
			acc += sc[t - lo] * vc[(size_t)t * C + h * D + d];
		out[h * D + d] = acc / sum;
	}
}

static __device__ __forceinline__ uint64_t splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* (value, index) order: a before b when a is larger, ties to the lower index. */
static __device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib)
{
	return va > vb || (va == vb && ia < ib);
}

/* One block of 1024 threads. Top-k by k rounds of "largest pair ranking after the previous
 * one" (O(k V / 1024) per token, no sort); the draw by thread 0 over the k kept values. With
 * top_k == 0 the whole vocabulary: contiguous chunks per thread, prefix over chunk sums. */
static __global__ void sample_top_k(int32_t *tokens, int *pos, const int *n_prompt,
				    const float *logits, int V, int top_k, float temperature,
				    uint64_t seed)
{
	__shared__ float kv[NG_DECODE_MAX_TOP_K];
	__shared__ int ki[NG_DECODE_MAX_TOP_K];
	__shared__ float wv[32];
	__shared__ int wi[32];
	__shared__ float part[1024];
	__shared__ int chosen;
	int p = *pos, tid = threadIdx.x, lane = tid % NG_WARP, warp = tid / NG_WARP;
	bool greedy = temperature <= 0.0f;
	int k = greedy ? 1 : (top_k > 0 ? min(top_k, V) : 0);
	float pv = INFINITY;
	int pi = -1;
	for (int r = 0; r < k; r++) { /* the r-th largest (value, index) */
		float bv = -INFINITY;
		int bi = INT32_MAX;
		for (int i = tid; i < V; i += blockDim.x) {
			float v = logits[i];
			if (ranks_before(pv, pi, v, i) && ranks_before(v, i, bv, bi)) {
				bv = v;
				bi = i;
			}
		}
		for (int o = NG_WARP / 2; o > 0; o >>= 1) {
			float ov = __shfl_xor_sync(0xffffffffu, bv, o);
			int oi = __shfl_xor_sync(0xffffffffu, bi, o);
			if (ranks_before(ov, oi, bv, bi)) {
				bv = ov;
				bi = oi;
			}
		}
		if (lane == 0) {
			wv[warp] = bv;
			wi[warp] = bi;
		}
		__syncthreads();
		if (tid == 0) {
			for (int w = 1; w < (int)blockDim.x / NG_WARP; w++)
				if (ranks_before(wv[w], wi[w], bv, bi)) {
					bv = wv[w];
					bi = wi[w];
				}
			kv[r] = bv;
			ki[r] = bi;
		}
		__syncthreads();
		pv = kv[r];
		pi = ki[r];
	}
	uint64_t h = splitmix64(seed ^ splitmix64((uint64_t)p + 1));
	float u = (float)((h >> 40) * (1.0 / 16777216.0)); /* [0, 1) from 24 bits */
	if (k > 0) {
		if (tid == 0) {
			float mx = kv[0], s = 0;
			for (int r = 0; r < k; r++)
				s += expf((kv[r] - mx) / temperature);
			float target = u * s, acc = 0;
			int c = ki[k - 1];
			for (int r = 0; r < k && !greedy; r++) {
				acc += expf((kv[r] - mx) / temperature);
				if (acc > target) {
					c = ki[r];
					break;
				}
			}
			chosen = greedy ? ki[0] : c;
		}
	} else {
		float mx = -INFINITY;
		for (int i = tid; i < V; i += blockDim.x)
			mx = fmaxf(mx, logits[i]);
		mx = ng_block_reduce_(mx, wv, -INFINITY, op_max());
		int chunk = (V + blockDim.x - 1) / blockDim.x, lo = tid * chunk;
		int hi = min(V, lo + chunk);
		float s = 0;
		for (int i = lo; i < hi; i++)
			s += expf((logits[i] - mx) / temperature);
		part[tid] = s;
		__syncthreads();
		if (tid == 0) {
			float tot = 0;
			for (int t = 0; t < (int)blockDim.x; t++)
				tot += part[t];
			float target = u * tot, acc = 0;
			int c = V - 1;
			for (int t = 0; t < (int)blockDim.x; t++) {
				if (acc + part[t] > target && part[t] > 0) {
					int l = t * chunk, e = min(V, l + chunk);
					for (c = l; c < e - 1; c++) {
						acc += expf((logits[c] - mx) / temperature);
						if (acc > target)
							break;
					}
					break;
				}
				acc += part[t];
			}
			chosen = c;
		}
	}
	__syncthreads();
	if (tid == 0) {
		if (p + 1 >= *n_prompt)
			tokens[p + 1] = chosen;
		*pos = p + 1;
	}
}

extern "C" enum ng_status ng_decode_embed(float *x, const ng_bf16 *wte, const ng_bf16 *wpe,
					  const int32_t *tokens, const int *pos, int C,
					  cudaStream_t s)
{
	if (C <= 0)
		return ng_check_arg_fail("ng_decode_embed", "C = %d", C);
	embed_row<<<1, DECODE_THREADS, 0, s>>>(x, (const __nv_bfloat16 *)wte,
					       (const __nv_bfloat16 *)wpe, tokens, pos, C);
	return NG_LAUNCH_CHECK("embed_row");
}

extern "C" enum ng_status ng_decode_layernorm(float *out, const float *x, const ng_bf16 *w,
					      const ng_bf16 *b, int C, cudaStream_t s)
{
	if (C <= 0)
		return ng_check_arg_fail("ng_decode_layernorm", "C = %d", C);
	layernorm_one_row<<<1, DECODE_THREADS, 0, s>>>(out, x, (const __nv_bfloat16 *)w,
						       (const __nv_bfloat16 *)b, C);
	return NG_LAUNCH_CHECK("layernorm_one_row");
}

extern "C" enum ng_status ng_decode_gemv(float *out, const ng_bf16 *W, const ng_bf16 *bias,
					 const float *x, int IC, int OC, int act, int accumulate,
					 cudaStream_t s)
{
	if (IC <= 0 || OC <= 0 || IC % 8 || !ng_aligned16_(W) || !ng_aligned16_(x) ||
	    (const void *)out == (const void *)x || act < NG_DECODE_ACT_NONE ||
	    act > NG_DECODE_ACT_RELU2)
		return ng_check_arg_fail("ng_decode_gemv", "IC = %d (multiple of 8), OC = %d, W %p "
					 "and x %p 16-byte aligned, out %p != x, act %d (0..2)", IC,
					 OC, W, x, out, act);
	int rows = DECODE_THREADS / NG_WARP;
	gemv_warp_per_row<<<(OC + rows - 1) / rows, DECODE_THREADS, 0, s>>>(
		out, (const __nv_bfloat16 *)W, (const __nv_bfloat16 *)bias, x, IC, OC, act,
		accumulate);
	return NG_LAUNCH_CHECK("gemv_warp_per_row");
}

/* The launch of attention_over_cache for both entries; span = the most keys a query sees. */
static enum ng_status attention_launch(const char *who, float *out, float *kcache,
				       float *vcache, const float *qkv, const int *pos,
				       const int *doc_start, int window, int block, float scale,
				       int H, int D, int Tmax, cudaStream_t s)
{
	/* the most keys a window lets a query see: its whole blocks (one at least) */
	int reach = window > 0 && block >= 1 ? (window / block > 0 ? window / block : 1) * block
					     : Tmax;
	int span = reach < Tmax ? reach : Tmax;
	size_t smem = (size_t)(D + span) * sizeof(float);
	if (H <= 0 || D <= 0 || D > 256 || Tmax <= 0 || block < 1 || smem > 48 * 1024)
		return ng_check_arg_fail(who, "H = %d, D = %d (<= 256), Tmax = %d, window %d, block "
					 "%d (>= 1; D + min(the window's whole blocks, Tmax) floats must "
					 "fit 48 KiB of shared memory)", H, D, Tmax, window, block);
	attention_over_cache<<<H, 128, smem, s>>>(out, kcache, vcache, qkv, pos, doc_start, window,
						   block, scale, H, D);
	return NG_LAUNCH_CHECK("attention_over_cache");
}

extern "C" enum ng_status ng_decode_attention(float *out, float *kcache, float *vcache,
					      const float *qkv, const int *pos, int H, int D,
					      int Tmax, cudaStream_t s)
{
	return attention_launch("ng_decode_attention", out, kcache, vcache, qkv, pos, NULL, 0, 1,
				0.0f, H, D, Tmax, s);
}

extern "C" enum ng_status ng_decode_attention_masked(float *out, float *kcache, float *vcache,
						     const float *qkv, const int *pos,
						     const int *doc_start, int window, int block,
						     float scale, int H, int D, int Tmax,
						     cudaStream_t s)
{
	if (!(scale > 0.0f))
		return ng_check_arg_fail("ng_decode_attention_masked", "scale %g must be > 0",
					 (double)scale);
	return attention_launch("ng_decode_attention_masked", out, kcache, vcache, qkv, pos,
				doc_start, window, block, scale, H, D, Tmax, s);
}

extern "C" enum ng_status ng_decode_sample(int32_t *tokens, int *pos, const int *n_prompt,
					   const float *logits, int V, int top_k, float temperature,
					   uint64_t seed, cudaStream_t s)
{
	if (V <= 0 || top_k < 0 || top_k > NG_DECODE_MAX_TOP_K)
		return ng_check_arg_fail("ng_decode_sample", "V = %d, top_k = %d (0..%d)", V, top_k,
					 NG_DECODE_MAX_TOP_K);
	sample_top_k<<<1, 1024, 0, s>>>(tokens, pos, n_prompt, logits, V, top_k, temperature,
					seed);
	return NG_LAUNCH_CHECK("sample_top_k");
}
