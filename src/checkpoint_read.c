/*
 * src/checkpoint_read.c — reading safetensors model and training-state files (see
 * checkpoint.h): the whole file is read, the header parsed with jansson and checked (length,
 * dtypes, shapes against byte counts, offsets contiguous and covering the data, the FNV-1a
 * checksum when present) before any tensor is used; model tensors found by their HF GPT-2
 * names (with or without "transformer."), F32/F64/BF16/F16 converted to float, Conv1D
 * weights transposed back to our (out, in).
 */
#define _POSIX_C_SOURCE 200809L
#include "src/checkpoint.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_HEADER (64u << 20) /* a header larger than this is a corrupt length */
#define N_LAYER_NAMES NG_CKPT_LAYER_TENSORS

struct in_tensor {
	const char *name;    /* into the JSON */
	int elem;            /* bytes per element */
	char dtype[8];
	int ndim;
	size_t shape[4];
	size_t begin, end;   /* in the data section */
};

struct in_file {
	const char *path;
	unsigned char *buf;  /* the whole file */
	size_t size;
	const unsigned char *data;
	size_t data_bytes;
	json_t *root;
	json_t *meta;        /* __metadata__ or NULL */
	struct in_tensor *t;
	int n;
};

static void in_close(struct in_file *f)
{
	free(f->buf);
	free(f->t);
	if (f->root)
		json_decref(f->root);
	memset(f, 0, sizeof(*f));
}

static int cmp_begin(const void *a, const void *b)
{
	const struct in_tensor *x = a, *y = b;
	return x->begin < y->begin ? -1 : x->begin > y->begin;
}

static enum ng_status bad(const char *path, const char *what)
{
	ng_fail(NG_ERR_INPUT, "checkpoint %s: %s", path, what);
	ng_hint("the file is corrupt, truncated or not a checkpoint of this model; use an earlier "
		"checkpoint");
	return NG_ERR_INPUT;
}

static enum ng_status in_open(struct in_file *f, const char *path)
{
	memset(f, 0, sizeof(*f));
	f->path = path;
	FILE *fp = fopen(path, "rb");
	if (!fp)
		return ng_fail(NG_ERR_INPUT, "cannot open checkpoint %s: %s", path, strerror(errno));
	struct stat sb;
	if (fstat(fileno(fp), &sb) != 0 || sb.st_size < 8) {
		fclose(fp);
		return bad(path, "shorter than the 8-byte header length");
	}
	f->size = (size_t)sb.st_size;
	f->buf = malloc(f->size);
	if (!f->buf) {
		fclose(fp);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory reading %s", path);
	}
	size_t got = fread(f->buf, 1, f->size, fp);
	fclose(fp);
	if (got != f->size)
		return bad(path, "read error");
	uint64_t hlen = 0;
	for (int i = 0; i < 8; i++)
		hlen |= (uint64_t)f->buf[i] << (8 * i);
	if (hlen > MAX_HEADER || hlen > f->size - 8) {
		char m[160];
		snprintf(m, sizeof(m), "header length %" PRIu64 " does not fit the file of %zu "
			 "bytes (truncated?)", hlen, f->size);
		return bad(path, m);
	}
	json_error_t je;
	f->root = json_loadb((const char *)f->buf + 8, hlen, 0, &je);
	if (!f->root || !json_is_object(f->root))
		return bad(path, "the JSON header does not parse");
	f->data = f->buf + 8 + hlen;
	f->data_bytes = f->size - 8 - hlen;
	f->meta = json_object_get(f->root, "__metadata__");
	size_t cap = json_object_size(f->root);
	f->t = calloc(cap ? cap : 1, sizeof(*f->t));
	if (!f->t)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	const char *key;
	json_t *v;
	json_object_foreach(f->root, key, v) {
		if (strcmp(key, "__metadata__") == 0)
			continue;
		struct in_tensor *t = &f->t[f->n];
		json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape");
		json_t *of = json_object_get(v, "data_offsets");
		if (!json_is_string(dt) || !json_is_array(sh) || json_array_size(sh) > 4 ||
		    !json_is_array(of) || json_array_size(of) != 2)
			return bad(path, "a tensor entry lacks dtype, shape or data_offsets");
		t->name = key;
		snprintf(t->dtype, sizeof(t->dtype), "%s", json_string_value(dt));
		t->elem = !strcmp(t->dtype, "F64") ? 8 : !strcmp(t->dtype, "F32") ? 4 :
			  (!strcmp(t->dtype, "BF16") || !strcmp(t->dtype, "F16")) ? 2 : 0;
		t->ndim = (int)json_array_size(sh);
		size_t numel = 1;
		for (int d = 0; d < t->ndim; d++) {
			json_int_t x = json_integer_value(json_array_get(sh, (size_t)d));
			if (x < 0)
				return bad(path, "negative dimension");
			t->shape[d] = (size_t)x;
			numel *= (size_t)x;
		}
		json_int_t b = json_integer_value(json_array_get(of, 0));
		json_int_t e = json_integer_value(json_array_get(of, 1));
		if (b < 0 || e < b || (size_t)e > f->data_bytes) {
			char m[256];
			snprintf(m, sizeof(m), "tensor %s lies past the end of the data (%zu bytes; "
				 "truncated?)", key, f->data_bytes);
			return bad(path, m);
		}
		t->begin = (size_t)b;
		t->end = (size_t)e;
		if (t->elem && numel * (size_t)t->elem != t->end - t->begin) {
			char m[256];
			snprintf(m, sizeof(m), "tensor %s: %zu bytes for its shape, %zu in the file",
				 key, numel * (size_t)t->elem, t->end - t->begin);
			return bad(path, m);
		}
		f->n++;
	}
	/* contiguous and covering: a torn or grafted file fails here */
	struct in_tensor *sorted = malloc(sizeof(*sorted) * (f->n ? f->n : 1));
	if (!sorted)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	memcpy(sorted, f->t, sizeof(*sorted) * f->n);
	qsort(sorted, (size_t)f->n, sizeof(*sorted), cmp_begin);
	size_t at = 0;
	for (int i = 0; i < f->n && sorted[i].begin == at; i++)
		at = sorted[i].end;
	free(sorted);
	if (at != f->data_bytes) {
		char m[160];
		snprintf(m, sizeof(m), "tensor data covers %zu of the %zu data bytes", at,
			 f->data_bytes);
		return bad(path, m);
	}
	json_t *ck = f->meta ? json_object_get(f->meta, "checksum") : NULL;
	if (ck) {
		char want[24];
		snprintf(want, sizeof(want), "%016" PRIx64, ng_ckpt_checksum(f->data, f->data_bytes));
		if (!json_is_string(ck) || strcmp(json_string_value(ck), want) != 0) {
			char m[160];
			snprintf(m, sizeof(m), "checksum mismatch (header %s, data %s)",
				 json_is_string(ck) ? json_string_value(ck) : "?", want);
			return bad(path, m);
		}
	}
	return NG_OK;
}

static const struct in_tensor *in_find(const struct in_file *f, const char *name)
{
	for (int i = 0; i < f->n; i++)
		if (strcmp(f->t[i].name, name) == 0)
			return &f->t[i];
	return NULL;
}

/* Metadata integer `key`; -1 when absent or not a number. */
static long long meta_get(const struct in_file *f, const char *key)
{
	json_t *v = f->meta ? json_object_get(f->meta, key) : NULL;
	if (!json_is_string(v))
		return -1;
	char *end;
	unsigned long long x = strtoull(json_string_value(v), &end, 10);
	return *end ? -1 : (long long)x;
}

static uint64_t meta_u64(const struct in_file *f, const char *key)
{
	json_t *v = f->meta ? json_object_get(f->meta, key) : NULL;
	return json_is_string(v) ? strtoull(json_string_value(v), NULL, 10) : 0;
}

static float half_to_float(uint16_t h, bool bf16)
{
	uint32_t u;
	if (bf16) {
		u = (uint32_t)h << 16;
	} else {
		uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
		if (e == 0 && m == 0)
			u = s;
		else if (e == 0) { /* subnormal */
			e = 113;
			while (!(m & 1024)) {
				m <<= 1;
				e--;
			}
			u = s | (e << 23) | ((m & 1023) << 13);
		} else if (e == 31)
			u = s | 0x7f800000u | (m << 13);
		else
			u = s | ((e + 112) << 23) | (m << 13);
	}
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* numel floats of tensor t (any supported dtype) into dst. */
static void in_floats(const struct in_file *f, const struct in_tensor *t, float *dst, size_t numel)
{
	const unsigned char *p = f->data + t->begin;
	for (size_t i = 0; i < numel; i++) {
		if (t->elem == 4) {
			memcpy(&dst[i], p + 4 * i, 4);
		} else if (t->elem == 8) {
			double d;
			memcpy(&d, p + 8 * i, 8);
			dst[i] = (float)d;
		} else {
			uint16_t h;
			memcpy(&h, p + 2 * i, 2);
			dst[i] = half_to_float(h, t->dtype[0] == 'B');
		}
	}
}

/* A model tensor by its HF name, with or without the "transformer." prefix. */
static const struct in_tensor *find_hf(const struct in_file *f, const char *name)
{
	const struct in_tensor *t = in_find(f, name);
	if (!t && strncmp(name, "transformer.", 12) == 0)
		t = in_find(f, name + 12);
	return t;
}

enum ng_status ng_ckpt_read_model(const char *path, struct ng_gpt_config *cfg, float **params)
{
	struct in_file f;
	*params = NULL;
	enum ng_status st = in_open(&f, path);
	if (st)
		goto out;
	const struct in_tensor *wte = find_hf(&f, "transformer.wte.weight");
	const struct in_tensor *wpe = find_hf(&f, "transformer.wpe.weight");
	if (!wte || !wpe || wte->ndim != 2 || wpe->ndim != 2) {
		st = bad(path, "no 2-D transformer.wte.weight / transformer.wpe.weight: not a GPT-2 "
			 "model file");
		goto out;
	}
	memset(cfg, 0, sizeof(*cfg));
	cfg->V = (int)wte->shape[0];
	cfg->C = (int)wte->shape[1];
	cfg->T = (int)wpe->shape[0];
	long long L = meta_get(&f, "n_layer"), H = meta_get(&f, "n_head");
	if (L < 0) {
		char nm[96];
		for (L = 0;; L++) {
			snprintf(nm, sizeof(nm), "transformer.h.%lld.ln_1.weight", L);
			if (!find_hf(&f, nm))
				break;
		}
	}
	cfg->L = (int)L;
	cfg->H = H > 0 ? (int)H : cfg->C / 64;
	st = ng_gpt_check(cfg);
	if (st) {
		ng_hint("checkpoint %s: its shapes give L=%d H=%d C=%d T=%d V=%d", path, cfg->L,
			cfg->H, cfg->C, cfg->T, cfg->V);
		goto out;
	}
	struct ng_gpt_layout lay;
	ng_gpt_layout(cfg, &lay);
	*params = calloc(lay.total, sizeof(float));
	float *tmp = malloc((size_t)cfg->C * 4 * cfg->C * sizeof(float));
	if (!*params || !tmp) {
		free(tmp);
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory reading %s", path);
		goto out;
	}
	int n = 4 + N_LAYER_NAMES * cfg->L;
	for (int k = 0; k < n && !st; k++) {
		char name[96];
		size_t off, shape[2];
		int ndim, tr;
		ng_ckpt_model_tensor_(cfg, &lay, k, name, sizeof(name), &off, shape, &ndim, &tr);
		const struct in_tensor *t = find_hf(&f, name);
		if (!t) {
			char m[160];
			snprintf(m, sizeof(m), "tensor %s is missing", name);
			st = bad(path, m);
			break;
		}
		size_t want = shape[0] * (ndim > 1 ? shape[1] : 1);
		if (t->ndim != ndim || t->shape[0] != shape[0] || (ndim > 1 && t->shape[1] != shape[1])
		    || !t->elem) {
			char m[256];
			snprintf(m, sizeof(m), "tensor %s has shape [%zu%s%zu] dtype %s, expected "
				 "[%zu, %zu] F32/F64/BF16/F16", name, t->shape[0],
				 t->ndim > 1 ? ", " : "", t->ndim > 1 ? t->shape[1] : 0, t->dtype,
				 shape[0], ndim > 1 ? shape[1] : 1);
			st = bad(path, m);
			break;
		}
		if (tr) {
			in_floats(&f, t, tmp, want);
			ng_ckpt_transpose_(*params + off, tmp, shape[0], shape[1]);
		} else {
			in_floats(&f, t, *params + off, want);
		}
	}
	free(tmp);
out:
	if (st) {
		free(*params);
		*params = NULL;
	}
	in_close(&f);
	return st;
}

enum ng_status ng_ckpt_read_state(const char *path, struct ng_train_state *s)
{
	struct in_file f;
	memset(s, 0, sizeof(*s));
	enum ng_status st = in_open(&f, path);
	if (st)
		goto out;
	if (meta_get(&f, "nanograph_state") != 1) {
		st = bad(path, "not a nanograph training-state file (no nanograph_state metadata)");
		goto out;
	}
	s->cfg = (struct ng_gpt_config){ (int)meta_get(&f, "L"), (int)meta_get(&f, "H"),
					 (int)meta_get(&f, "C"), (int)meta_get(&f, "T"),
					 (int)meta_get(&f, "V"), 0 };
	st = ng_gpt_check(&s->cfg);
	if (st)
		goto out;
	s->B = (int)meta_get(&f, "B");
	s->T = (int)meta_get(&f, "Tseq");
	s->K = (int)meta_get(&f, "K");
	long long world = meta_get(&f, "world"); /* absent in files of earlier versions */
	s->world = world < 0 ? 0 : (int)world;
	s->muon = meta_get(&f, "optimizer_muon") > 0; /* absent: an AdamW run */
	s->step = meta_get(&f, "step");
	s->n_skipped = meta_get(&f, "n_skipped");
	s->seed = meta_u64(&f, "seed");
	s->has_pos = meta_get(&f, "has_pos") == 1;
	s->pos = (struct ng_loader_pos){ meta_u64(&f, "pos_seed"), meta_u64(&f, "pos_windows"),
					 meta_u64(&f, "pos_epoch"), meta_u64(&f, "pos_batch") };
	if (s->step < 0 || s->n_skipped < 0 || s->B <= 0 || s->T <= 0 || s->K <= 0 ||
	    s->world < 0) {
		st = bad(path, "step, batch or shape metadata missing");
		goto out;
	}
	struct ng_gpt_layout lay;
	ng_gpt_layout(&s->cfg, &lay);
	const char *names[3] = { "params", "adam_m", "adam_v" };
	const struct in_tensor *t[3];
	for (int i = 0; i < 3; i++) {
		t[i] = in_find(&f, names[i]);
		if (!t[i] || t[i]->ndim != 1 || t[i]->shape[0] != lay.total ||
		    (t[i]->elem != 4 && t[i]->elem != 8) || t[i]->elem != t[0]->elem) {
			char m[200];
			snprintf(m, sizeof(m), "tensor %s missing or not (%zu) F32/F64 as the model "
				 "L=%d C=%d V=%d needs", names[i], lay.total, s->cfg.L, s->cfg.C,
				 s->cfg.V);
			st = bad(path, m);
			goto out;
		}
	}
	st = ng_ckpt_state_alloc(s, t[0]->elem, lay.total);
	if (st)
		goto out;
	void *dst[3] = { s->params, s->m, s->v };
	for (int i = 0; i < 3; i++)
		memcpy(dst[i], f.data + t[i]->begin, t[i]->end - t[i]->begin);
	const struct in_tensor *t8 = in_find(&f, "fp8_state"); /* --fp8 runs only */
	if (t8) {
		if (t8->ndim != 1 || strcmp(t8->dtype, "F32") != 0 || t8->shape[0] == 0) {
			st = bad(path, "tensor fp8_state is not a 1-D F32 tensor");
			goto out;
		}
		s->n_fp8 = t8->shape[0];
		s->fp8 = malloc(s->n_fp8 * sizeof(float));
		if (!s->fp8) {
			st = ng_fail(NG_ERR_RUNTIME, "out of host memory for %s", path);
			goto out;
		}
		memcpy(s->fp8, f.data + t8->begin, s->n_fp8 * sizeof(float));
	}
out:
	if (st)
		ng_ckpt_state_free(s);
	in_close(&f);
	return st;
}

