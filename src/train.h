/*
 * src/train.h — the training loop shared by the CPU reference and the GPU step: schedule,
 * data feeding, validation, logging (per-step line on stderr, --metrics JSONL) and the summary.
 * The device-specific part is a backend (a small table of functions), so both paths run the
 * same loop and print the same lines.
 */
#ifndef NG_SRC_TRAIN_H
#define NG_SRC_TRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/muon.h"
#include "src/checkpoint.h"
#include "src/cli.h"

struct ng_train_opts {
	struct ng_shape shape;     /* model, B, T, K */
	long long steps;           /* optimizer steps */
	double lr;                 /* peak learning rate */
	long long warmup;          /* warmup steps */
	double lr_final_frac;      /* final lr / peak lr */
	const char *schedule;      /* "cosine" or "linear" */
	double weight_decay;       /* on 2-D weights only */
	double clip;               /* global-norm clip; 0 = off */
	double beta1, beta2, eps;  /* AdamW */
	const char *train_glob;    /* NULL: the synthetic corpus */
	bool no_shuffle;           /* read training windows in file order (peer parity runs) */
	const char *val_glob;      /* NULL: synthetic (or none with --train) */
	long long val_every;       /* validate every N steps (and at the end); 0 = only at the end */
	double target_val_loss;    /* > 0: stop after the first validation at or below this loss */
	long long val_batches;     /* micro-batches per validation */
	const char *out_dir;       /* checkpoints */
	long long ckpt_every;      /* write a checkpoint every N steps (0: only on a signal) */
	bool resume;               /* continue from the latest checkpoint in out_dir */
	long long stop_after;      /* checkpoint and stop after this step (0: never), as a signal */
	const char *init_path;     /* start from this model file's weights (NULL: seeded init) */
	long long seed;
	bool deterministic;
	bool no_graph;
	const char *device;        /* "cuda" or "cpu" */
	const char *metrics_path;  /* JSONL, or NULL */
	long long log_every;       /* print a step line every N steps (the JSONL has every step) */
	int rank, world;           /* data parallelism (src/dist.h); world 0 or 1: one process */
	struct ng_dist *dist;      /* the bootstrap with the NCCL communicator, or NULL */
	bool zero1;                /* ZeRO-1: AdamW moments sharded across ranks */
	bool no_overlap;           /* all-reduce the gradient in one piece after the backward */
	bool profile;              /* GPU: time every op of one step at start and print the table */
	bool autotune;             /* GPU: time cuBLASLt candidates per matmul shape at plan time */
	const char *own_gemm;      /* GPU: --own-gemm auto (NULL: the same) | off */
	const char *autotune_cache; /* GPU: directory keeping autotune's choices, "none", or NULL
	                            * ($XDG_CACHE_HOME/nanograph or ~/.cache/nanograph) */
	const char *recompute;     /* GPU: "gelu,layernorm", "gelu", "layernorm", "none" or "auto" */
	double gpu_mem_gib;        /* GPU: device memory the run may have in use; 0: what is free
	                            * (--recompute auto fits the step into it) */
	long long head_chunk;      /* GPU: classifier rows per chunk, 0 = all B*T at once */
	const char *gelu_fusion;   /* GPU: --gelu-fusion fwd,bwd | fwd | bwd | none (NULL: default) */
	bool fp8;                  /* GPU: E4M3 forward matmuls (graph/step.h "FP8") */
	bool fp8_dw;               /* GPU, with fp8: the weight-gradient matmuls in FP8 too */
	bool head_bf16;            /* GPU, speedrun model: the head's forward in bf16, not FP8 */
	const char *optimizer;     /* "adamw" (NULL too) or "muon" (kernels/muon.h: Muon on the
	                            * hidden matrices, the speedrun's Adam on the rest) */
	struct ng_muon_config muon; /* --optimizer muon: its constants (total = steps) */
};

/* --optimizer muon. */
static inline bool ng_train_is_muon(const struct ng_train_opts *o)
{
	return o->optimizer && o->optimizer[0] == 'm';
}

/* What a backend reports for one optimizer step. */
struct ng_step_result {
	long long step;    /* 1-based */
	double loss;       /* mean training loss over the step's K*B*T tokens */
	double grad_norm;  /* before clipping */
	double lr;
	bool skipped;      /* update skipped: non-finite loss or gradient */
	bool stop;         /* a rank asked to stop by this step (request_stop; same on every rank) */
	double ms;         /* the step's time (GPU: device time between replays); 0 = unknown */
};

struct ng_backend {
	const char *name;          /* "cpu", "cuda" */
	void *ctx;
	double peak_flops;         /* for MFU; 0 = unknown */
	/* Where the next step's K*B*(T+1) tokens go; blocks only until the previous contents are
	 * consumed (the GPU's H2D copy of the previous step has run). */
	enum ng_status (*input_buffer)(void *ctx, uint16_t **buf);
	/* Start one optimizer step on the tokens in the input buffer. */
	enum ng_status (*submit)(void *ctx);
	/* Results of completed steps, oldest first; returns how many were written (<= max). When
	 * `wait` is set, blocks until every submitted step has completed. */
	enum ng_status (*collect)(void *ctx, struct ng_step_result *out, int max, bool wait, int *n);
	/* Mean loss over n micro-batches of B*(T+1) tokens (synchronous). The speedrun model
	 * attends within `window` 128-token blocks (0: the widest, ng_spr_window_blocks(1, 1));
	 * GPT-2 models ignore it. */
	enum ng_status (*evaluate)(void *ctx, const uint16_t *tokens, int n, int window,
				   double *loss);
	/* Copy the training state out, between steps with nothing in flight: fills s->step,
	 * s->n_skipped and s->params/m/v (allocated here with ng_ckpt_state_alloc, in the master
	 * copy's precision), and *params32 (malloc'ed fp32 model weights, lay.total). With
	 * ZeRO-1 every rank calls it (the moments are gathered); ranks other than 0 get nothing. */
	enum ng_status (*save_state)(void *ctx, struct ng_train_state *s, float **params32);
	/* Restore s (F32 or F64 buffers, checked against the run's shape by the loop). */
	enum ng_status (*load_state)(void *ctx, const struct ng_train_state *s);
	/* Data parallelism: mark the steps submitted from now on as "stop asked" (NULL: one
	 * process, the loop stops by itself). */
	void (*request_stop)(void *ctx);
	void (*free)(void *ctx);
};

enum ng_status ng_train_run(const struct ng_train_opts *opts, struct ng_backend *be);

/* Backends. */
enum ng_status ng_backend_cpu_init(struct ng_backend *be, const struct ng_train_opts *opts);
enum ng_status ng_backend_cuda_init(struct ng_backend *be, const struct ng_train_opts *opts);

#endif
