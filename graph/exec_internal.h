/*
 * graph/exec_internal.h — what the executor's files (graph/exec*.c) share with each other; not
 * for use outside them. Names end in an underscore. Each group is the file it lives in.
 */
#ifndef NG_GRAPH_EXEC_INTERNAL_H
#define NG_GRAPH_EXEC_INTERNAL_H

#include "graph/exec.h"

/* Planning (exec_plan.c): graphs, data-parallel layout, kernel plans, the scratch sizes. */
enum ng_status ng_exec_plan_(struct ng_exec *e, const struct cudaDeviceProp *prop,
			     struct ng_exec_report *rep);
/* Find or make the plan of this matmul shape in e->plans; *idx its index. */
enum ng_status ng_exec_plan_spec_(struct ng_exec *e, struct ng_matmul_spec s, int *idx);

/* Timed choices and memory budgets (exec_trials.c); ms: the report's times of that trial. */
enum ng_status ng_exec_choose_gelu_fwd_(struct ng_exec *e, float ms[2], int *fuse);
enum ng_status ng_exec_choose_dgelu_(struct ng_exec *e, float ms[3], int *fuse);
enum ng_status ng_exec_choose_fp8_(struct ng_exec *e, int fuse_fwd, int fuse_bwd, int head_rows,
				   float ms[][2], int *mask);
enum ng_status ng_exec_agree_choices_(struct ng_exec *e, int *fuse, int *mask);
size_t ng_exec_fit_budget_(const struct ng_exec *e);
/* The smallest *budget of all ranks; *lowered = 1 when another rank's was smaller. */
enum ng_status ng_exec_agree_budget_(struct ng_exec *e, size_t *budget, int *lowered);
/* qsort's order of floats. */
int ng_exec_cmp_float_(const void *a, const void *b);

/* Launches (exec_dispatch.c). */
/* Device address of tensor t of graph g inside the arena. */
void *ng_exec_tensor_(const struct ng_exec *e, const struct ng_graph *g, int t);
/* Enqueue one op of g on e->stream (plan: its index into e->plans, or -1). */
enum ng_status ng_exec_run_op_(struct ng_exec *e, const struct ng_graph *g, const struct ng_op *op,
			       int plan);
/* The speedrun family's ops (exec_spr.c), and its attention and loss. */
enum ng_status ng_exec_run_spr_op_(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, void *scratch, cudaStream_t s);
/* Enqueue every op of g on e->stream, in order (eager launches, or inside a capture). */
enum ng_status ng_exec_run_eager_(struct ng_exec *e, const struct ng_graph *g, const int *pl);

/* --profile (exec_profile.c): e->op_ms from one step. */
enum ng_status ng_exec_profile_step_(struct ng_exec *e);

/* The state (exec_state.c). */
/* Parameters from the seeded init; grads, moments, the step state (and fp8 state) zeroed. */
enum ng_status ng_exec_reset_state_(struct ng_exec *e);
/* The split fp32 master (kernels/split.h) from host floats. */
enum ng_status ng_exec_upload_params_(struct ng_exec *e, const float *params);
/* --fp8 dinp: the gradient slots' first history entry, on a zeroed fp8_state. */
enum ng_status ng_exec_seed_grad_scales_(struct ng_exec *e, const struct ng_graph *g);
/* The fp32 master to host floats, from the bf16 copy and a device low half. */
enum ng_status ng_exec_join_params_(struct ng_exec *e, float *params, const uint16_t *d_lo);

/* Data parallelism (exec_dp.c). */
enum ng_status ng_exec_dp_shard_layout_(struct ng_exec *e, struct ng_graph *g);
enum ng_status ng_exec_dp_plan_overlap_(struct ng_exec *e);
enum ng_status ng_exec_dp_after_op_(struct ng_exec *e, const struct ng_graph *g, int i);
enum ng_status ng_exec_dp_grad_norm_(struct ng_exec *e, const struct ng_graph *g,
				   const struct ng_op *op, void *scratch, cudaStream_t s);
enum ng_status ng_exec_dp_adamw_shard_(struct ng_exec *e, const struct ng_graph *g,
				     const struct ng_op *op, cudaStream_t s);
enum ng_status ng_exec_dp_gather_state_(struct ng_exec *e, float *params, float *m, float *v);

#endif
