/*
 * src/checkpoint.h — checkpoints: model weights as safetensors with the Hugging Face GPT-2 names
 * and layouts (so transformers' GPT2LMHeadModel loads them), and the training state (master
 * weights, AdamW moments, step, loader position, seed, shape) as a second safetensors file, both
 * written atomically (temporary file, fsync, rename, fsync of the directory).
 *
 * safetensors (huggingface/safetensors, docs "format"): 8-byte little-endian header length N,
 * N bytes of JSON {name: {"dtype","shape","data_offsets":[begin,end]}, "__metadata__": {str:
 * str}}, then the data; offsets are relative to the data start, contiguous and cover it all.
 *
 * Model file (fp32), HF GPT-2 names; ours are (out, in) like torch.nn.Linear, HF's Conv1D stores
 * (in, out), so every linear weight is transposed:
 *   transformer.wte.weight (V, C)  (our padded rows V..Vp-1 dropped)   transformer.wpe.weight (T, C)
 *   transformer.h.{i}.ln_1.weight/bias (C)   .attn.c_attn.weight (C, 3C) = qkvw[i]^T   .bias (3C)
 *   .attn.c_proj.weight (C, C) = attprojw[i]^T   .ln_2.weight/bias   .mlp.c_fc.weight (C, 4C)
 *   .mlp.c_proj.weight (4C, C)   transformer.ln_f.weight/bias (C)
 * lm_head.weight is not written: GPT-2 ties it to wte (transformers re-ties it on load).
 * Metadata: format=pt, n_layer, n_head, n_embd, n_positions, vocab_size, checksum.
 *
 * The speedrun model's file (format=nanograph-speedrun, the same shape metadata) names its
 * tensors for what they are, in our (out, in) layout: wte (V, C), ve.<t> (V, C) for t < 3,
 * blocks.<l>.qkvw (3C, C), .attprojw (C, C), .vlambda (2) for the blocks with attention,
 * blocks.<l>.fcw (4C, C), .fcprojw (C, 4C), .xlambda (2) for every block, headw (Vp, C: the
 * untied head trains every padded column), skipw (L/2). Reading it takes V and C from wte and
 * L, H, T from the metadata (no tensor gives H or T), and asks for exactly these tensors.
 *
 * Checksum: the last metadata entry, "checksum": "header+data:<16 hex digits>", the FNV-1a 64 of
 * the whole file (length, header JSON, data) with those 16 digits read as '0'. So the header
 * (shapes, data_offsets, every metadata value) is covered as well as the data, the entry is an
 * ordinary string that Hugging Face's readers pass over, and verifying needs no JSON rewriting:
 * the digits are found where they stand in the header bytes. Files of earlier versions carry a
 * bare "<16 hex digits>" over the data section only, and are still read.
 * Reading accepts names with or without the "transformer." prefix, F32/F64/BF16/F16 data, a
 * missing checksum (files from other writers, e.g. HF's GPT-2) and infers the config from the
 * shapes: L from the layers present, n_head from the metadata, else C/64. Metadata that is
 * present must be a decimal integer in range and agree with the tensors.
 *
 * State file: tensors "params", "adam_m", "adam_v" (F32 from the GPU, F64 from the CPU
 * reference: the master copy's own precision, so a resume is bit-exact), metadata with step,
 * n_skipped, seed, the shape (L H C T V B Tseq K), world, shuffle, the loader position and the
 * checksum, which a state file must carry. On reading, the invariants of a run are checked:
 * 0 <= n_skipped <= step, and with shards the loader position is the one `step` steps of K
 * batches lead to (epoch * batches_per_epoch + batch = step * K).
 *
 * A checkpoint directory holds model_<step>.safetensors, state_<step>.safetensors and `latest`
 * (the step, written last and atomically): a run killed while writing leaves the previous
 * checkpoint and `latest` intact.
 */
#ifndef NG_SRC_CHECKPOINT_H
#define NG_SRC_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "data/loader.h"
#include "graph/gpt.h"
#include "util/status.h"

/* Everything needed to continue a run. */
struct ng_train_state {
	struct ng_gpt_config cfg;    /* model (Vp filled) */
	int B, T, K;                 /* micro-batch, sequence length, micro-batches per step */
	long long step;              /* optimizer steps completed */
	long long n_skipped;         /* updates skipped so far */
	uint64_t seed;               /* init and data order */
	bool has_pos;                /* pos is meaningful (training from shards) */
	struct ng_loader_pos pos;    /* position of the next training batch */
	int world;                   /* processes of the run that wrote it; 0: not recorded (files
	                              * of earlier versions), not checked on resume */
	int muon;                    /* 1: written by --optimizer muon (adam_m holds Muon's momentum
	                              * in the hidden matrices' ranges); 0: AdamW, or not recorded */
	int shuffle;                 /* 1: shuffled windows, 0: --no-shuffle, -1: not recorded
	                              * (files of earlier versions), not checked on resume */
	long long train_us;          /* training time of the run up to `step`, validation and
	                              * checkpoints excluded, in microseconds (summed over the
	                              * parts of a resumed run); -1: not known (not recorded) */
	int elem_size;               /* 4 (float) or 8 (double): the master weights' precision */
	size_t n;                    /* elements per buffer: the flat layout's total */
	void *params;                /* (n) master weights, flat layout of graph/gpt.h */
	void *m, *v;                 /* (n) AdamW moments */
	float *fp8;                  /* --fp8: the scales' state (graph/step.h "FP8", rank 0's),
	                              * tensor "fp8_state"; NULL and 0 without */
	size_t n_fp8;
};

/* Allocate params/m/v for n elements of elem_size bytes (zeroed). */
enum ng_status ng_ckpt_state_alloc(struct ng_train_state *s, int elem_size, size_t n);
void ng_ckpt_state_free(struct ng_train_state *s);

/* Model weights (flat layout, lay.total floats) to a safetensors file with HF names (GPT-2), or
 * the speedrun model's own (src/checkpoint.c, format "nanograph-speedrun"). */
enum ng_status ng_ckpt_write_model(const char *path, const struct ng_gpt_config *cfg,
				   const float *params);
/* Read a model file: *cfg from its metadata or shapes (Vp filled), *params malloc'ed in the
 * flat layout (padding zero; caller frees). NG_ERR_INPUT naming the file and the problem for a
 * bad header, missing tensor, wrong shape, short file or checksum mismatch. */
enum ng_status ng_ckpt_read_model(const char *path, struct ng_gpt_config *cfg, float **params);

enum ng_status ng_ckpt_write_state(const char *path, const struct ng_train_state *s);
/* Read a state file into *s (allocated here; free with ng_ckpt_state_free). */
enum ng_status ng_ckpt_read_state(const char *path, struct ng_train_state *s);

/* Write model_<step> and state_<step> into dir (created if missing), then `latest`. `params32`
 * is the fp32 model (for the CPU reference: s->params rounded to float). */
enum ng_status ng_ckpt_save(const char *dir, const struct ng_train_state *s,
			    const float *params32);
/* The step named by dir/latest; NG_ERR_INPUT when there is none. */
enum ng_status ng_ckpt_latest(const char *dir, long long *step);
/* "dir/model_00000100.safetensors" or "dir/state_00000100.safetensors". */
void ng_ckpt_path(char *out, size_t n, const char *dir, const char *kind, long long step);

/* Make dir (if missing) and check that a file can be created in it: what a run does before
 * step 1, so an unusable --out is found before any work is done. NG_ERR_INPUT naming it. */
enum ng_status ng_ckpt_check_dir(const char *dir);

/* FNV-1a 64 of n bytes (the checksum of a file's data section). */
uint64_t ng_ckpt_checksum(const void *data, size_t n);
/* FNV-1a 64 continued over n more bytes from h (NG_CKPT_FNV_INIT to start). */
#define NG_CKPT_FNV_INIT 1469598103934665603ull
uint64_t ng_ckpt_fnv1a_(uint64_t h, const void *data, size_t n);
/* The checksum value's prefix: the hash covers the header and the data. */
#define NG_CKPT_CHECKSUM_PREFIX "header+data:"

/* Internal (checkpoint.c and checkpoint_read.c). Model-file tensor k, 0 <= k < 4 + 12 L: its HF
 * name, offset of our source in the flat layout, HF shape (ndim 1 or 2) and whether HF stores
 * it transposed (Conv1D). */
#define NG_CKPT_LAYER_TENSORS 12
void ng_ckpt_model_tensor_(const struct ng_gpt_config *cfg, const struct ng_gpt_layout *lay,
			   int k, char *name, size_t nname, size_t *off, size_t shape[2], int *ndim,
			   int *transpose);
/* dst (cols, rows) = src (rows, cols)^T */
void ng_ckpt_transpose_(float *dst, const float *src, size_t rows, size_t cols);

/* Internal (checkpoint.c and checkpoint_read.c). One tensor of a speedrun model file, as
 * write_model_speedrun writes it and ng_ckpt_read_model expects it. */
struct ng_ckpt_spr_tensor_ {
	char name[32];   /* "wte", "ve.<t>", "blocks.<l>.<name>", "headw", "skipw" */
	size_t off;      /* of its data in the flat layout, in elements */
	int ndim;        /* 1 or 2 */
	size_t shape[2]; /* as stored; shape[1] = 1 when 1-D */
};
/* The speedrun model file's tensors in file order into t (NULL: only count them); returns the
 * count, 6 L + 3. */
int ng_ckpt_spr_tensors_(const struct ng_gpt_config *cfg, const struct ng_gpt_layout *lay,
			 struct ng_ckpt_spr_tensor_ *t);

#endif
