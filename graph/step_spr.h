/*
 * graph/step_spr.h — the speedrun model's steps as IR graphs (the ops of graph/ir.h "The
 * speedrun family"); graph/step.h's builders call these for arch NG_ARCH_SPEEDRUN.
 *
 * Training step, per micro-batch of B sequences of T tokens (the real run: B = 1, T = 49152):
 *   x0 = rmsnorm(wte[tok]); the value embeddings' rows ve_t[tok] once each;
 *   block l: (l >= L/2: x += skipw[j] * the output of block L/2-1-j, j = l - L/2)
 *            x = l0 x + l1 x0; x += attproj(attn(qk_rotary(qkv(rmsnorm(x))), vmix)) unless
 *            l is the block without attention; x += fcproj(relu2(fc(rmsnorm(x))));
 *   the head over rmsnorm(x) (untied, all Vp columns), the soft-capped loss summed over tokens;
 * then the backward in reverse and the update. The window (in 128-token blocks) at step s of S
 * is W = max(1, ceil(13.5 s / S)); long-window blocks see W * 128 tokens back, the others
 * max(1, W / 2) * 128; ATTN_BOUNDS computes it on the device from the step counter, so every
 * captured variant of the step (graph/exec.h) attends within the step's window. The eval
 * graph's ATTN_BOUNDS reads W from its eval_window tensor instead, which the host writes before
 * each evaluation: a validation during training uses the window of the step it follows (as the
 * reference run validates), `eval` the widest or the one asked for.
 */
#ifndef NG_GRAPH_STEP_SPR_H
#define NG_GRAPH_STEP_SPR_H

#include "graph/ir.h"
#include "graph/step.h"

enum ng_status ng_spr_build_train(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				  int T, int K, const struct ng_step_options *opt);
enum ng_status ng_spr_build_eval(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				 int T, int K, const struct ng_step_options *opt);
/* The speedrun model decodes outside the step IR (graph/sampler_spr.c, launched and captured by
 * graph/sampler.c), so there is no sample step to build: NG_ERR_INPUT with a hint. */
enum ng_status ng_spr_build_sample(struct ng_graph *g, const struct ng_gpt_config *cfg, int B,
				   int T, const struct ng_step_options *opt);

/* The window in 128-token blocks at optimizer step `step` (0-based) of `steps`. */
static inline int ng_spr_window_blocks(int step, int steps)
{
	if (steps <= 0)
		return 1;
	/* ceil(13.5 step / steps) = ceil(27 step / (2 steps)), in integers */
	long long num = 27LL * step, den = 2LL * steps;
	int w = (int)((num + den - 1) / den);
	return w < 1 ? 1 : w;
}

#endif
