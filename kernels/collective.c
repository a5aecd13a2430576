/*
 * kernels/collective.c — NCCL calls of the data-parallel step (see collective.h). Each call is
 * one enqueue on the caller's stream; errors carry NCCL's string and the operation's size.
 */
#include "kernels/collective.h"

#include "ng_config.h"

#if NG_HAVE_NCCL
#include <nccl.h>
#endif

size_t ng_collective_shard_len(size_t total, int world)
{
	if (world <= 1)
		return total;
	/* a multiple of 4, so every shard starts 16-byte aligned in fp32 and 8-byte in bf16 (the
	 * vector loads of AdamW): ceil(total / world) alone fails them at, e.g., 3 ranks */
	return ((total + (size_t)world - 1) / (size_t)world + 3) / 4 * 4;
}

#if NG_HAVE_NCCL

static enum ng_status nccl_check(ncclResult_t r, ncclComm_t comm, const char *what, size_t n)
{
	if (r == ncclSuccess)
		return NG_OK;
	const char *last = comm ? ncclGetLastError(comm) : "";
	ng_fail(NG_ERR_RUNTIME, "NCCL %s of %zu elements: %s%s%s", what, n, ncclGetErrorString(r),
		last && *last ? " — " : "", last ? last : "");
	ng_hint("run with NCCL_DEBUG=WARN (or INFO) for NCCL's own account of the failure");
	return NG_ERR_RUNTIME;
}

enum ng_status ng_collective_allreduce_mean_f32(struct ncclComm *comm, float *buf, size_t n,
						cudaStream_t s)
{
	return nccl_check(ncclAllReduce(buf, buf, n, ncclFloat32, ncclAvg, comm, s), comm,
			  "all-reduce (mean)", n);
}

enum ng_status ng_collective_allreduce_sum_f32(struct ncclComm *comm, float *buf, size_t n,
					       cudaStream_t s)
{
	return nccl_check(ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, comm, s), comm,
			  "all-reduce (sum)", n);
}

enum ng_status ng_collective_allreduce_max_u32(struct ncclComm *comm, unsigned *buf, size_t n,
					       cudaStream_t s)
{
	return nccl_check(ncclAllReduce(buf, buf, n, ncclUint32, ncclMax, comm, s), comm,
			  "all-reduce (max)", n);
}

enum ng_status ng_collective_reduce_scatter_mean_f32(struct ncclComm *comm, float *buf,
						     size_t len, int rank, cudaStream_t s)
{
	return nccl_check(ncclReduceScatter(buf, buf + (size_t)rank * len, len, ncclFloat32,
					    ncclAvg, comm, s),
			  comm, "reduce-scatter (mean)", len);
}

enum ng_status ng_collective_allgather(struct ncclComm *comm, void *buf, size_t len,
				       size_t elem_bytes, int rank, cudaStream_t s)
{
	if (elem_bytes != 4 && elem_bytes != 2)
		return ng_fail(NG_ERR_RUNTIME, "all-gather: element size %zu is not 4 or 2",
			       elem_bytes);
	ncclDataType_t t = elem_bytes == 4 ? ncclFloat32 : ncclBfloat16;
	char *b = buf;
	return nccl_check(ncclAllGather(b + (size_t)rank * len * elem_bytes, b, len, t, comm, s),
			  comm, "all-gather", len);
}

enum ng_status ng_collective_group_begin(void)
{
	return nccl_check(ncclGroupStart(), NULL, "group start", 0);
}

enum ng_status ng_collective_group_end(void)
{
	return nccl_check(ncclGroupEnd(), NULL, "group end", 0);
}

#else /* built without NCCL */

static enum ng_status no_nccl(void)
{
	ng_fail(NG_ERR_RUNTIME, "this build has no NCCL (multi-GPU collectives unavailable)");
	ng_hint("install NCCL and reconfigure with meson -Dnccl=enabled");
	return NG_ERR_RUNTIME;
}

enum ng_status ng_collective_allreduce_mean_f32(struct ncclComm *comm, float *buf, size_t n,
						cudaStream_t s)
{
	return no_nccl();
}

enum ng_status ng_collective_allreduce_sum_f32(struct ncclComm *comm, float *buf, size_t n,
					       cudaStream_t s)
{
	return no_nccl();
}

enum ng_status ng_collective_allreduce_max_u32(struct ncclComm *comm, unsigned *buf, size_t n,
					       cudaStream_t s)
{
	return no_nccl();
}

enum ng_status ng_collective_reduce_scatter_mean_f32(struct ncclComm *comm, float *buf,
						     size_t len, int rank, cudaStream_t s)
{
	return no_nccl();
}

enum ng_status ng_collective_allgather(struct ncclComm *comm, void *buf, size_t len,
				       size_t elem_bytes, int rank, cudaStream_t s)
{
	return no_nccl();
}

enum ng_status ng_collective_group_begin(void) { return no_nccl(); }
enum ng_status ng_collective_group_end(void) { return no_nccl(); }

#endif
