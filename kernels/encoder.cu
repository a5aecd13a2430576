/*
 * kernels/encoder.cu — token + position embedding forward and its deterministic backward.
 *
 * Forward, encoder_fwd_rows: C/8 threads per token (8 channels each, 16-byte loads of wte and
 * wpe), several tokens per block, ENC_FWD_ROWS tokens per thread with all loads issued first.
 * Backward (dwte): the (token, position) pairs are sorted by token with cub's device radix sort
 * (stable, so positions stay in increasing order within a token): as 32-bit keys
 * token << pb | position sorted on the token bits alone when both fit (B*T <= 65536 at
 * Vp = 50304), else as key-value pairs. The sorted slots are then cut
 * into windows of K slots (K = 16..64, enc_window) and encoder_bwd_wte_windows runs one block
 * per window:
 *  - a short run of equal tokens (at most K slots) is summed whole, in position order, by the
 *    block of the window holding its first slot, and added to dwte once;
 *  - a long run (more than K slots: frequent tokens of real text, or the executor's warm-up with
 *    every token equal) is cut at the window edges; each window sums its piece into its own
 *    partial row (head: the piece of a run that began earlier; tail: a run that begins here),
 *    and encoder_bwd_wte_combine adds a long run's pieces in window order (16 interleaved
 *    slices, then the slices in order) and adds the total to dwte once.
 * A window sees at most two long-run pieces (a long run is longer than a window). No atomics,
 * no host work: the same bits every run, capturable in a CUDA graph, and no run is summed by a
 * single block any more (the one-block-per-run version took 21 ms with all tokens equal).
 * Backward (dwpe): per (t, 8 channels), up to 4 thread groups each sum a contiguous range of b
 * in order, then the group sums are added in group order; its blocks share one launch with the
 * windows, interleaved (encoder_bwd_windows_wpe).
 * References: llm.c encoder_backward (which sorts on the host — avoided here); CUB
 * DeviceRadixSort::SortPairs documentation.
 */
#include "kernels/common.cuh"

#include <cub/device/device_radix_sort.cuh>

#include "kernels/encoder.h"

#define ENC_FWD_ROWS 1    /* tokens per forward thread (2 and 4 measured slower on the H200) */
#define ENC_WIN_MAX 64    /* largest window (slots of the sorted tokens per block); 32 measured
                           * no better */
#define ENC_BWD_THREADS 256 /* threads of a window block (128 measured 3-9% faster at d48 and
                             * with all tokens equal, 1-2% slower at d12: not yet tested) */
#define ENC_BWD_MINB 1    /* window blocks per SM forced by __launch_bounds__ (6 spills a little
                           * and measured no better) */
#define ENC_RED_SLICES 16 /* slices a long run's partial rows are split into by the combine */
#define ENC_NONE 0xffffffffu /* "no long-run piece" marker, never a token */

/* blockDim.x = C/8 threads cover a token's channels; blockDim.y token slots per block; each
 * thread handles tokens bt0 + y + r * blockDim.y, r < ENC_FWD_ROWS. POS false: no position
 * table (ng_embed_fwd), the rows of wte copied. */
template <bool POS>
static __global__ void encoder_fwd_rows(__nv_bfloat16 *out, const int32_t *tokens,
					const __nv_bfloat16 *wte, const __nv_bfloat16 *wpe, int T,
					int C, int ntok)
{
	int bt0 = blockIdx.x * blockDim.y * ENC_FWD_ROWS + threadIdx.y;
	int c = threadIdx.x * 8;
	struct ng_bf16x8 a[ENC_FWD_ROWS], b[ENC_FWD_ROWS];
#pragma unroll
	for (int r = 0; r < ENC_FWD_ROWS; r++) {
		int bt = bt0 + r * blockDim.y;
		if (bt < ntok) {
			a[r] = ng_load8_(wte + (size_t)tokens[bt] * C + c);
			if (POS)
				b[r] = ng_load8_(wpe + (size_t)(bt % T) * C + c);
		}
	}
#pragma unroll
	for (int r = 0; r < ENC_FWD_ROWS; r++) {
		int bt = bt0 + r * blockDim.y;
		if (bt >= ntok)
			continue;
		if (!POS) { /* a copy: the bits of the table */
			ng_store8_(out + (size_t)bt * C + c, a[r]);
			continue;
		}
		float x[8], y[8];
		ng_unpack8_(x, a[r]);
		ng_unpack8_(y, b[r]);
#pragma unroll
		for (int k = 0; k < 8; k++)
			x[k] += y[k];
		ng_store8_(out + (size_t)bt * C + c, ng_pack8_(x));
	}
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

/* v[i] = (tokens[i] << pb) | i: the token above the position, sorted on the token bits only
 * (stable: positions stay in increasing order within a token), keys alone. */
static __global__ void encoder_pack_keys(uint32_t *v, const int32_t *tokens, int pb, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		v[i] = ((uint32_t)tokens[i] << pb) | (uint32_t)i;
}

/* acc[0..8) += sum over j in [a, b), in order, of dout[row(j), c..c+8). U rows' loads in flight
 * before their adds (the adds stay in order). */
template <int U, class Row>
static __device__ __forceinline__ void add_rows8(float acc[8], const __nv_bfloat16 *__restrict__ dout,
						 Row row, int a, int b, int C, int c)
{
	int j = a;
	for (; j + U <= b; j += U) {
		struct ng_bf16x8 v[U];
#pragma unroll
		for (int u = 0; u < U; u++)
			v[u] = ng_load8_(dout + row(j + u) * C + c);
#pragma unroll
		for (int u = 0; u < U; u++) {
			float d[8];
			ng_unpack8_(d, v[u]);
#pragma unroll
			for (int k = 0; k < 8; k++)
				acc[k] += d[k];
		}
	}
	for (; j < b; j++) {
		float d[8];
		ng_unpack8_(d, ng_load8_(dout + row(j) * C + c));
#pragma unroll
		for (int k = 0; k < 8; k++)
			acc[k] += d[k];
	}
}

/* acc[0..8) = sum over sorted slots j in [a, b), in order, of dout[pos[j], c..c+8); pos in
 * shared memory. */
static __device__ __forceinline__ void sum_rows8(float acc[8], const __nv_bfloat16 *__restrict__ dout,
						 const uint32_t *pos, int a, int b, int C, int c)
{
#pragma unroll
	for (int k = 0; k < 8; k++)
		acc[k] = 0.0f;
	add_rows8<4>(acc, dout, [pos](int j) { return (size_t)pos[j]; }, a, b, C, c);
}

/* One block per window of K sorted slots [s0, s0 + K). Keys of slots [s0 - K, s0 + 2K) and
 * positions of [s0, s0 + 2K) are staged in shared memory (enough to classify every run that
 * touches the window and to sum every short run that starts in it). Warp 0 finds the pieces
 * (each lane looks at slots lane and lane + 32; a ballot puts them in slot order); then every
 * thread takes (piece, 8 channels) items, so a window of many short runs keeps many rows in
 * flight. pos NULL: keys are packed, token = key >> pb, position = the low pb bits (pb 0 and
 * pos given: plain keys). part: (2 * nwin, C) fp32, row 2w the head piece, 2w + 1 the tail piece;
 * head_tok/tail_tok (nwin): the piece's token or ENC_NONE. */
static __device__ __forceinline__ void wte_window(int w, float *__restrict__ dwte,
						  float *__restrict__ part, uint32_t *head_tok,
						  uint32_t *tail_tok,
						  const __nv_bfloat16 *__restrict__ dout,
						  const uint32_t *keys, const uint32_t *pos, int n,
						  int C, int K, int pb)
{
	__shared__ uint32_t sk[3 * ENC_WIN_MAX]; /* keys of slots s0 - K + i */
	__shared__ uint32_t sp[2 * ENC_WIN_MAX]; /* positions of slots s0 + i */
	__shared__ int2 pieces[ENC_WIN_MAX];     /* [first slot, end slot) of each piece */
	__shared__ int kinds[ENC_WIN_MAX];       /* 0: whole short run, 1: head, 2: tail */
	__shared__ int npieces;
	int s0 = w * K, s1 = min(s0 + K, n), ns = s1 - s0;
	for (int i = threadIdx.x; i < 3 * K; i += blockDim.x) {
		int s = s0 - K + i;
		sk[i] = (s >= 0 && s < n) ? keys[s] >> pb : ENC_NONE;
		if (i < 2 * K) {
			uint32_t pv = (s0 + i < n) ? (pos ? pos[s0 + i] : keys[s0 + i]) : 0u;
			sp[i] = pos ? pv : pv & ((1u << pb) - 1u);
		}
	}
	__syncthreads();
	if (threadIdx.x < NG_WARP) {
		const uint32_t *k = sk + K; /* k[i] = key of slot s0 + i, i in [-K, 2K) */
		int lane = threadIdx.x, base = 0;
		unsigned any_head = 0, any_tail = 0;
		for (int half = 0; half < 2; half++) {
			int i = lane + half * NG_WARP, kind = -1, e = 0;
			uint32_t key = ENC_NONE;
			if (i < ns && (i == 0 || k[i - 1] != k[i])) {
				key = k[i];
				int st = i;
				while (st > -K && k[st - 1] == key)
					st--;
				/* st: the run's first slot, or -K if it begins at or before s0 - K; either
				 * way the run is long (more than K slots) iff slot st + K holds the key */
				int is_long = k[st + K] == key;
				e = i + 1;
				while (e < ns && k[e] == key)
					e++;
				if (!is_long && st == i) { /* a short run starting here may end past s1 */
					while (e < 2 * K && k[e] == key)
						e++;
					kind = 0;
				} else if (is_long) {
					kind = st < 0 ? 1 : 2;
				} /* else: a short run the previous window sums */
			}
			unsigned m = __ballot_sync(0xffffffffu, kind >= 0);
			any_head |= __ballot_sync(0xffffffffu, kind == 1);
			any_tail |= __ballot_sync(0xffffffffu, kind == 2);
			if (kind >= 0) {
				int q = base + __popc(m & ((1u << lane) - 1u));
				pieces[q] = make_int2(i, e);
				kinds[q] = kind;
				if (kind == 1)
					head_tok[w] = key;
				if (kind == 2)
					tail_tok[w] = key;
			}
			base += __popc(m);
		}
		if (lane == 0) {
			npieces = base;
			if (!any_head)
				head_tok[w] = ENC_NONE;
			if (!any_tail)
				tail_tok[w] = ENC_NONE;
		}
	}
	__syncthreads();
	int c8 = C / 8, nitems = npieces * c8;
	for (int it = threadIdx.x; it < nitems; it += blockDim.x) {
		int q = it / c8, c = (it - q * c8) * 8;
		int2 pc = pieces[q];
		int kind = kinds[q];
		float *dst = kind == 0 ? dwte + (size_t)sk[K + pc.x] * C + c
				       : part + (size_t)(2 * w + (kind == 2)) * C + c;
		float4 o0 = make_float4(0.f, 0.f, 0.f, 0.f), o1 = o0;
		if (kind == 0) { /* dwte's old value, loaded alongside the rows */
			o0 = reinterpret_cast<const float4 *>(dst)[0];
			o1 = reinterpret_cast<const float4 *>(dst)[1];
		}
		float acc[8];
		sum_rows8(acc, dout, sp, pc.x, pc.y, C, c);
		o0.x += acc[0], o0.y += acc[1], o0.z += acc[2], o0.w += acc[3];
		o1.x += acc[4], o1.y += acc[5], o1.z += acc[6], o1.w += acc[7];
		reinterpret_cast<float4 *>(dst)[0] = o0;
		reinterpret_cast<float4 *>(dst)[1] = o1;
	}
}

/* Block (32, ENC_RED_SLICES), grid (ceil(nwin / ENC_COMB_WINS), ceil(C / 256)): block (g, y)
 * looks at windows g * ENC_COMB_WINS .. + ENC_COMB_WINS (their tail tokens loaded at once); for
 * each that holds the tail piece of a long run (the run starts there), it adds that run's pieces
 * (tail of w, heads of w + 1 .. the run's last window), channels 256 y .. 256 y + 255, to dwte.
 * The run's last window: the window before the first one after w whose head token is not the
 * run's (every window the run covers from its first slot on has the run's head piece), found by
 * all threads at once, 512 windows a round (a binary search over the keys, 16 dependent loads a
 * run, made Zipf tokens 18% slower at d12). Slice y sums pieces y, y + 16, ... in order; row 0
 * then adds the slices in order. Grouping the windows keeps the grid small when there are few
 * long runs (uniform tokens: a grid of nwin x C/256 blocks that nearly all exit cost several
 * us); the channel chunks keep one very long run (all tokens equal) spread over C/256 blocks. */
#define ENC_COMB_WINS 8
static __global__ void encoder_bwd_wte_combine(float *dwte, const float *part,
					       const uint32_t *head_tok, const uint32_t *tail_tok,
					       int nwin, int C)
{
	__shared__ float sh[ENC_RED_SLICES][NG_WARP * 8 + 4];
	__shared__ int end_win; /* the first window after the run's */
	const int tid = threadIdx.y * NG_WARP + threadIdx.x, nt = NG_WARP * ENC_RED_SLICES;
	int w0 = blockIdx.x * ENC_COMB_WINS;
	uint32_t tok[ENC_COMB_WINS];
#pragma unroll
	for (int i = 0; i < ENC_COMB_WINS; i++)
		tok[i] = w0 + i < nwin ? tail_tok[w0 + i] : ENC_NONE;
	int c = (blockIdx.y * NG_WARP + threadIdx.x) * 8;
#pragma unroll /* tok stays in registers */
	for (int i = 0; i < ENC_COMB_WINS; i++) {
		uint32_t key = tok[i];
		if (key == ENC_NONE)
			continue;
		int w = w0 + i;
		if (tid == 0)
			end_win = nwin;
		__syncthreads();
		for (int base = w + 1; base < nwin; base += nt) {
			int j = base + tid;
			if (j < nwin && head_tok[j] != key)
				atomicMin(&end_win, j);
			__syncthreads();
			bool found = end_win < nwin;
			__syncthreads(); /* everyone has read it before the next round's writes */
			if (found)
				break;
		}
		int npc = end_win - w;
		float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
		if (c < C)
			for (int q = threadIdx.y; q < npc; q += ENC_RED_SLICES) {
				size_t row = q == 0 ? 2 * (size_t)w + 1 : 2 * (size_t)(w + q);
				float4 x = *reinterpret_cast<const float4 *>(part + row * C + c);
				float4 y = *reinterpret_cast<const float4 *>(part + row * C + c + 4);
				acc[0] += x.x, acc[1] += x.y, acc[2] += x.z, acc[3] += x.w;
				acc[4] += y.x, acc[5] += y.y, acc[6] += y.z, acc[7] += y.w;
			}
#pragma unroll
		for (int k = 0; k < 8; k++)
			sh[threadIdx.y][threadIdx.x * 8 + k] = acc[k];
		__syncthreads();
		if (threadIdx.y == 0 && c < C) {
			for (int y = 1; y < ENC_RED_SLICES; y++)
#pragma unroll
				for (int k = 0; k < 8; k++)
					acc[k] += sh[y][threadIdx.x * 8 + k];
			add8_f32(dwte + (size_t)key * C + c, acc);
		}
		__syncthreads(); /* sh and last_win are reused by the next run */
	}
}

/* dwpe[t, :] += sum over b of dout[b, t, :], by one block of ENC_BWD_THREADS threads. With
 * C/8 <= ENC_BWD_THREADS / 2 the threads form G = min(4, threads / (C/8)) groups, each summing a
 * contiguous range of b in order (8 rows' loads in flight); group 0 then adds the groups' sums
 * in group order. G depends on C alone: a fixed order for a given shape. */
#define ENC_WPE_GROUPS_MAX 4
static __device__ __forceinline__ void wpe_row(int t, float *dwpe,
					       const __nv_bfloat16 *__restrict__ dout, int B, int T,
					       int C)
{
	__shared__ float sh[ENC_WPE_GROUPS_MAX - 1][ENC_BWD_THREADS * 8];
	int c8 = C / 8, G = c8 >= ENC_BWD_THREADS ? 1 : min(ENC_WPE_GROUPS_MAX, ENC_BWD_THREADS / c8);
	int span = G == 1 ? min(c8, ENC_BWD_THREADS) : c8; /* channel groups of 8 per pass */
	int y = threadIdx.x / span, j = threadIdx.x % span;
	int per = (B + G - 1) / G, b0 = y * per, b1 = min(B, b0 + per);
	for (int cb = 0; cb < c8; cb += span) {
		int cc = cb + j;
		bool live = y < G && cc < c8;
		float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
		if (live)
			add_rows8<8>(acc, dout, [T, t](int b) { return (size_t)b * T + t; }, b0, b1, C,
				     cc * 8);
		if (live && y > 0)
#pragma unroll
			for (int k = 0; k < 8; k++)
				sh[y - 1][j * 8 + k] = acc[k];
		__syncthreads();
		if (live && y == 0) {
			for (int g = 1; g < G; g++)
#pragma unroll
				for (int k = 0; k < 8; k++)
					acc[k] += sh[g - 1][j * 8 + k];
			add8_f32(dwpe + (size_t)t * C + cc * 8, acc);
		}
		__syncthreads();
	}
}

/* One launch for dwte's windows and dwpe's rows, interleaved (block 2i: window i, block 2i + 1:
 * dwpe row i, then whichever has more), so that dwpe's plain streaming fills the time a window
 * block spends classifying its slots, and one launch (and its tail) is saved. T = 0: windows
 * only (no position table). */
static __global__ void __launch_bounds__(ENC_BWD_THREADS, ENC_BWD_MINB)
encoder_bwd_windows_wpe(float *__restrict__ dwte, float *__restrict__ part, uint32_t *head_tok,
			uint32_t *tail_tok, float *dwpe, const __nv_bfloat16 *__restrict__ dout,
			const uint32_t *keys, const uint32_t *pos, int n, int C, int K, int pb,
			int nwin, int B, int T)
{
	int i = blockIdx.x, m = min(nwin, T);
	bool win;
	int k;
	if (i < 2 * m) {
		win = (i & 1) == 0;
		k = i >> 1;
	} else {
		win = nwin > T;
		k = m + (i - 2 * m);
	}
	if (win)
		wte_window(k, dwte, part, head_tok, tail_tok, dout, keys, pos, n, C, K, pb);
	else
		wpe_row(k, dwpe, dout, B, T, C);
}

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* Window size: 64 slots, fewer when that leaves under four blocks per SM of an H200 (the
 * choice depends only on n, so the summation order is the same on every device). */
static int enc_window(int n)
{
	int k = ENC_WIN_MAX;
	while (k > 16 && (n + k - 1) / k < 4 * 132)
		k /= 2;
	return k;
}

/* Bytes cub needs to sort n pairs over key bits [0, end_bit). */
static size_t sort_temp_bytes(int n, int end_bit)
{
	size_t bytes = 0;
	cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const uint32_t *)nullptr,
					(uint32_t *)nullptr, (const uint32_t *)nullptr,
					(uint32_t *)nullptr, n, 0, end_bit);
	return bytes;
}

/* Two buffers. The sorted one (ng_encoder_bwd_sort writes it, ng_encoder_bwd_sorted reads it):
 * sorted keys, positions in (or the packed keys), positions out, cub's temporary storage. The
 * work one (ng_encoder_bwd_sorted's own): head/tail tokens (nwin each), the pieces' partial
 * rows (2 nwin, C) fp32. ng_encoder_bwd's scratch is the two, one after the other. */
struct enc_scratch {
	size_t nb;     /* bytes of one (n) uint32 array, aligned */
	size_t temp;   /* cub's bytes (32 key bits: enough for any Vp) */
	size_t sorted; /* the sorted buffer */
	size_t tokb;   /* bytes of one (nwin) uint32 array, aligned */
	size_t partb;  /* bytes of the partial rows */
	size_t work;   /* the work buffer */
};

static struct enc_scratch enc_scratch_layout(int B, int T, int C)
{
	struct enc_scratch s;
	int n = B * T, k = enc_window(n), nwin = (n + k - 1) / k;
	s.nb = align256((size_t)n * sizeof(uint32_t));
	s.temp = align256(sort_temp_bytes(n, 32));
	size_t kb = 0;
	cub::DeviceRadixSort::SortKeys(nullptr, kb, (const uint32_t *)nullptr, (uint32_t *)nullptr, n,
				       0, 32);
	if (align256(kb) > s.temp)
		s.temp = align256(kb);
	s.sorted = 3 * s.nb + s.temp;
	s.tokb = align256((size_t)nwin * sizeof(uint32_t));
	s.partb = align256(2 * (size_t)nwin * C * sizeof(float));
	s.work = 2 * s.tokb + s.partb;
	return s;
}

extern "C" size_t ng_encoder_bwd_scratch_bytes(int B, int T, int C)
{
	if (B <= 0 || T <= 0 || C <= 0)
		return 0;
	struct enc_scratch L = enc_scratch_layout(B, T, C);
	return L.sorted + L.work;
}

extern "C" size_t ng_encoder_bwd_sorted_bytes(int B, int T)
{
	if (B <= 0 || T <= 0)
		return 0;
	return enc_scratch_layout(B, T, 8).sorted;
}

extern "C" size_t ng_encoder_bwd_work_bytes(int B, int T, int C)
{
	if (B <= 0 || T <= 0 || C <= 0)
		return 0;
	return enc_scratch_layout(B, T, C).work;
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

/* The forward's launch, shape checked: wpe NULL copies the rows of wte (ng_embed_fwd). */
static enum ng_status fwd_launch(const char *who, ng_bf16 *out, const int32_t *tokens,
				 const ng_bf16 *wte, const ng_bf16 *wpe, int B, int T, int C,
				 cudaStream_t s)
{
	if (!ng_aligned16_(out) || !ng_aligned16_(wte) || !ng_aligned16_(wpe))
		return ng_check_arg_fail(who, "out/wte/wpe must be 16-byte aligned (%p %p %p)",
					 (void *)out, (const void *)wte, (const void *)wpe);
	if (C / 8 > 1024)
		return ng_check_arg_fail(who, "C=%d is above 8192", C);
	int ntok = B * T, per = C / 8 >= 256 ? 1 : 256 / (C / 8);
	int tpb = per * ENC_FWD_ROWS; /* tokens per block */
	dim3 block((unsigned)(C / 8), (unsigned)per);
	unsigned grid = (unsigned)((ntok + tpb - 1) / tpb);
	const __nv_bfloat16 *te = (const __nv_bfloat16 *)wte, *pe = (const __nv_bfloat16 *)wpe;
	if (!wpe) {
		encoder_fwd_rows<false><<<grid, block, 0, s>>>((__nv_bfloat16 *)out, tokens, te, pe,
							      T, C, ntok);
		return NG_LAUNCH_CHECK("encoder_fwd_rows<no position>");
	}
	encoder_fwd_rows<true><<<grid, block, 0, s>>>((__nv_bfloat16 *)out, tokens, te, pe, T, C,
						     ntok);
	return NG_LAUNCH_CHECK("encoder_fwd_rows");
}

extern "C" enum ng_status ng_encoder_fwd(ng_bf16 *out, const int32_t *tokens, const ng_bf16 *wte,
					 const ng_bf16 *wpe, int B, int T, int C, cudaStream_t s)
{
	enum ng_status st = check_shape("ng_encoder_fwd", B, T, C);
	if (st)
		return st;
	if (!wpe)
		return ng_check_arg_fail("ng_encoder_fwd", "wpe is required");
	return fwd_launch("ng_encoder_fwd", out, tokens, wte, wpe, B, T, C, s);
}

extern "C" enum ng_status ng_embed_fwd(ng_bf16 *out, const ng_bf16 *table, const int32_t *tok,
				       int N, int C, cudaStream_t s)
{
	enum ng_status st = check_shape("ng_embed_fwd", 1, N, C);
	if (st)
		return st;
	return fwd_launch("ng_embed_fwd", out, tok, table, NULL, 1, N, C, s);
}

/* Key bits of a token below Vp, and position bits of n slots; packed: both fit in 32 bits
 * (keys token << pb | position, sorted alone on the token bits; d12 sort 57.8 -> 52.2 us,
 * d48 54.4 -> 46.8 us on the H200), else (token, position) pairs. */
struct enc_bits {
	int end_bit, pb, packed;
};

static struct enc_bits enc_bits(int n, int Vp)
{
	struct enc_bits k = {1, 0, 0};
	while (k.end_bit < 32 && ((uint32_t)(Vp - 1) >> k.end_bit) != 0)
		k.end_bit++;
	while (k.pb < 32 && ((uint32_t)(n - 1) >> k.pb) != 0)
		k.pb++;
	k.packed = k.pb + k.end_bit <= 32;
	if (!k.packed)
		k.pb = 0;
	return k;
}

/* The checks the backward's three entries share: the shape (the sort passes C = 8: it does not
 * see C) and Vp; then *L, the shape's scratch layout. */
static enum ng_status check_bwd(const char *who, int B, int T, int C, int Vp,
				struct enc_scratch *L)
{
	enum ng_status st = check_shape(who, B, T, C);
	if (st)
		return st;
	if (Vp <= 0)
		return ng_check_arg_fail(who, "Vp must be > 0, got %d", Vp);
	*L = enc_scratch_layout(B, T, C);
	return NG_OK;
}

/* Launchers of the two halves, arguments already checked (check_bwd, alignment, sizes). */
static enum ng_status bwd_sort_launch(void *sorted, const int32_t *tokens, int B, int T, int Vp,
				      const struct enc_scratch *L, cudaStream_t s)
{
	enum ng_status st;
	int n = B * T;
	struct enc_bits k = enc_bits(n, Vp);
	char *p = (char *)sorted;
	uint32_t *keys_out = (uint32_t *)p;
	uint32_t *pos_in = (uint32_t *)(p + L->nb);
	uint32_t *pos_out = (uint32_t *)(p + 2 * L->nb);
	void *tmp = p + 3 * L->nb;
	size_t tb = L->temp;
	if (k.packed) {
		encoder_pack_keys<<<(n + 255) / 256, 256, 0, s>>>(pos_in, tokens, k.pb, n);
		if ((st = NG_LAUNCH_CHECK("encoder_pack_keys")))
			return st;
		return NG_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(
			tmp, tb, (const uint32_t *)pos_in, keys_out, n, k.pb, k.pb + k.end_bit, s));
	}
	encoder_iota<<<(n + 255) / 256, 256, 0, s>>>(pos_in, n);
	if ((st = NG_LAUNCH_CHECK("encoder_iota")))
		return st;
	return NG_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
		tmp, tb, (const uint32_t *)tokens, keys_out, (const uint32_t *)pos_in, pos_out, n, 0,
		k.end_bit, s));
}

static enum ng_status bwd_sorted_launch(float *dwte, float *dwpe, const ng_bf16 *dout,
					const void *sorted, int B, int T, int C, int Vp,
					void *work, const struct enc_scratch *L, cudaStream_t s)
{
	enum ng_status st;
	int n = B * T, K = enc_window(n), nwin = (n + K - 1) / K;
	struct enc_bits k = enc_bits(n, Vp);
	const uint32_t *keys_out = (const uint32_t *)sorted;
	const uint32_t *pos_out = (const uint32_t *)((const char *)sorted + 2 * L->nb);
	char *p = (char *)work;
	uint32_t *head_tok = (uint32_t *)p;
	uint32_t *tail_tok = (uint32_t *)(p + L->tokb);
	float *part = (float *)(p + 2 * L->tokb);
	int Tp = dwpe ? T : 0; /* dwpe rows to sum: none without a position table */
	encoder_bwd_windows_wpe<<<nwin + Tp, ENC_BWD_THREADS, 0, s>>>(
		dwte, part, head_tok, tail_tok, dwpe, (const __nv_bfloat16 *)dout, keys_out,
		k.packed ? nullptr : pos_out, n, C, K, k.pb, nwin, B, Tp);
	if ((st = NG_LAUNCH_CHECK("encoder_bwd_windows_wpe")))
		return st;
	dim3 cgrid((unsigned)((nwin + ENC_COMB_WINS - 1) / ENC_COMB_WINS),
		   (unsigned)((C / 8 + NG_WARP - 1) / NG_WARP));
	encoder_bwd_wte_combine<<<cgrid, dim3(NG_WARP, ENC_RED_SLICES), 0, s>>>(
		dwte, part, head_tok, tail_tok, nwin, C);
	return NG_LAUNCH_CHECK("encoder_bwd_wte_combine");
}

extern "C" enum ng_status ng_encoder_bwd_sort(void *sorted, size_t sorted_bytes,
					      const int32_t *tokens, int B, int T, int Vp,
					      cudaStream_t s)
{
	const char *who = "ng_encoder_bwd_sort";
	struct enc_scratch L;
	enum ng_status st = check_bwd(who, B, T, 8, Vp, &L);
	if (st)
		return st;
	if (!ng_aligned16_(sorted))
		return ng_check_arg_fail(who, "sorted must be 16-byte aligned");
	if (sorted_bytes < L.sorted)
		return ng_check_arg_fail(who, "sorted is %zu bytes, need %zu (B=%d T=%d)",
					 sorted_bytes, L.sorted, B, T);
	return bwd_sort_launch(sorted, tokens, B, T, Vp, &L, s);
}

extern "C" enum ng_status ng_encoder_bwd_sorted(float *dwte, float *dwpe, const ng_bf16 *dout,
						const void *sorted, int B, int T, int C, int Vp,
						void *work, size_t work_bytes, cudaStream_t s)
{
	const char *who = "ng_encoder_bwd_sorted";
	struct enc_scratch L;
	enum ng_status st = check_bwd(who, B, T, C, Vp, &L);
	if (st)
		return st;
	if (!ng_aligned16_(dwte) || !ng_aligned16_(dwpe) || !ng_aligned16_(dout) ||
	    !ng_aligned16_(sorted) || !ng_aligned16_(work))
		return ng_check_arg_fail(who, "dwte/dwpe/dout/sorted/work must be 16-byte aligned");
	if (work_bytes < L.work)
		return ng_check_arg_fail(who, "work is %zu bytes, need %zu (B=%d T=%d C=%d)",
					 work_bytes, L.work, B, T, C);
	return bwd_sorted_launch(dwte, dwpe, dout, sorted, B, T, C, Vp, work, &L, s);
}

/* The two halves on one scratch (sorted, then work: L.sorted is a multiple of 256, so work stays
 * 16-byte aligned), each argument checked once, here, before either half launches. */
extern "C" enum ng_status ng_encoder_bwd(float *dwte, float *dwpe, const ng_bf16 *dout,
					 const int32_t *tokens, int B, int T, int C, int Vp,
					 void *scratch, size_t scratch_bytes, cudaStream_t s)
{
	const char *who = "ng_encoder_bwd";
	struct enc_scratch L;
	enum ng_status st = check_bwd(who, B, T, C, Vp, &L);
	if (st)
		return st;
	if (!ng_aligned16_(dwte) || !ng_aligned16_(dwpe) || !ng_aligned16_(dout) ||
	    !ng_aligned16_(scratch))
		return ng_check_arg_fail(who, "dwte/dwpe/dout/scratch must be 16-byte aligned");
	if (scratch_bytes < L.sorted + L.work)
		return ng_check_arg_fail(who, "scratch is %zu bytes, need %zu (B=%d T=%d C=%d)",
					 scratch_bytes, L.sorted + L.work, B, T, C);
	if ((st = bwd_sort_launch(scratch, tokens, B, T, Vp, &L, s)))
		return st;
	return bwd_sorted_launch(dwte, dwpe, dout, scratch, B, T, C, Vp,
				 (char *)scratch + L.sorted, &L, s);
}

/* An embedding without positions is the encoder's backward over one sequence of N tokens with
 * no position table: the same sort, windows and combine, the same determinism. */
extern "C" size_t ng_embed_bwd_scratch_bytes(int N, int C)
{
	return ng_encoder_bwd_scratch_bytes(1, N, C);
}

extern "C" enum ng_status ng_embed_bwd(float *dtable, const ng_bf16 *dout, const int32_t *tok,
				       int N, int C, int rows, void *scratch, size_t scratch_bytes,
				       cudaStream_t s)
{
	return ng_encoder_bwd(dtable, NULL, dout, tok, 1, N, C, rows, scratch, scratch_bytes, s);
}
