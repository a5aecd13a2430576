/*
 * kernels/encoder.cu — token + position embedding forward and its deterministic backward.
 *
 * Forward: one thread per 8 channels of one token (C/8 threads per token, several tokens per
 * block), 16-byte loads of wte and wpe.
 * Backward (dwte): the (token, position) pairs are sorted by token with cub's device radix sort
 * (stable, so positions stay in increasing order within a token); then one block per run of equal
 * tokens sums that token's dout rows in position order and adds the sum to dwte once. No
 * atomics, no host work: the same bytes every run, and capturable in a CUDA graph.
 * Backward (dwpe): one thread per (t, 8 channels) sums over b in order.
 * References: llm.c encoder_backward (which sorts on the host — avoided here); CUB
 * DeviceRadixSort::SortPairs documentation.
 */
#include "kernels/common.cuh"

#include <cub/device/device_radix_sort.cuh>

#include "kernels/encoder.h"


/* blockDim.x = C/8 threads cover a token's channels; blockDim.y tokens per block. */
static __global__ void encoder_fwd_vec8(__nv_bfloat16 *out, const int32_t *tokens,
					const __nv_bfloat16 *wte, const __nv_bfloat16 *wpe, int T,
					int C, int ntok)
{
	int bt = blockIdx.x * blockDim.y + threadIdx.y;
	if (bt >= ntok)
		return;
	int c = threadIdx.x * 8;
	int t = bt % T;
	int tok = tokens[bt];
	float a[8], b[8];
	ng_unpack8_(a, ng_load8_(wte + (size_t)tok * C + c));
	ng_unpack8_(b, ng_load8_(wpe + (size_t)t * C + c));
#pragma unroll
	for (int k = 0; k < 8; k++)
		a[k] += b[k];
	ng_store8_(out + (size_t)bt * C + c, ng_pack8_(a));
}

/* dst[0..8) += acc (dst 32-byte aligned: two float4). */
static __device__ __forceinline__ void add8_f32(float *dst, const float acc[8])
{
	float4 *d = reinterpret_cast<float4 *>(dst);
	float4 x = d[0], y = d[1];
	x.x += acc[0], x.y += acc[1], x.z += acc[2], x.w += acc[3];
	y.x += acc[4], y.y += acc[5], y.z += acc[6], y.w += acc[7];
	d[0] = x;
	d[1] = y;
}

static __global__ void encoder_iota(uint32_t *v, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		v[i] = (uint32_t)i;
}

/* One block per sorted slot; only the first slot of each run of equal tokens works. */
static __global__ void encoder_bwd_wte_sorted_runs(float *dwte, const __nv_bfloat16 *dout,
						   const uint32_t *keys, const uint32_t *pos, int n,
						   int C)
{
	int i = blockIdx.x;
	uint32_t tok = keys[i];
	if (i > 0 && keys[i - 1] == tok)
		return;
	int end = i + 1;
	while (end < n && keys[end] == tok)
		end++;
	for (int c = threadIdx.x * 8; c < C; c += blockDim.x * 8) {
		float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
		for (int j = i; j < end; j++) {
			float d[8];
			ng_unpack8_(d, ng_load8_(dout + (size_t)pos[j] * C + c));
#pragma unroll
			for (int k = 0; k < 8; k++)
				acc[k] += d[k];
		}
		add8_f32(dwte + (size_t)tok * C + c, acc);
	}
}

static __global__ void encoder_bwd_wpe_sum_over_batch(float *dwpe, const __nv_bfloat16 *dout,
						      int B, int T, int C)
{
	int t = blockIdx.x;
	int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
	if (c >= C)
		return;
	float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
	for (int b = 0; b < B; b++) {
		float d[8];
		ng_unpack8_(d, ng_load8_(dout + ((size_t)b * T + t) * C + c));
#pragma unroll
		for (int k = 0; k < 8; k++)
			acc[k] += d[k];
	}
	add8_f32(dwpe + (size_t)t * C + c, acc);
}

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* Bytes cub needs to sort n pairs over key bits [0, end_bit). */
static size_t sort_temp_bytes(int n, int end_bit)
{
	size_t bytes = 0;
	cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const uint32_t *)nullptr,
					(uint32_t *)nullptr, (const uint32_t *)nullptr,
					(uint32_t *)nullptr, n, 0, end_bit);
	return bytes;
}

extern "C" size_t ng_encoder_bwd_scratch_bytes(int B, int T, int C)
{
	(void)C;
	size_t n = (size_t)B * T;
	return 3 * align256(n * sizeof(uint32_t)) + align256(sort_temp_bytes((int)n, 32));
}

static enum ng_status check_shape(const char *who, int B, int T, int C)
{
	if (B <= 0 || T <= 0 || C <= 0 || C % 8 != 0)
		return ng_check_arg_fail(who, "need B, T, C > 0 and C %% 8 == 0, got B=%d T=%d C=%d",
					 B, T, C);
	if ((size_t)B * T > (size_t)INT32_MAX)
		return ng_check_arg_fail(who, "B*T = %zu tokens is too many", (size_t)B * T);
	return NG_OK;
}

extern "C" enum ng_status ng_encoder_fwd(ng_bf16 *out, const int32_t *tokens, const ng_bf16 *wte,
					 const ng_bf16 *wpe, int B, int T, int C, cudaStream_t s)
{
	enum ng_status st = check_shape("ng_encoder_fwd", B, T, C);
	if (st)
		return st;
	if (!ng_aligned16_(out) || !ng_aligned16_(wte) || !ng_aligned16_(wpe))
		return ng_check_arg_fail("ng_encoder_fwd", "out/wte/wpe must be 16-byte aligned (%p %p %p)",
					 (void *)out, (const void *)wte, (const void *)wpe);
	if (C / 8 > 1024)
		return ng_check_arg_fail("ng_encoder_fwd", "C=%d is above 8192", C);
	int ntok = B * T, per = C / 8 >= 256 ? 1 : 256 / (C / 8);
	dim3 block((unsigned)(C / 8), (unsigned)per);
	encoder_fwd_vec8<<<(ntok + per - 1) / per, block, 0, s>>>(
		(__nv_bfloat16 *)out, tokens, (const __nv_bfloat16 *)wte, (const __nv_bfloat16 *)wpe,
		T, C, ntok);
	return NG_LAUNCH_CHECK("encoder_fwd_vec8");
}

extern "C" enum ng_status ng_encoder_bwd(float *dwte, float *dwpe, const ng_bf16 *dout,
					 const int32_t *tokens, int B, int T, int C, int Vp,
					 void *scratch, size_t scratch_bytes, cudaStream_t s)
{
	const char *who = "ng_encoder_bwd";
	enum ng_status st = check_shape(who, B, T, C);
	if (st)
		return st;
	if (Vp <= 0)
		return ng_check_arg_fail(who, "Vp must be > 0, got %d", Vp);
	if (!ng_aligned16_(dwte) || !ng_aligned16_(dwpe) || !ng_aligned16_(dout) ||
	    !ng_aligned16_(scratch))
		return ng_check_arg_fail(who, "dwte/dwpe/dout/scratch must be 16-byte aligned");
	int n = B * T;
	int end_bit = 1;
	while (end_bit < 32 && ((uint32_t)(Vp - 1) >> end_bit) != 0)
		end_bit++;
	size_t nb = align256((size_t)n * sizeof(uint32_t));
	size_t temp = sort_temp_bytes(n, end_bit);
	if (scratch_bytes < 3 * nb + temp)
		return ng_check_arg_fail(who, "scratch is %zu bytes, need %zu (B=%d T=%d)",
					 scratch_bytes, 3 * nb + temp, B, T);
	char *p = (char *)scratch;
	uint32_t *keys_out = (uint32_t *)p;
	uint32_t *pos_in = (uint32_t *)(p + nb);
	uint32_t *pos_out = (uint32_t *)(p + 2 * nb);
	void *tmp = p + 3 * nb;

	encoder_iota<<<(n + 255) / 256, 256, 0, s>>>(pos_in, n);
	if ((st = NG_LAUNCH_CHECK("encoder_iota")))
		return st;
	size_t tb = temp;
	if ((st = NG_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
		     tmp, tb, (const uint32_t *)tokens, keys_out, (const uint32_t *)pos_in, pos_out,
		     n, 0, end_bit, s))))
		return st;
	int c8 = C / 8;
	int threads = c8 < 1024 ? ((c8 + 31) / 32) * 32 : 1024;
	encoder_bwd_wte_sorted_runs<<<n, threads, 0, s>>>(dwte, (const __nv_bfloat16 *)dout,
							   keys_out, pos_out, n, C);
	if ((st = NG_LAUNCH_CHECK("encoder_bwd_wte_sorted_runs")))
		return st;
	int tw = c8 < 128 ? ((c8 + 31) / 32) * 32 : 128;
	dim3 g((unsigned)T, (unsigned)((c8 + tw - 1) / tw));
	encoder_bwd_wpe_sum_over_batch<<<g, tw, 0, s>>>(dwpe, (const __nv_bfloat16 *)dout, B, T, C);
	return NG_LAUNCH_CHECK("encoder_bwd_wpe_sum_over_batch");
}
