/*
 * graph/step_build.h — the graph builder's primitives, shared by the two model families' step
 * builders (graph/step.c for GPT-2, graph/step_spr.c for the speedrun model). Internal to graph/.
 *
 * A builder emits ops in execution order into one ng_graph: tensors are added as they are first
 * needed (activations named "<m>L<l>.<what>", see graph/step.c), ops get their display name,
 * micro-batch and phase from the builder's state, and a workspace (a SCRATCH tensor) when asked.
 */
#ifndef NG_GRAPH_STEP_BUILD_H
#define NG_GRAPH_STEP_BUILD_H

#include <stddef.h>

#include "graph/ir.h"
#include "graph/step.h"

/* The builder's state while it emits one graph. */
struct ng_bld {
	struct ng_graph *g;
	struct ng_step_workspace ws; /* workspace sizes in use */
	int micro;                   /* current micro-batch, -1 outside */
	enum ng_phase phase;         /* phase of the ops being emitted */
	char pfx[16];                /* "m3." when K > 1, else "" */
	size_t B, T, C, Vp, N;       /* sizes as size_t for shape arithmetic */
};

/* An op's tensor list: IN(a, b, c) expands to the count and a compound-literal array. */
#define IN(...) (int)(sizeof((int[]){ __VA_ARGS__ }) / sizeof(int)), (int[]){ __VA_ARGS__ }
#define OUT(...) IN(__VA_ARGS__)

/* An activation "<pfx><name>" (ndim <= 3; unused dims 1); its index, -1 on failure (sticky). */
int ng_bld_act(struct ng_bld *b, const char *name, enum ng_dtype dt, int ndim, size_t s0,
	       size_t s1, size_t s2);
/* The same named "<pfx>L<l>.<what>". */
int ng_bld_lact(struct ng_bld *b, int l, const char *what, enum ng_dtype dt, int ndim, size_t s0,
		size_t s1, size_t s2);
/* Name, micro-batch and phase the op, attach a workspace of ws_bytes (none when 0), add it. */
int ng_bld_emit(struct ng_bld *b, struct ng_op *op, size_t ws_bytes);
/* An op of `kind` with its tensors. */
struct ng_op ng_bld_mk(enum ng_op_kind kind, enum ng_op_which which, int layer, int n_in,
		       const int *in, int n_out, const int *out);
/* Check the sizes, reset g, declare the persistent tensors (the same in every graph kind of a
 * model) and the token buffer, and emit TOKENS_H2D. */
enum ng_status ng_bld_begin(struct ng_bld *b, struct ng_graph *g, enum ng_graph_kind kind,
			    const struct ng_gpt_config *cfg, int B, int T, int K,
			    const struct ng_step_options *opt);
void ng_bld_enter_micro(struct ng_bld *b, int m);
void ng_bld_leave_micro(struct ng_bld *b, enum ng_phase phase);
/* --fp8 train graphs (graph/step.h "FP8"): when op's kind is an fp8 one, make it so (its E4M3
 * weights and the scales as inputs, inp8 the E4M3 copy of its input when a norm wrote one, else
 * -1) and return the scratch bytes it needs in front to cast its input; 0 otherwise. */
size_t ng_bld_fp8_in(struct ng_bld *b, struct ng_op *op, size_t ic, int inp8);
/* Make op an fp8 matmul: its E4M3 weights (W^T when transposed; with --recompute fp8 the bf16
 * ones, cast by the op) and fp8_state as its next inputs; returns the scratch bytes of that
 * cast (0 without --recompute fp8). */
size_t ng_bld_fp8_weights(struct ng_bld *b, struct ng_op *op, int transposed);
/* --fp8 train graphs: when op (a DINP matmul, row_count set) is of an fp8 dinp kind, make it so
 * (W^T in E4M3, or W with --recompute fp8, and the scales as inputs) and return the scratch
 * bytes in front for dout's E5M2 copy (and W^T's cast with --recompute fp8); 0 otherwise. */
size_t ng_bld_fp8_dinp(struct ng_bld *b, struct ng_op *op);
/* --fp8-dw train graphs (graph/step.h "FP8", NG_FP8_DW_*): when op (a layer's DW matmul,
 * row_count and param set) is of an fp8 dW kind and its rows come in whole 16-row groups,
 * make it so (fp8_state as its next input) and return the scratch bytes in front for its
 * transposes and column sums; with `share`, when the kind's dinp is fp8 too, also give it the
 * E5M2 dout that the dinp reads next (*d8, "dout8.<kind>"; else -1). 0 otherwise. */
size_t ng_bld_fp8_dw(struct ng_bld *b, struct ng_op *op, int share, int *d8);
/* --fp8 train graphs: the FP8_PREP op (scales rolled, weights cast), first after the tokens. */
void ng_bld_fp8_prep(struct ng_bld *b);
/* The first dW matmul of each (linear layer, layer) overwrites its gradient (graph/step.c). */
void ng_bld_mark_first_writers(struct ng_graph *g);
/* Plan and validate; on failure free g. Returns the status. */
enum ng_status ng_bld_finish(struct ng_graph *g);

#endif
