/*
 * graph/optim_muon.h — the MUON op of the training step on the GPU (--optimizer muon;
 * graph/ir.h): what its scratch holds, its plan (one strided-batched Newton-Schulz plan per
 * group of same-shape hidden matrices, graph/cpu_muon.h), and the launches run_op makes for it.
 *
 * The op, in order: the step's scalars (kernels/muon.h ng_muon_schedule); the speedrun's Adam on
 * every parameter that is not a hidden matrix; then for each group (qkv slices, attproj, fc,
 * fcproj): momentum + Nesterov into bf16 u (all matrices), the per-matrix normalisation and the
 * 5 Newton-Schulz steps on this rank's share (a contiguous range of ceil(batch / world)
 * matrices), the all-gather of the orthogonalised matrices (with a communicator, 1 rank
 * included), and the update of every matrix. Every rank then holds the same momentum and
 * weights. The momentum is the AdamW first-moment buffer's range of each matrix.
 *
 * Scratch, each part 256-byte aligned: the scalars (struct ng_muon_scalars); x0 and x1, the
 * iterate of the largest group ((share x world) matrices, bf16); a and b, the Gram matrix and
 * the polynomial of the share (bf16); the cuBLASLt workspace (NG_OPTIM_MUON_WS bytes).
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
	size_t off_x0, off_x1, off_a, off_b, off_ws; /* bytes from the scratch start */
	size_t bytes;              /* the whole scratch */
};

/* The plan of the op (held by the executor). */
struct ng_optim_muon {
	struct ng_optim_muon_layout lay;
	struct ng_muon_group grp[NG_MUON_GROUPS];
	int lo[NG_MUON_GROUPS];    /* this rank's first matrix of each group */
	int count[NG_MUON_GROUPS]; /* and how many (0 when world exceeds the batch) */
	struct ng_muon_ns ns[NG_MUON_GROUPS]; /* planned when count > 0 */
};

void ng_optim_muon_layout(const struct ng_gpt_config *cfg, int world,
			  struct ng_optim_muon_layout *out);
/* The scratch bytes of the op (the builder's estimate uses world 1). */
size_t ng_optim_muon_scratch_bytes(const struct ng_gpt_config *cfg, int world);

/* Executor side (graph/exec*.c only). Plan once, before any capture. */
enum ng_status ng_optim_muon_plan_(struct ng_exec *e, const struct ng_graph *g);
/* Enqueue the op on s; scratch: its scratch tensor. */
enum ng_status ng_optim_muon_run_(struct ng_exec *e, const struct ng_graph *g,
				  const struct ng_op *op, void *scratch, cudaStream_t s);
void ng_optim_muon_free_(struct ng_exec *e);

#endif
