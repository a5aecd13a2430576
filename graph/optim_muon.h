/*
 * graph/optim_muon.h — the MUON op of the training step on the GPU (--optimizer muon;
 * graph/ir.h): what its scratch holds, its plan (one strided-batched Newton-Schulz plan per
 * group of same-shape hidden matrices, graph/cpu_muon.h), and the launches run_op makes for it.
 *
 * The op: the step's scalars (kernels/muon.h ng_muon_schedule) on the step's stream, then, forked
 * onto streams of their own and joined again before the op ends: the speedrun's Adam on every
 * parameter that is not a hidden matrix (memory-bound: it runs under the GEMMs of the groups),
 * and each group of same-shape matrices (qkv slices, attproj, fc, fcproj): momentum + Nesterov
 * into bf16 u (all matrices), the per-matrix normalisation and the 5 Newton-Schulz steps on this
 * rank's share (a contiguous range of ceil(batch / world) matrices), and the update of every
 * matrix. With a communicator (1 rank included) the groups' orthogonalised shares are
 * all-gathered on the step's stream after the join, one group after another in a fixed order
 * (NCCL calls on one communicator must not run concurrently), and the updates follow there.
 * Every rank then holds the same momentum and weights. The momentum is the AdamW first-moment
 * buffer's range of each matrix. Measured on an H200 (tools/bench_muon, speedrun shapes): one
 * stream 9.19 ms, these streams 5.79 ms with the earlier one-block-per-matrix normalisation.
 *
 * Scratch, each part 256-byte aligned: the scalars (struct ng_muon_scalars), then per group its
 * own x0 and x1 (the iterate, share x world matrices, bf16), a and b (the Gram matrix and the
 * polynomial of the share, bf16), the normalisation's partial sums and a cuBLASLt workspace
 * (NG_OPTIM_MUON_WS bytes): groups that run at once share nothing.
 */
#ifndef NG_GRAPH_OPTIM_MUON_H
#define NG_GRAPH_OPTIM_MUON_H

#include <cuda_runtime.h>
#include <stddef.h>

#include "graph/cpu_muon.h"
#include "graph/gpt.h"
#include "graph/ir.h"
#include "kernels/muon_ns.h"
#include "util/status.h"

#define NG_OPTIM_MUON_WS ((size_t)32 << 20) /* cuBLASLt workspace of the Newton-Schulz GEMMs */

struct ng_exec;

/* Where the parts of the scratch are, for a model and a number of ranks. */
struct ng_optim_muon_layout {
	int share[NG_MUON_GROUPS]; /* matrices per rank: ceil(batch / world) */
	size_t off_x0[NG_MUON_GROUPS], off_x1[NG_MUON_GROUPS]; /* bytes from the scratch start */
	size_t off_a[NG_MUON_GROUPS], off_b[NG_MUON_GROUPS];
	size_t off_part[NG_MUON_GROUPS], off_ws[NG_MUON_GROUPS];
	size_t bytes;              /* the whole scratch */
};

/* The plan of the op (held by the executor). */
struct ng_optim_muon {
	struct ng_optim_muon_layout lay;
	struct ng_muon_group grp[NG_MUON_GROUPS];
	int lo[NG_MUON_GROUPS];    /* this rank's first matrix of each group */
	int count[NG_MUON_GROUPS]; /* and how many (0 when world exceeds the batch) */
	struct ng_muon_ns ns[NG_MUON_GROUPS]; /* planned when count > 0 */
	cudaStream_t stream[NG_MUON_GROUPS + 1]; /* a group's, then Adam's */
	cudaEvent_t fork;          /* the scalars are written */
	cudaEvent_t join[NG_MUON_GROUPS + 1]; /* a stream's work is done */
};

void ng_optim_muon_layout(const struct ng_gpt_config *cfg, int world,
			  struct ng_optim_muon_layout *out);
/* The scratch bytes of the op (the builder's estimate uses world 1). */
size_t ng_optim_muon_scratch_bytes(const struct ng_gpt_config *cfg, int world);

/* Executor side (graph/exec*.c only). Plan once, before any capture; with tune (autotune and
 * not deterministic) each Newton-Schulz GEMM runs the fastest algorithm cuBLASLt offers, timed
 * on scratch memory freed again. */
enum ng_status ng_optim_muon_plan_(struct ng_exec *e, const struct ng_graph *g);
/* Enqueue the op on s; scratch: its scratch tensor. */
enum ng_status ng_optim_muon_run_(struct ng_exec *e, const struct ng_graph *g,
				  const struct ng_op *op, void *scratch, cudaStream_t s);
void ng_optim_muon_free_(struct ng_exec *e);

#endif
