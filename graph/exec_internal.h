/*
 * graph/exec_internal.h — what exec.c shares with exec_host.c and exec_dp.c; not for use outside graph/exec*.
 */
#ifndef NG_GRAPH_EXEC_INTERNAL_H
#define NG_GRAPH_EXEC_INTERNAL_H

#include "graph/exec.h"

/* Device address of tensor t of graph g inside the arena. */
void *ng_exec_tensor_(const struct ng_exec *e, const struct ng_graph *g, int t);
/* Enqueue every op of g on e->stream, in order (eager launches, or inside a capture). */
enum ng_status ng_exec_run_eager_(struct ng_exec *e, const struct ng_graph *g, const int *pl);

/* Data parallelism (exec_dp.c). */
enum ng_status ng_exec_dp_shard_layout_(struct ng_exec *e, struct ng_graph *g);
enum ng_status ng_exec_dp_plan_overlap_(struct ng_exec *e);
enum ng_status ng_exec_dp_after_op_(struct ng_exec *e, const struct ng_graph *g, int i);
enum ng_status ng_exec_dp_grad_norm_(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, void *scratch, cudaStream_t s);
enum ng_status ng_exec_dp_adamw_shard_(struct ng_exec *e, const struct ng_graph *g,
				     const struct ng_op *op, cudaStream_t s);
enum ng_status ng_exec_dp_gather_state_(struct ng_exec *e, float *params, float *m, float *v);

/* The split fp32 master (kernels/split.h) to and from host floats (exec_host.c). */
enum ng_status ng_exec_upload_params_(struct ng_exec *e, const float *params);
/* --fp8 dinp: the gradient slots' first history entry, on a zeroed fp8_state (exec.c). */
enum ng_status ng_exec_seed_grad_scales_(struct ng_exec *e, const struct ng_graph *g);
enum ng_status ng_exec_join_params_(struct ng_exec *e, float *params, const uint16_t *d_lo);

#endif
