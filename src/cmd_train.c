/*
 * src/cmd_train.c — `nanograph train`: flags of the docs/DESIGN.md contract into ng_train_opts,
 * the backend chosen by --device, then the shared loop (train.c).
 */
#include <stdio.h>
#include <string.h>

#include "graph/step.h"
#include "kernels/check.h"
#include "src/commands.h"
#include "src/dist.h"
#include "src/train.h"

enum ng_status ng_cmd_train(int argc, char **argv)
{
	struct ng_train_opts o = {
		.steps = 200, .lr = 6e-4, .warmup = 20, .lr_final_frac = 0.1,
		.schedule = "cosine", .weight_decay = 0.1, .clip = 1.0, .beta1 = 0.9,
		.beta2 = 0.95, .eps = 1e-8, .val_every = 0, .val_batches = 8, .out_dir = "out",
		.seed = 1337, .device = "cuda", .log_every = 0, .head_chunk = NG_HEAD_CHUNK_DEFAULT,
	};
	struct ng_model_args ma;
	struct ng_dist_args da = { .world = 0, .rank = -1, .file = NULL };
	struct ng_flag flags[NG_MODEL_NFLAGS + 56];
	/* --optimizer muon (kernels/muon.h; defaults of ng_muon_config_default) */
	double muon_lr = 0.05, adam_lr = 0.008, embed_mult = 1, scalar_mult = 5, cooldown = 0.4;
	double head_mult = 27.5, adam_eps = 1e-10;
	long long mu_warmup = 300;
	ng_cli_model_flags(&ma, flags, "d12", 0); /* --model tiny: --batch 8 */
	struct ng_flag more[] = {
		{ "--steps", NG_FLAG_INT, &o.steps, 1, 1e12, "N",
		  "optimizer steps (200; 1770 for --model speedrun, the reference run's)", false },
		{ "--lr", NG_FLAG_DOUBLE, &o.lr, 0, 10, "X", "peak learning rate (6e-4; 3e-3 for --model tiny)", false },
		{ "--warmup", NG_FLAG_INT, &o.warmup, 0, 1e12, "N", "linear warmup steps (20)",
		  false },
		{ "--lr-final-frac", NG_FLAG_DOUBLE, &o.lr_final_frac, 0, 1, "X",
		  "final lr as a fraction of the peak (0.1)", false },
		{ "--schedule", NG_FLAG_STRING, &o.schedule, 0, 0, "cosine|linear",
		  "decay after warmup (cosine)", false },
		{ "--weight-decay", NG_FLAG_DOUBLE, &o.weight_decay, 0, 10, "X",
		  "AdamW decoupled weight decay on 2-D weights (0.1)", false },
		{ "--clip", NG_FLAG_DOUBLE, &o.clip, 0, 1e6, "X",
		  "global gradient-norm clip, 0 = off (1.0)", false },
		{ "--train", NG_FLAG_STRING, &o.train_glob, 0, 0, "GLOB",
		  "training shards (default: the built-in synthetic corpus)", false },
		{ "--no-shuffle", NG_FLAG_BOOL, &o.no_shuffle, 0, 0, NULL,
		  "read training windows in file order (as the PyTorch peer does)", false },
		{ "--val", NG_FLAG_STRING, &o.val_glob, 0, 0, "GLOB", "validation shards", false },
		{ "--val-every", NG_FLAG_INT, &o.val_every, 0, 1e12, "N",
		  "validate every N steps, 0 = at the end only (0; with --val and --model speedrun "
		  "125, the reference run's)", false },
		{ "--val-batches", NG_FLAG_INT, &o.val_batches, 0, 1e6, "N",
		  "micro-batches per validation (8; with --val and --model speedrun 213 sequences, "
		  "the reference's 10,485,760 validation tokens to within one sequence)", false },
		{ "--target-val-loss", NG_FLAG_DOUBLE, &o.target_val_loss, 0, 1e6, "X",
		  "stop after the first validation (--val-every) at or below X and print the "
		  "training time (validation and checkpoints excluded; with --resume, of all the "
		  "run's parts) and tokens it took; 0 = never (0)", false },
		{ "--out", NG_FLAG_STRING, &o.out_dir, 0, 0, "DIR", "checkpoint directory (out)",
		  false },
		{ "--ckpt-every", NG_FLAG_INT, &o.ckpt_every, 0, 1e12, "N",
		  "write a checkpoint every N steps", false },
		{ "--resume", NG_FLAG_BOOL, &o.resume, 0, 0, NULL,
		  "continue from the latest checkpoint in --out", false },
		{ "--stop-after", NG_FLAG_INT, &o.stop_after, 0, 1e12, "N",
		  "checkpoint and stop after step N, as SIGINT/SIGTERM do (0 = never)", false },
		{ "--init", NG_FLAG_STRING, &o.init_path, 0, 0, "FILE",
		  "start from a model safetensors file (ours of either family, or HF GPT-2) "
		  "instead of the seeded init", false },
		{ "--seed", NG_FLAG_INT, &o.seed, 0, 9e18, "N", "init and data order (1337)",
		  false },
		{ "--deterministic", NG_FLAG_BOOL, &o.deterministic, 0, 0, NULL,
		  "bitwise-reproducible kernels (deterministic attention backward)", false },
		{ "--no-graph", NG_FLAG_BOOL, &o.no_graph, 0, 0, NULL,
		  "launch the step's nodes eagerly instead of replaying the CUDA Graph", false },
		{ "--device", NG_FLAG_STRING, &o.device, 0, 0, "cuda|cpu",
		  "cuda (default) or cpu (the double-precision reference)", false },
		{ "--metrics", NG_FLAG_STRING, &o.metrics_path, 0, 0, "FILE",
		  "one JSON object per step (and per validation)", false },
		{ "--profile", NG_FLAG_BOOL, &o.profile, 0, 0, NULL,
		  "GPU: time every op in replays of the captured step at start; print where the "
		  "time goes", false },
		{ "--autotune", NG_FLAG_BOOL, &o.autotune, 0, 0, NULL,
		  "GPU: time the top cuBLASLt algorithms of each matmul shape at plan time, under "
		  "sustained load (~20 s more start-up the first time: the choices are kept, see "
		  "--autotune-cache); off with --deterministic", false },
		{ "--own-gemm", NG_FLAG_STRING, &o.own_gemm, 0, 0, "auto|off",
		  "GPU: with --autotune, also time our own Hopper GEMM for each bf16 forward matmul "
		  "and keep it where it is faster, and run the speedrun model's relu^2 in its "
		  "fc forward's epilogue (auto, the default), or never (off)", false },
		{ "--autotune-cache", NG_FLAG_STRING, &o.autotune_cache, 0, 0, "DIR",
		  "GPU: where --autotune keeps its choices for the next run, a file per GPU and "
		  "cuBLASLt, or none ($XDG_CACHE_HOME/nanograph, else ~/.cache/nanograph)", false },
		{ "--recompute", NG_FLAG_STRING, &o.recompute, 0, 0, "WHAT",
		  "GPU: recompute to save memory, a comma list of gelu, layernorm and fp8 (with --fp8: "
		  "cast each E4M3 weight at its use instead of keeping copies), none (default), or "
		  "auto: the least recompute, layer by layer, that fits --gpu-mem", false },
		{ "--gpu-mem", NG_FLAG_DOUBLE, &o.gpu_mem_gib, 0.01, 1e6, "GIB",
		  "GPU: with --recompute auto, the device memory the run may have in use (as the "
		  "init log counts it; default: what is free at start)", false },
		{ "--head-chunk", NG_FLAG_INT, &o.head_chunk, 0, 1 << 30, "ROWS",
		  "GPU: classifier rows per chunk, 0 = all B*T rows at once (16384)", false },
		{ "--gelu-fusion", NG_FLAG_STRING, &o.gelu_fusion, 0, 0, "WHAT",
		  "GPU: GELU / DGELU as matmul epilogues: auto | fwd,bwd | fwd,own | fwd | bwd | own | "
		  "none (own: the DGELU on our own Hopper GEMM, sm_90; auto: "
		  "each where it times faster at plan time)", false },
		{ "--fp8", NG_FLAG_BOOL, &o.fp8, 0, 0, NULL,
		  "GPU (sm_89+): matmuls in FP8 with per-tensor scales where they time faster: "
		  "forward E4M3, input gradients E5M2 x E4M3 (weight gradients stay bf16)", false },
		{ "--fp8-dw", NG_FLAG_BOOL, &o.fp8_dw, 0, 0, NULL,
		  "GPU, with --fp8: the weight-gradient matmuls of the layer kinds whose forward is "
		  "FP8 in FP8 too (E5M2 gradient x E4M3 input, the bias gradient from the same "
		  "cast)", false },
		{ "--head-bf16", NG_FLAG_BOOL, &o.head_bf16, 0, 0, NULL,
		  "GPU, speedrun model: the head's forward matmul in bf16 (default: FP8 E4M3 with "
		  "per-tensor scales, as the speedrun's, on sm_89+)", false },
		{ "--log-every", NG_FLAG_INT, &o.log_every, 0, 1e12, "N",
		  "print every Nth step line (default: about 50 lines per run)", false },
		{ "--world", NG_FLAG_INT, &da.world, 1, 1 << 20, "N",
		  "data parallelism: N processes, one per GPU (or env NG_WORLD; mpirun and srun "
		  "need no flag); --world 1 runs one GPU through NCCL", false },
		{ "--rank", NG_FLAG_INT, &da.rank, 0, 1 << 20, "R",
		  "this process's rank in [0, N) (or env NG_RANK)", false },
		{ "--dist-file", NG_FLAG_STRING, &da.file, 0, 0, "PATH",
		  "rendezvous file every rank can read (or env NG_DIST_FILE)", false },
		{ "--zero1", NG_FLAG_BOOL, &o.zero1, 0, 0, NULL,
		  "ZeRO-1: shard the AdamW moments across ranks (reduce-scatter + all-gather)",
		  false },
		{ "--no-overlap", NG_FLAG_BOOL, &o.no_overlap, 0, 0, NULL,
		  "all-reduce the gradient after the backward instead of per layer during it",
		  false },
		{ "--optimizer", NG_FLAG_STRING, &o.optimizer, 0, 0, "adamw|muon",
		  "adamw (default), or muon: Muon (5 bf16 Newton-Schulz steps) on the hidden "
		  "matrices and the speedrun's Adam (0.8, 0.95, eps 1e-10, no decay) on the rest, "
		  "lr constant then a linear cooldown to 0.1x; --lr, --warmup, --schedule and "
		  "--weight-decay are AdamW's and unused; --clip is off unless given", false },
		{ "--muon-lr", NG_FLAG_DOUBLE, &muon_lr, 0, 10, "X",
		  "muon: Muon's learning rate (0.05)", false },
		{ "--muon-momentum-warmup", NG_FLAG_INT, &mu_warmup, 0, 1e12, "N",
		  "muon: steps over which the momentum rises linearly 0.85 -> 0.95 (300)", false },
		{ "--adam-lr", NG_FLAG_DOUBLE, &adam_lr, 0, 10, "X",
		  "muon: the base lr of Adam's groups, times --adam-embed-mult or "
		  "--adam-scalar-mult (0.008)", false },
		{ "--adam-embed-mult", NG_FLAG_DOUBLE, &embed_mult, 0, 1e6, "X",
		  "muon: Adam lr multiplier of wte (the tied head) and wpe (1: lr 0.008, the "
		  "speedrun's head lr; its untied embedding's 75 = 0.6 diverges when tied)", false },
		{ "--adam-scalar-mult", NG_FLAG_DOUBLE, &scalar_mult, 0, 1e6, "X",
		  "muon: Adam lr multiplier of biases and LayerNorm weights, and of the speedrun "
		  "model's scalars (5: lr 0.04)", false },
		{ "--adam-head-mult", NG_FLAG_DOUBLE, &head_mult, 0, 1e6, "X",
		  "muon: Adam lr multiplier of the speedrun model's untied head (27.5: lr 0.22)",
		  false },
		{ "--cooldown-frac", NG_FLAG_DOUBLE, &cooldown, 0, 1, "X",
		  "muon: last fraction of the steps with the linear lr cooldown to 0.1x (0.4)",
		  false },
		{ "--adam-eps", NG_FLAG_DOUBLE, &adam_eps, 0, 1, "X",
		  "muon: Adam's epsilon, added to the root of its uncorrected second moment (1e-10)",
		  false },
	};
	int nmore = (int)(sizeof(more) / sizeof(more[0]));
	memcpy(flags + NG_MODEL_NFLAGS, more, sizeof(more));
	struct ng_command_spec spec = {
		.name = "train",
		.summary = "Train a GPT. On the GPU the whole step (K micro-batches of forward and "
			   "backward, clipping, schedule, AdamW) is one CUDA Graph replayed per step.",
		.usage = "[model] [batch] [--steps N] [--lr X] ... (flags below)",
		.flags = flags,
		.nflags = NG_MODEL_NFLAGS + nmore,
	};
	char *pos[1];
	int npos;
	bool help;
	enum ng_status st = ng_cli_parse(&spec, argc, argv, pos, &npos, &help);
	if (st || help)
		return st;
	/* tiny is for the CPU reference: a small default micro-batch, and a learning rate that
	 * gets near the synthetic corpus's floor in a few hundred steps */
	if (ma.model && strcmp(ma.model, "tiny") == 0) {
		if (!ng_cli_seen(&spec, "--batch"))
			ma.batch = 8;
		if (!ng_cli_seen(&spec, "--lr"))
			o.lr = 3e-3;
	}
	st = ng_cli_resolve_shape(&ma, &o.shape);
	if (st)
		return st;
	/* the speedrun model trains as its reference does: one long sequence, Muon with its
	 * untied embeddings' Adam rate, the loss summed over the step's tokens, no clipping */
	if (o.shape.model.arch == NG_ARCH_SPEEDRUN) {
		if (!ng_cli_seen(&spec, "--optimizer"))
			o.optimizer = "muon";
		if (!ng_cli_seen(&spec, "--adam-embed-mult"))
			embed_mult = 75;
		if (!ng_cli_seen(&spec, "--clip"))
			o.clip = 0;
	}
	/* --model speedrun is the reference run (docs/DESIGN.md "The speedrun model"): its steps,
	 * and with --val its validation cadence and set (10,485,760 tokens, the largest whole
	 * number of sequences in it) */
	if (ma.model && strcmp(ma.model, "speedrun") == 0) {
		if (!ng_cli_seen(&spec, "--steps"))
			o.steps = 1770;
		if (o.val_glob && !ng_cli_seen(&spec, "--val-every"))
			o.val_every = 125;
		long long seq = (long long)o.shape.B * o.shape.T;
		if (o.val_glob && !ng_cli_seen(&spec, "--val-batches") && seq > 0)
			o.val_batches = 10485760 / seq > 0 ? 10485760 / seq : 1;
	}
	struct ng_step_options rc;
	if (o.recompute && (st = ng_step_parse_recompute(o.recompute, o.fp8, &rc)))
		return st;
	if (ng_cli_seen(&spec, "--gpu-mem") && !(o.recompute && rc.recompute_auto))
		return ng_fail(NG_ERR_INPUT, "train --gpu-mem: only --recompute auto reads it "
			       "(it fits the step's recompute into that much device memory)");
	int gelu_mask;
	if (o.gelu_fusion && (st = ng_step_parse_gelu_fusion(o.gelu_fusion, &gelu_mask)))
		return st;
	if (o.own_gemm && strcmp(o.own_gemm, "auto") != 0 && strcmp(o.own_gemm, "off") != 0)
		return ng_fail(NG_ERR_INPUT, "train --own-gemm: '%s' is not auto or off", o.own_gemm);
	if (strcmp(o.schedule, "cosine") != 0 && strcmp(o.schedule, "linear") != 0)
		return ng_fail(NG_ERR_INPUT, "train --schedule: '%s' is not cosine or linear",
			       o.schedule);
	if (o.warmup > o.steps)
		o.warmup = o.steps;
	if (o.optimizer && strcmp(o.optimizer, "adamw") != 0 && strcmp(o.optimizer, "muon") != 0)
		return ng_fail(NG_ERR_INPUT, "train --optimizer: '%s' is not adamw or muon",
			       o.optimizer);
	if (ng_train_is_muon(&o)) {
		o.muon = ng_muon_config_default((int)o.steps);
		o.muon.lr = (float)muon_lr;
		o.muon.mu_warmup = (int)mu_warmup;
		o.muon.adam_lr = (float)adam_lr;
		o.muon.adam_mult[NG_MUON_ADAM_EMBED] = (float)embed_mult;
		o.muon.adam_mult[NG_MUON_ADAM_SCALAR] = (float)scalar_mult;
		o.muon.adam_mult[NG_MUON_ADAM_HEAD] = (float)head_mult;
		o.muon.cooldown_frac = (float)cooldown;
		o.muon.eps = (float)adam_eps;
		if (!ng_cli_seen(&spec, "--clip")) /* the speedrun clips nothing */
			o.clip = 0;
		if (o.zero1) {
			ng_fail(NG_ERR_INPUT, "train --optimizer muon: --zero1 shards AdamW's moments, "
				"which Muon does not have");
			ng_hint("drop --zero1: with ranks Muon divides its Newton-Schulz work among "
				"them instead");
			return NG_ERR_INPUT;
		}
	}
	if (o.val_glob && !o.train_glob)
		return ng_fail(NG_ERR_INPUT, "train: --val needs --train (without --train the "
			       "synthetic corpus provides its own validation stream)");
	if (o.log_every == 0)
		o.log_every = o.steps <= 50 ? 1 : (o.steps + 49) / 50;

	struct ng_dist dist = { 0 };
	struct ng_dist_plan plan;
	if ((st = ng_dist_resolve(&plan, &da)))
		return st;
	if (plan.method != NG_DIST_METHOD_NONE && strcmp(o.device, "cuda") != 0)
		return ng_fail(NG_ERR_INPUT, "train: data parallelism (%s, world %d) needs "
			       "--device cuda", ng_dist_method_name(plan.method), plan.world);
	if (o.zero1 && plan.method == NG_DIST_METHOD_NONE)
		return ng_fail(NG_ERR_INPUT, "train --zero1: needs data parallelism (--world N, "
			       "mpirun or srun)");

	if (o.target_val_loss > 0 && (o.val_every == 0 || o.val_batches == 0)) {
		ng_fail(NG_ERR_INPUT, "train --target-val-loss: no validation during the run to "
			"compare with it");
		ng_hint("add --val-every N (and --val GLOB with --train)");
		return NG_ERR_INPUT;
	}
	if (o.target_val_loss > 0 && plan.world > 1)
		return ng_fail(NG_ERR_INPUT, "train --target-val-loss: one process only (rank 0 "
			       "validates, and the ranks would not stop at the same step)");
	struct ng_backend be;
	if (o.fp8_dw && !o.fp8) {
		ng_fail(NG_ERR_INPUT, "train --fp8-dw: weight gradients in FP8 need --fp8 (their "
			"input's scale is the FP8 forward's)");
		ng_hint("add --fp8");
		return NG_ERR_INPUT;
	}
	if (strcmp(o.device, "cpu") == 0 && o.fp8) {
		ng_fail(NG_ERR_INPUT, "train --fp8: the CPU reference computes in double precision "
			"and has no FP8 path");
		ng_hint("drop --fp8, or train on the GPU (--device cuda)");
		return NG_ERR_INPUT;
	}
	if (strcmp(o.device, "cpu") == 0) {
		st = ng_backend_cpu_init(&be, &o);
	} else if (strcmp(o.device, "cuda") == 0) {
		if (ng_cuda_device_count() == 0) {
			ng_fail(NG_ERR_RUNTIME, "no CUDA device found");
			ng_hint("train on the CPU reference with --device cpu (small models only, "
				"e.g. --model tiny)");
			return NG_ERR_RUNTIME;
		}
		st = ng_dist_init(&dist, &da);
		if (!st && dist.comm) {
			o.dist = &dist;
			o.world = dist.plan.world;
			o.rank = dist.plan.rank;
		}
		if (!st)
			st = ng_backend_cuda_init(&be, &o);
		if (st) {
			ng_dist_free(&dist);
			return st;
		}
	} else {
		return ng_fail(NG_ERR_INPUT, "train --device: '%s' is not cuda or cpu", o.device);
	}
	if (st)
		return st;
	const struct ng_gpt_config *m = &o.shape.model;
	if (o.rank == 0)
		fprintf(stderr, "model: L=%d H=%d C=%d T=%d V=%d (padded %d) | batch %d x %d, %d "
			"micro-batch(es) | device %s\n", m->L, m->H, m->C, o.shape.T, m->V, m->Vp,
			o.shape.B, o.shape.T, o.shape.K, be.name);
	st = ng_train_run(&o, &be);
	be.free(be.ctx);
	ng_dist_free(&dist);
	return st;
}
