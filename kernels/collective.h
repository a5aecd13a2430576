/*
 * kernels/collective.h — the NCCL wrapper of the data-parallel step: gradient all-reduce (mean),
 * the loss/metric reductions, and the ZeRO-1 pieces (reduce-scatter of the gradient into the
 * rank's shard, all-gather of the updated parameters). Every call only enqueues on the given
 * stream, so the calls capture into a CUDA Graph (NCCL >= 2.9 supports stream capture).
 *
 * Shards: a flat buffer of `total` elements is split into `world` equal shards of
 * ng_collective_shard_len(total, world) = ceil(total / world) rounded up to a multiple of 4
 * elements (aligned shards); rank r owns
 * [r * len, (r + 1) * len). The buffer must hold world * len elements (the tail past `total` is
 * padding). In-place reduce-scatter / all-gather use NCCL's documented in-place layout
 * (recvbuff = sendbuff + rank * len for reduce-scatter, sendbuff = recvbuff + rank * len for
 * all-gather).
 *
 * The communicator is passed as `struct ncclComm *` (what ncclComm_t points to) so this header
 * needs no nccl.h. Built without NCCL, every call fails with NG_ERR_RUNTIME and a hint.
 */
#ifndef NG_KERNELS_COLLECTIVE_H
#define NG_KERNELS_COLLECTIVE_H

#include <cuda_runtime.h>
#include <stddef.h>

#include "kernels/types.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ncclComm;

/* Elements per rank of a flat buffer of `total` elements (ceil(total / world), up to 4k). */
size_t ng_collective_shard_len(size_t total, int world);

/* buf (n fp32) <- mean over ranks of buf, in place. */
enum ng_status ng_collective_allreduce_mean_f32(struct ncclComm *comm, float *buf, size_t n,
						cudaStream_t s);
/* buf (n fp32) <- sum over ranks of buf, in place (norm-squared partial sums). */
enum ng_status ng_collective_allreduce_sum_f32(struct ncclComm *comm, float *buf, size_t n,
					       cudaStream_t s);
/* buf (n u32) <- maximum over ranks of buf, in place (the --fp8 maxima as float bits,
 * kernels/fp8.h ng_fp8_amax_fold). */
enum ng_status ng_collective_allreduce_max_u32(struct ncclComm *comm, unsigned *buf, size_t n,
					       cudaStream_t s);
/* buf holds world * len fp32; afterwards buf[rank*len, (rank+1)*len) is the mean over ranks of
 * that range (the rest of buf is unspecified: NCCL may use it as it likes only for the send). */
enum ng_status ng_collective_reduce_scatter_mean_f32(struct ncclComm *comm, float *buf,
						     size_t len, int rank, cudaStream_t s);
/* buf holds world * len elements of elem_bytes (4: fp32, 2: bf16); every rank's shard
 * [r*len, (r+1)*len) is copied to every rank, in place. */
enum ng_status ng_collective_allgather(struct ncclComm *comm, void *buf, size_t len,
				       size_t elem_bytes, int rank, cudaStream_t s);
/* Fuse the calls between begin and end into one NCCL launch (ncclGroupStart / ncclGroupEnd). */
enum ng_status ng_collective_group_begin(void);
enum ng_status ng_collective_group_end(void);

#ifdef __cplusplus
}
#endif

#endif
