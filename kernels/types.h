/*
 * kernels/types.h — the types shared by kernel launchers and their callers, valid C11.
 * bf16 travels through C as its 16 bits (ng_bf16); .cu files reinterpret it as __nv_bfloat16.
 */
#ifndef NG_KERNELS_TYPES_H
#define NG_KERNELS_TYPES_H

#include <stdint.h>

typedef uint16_t ng_bf16; /* bfloat16 bits */

/* The per-step scalars, in device memory. Kernels inside the captured graph read and write them,
 * so a replay sees this step's values (docs/DESIGN.md: a value passed as a kernel argument is
 * frozen into the graph at capture). */
struct ng_step_state {
	int step;          /* optimizer steps completed so far (0 before the first update) */
	int skipped;       /* 1 when this step's update is skipped (non-finite loss or grad norm) */
	int n_skipped;     /* updates skipped since the start */
	float lr;          /* learning rate of this step */
	float grad_norm;   /* global L2 norm of the gradient, before clipping */
	float clip_scale;  /* gradients are multiplied by this in AdamW (min(1, clip/norm)) */
	float loss_sum;    /* sum over this step's tokens of the per-token loss, times 1/ntokens */
	float stop;        /* > 0: a rank asked to stop (copied in with the tokens; with data
	                    * parallelism the mean over ranks, reduced with loss_sum) */
};

/* The learning-rate schedule: constants of the run, so passing them by value is fine. */
struct ng_schedule {
	float lr_max;      /* peak learning rate */
	float final_frac;  /* lr at the last step = lr_max * final_frac */
	int warmup;        /* linear warmup steps (lr at step s < warmup: lr_max * (s+1)/warmup) */
	int total;         /* total optimizer steps of the run */
	int cosine;        /* 1 cosine decay, 0 linear decay */
};

/* One metrics record, written by the device into a host-mapped pinned ring, slot step % N. */
struct ng_metrics_record {
	int step;          /* the step these metrics belong to (1-based after the update) */
	int skipped;
	float loss;
	float grad_norm;
	float lr;
	float stop;        /* the step state's stop: equal on every rank */
	float pad_[2];
};

#endif
