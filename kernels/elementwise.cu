/*
 * kernels/elementwise.cu — GELU forward/backward, bias gradient, casts, transpose, token split.
 *
 * All memory-bound: one thread per 8 elements (16-byte bf16 loads), a scalar tail for n % 8.
 * GELU uses the tanh approximation of GPT-2 (Hendrycks & Gimpel 2016), in fp32, written with
 * sigmoids so that small outputs and gradients keep their relative precision.
 * Bias gradient, bias_grad_row_chunks: blocks of 32 x 8 threads cover 256 columns x one chunk of
 * BG_ROWS rows; per-chunk sums go to scratch in a fixed order and bias_grad_reduce_chunks adds
 * them to dbias in chunk order (deterministic, no atomics). The GELU backward with the bias
 * gradient (and the recomputed GELU) uses the same blocks and reduce.
 */
#include "kernels/common.cuh"

#include "kernels/elementwise.h"

#define EW_THREADS 256
#define BG_ROWS 256 /* rows per bias-grad chunk */
struct gelu_op { /* GELU(x) */
	__device__ float operator()(float x) const { return ng_gelu_f(x); }
};
struct gelu_grad_op { /* GELU'(x) d */
	__device__ float operator()(float x, float d) const { return d * ng_gelu_grad_f(x); }
};

static __global__ void gelu_fwd_vec8(__nv_bfloat16 *out, const __nv_bfloat16 *inp, size_t n)
{
	ng_map1_vec8_(out, inp, n, gelu_op());
}

/* Transpose (a batch: blockIdx.z) in 64 x 64 tiles through shared memory (rows padded by 4
 * bytes: at most 2-way bank conflicts), 32 x 8 threads a block; with PAIRS (R and C even) each
 * thread moves bf16 pairs, 4-byte accesses along rows both ways, else single elements. */
#define TP_TILE 64
template <int PAIRS>
static __global__ void transpose_bf16(__nv_bfloat16 *out, const __nv_bfloat16 *in, int R, int C)
{
	__shared__ __nv_bfloat16 tile[TP_TILE][TP_TILE + 2];
	const int c0 = blockIdx.x * TP_TILE, r0 = blockIdx.y * TP_TILE, x = threadIdx.x;
	in += (size_t)blockIdx.z * R * C; /* matrix blockIdx.z of the batch */
	out += (size_t)blockIdx.z * R * C;
	for (int k = threadIdx.y; k < TP_TILE; k += 8) {
		const int r = r0 + k, c = c0 + 2 * x;
		if (r >= R)
			break;
		if (PAIRS && c < C) {
			*reinterpret_cast<__nv_bfloat162 *>(&tile[k][2 * x]) =
				*reinterpret_cast<const __nv_bfloat162 *>(in + (size_t)r * C + c);
		} else if (!PAIRS) {
			if (c < C)
				tile[k][2 * x] = in[(size_t)r * C + c];
			if (c + 1 < C)
				tile[k][2 * x + 1] = in[(size_t)r * C + c + 1];
		}
	}
	__syncthreads();
	for (int k = threadIdx.y; k < TP_TILE; k += 8) {
		const int c = c0 + k, r = r0 + 2 * x; /* out's row c, columns r, r + 1 */
		if (c >= C)
			break;
		if (PAIRS && r < R) {
			__nv_bfloat162 v;
			v.x = tile[2 * x][k];
			v.y = tile[2 * x + 1][k];
			*reinterpret_cast<__nv_bfloat162 *>(out + (size_t)c * R + r) = v;
		} else if (!PAIRS) {
			if (r < R)
				out[(size_t)c * R + r] = tile[2 * x][k];
			if (r + 1 < R)
				out[(size_t)c * R + r + 1] = tile[2 * x + 1][k];
		}
	}
}

static __global__ void gelu_bwd_vec8(__nv_bfloat16 *dinp, const __nv_bfloat16 *inp,
				     const __nv_bfloat16 *dout, size_t n)
{
	ng_map2_vec8_(dinp, inp, dout, n, gelu_grad_op());
}

/* The end of a row-chunk block (32 x 8 threads, 256 columns): the 8 row groups' sums of each
 * column added in a fixed order and written as this chunk's partial row (part[blockIdx.y]). */
static __device__ __forceinline__ void column_partials(const float acc[8], float *part, int OC)
{
	__shared__ float sh[8][256 + 1];
#pragma unroll
	for (int k = 0; k < 8; k++)
		sh[threadIdx.y][threadIdx.x * 8 + k] = acc[k];
	__syncthreads();
	int t = threadIdx.y * 32 + threadIdx.x; /* 0..255: one column each */
	if (blockIdx.x * 256 + t < OC) {
		float s = 0.0f;
		for (int y = 0; y < 8; y++)
			s += sh[y][t];
		part[(size_t)blockIdx.y * OC + blockIdx.x * 256 + t] = s;
	}
}

static __global__ void bias_grad_row_chunks(float *part, const __nv_bfloat16 *dout, int N, int OC)
{
	int col = blockIdx.x * 256 + threadIdx.x * 8;
	int r0 = blockIdx.y * BG_ROWS, r1 = min(r0 + BG_ROWS, N);
	float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
	if (col < OC)
		for (int r = r0 + threadIdx.y; r < r1; r += 8) {
			float d[8];
			ng_unpack8_(d, ng_load8_stream_(dout + (size_t)r * OC + col));
#pragma unroll
			for (int k = 0; k < 8; k++)
				acc[k] += d[k];
		}
	column_partials(acc, part, OC);
}

static __global__ void bias_grad_reduce_chunks(float *dbias, const float *part, int nchunks,
					       int OC, int accumulate)
{
	int c = blockIdx.x * blockDim.x + threadIdx.x;
	if (c >= OC)
		return;
	float s = 0.0f;
	for (int k = 0; k < nchunks; k++)
		s += part[(size_t)k * OC + c];
	dbias[c] = accumulate ? dbias[c] + s : s;
}

/* ng_bias_grad_reduce: blocks of 32 columns x 8 row strides; thread (x, y) sums rows y, y + 8,
 * ... of its column, then row y = 0 adds the 8 in order (deterministic). Many rows (one a GEMM
 * warp: ~1000 at d24) want more than bias_grad_reduce_chunks' one thread a column. */
static __global__ void bias_grad_reduce_rows(float *dbias, const float *part, int rows, int OC,
					     int accumulate)
{
	__shared__ float sh[8][32];
	const int c = blockIdx.x * 32 + threadIdx.x;
	float acc = 0.0f;
	if (c < OC)
		for (int r = threadIdx.y; r < rows; r += 8)
			acc += part[(size_t)r * OC + c];
	sh[threadIdx.y][threadIdx.x] = acc;
	__syncthreads();
	if (threadIdx.y == 0 && c < OC) {
		float t = 0.0f;
		for (int y = 0; y < 8; y++)
			t += sh[y][threadIdx.x];
		dbias[c] = accumulate ? dbias[c] + t : t;
	}
}

#define GB_UNROLL 4 /* rows a thread loads before it computes: 8 16-byte loads in flight */

/* ng_gelu_bwd_bias, pass 1: the blocks of bias_grad_row_chunks (32 x 8 threads, 256 columns x
 * BG_ROWS rows); each thread loads GB_UNROLL of its rows (r, r + 8, ...) at once, then computes
 * their 8 columns, stores them, and adds the stored (bf16) gradient to its column sums in row
 * order. In place (dinp == dout) is safe: a thread reads and writes only its own elements. */
static __global__ void gelu_bwd_bias_row_chunks(__nv_bfloat16 *dinp, __nv_bfloat16 *gelu_out,
						float *part, const __nv_bfloat16 *inp,
						const __nv_bfloat16 *dout, int N, int OC)
{
	int col = blockIdx.x * 256 + threadIdx.x * 8;
	int r0 = blockIdx.y * BG_ROWS, r1 = min(r0 + BG_ROWS, N);
	float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
	if (col < OC)
		for (int r = r0 + threadIdx.y; r < r1; r += 8 * GB_UNROLL) {
			struct ng_bf16x8 xv[GB_UNROLL], dv[GB_UNROLL];
#pragma unroll
			for (int u = 0; u < GB_UNROLL; u++)
				if (r + 8 * u < r1) {
					size_t at = (size_t)(r + 8 * u) * OC + col;
					xv[u] = ng_load8_stream_(inp + at);
					dv[u] = ng_load8_stream_(dout + at);
				}
#pragma unroll
			for (int u = 0; u < GB_UNROLL; u++) {
				if (r + 8 * u >= r1)
					break;
				size_t at = (size_t)(r + 8 * u) * OC + col;
				float x[8], d[8];
				ng_unpack8_(x, xv[u]);
				ng_unpack8_(d, dv[u]);
#pragma unroll
				for (int k = 0; k < 8; k++)
					d[k] *= ng_gelu_grad_value_f(x[k], &x[k]);
				struct ng_bf16x8 packed = ng_pack8_(d);
				ng_store8_(dinp + at, packed);
				ng_unpack8_(d, packed); /* the sums are of what was stored */
#pragma unroll
				for (int k = 0; k < 8; k++)
					acc[k] += d[k];
				if (gelu_out)
					ng_store8_(gelu_out + at, ng_pack8_(x));
			}
		}
	column_partials(acc, part, OC);
}

static __global__ void cast_f32_to_bf16_vec8(__nv_bfloat16 *out, const float *in, size_t n)
{
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
	if (i + 8 <= n) {
		float4 a = __ldcs(reinterpret_cast<const float4 *>(in + i));
		float4 b = __ldcs(reinterpret_cast<const float4 *>(in + i + 4));
		float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
		ng_store8_(out + i, ng_pack8_(f));
	} else {
		for (; i < n; i++)
			out[i] = __float2bfloat16_rn(in[i]);
	}
}

static __global__ void cast_bf16_to_f32_vec8(float *out, const __nv_bfloat16 *in, size_t n)
{
	size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
	if (i + 8 <= n) {
		float f[8];
		ng_unpack8_(f, ng_load8_stream_(in + i));
		reinterpret_cast<float4 *>(out + i)[0] = make_float4(f[0], f[1], f[2], f[3]);
		reinterpret_cast<float4 *>(out + i)[1] = make_float4(f[4], f[5], f[6], f[7]);
	} else {
		for (; i < n; i++)
			out[i] = __bfloat162float(in[i]);
	}
}

static __global__ void tokens_split_shift(int32_t *inputs, int32_t *targets,
					  const uint16_t *windows, int B, int T)
{
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= (size_t)B * T)
		return;
	size_t b = i / T, t = i % T;
	const uint16_t *w = windows + b * (T + 1) + t;
	inputs[i] = w[0];
	targets[i] = w[1];
}

static unsigned grid8(size_t n) { return ng_vec8_grid_(n, EW_THREADS); }

static enum ng_status check_vec(const char *who, size_t n, const void *a, const void *b,
				const void *c)
{
	return ng_check_vec8_(who, n, EW_THREADS, a, b, c);
}

extern "C" enum ng_status ng_gelu_fwd(ng_bf16 *out, const ng_bf16 *inp, size_t n, cudaStream_t s)
{
	enum ng_status st = check_vec("ng_gelu_fwd", n, out, inp, inp);
	if (st)
		return st;
	gelu_fwd_vec8<<<grid8(n), EW_THREADS, 0, s>>>((__nv_bfloat16 *)out,
						      (const __nv_bfloat16 *)inp, n);
	return NG_LAUNCH_CHECK("gelu_fwd_vec8");
}

extern "C" enum ng_status ng_gelu_bwd(ng_bf16 *dinp, const ng_bf16 *inp, const ng_bf16 *dout,
				      size_t n, cudaStream_t s)
{
	enum ng_status st = check_vec("ng_gelu_bwd", n, dinp, inp, dout);
	if (st)
		return st;
	gelu_bwd_vec8<<<grid8(n), EW_THREADS, 0, s>>>((__nv_bfloat16 *)dinp,
						      (const __nv_bfloat16 *)inp,
						      (const __nv_bfloat16 *)dout, n);
	return NG_LAUNCH_CHECK("gelu_bwd_vec8");
}

extern "C" size_t ng_bias_grad_scratch_bytes(int N, int OC)
{
	if (N <= 0 || OC <= 0)
		return 0;
	return (size_t)((N + BG_ROWS - 1) / BG_ROWS) * OC * sizeof(float);
}

extern "C" enum ng_status ng_bias_grad(float *dbias, const ng_bf16 *dout, int N, int OC,
				       void *scratch, cudaStream_t s)
{
	const char *who = "ng_bias_grad";
	if (N <= 0 || OC <= 0 || OC % 8 != 0)
		return ng_check_arg_fail(who, "need N > 0, OC > 0, OC %% 8 == 0, got N=%d OC=%d", N,
					 OC);
	if (!ng_aligned16_(dout) || !ng_aligned16_(scratch))
		return ng_check_arg_fail(who, "dout (%p) and scratch (%p) must be 16-byte aligned",
					 (const void *)dout, scratch);
	int nchunks = (N + BG_ROWS - 1) / BG_ROWS;
	dim3 grid((unsigned)((OC + 255) / 256), (unsigned)nchunks);
	bias_grad_row_chunks<<<grid, dim3(32, 8), 0, s>>>((float *)scratch,
							  (const __nv_bfloat16 *)dout, N, OC);
	enum ng_status st = NG_LAUNCH_CHECK("bias_grad_row_chunks");
	if (st)
		return st;
	bias_grad_reduce_chunks<<<(OC + 255) / 256, 256, 0, s>>>(dbias, (const float *)scratch,
								 nchunks, OC, 1);
	return NG_LAUNCH_CHECK("bias_grad_reduce_chunks");
}

extern "C" enum ng_status ng_bias_grad_reduce(float *dbias, const float *part, int rows, int OC,
					      int accumulate, cudaStream_t s)
{
	if (rows < 1 || OC < 1 || !dbias || !part)
		return ng_check_arg_fail("ng_bias_grad_reduce", "rows = %d, OC = %d, dbias %p, part "
					 "%p: rows, OC >= 1 and both pointers set", rows, OC,
					 (void *)dbias, (const void *)part);
	bias_grad_reduce_rows<<<(OC + 31) / 32, dim3(32, 8), 0, s>>>(dbias, part, rows, OC,
								     accumulate);
	return NG_LAUNCH_CHECK("bias_grad_reduce_rows");
}

extern "C" enum ng_status ng_gelu_bwd_bias(ng_bf16 *dinp, ng_bf16 *gelu_out, float *dbias,
					   int accumulate, const ng_bf16 *inp, const ng_bf16 *dout,
					   int N, int OC, void *scratch, cudaStream_t s)
{
	const char *who = "ng_gelu_bwd_bias";
	if (N <= 0 || OC <= 0 || OC % 8 != 0)
		return ng_check_arg_fail(who, "need N > 0, OC > 0, OC %% 8 == 0, got N=%d OC=%d", N,
					 OC);
	if (!ng_aligned16_(dinp) || !ng_aligned16_(inp) || !ng_aligned16_(dout) ||
	    !ng_aligned16_(scratch) || (gelu_out && !ng_aligned16_(gelu_out)))
		return ng_check_arg_fail(who, "dinp, gelu_out, inp, dout and scratch must be 16-byte "
					 "aligned");
	int nchunks = (N + BG_ROWS - 1) / BG_ROWS;
	dim3 grid((unsigned)((OC + 255) / 256), (unsigned)nchunks);
	gelu_bwd_bias_row_chunks<<<grid, dim3(32, 8), 0, s>>>(
		(__nv_bfloat16 *)dinp, (__nv_bfloat16 *)gelu_out, (float *)scratch,
		(const __nv_bfloat16 *)inp, (const __nv_bfloat16 *)dout, N, OC);
	enum ng_status st = NG_LAUNCH_CHECK("gelu_bwd_bias_row_chunks");
	if (st)
		return st;
	bias_grad_reduce_chunks<<<(OC + 255) / 256, 256, 0, s>>>(dbias, (const float *)scratch,
								 nchunks, OC, accumulate);
	return NG_LAUNCH_CHECK("bias_grad_reduce_chunks");
}

extern "C" enum ng_status ng_cast_f32_to_bf16(ng_bf16 *out, const float *in, size_t n,
					      cudaStream_t s)
{
	enum ng_status st = check_vec("ng_cast_f32_to_bf16", n, out, in, in);
	if (st)
		return st;
	cast_f32_to_bf16_vec8<<<grid8(n), EW_THREADS, 0, s>>>((__nv_bfloat16 *)out, in, n);
	return NG_LAUNCH_CHECK("cast_f32_to_bf16_vec8");
}

extern "C" enum ng_status ng_cast_bf16_to_f32(float *out, const ng_bf16 *in, size_t n,
					      cudaStream_t s)
{
	enum ng_status st = check_vec("ng_cast_bf16_to_f32", n, out, in, in);
	if (st)
		return st;
	cast_bf16_to_f32_vec8<<<grid8(n), EW_THREADS, 0, s>>>(out, (const __nv_bfloat16 *)in, n);
	return NG_LAUNCH_CHECK("cast_bf16_to_f32_vec8");
}

extern "C" enum ng_status ng_transpose_bf16(ng_bf16 *out, const ng_bf16 *in, int R, int C,
					    int count, cudaStream_t s)
{
	if (R < 1 || C < 1 || count < 1 || count > 65535 || !out || !in)
		return ng_check_arg_fail("ng_transpose_bf16", "R = %d, C = %d, count %d, out %p, in %p: "
					 "R, C >= 1, count 1..65535 and both pointers set", R, C,
					 count, (void *)out, (const void *)in);
	const char *o = (const char *)out, *i = (const char *)in;
	const size_t bytes = (size_t)R * C * 2 * count;
	if (o < i + bytes && i < o + bytes)
		return ng_check_arg_fail("ng_transpose_bf16", "out %p overlaps in %p (%zu bytes)",
					 (void *)out, (const void *)in, bytes);
	dim3 grid((C + TP_TILE - 1) / TP_TILE, (R + TP_TILE - 1) / TP_TILE, count);
	if (grid.y > 65535)
		return ng_check_arg_fail("ng_transpose_bf16", "R = %d: more than %d rows", R,
					 65535 * TP_TILE);
	const int pairs = R % 2 == 0 && C % 2 == 0 && (uintptr_t)out % 4 == 0 &&
			  (uintptr_t)in % 4 == 0;
	if (pairs)
		transpose_bf16<1><<<grid, dim3(32, 8), 0, s>>>((__nv_bfloat16 *)out,
							       (const __nv_bfloat16 *)in, R, C);
	else
		transpose_bf16<0><<<grid, dim3(32, 8), 0, s>>>((__nv_bfloat16 *)out,
							       (const __nv_bfloat16 *)in, R, C);
	return NG_LAUNCH_CHECK("transpose_bf16");
}

extern "C" enum ng_status ng_tokens_split(int32_t *inputs, int32_t *targets,
					  const uint16_t *windows, int B, int T, cudaStream_t s)
{
	if (B <= 0 || T <= 0)
		return ng_check_arg_fail("ng_tokens_split", "need B, T > 0, got B=%d T=%d", B, T);
	size_t n = (size_t)B * T;
	tokens_split_shift<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(inputs, targets, windows, B,
									  T);
	return NG_LAUNCH_CHECK("tokens_split_shift");
}
