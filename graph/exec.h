/*
 * graph/exec.h — the GPU executor: from the planned step IR (graph/step.h) to ONE device arena,
 * planned matmuls and attention, and a captured CUDA Graph replayed every step.
 *
 * Plan (ng_exec_init): build the train and eval graphs, size every workspace from the real
 * cuBLASLt / cuDNN plans and re-plan, one cudaMalloc for the arena, initialise the parameters
 * (graph/gpt.h init, identical to the CPU reference's), run the step once eagerly (loads every
 * module, surfaces errors with the node's name), restore the initial state, then capture the
 * step with cudaStreamCaptureModeGlobal so a forbidden call (sync, malloc) fails loudly.
 * Replay (ng_exec_submit): one cudaGraphLaunch per step, no host synchronisation; the tokens
 * come from a fixed pinned buffer that the graph's first node copies; metrics come back through
 * a host-mapped ring written by the last node, read a step late (ng_exec_collect).
 * Data parallelism (cfg.comm set, one process per GPU): inside the same captured step, right
 * before GRAD_NORM, the fp32 gradient is all-reduced to the mean over ranks (with the step's
 * loss), so every rank clips, schedules and updates identically. With cfg.zero1 the gradient is
 * reduce-scattered instead, each rank runs AdamW on its shard of ceil(total / world) parameters
 * (its moments are only that shard: adam_m / adam_v shrink to it), the squared norm is summed
 * across ranks, and the updated fp32 and bf16 parameters are all-gathered.
 * Overlap (all-reduce mode): in the last micro-batch, as soon as the op that writes a layer's
 * gradient for the last time has been enqueued, an event forks a second stream that all-reduces
 * that layer's slices while the backward of the layers below runs; GRAD_NORM joins the stream and
 * all-reduces the rest (embeddings, final layernorm, any layer not sent) with the loss.
 * The implementation is split by job into graph/exec*.c; graph/exec.c says which does what.
 */
#ifndef NG_GRAPH_EXEC_H
#define NG_GRAPH_EXEC_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime.h>
#include <cudnn.h>

#include "graph/ir.h"
#include "graph/step.h"
#include "kernels/attention.h"
#include "kernels/collective.h"
#include "kernels/matmul.h"
#include "kernels/muon.h"
#include "kernels/types.h"

#define NG_EXEC_RING 16       /* metrics records in flight, at most */
#define NG_EXEC_MAX_PLANS 64  /* distinct matmul shapes of one model */
#define NG_EXEC_SPR_BANDS 14  /* the speedrun window's largest W (graph/step_spr.h) */
#define NG_EXEC_FP8_KINDS 9   /* timed fp8 kinds: 5 forward, 4 dinp (graph/step.h) */

struct ng_exec_config {
	struct ng_gpt_config model;    /* checked configuration */
	int B, T, K;                   /* micro-batch, sequence length, micro-batches per step */
	int eval_batches;              /* batches per evaluation graph replay (0: no eval graph) */
	struct ng_step_options step;   /* recompute, classifier chunks, fused GELU */
	struct ng_schedule sched;      /* learning-rate schedule */
	float clip, wd, beta1, beta2, eps;
	uint64_t seed;                 /* parameter init */
	int deterministic;             /* bitwise-reproducible attention backward */
	int no_graph;                  /* launch the nodes eagerly every step */
	int force_naive_attention;     /* plain CUDA attention instead of cuDNN */
	int autotune;                  /* time cuBLASLt candidates at plan time (not with
	                                * deterministic: ng_exec_init turns it off) */
	const char *autotune_cache;    /* autotune: the directory that keeps its choices between
	                                * runs (a file per GPU and cuBLASLt); NULL or "": none */
	int no_own_gemm;               /* autotune never times our own GEMM as a bf16 forward
	                                * candidate (train --own-gemm off; kernels/matmul.h) */
	int rank, world;               /* data parallelism: this process's rank, ranks (1 alone) */
	struct ncclComm *comm;         /* NCCL communicator (src/dist.h); NULL: no collectives */
	int zero1;                     /* ZeRO-1: AdamW moments sharded across ranks (needs comm) */
	int dp_no_overlap;             /* all-reduce the whole gradient at GRAD_NORM, not per layer */
	int profile;                   /* time every op of one eager step at init (op_ms) */
	struct ng_muon_config muon;    /* step.muon (--optimizer muon): its constants */
	size_t gpu_mem;                /* with step.recompute_auto: the device memory in use the run
	                                * may reach (what is in use when the step is planned, plus
	                                * the arena); 0: what is free then, less a margin */
};

struct ng_exec_matmul {
	struct ng_matmul_spec spec;    /* the key */
	struct ng_matmul mm;           /* its plan, shared by every op of that shape */
};

/* What planning measured and chose, for the init log: ng_exec_init fills it when asked. Times
 * are ms a pass of what the trial ran (graph/exec_trials.c); -1: not timed (not asked for, or
 * no device memory to spare for the trial). */
struct ng_exec_report {
	float gelu_fwd_ms[2];          /* --gelu-fusion auto, FC forward: fused / plain + kernel */
	float dgelu_ms[3];             /* FC backward (FC-proj dinp, GELU backward, fc dW):
	                                * cuBLASLt's DGELU fused / unfused / our own GEMM's DGELU */
	float fp8_ms[NG_EXEC_FP8_KINDS][2]; /* --fp8 auto, per kind (forward qkv, attproj, fc,
	                                * fcproj, head; dinp qkv, attproj, fc, fcproj): bf16 / cast
	                                * + fp8 */
	int fit_lowered;               /* --recompute auto with ranks: another rank's budget, smaller
	                                * than this one's, is what the step was fitted to */
	char tune_cache_path[4096];    /* autotune's choices file, or "" when none is kept */
	int tune_loaded;               /* choices read from it */
	char tune_warning[512];        /* why it could not be read or written, or "" */
};

struct ng_exec {
	struct ng_exec_config cfg;
	struct ng_graph train;         /* the training step */
	struct ng_graph eval;          /* the evaluation step (kind EVAL), when eval_batches > 0 */
	char *arena;                   /* the one device allocation */
	size_t arena_bytes;
	cudaStream_t stream;
	cudaStream_t side_stream;      /* ENCODER_SORT, beside the forward (graph/ir.h) */
	cudaEvent_t side_fork, side_join; /* its fork from stream, and its join before ENCODER_BWD */
	cudnnHandle_t cudnn;
	struct ng_matmul_ctx mmctx;
	struct ng_attention att;       /* one plan: every layer has the same shape (GPT-2) */
	/* The speedrun model: a plan per band of k blocks of 128 tokens (att_band[k - 1], k = 1 ..
	 * NG_EXEC_SPR_BANDS), and a captured step per window W (spr_exec[W - 1]) whose long-window
	 * blocks use the band W and the others max(1, W / 2): cuDNN skips the tiles outside the
	 * band, so each step pays for its own window. The window itself is data (the per-query
	 * lower bounds), so every variant computes the same values. */
	struct ng_attention att_band[NG_EXEC_SPR_BANDS];
	cudaGraph_t spr_graph[NG_EXEC_SPR_BANDS];
	cudaGraphExec_t spr_exec[NG_EXEC_SPR_BANDS];
	int spr_variant;               /* the W - 1 whose bands the ops use (capture, eager) */
	struct ng_exec_matmul plans[NG_EXEC_MAX_PLANS];
	int n_plans;
	int *train_plan;               /* per train op: index into plans, or -1 */
	int *eval_plan;                /* per eval op */
	uint16_t *h_tokens;            /* pinned (K, B, T+1): the next step's tokens */
	float *h_stop;                 /* pinned: copied into the step state with the tokens */
	uint16_t *h_eval_tokens;       /* pinned (eval_batches, B, T+1) */
	struct ng_metrics_record *ring;   /* host-mapped pinned ring, NG_EXEC_RING records */
	struct ng_metrics_record *d_ring; /* its device address */
	cudaEvent_t h2d_done;          /* recorded inside the step right after the token copy */
	cudaEvent_t done[NG_EXEC_RING];/* recorded after each submitted step (timing events) */
	cudaEvent_t start;             /* recorded before step start_at (the first submitted step,
	                                * or the first after an evaluation) */
	cudaGraph_t train_graph;       /* the captured step (kept for the DOT dump) */
	cudaGraphExec_t train_exec;
	cudaGraph_t eval_graph;
	cudaGraphExec_t eval_exec;
	long long submitted;           /* steps launched */
	long long collected;           /* steps whose metrics were read */
	long long start_at;            /* the step whose time counts from `start` */
	bool restart_timing;           /* an evaluation or a snapshot came since the last step:
	                                * the next submit records `start` anew */
	long long step_base;           /* optimizer steps restored from a checkpoint (ring slots) */
	float *op_ms;                  /* profile: device ms of each train op (n_ops), or NULL */
	bool profile_replayed;         /* op_ms from graph replays (else eager launches) */
	double peak_flops;             /* bf16 dense peak of this GPU (by name), 0 if unknown */
	char device_name[256];
	size_t shard_len;              /* ZeRO-1: parameters per rank (ceil(total / world)) */
	size_t shard_off;              /* ZeRO-1: first parameter this rank updates */
	cudaStream_t dp_stream;        /* per-layer gradient all-reduces, overlapping the backward */
	cudaEvent_t *dp_ready;         /* per layer: recorded once its gradient is final */
	cudaEvent_t dp_join;           /* dp_stream's work done: GRAD_NORM waits on it */
	int *dp_bucket;                /* per train op: the layer whose gradient it completes, or -1 */
	bool *dp_sent;                 /* per layer: all-reduce launched in the current pass */
	struct ng_optim_muon *muon;    /* --optimizer muon: the MUON op's plan (graph/optim_muon.h) */
	bool inited;
};

/* --gelu-fusion auto's FC-backward choice from the trial's times (ms a pass; nv = 2: cuBLASLt's
 * DGELU epilogue, the unfused pair; nv = 3: also our own GEMM's DGELU): NG_GELU_FUSE_BWD,
 * NG_GELU_FUSE_BWD | NG_GELU_FUSE_OWN (ours only when >= 3% ahead of the better other), or 0. */
int ng_exec_pick_dgelu(const float *ms, int nv);

/* Plan, allocate, initialise and capture; *report (may be NULL) gets what planning measured and
 * chose. NG_ERR_INPUT when the plan does not fit the GPU (with the numbers and a hint),
 * NG_ERR_RUNTIME for CUDA/library failures. */
enum ng_status ng_exec_init(struct ng_exec *e, const struct ng_exec_config *cfg,
			    struct ng_exec_report *report);
void ng_exec_free(struct ng_exec *e);

/* The pinned buffer for the next step's K*B*(T+1) tokens; waits only until the previous step's
 * copy of it has run on the device. */
enum ng_status ng_exec_input(struct ng_exec *e, uint16_t **tokens);
/* Launch one step (graph replay, or the nodes eagerly with no_graph). */
enum ng_status ng_exec_submit(struct ng_exec *e);
/* Metrics of completed steps, oldest first (at most max); wait: until all submitted completed.
 * ms[i] (may be NULL) gets each step's device time, from the events between replays. */
enum ng_status ng_exec_collect(struct ng_exec *e, struct ng_metrics_record *out, float *ms, int max,
			       bool wait, int *n);
/* Ask to stop: every later step carries stop > 0 in its step state and metrics record (with
 * data parallelism reduced over ranks, so every rank sees it at the same step). */
void ng_exec_request_stop(struct ng_exec *e);
/* Mean loss over eval_batches batches of B*(T+1) tokens (synchronous). The speedrun model
 * attends within `window` blocks of 128 tokens (<= 0 or above NG_EXEC_SPR_BANDS: the widest);
 * GPT-2 models ignore it. */
enum ng_status ng_exec_evaluate(struct ng_exec *e, const uint16_t *tokens, int window,
				double *loss);

/* Copy a persistent flat buffer to the host as its bytes: t_grads (float), t_params_bf16 and
 * t_params_lo (uint16, the two halves of the master: kernels/split.h; ng_exec_snapshot gives
 * the fp32 master) ... any tensor index of the train graph (synchronous; not in a step). */
enum ng_status ng_exec_download(struct ng_exec *e, int tensor, void *host);
/* Print the profile (op_ms) grouped by op kind and layer type, largest first, to `f`. */
void ng_exec_print_profile(const struct ng_exec *e, void *file);
/* Copy host data into a persistent tensor of the train graph (synchronous; between steps). The
 * captured graph reads device memory only, so the next replay sees it without a re-capture. */
enum ng_status ng_exec_upload(struct ng_exec *e, int tensor, const void *host);
/* The training state between steps, into host buffers of lay.total floats: fp32 params (the
 * master joined from its bf16 copy and low half), AdamW m and v, and the step state. With
 * ZeRO-1 the low half and the moments are gathered from every rank's shard, so every rank
 * must call it at the same point; a rank that writes nothing passes NULL buffers. */
enum ng_status ng_exec_snapshot(struct ng_exec *e, float *params, float *m, float *v,
				long long *step, long long *n_skipped);
/* Restore a training state between steps: fp32 params (split into the bf16 copy and the low
 * half as AdamW splits them), AdamW m and v (each lay.total floats; with ZeRO-1 each rank keeps
 * its shard of the low half and the moments), grads zeroed, the step state {step,
 * n_skipped}; the metrics ring continues at slot `step`. */
enum ng_status ng_exec_restore(struct ng_exec *e, const float *params, const float *m,
			       const float *v, long long step, long long n_skipped);
/* Write cuda_graph.dot of the captured step to `path` and count its nodes by type into `text`. */
enum ng_status ng_exec_dump_cuda_graph(struct ng_exec *e, const char *path, char *text, size_t n);

#endif
