/*
 * src/checkpoint.c — safetensors model and training-state files (see checkpoint.h): the JSON
 * header through jansson, HF GPT-2 names with Conv1D (in, out) transposes, an FNV-1a checksum
 * of the data section, atomic writes (temporary, fsync, rename, fsync of the directory).
 */
#define _POSIX_C_SOURCE 200809L
#include "src/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_HEADER (64u << 20) /* a header larger than this is a corrupt length */

uint64_t ng_ckpt_checksum(const void *data, size_t n)
{
	const unsigned char *p = data;
	uint64_t h = 1469598103934665603ull;
	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= 1099511628211ull;
	}
	return h;
}

/* ---- writing ---- */

/* One tensor to write: its bytes are already in the final (HF) layout. */
struct out_tensor {
	char name[96];       /* HF name */
	const char *dtype;   /* "F32", "F64" */
	int ndim;
	size_t shape[2];
	const void *data;
	size_t bytes;
};

static enum ng_status write_all(int fd, const void *p, size_t n, const char *path)
{
	const char *c = p;
	while (n > 0) {
		ssize_t w = write(fd, c, n > (1u << 30) ? (1u << 30) : n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return ng_fail(NG_ERR_RUNTIME, "cannot write %s: %s", path, strerror(errno));
		c += w;
		n -= (size_t)w;
	}
	return NG_OK;
}

/* Write the 8-byte length, header and tensors (header NULL: the tensors' bytes only) to path
 * through path.tmp, fsync, rename, fsync the directory. */
static enum ng_status write_atomic(const char *path, const char *header, size_t hlen,
				   const struct out_tensor *t, int n)
{
	char tmp[4096], dir[4096];
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0)
		return ng_fail(NG_ERR_INPUT, "cannot create %s: %s", tmp, strerror(errno));
	unsigned char len8[8];
	for (int i = 0; i < 8; i++)
		len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
	enum ng_status st = header ? write_all(fd, len8, 8, tmp) : NG_OK;
	if (!st && header)
		st = write_all(fd, header, hlen, tmp);
	for (int i = 0; i < n && !st; i++)
		st = write_all(fd, t[i].data, t[i].bytes, tmp);
	if (!st && fsync(fd) != 0)
		st = ng_fail(NG_ERR_RUNTIME, "fsync %s: %s", tmp, strerror(errno));
	if (close(fd) != 0 && !st)
		st = ng_fail(NG_ERR_RUNTIME, "close %s: %s", tmp, strerror(errno));
	if (!st && rename(tmp, path) != 0)
		st = ng_fail(NG_ERR_RUNTIME, "rename %s -> %s: %s", tmp, path, strerror(errno));
	if (st) {
		unlink(tmp);
		return st;
	}
	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (slash)
		*slash = '\0';
	else
		snprintf(dir, sizeof(dir), ".");
	int dfd = open(dir, O_RDONLY);
	if (dfd >= 0) {
		fsync(dfd);
		close(dfd);
	}
	return NG_OK;
}

static void meta_set(json_t *meta, const char *key, unsigned long long v)
{
	char s[32];
	snprintf(s, sizeof(s), "%llu", v);
	json_object_set_new(meta, key, json_string(s));
}

/* Build the header for tensors t[0..n) laid out back to back, with `meta` (consumed), and write. */
static enum ng_status write_safetensors(const char *path, const struct out_tensor *t, int n,
					json_t *meta)
{
	json_t *root = json_object();
	size_t off = 0;
	uint64_t h = 1469598103934665603ull;
	for (int i = 0; i < n; i++) {
		json_t *e = json_object(), *shape = json_array(), *offs = json_array();
		for (int d = 0; d < t[i].ndim; d++)
			json_array_append_new(shape, json_integer((json_int_t)t[i].shape[d]));
		json_array_append_new(offs, json_integer((json_int_t)off));
		json_array_append_new(offs, json_integer((json_int_t)(off + t[i].bytes)));
		json_object_set_new(e, "dtype", json_string(t[i].dtype));
		json_object_set_new(e, "shape", shape);
		json_object_set_new(e, "data_offsets", offs);
		json_object_set_new(root, t[i].name, e);
		off += t[i].bytes;
		/* FNV-1a continues across tensors: the checksum of the whole data section */
		const unsigned char *p = t[i].data;
		for (size_t k = 0; k < t[i].bytes; k++) {
			h ^= p[k];
			h *= 1099511628211ull;
		}
	}
	char ck[24];
	snprintf(ck, sizeof(ck), "%016" PRIx64, h);
	json_object_set_new(meta, "checksum", json_string(ck));
	json_object_set_new(root, "__metadata__", meta);
	char *js = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
	json_decref(root);
	if (!js)
		return ng_fail(NG_ERR_RUNTIME, "cannot format the safetensors header of %s", path);
	size_t len = strlen(js), padded = (len + 7) / 8 * 8;
	char *hdr = malloc(padded);
	if (!hdr) {
		free(js);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	}
	memcpy(hdr, js, len);
	memset(hdr + len, ' ', padded - len); /* the format allows trailing spaces */
	free(js);
	enum ng_status st = write_atomic(path, hdr, padded, t, n);
	free(hdr);
	return st;
}

/* ---- the HF GPT-2 name table ---- */

struct hf_name {
	const char *suffix;  /* after "transformer." (per-layer: after "h.{i}.") */
	int id;              /* enum ng_param_id */
	int transpose;       /* Conv1D weight: HF (in, out) = ours^T */
};

static const struct hf_name layer_names[] = {
	{ "ln_1.weight", NG_P_LN1W, 0 },          { "ln_1.bias", NG_P_LN1B, 0 },
	{ "attn.c_attn.weight", NG_P_QKVW, 1 },   { "attn.c_attn.bias", NG_P_QKVB, 0 },
	{ "attn.c_proj.weight", NG_P_ATTPROJW, 1 }, { "attn.c_proj.bias", NG_P_ATTPROJB, 0 },
	{ "ln_2.weight", NG_P_LN2W, 0 },          { "ln_2.bias", NG_P_LN2B, 0 },
	{ "mlp.c_fc.weight", NG_P_FCW, 1 },       { "mlp.c_fc.bias", NG_P_FCB, 0 },
	{ "mlp.c_proj.weight", NG_P_FCPROJW, 1 }, { "mlp.c_proj.bias", NG_P_FCPROJB, 0 },
};
#define N_LAYER_NAMES ((int)(sizeof(layer_names) / sizeof(layer_names[0])))

/* Tensor k of the model file (0 <= k < 4 + 12 L): its name, our source (pointer into params at
 * the right layer), HF shape and whether it is transposed. */
static void model_tensor(const struct ng_gpt_config *cfg, const struct ng_gpt_layout *lay, int k,
			 char *name, size_t nname, size_t *off, size_t shape[2], int *ndim,
			 int *transpose)
{
	int id, layer = -1;
	*transpose = 0;
	if (k == 0 || k == 1) {
		id = k == 0 ? NG_P_WTE : NG_P_WPE;
		snprintf(name, nname, "transformer.%s.weight", k == 0 ? "wte" : "wpe");
	} else if (k == 2 || k == 3) {
		id = k == 2 ? NG_P_LNFW : NG_P_LNFB;
		snprintf(name, nname, "transformer.ln_f.%s", k == 2 ? "weight" : "bias");
	} else {
		layer = (k - 4) / N_LAYER_NAMES;
		const struct hf_name *h = &layer_names[(k - 4) % N_LAYER_NAMES];
		id = h->id;
		*transpose = h->transpose;
		snprintf(name, nname, "transformer.h.%d.%s", layer, h->suffix);
	}
	const struct ng_param_spec *p = &lay->p[id];
	size_t per = p->per_layer ? p->numel / p->shape[0] : p->numel;
	*off = p->offset + (layer > 0 ? (size_t)layer * per : 0);
	int d0 = p->per_layer ? 1 : 0; /* our shape without the L dimension */
	*ndim = p->ndim - d0;
	shape[0] = p->shape[d0];
	shape[1] = *ndim > 1 ? p->shape[d0 + 1] : 1;
	if (id == NG_P_WTE)
		shape[0] = (size_t)cfg->V; /* unpadded */
	if (*transpose) {
		size_t s = shape[0];
		shape[0] = shape[1];
		shape[1] = s;
	}
}

/* dst (cols, rows) = src (rows, cols)^T */
static void transpose(float *dst, const float *src, size_t rows, size_t cols)
{
	for (size_t r = 0; r < rows; r++)
		for (size_t c = 0; c < cols; c++)
			dst[c * rows + r] = src[r * cols + c];
}

enum ng_status ng_ckpt_write_model(const char *path, const struct ng_gpt_config *cfg,
				   const float *params)
{
	struct ng_gpt_layout lay;
	ng_gpt_layout(cfg, &lay);
	int n = 4 + N_LAYER_NAMES * cfg->L;
	struct out_tensor *t = calloc((size_t)n, sizeof(*t));
	float *tbuf = malloc(lay.total * sizeof(float)); /* transposed copies */
	if (!t || !tbuf) {
		free(t);
		free(tbuf);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory writing %s", path);
	}
	size_t used = 0;
	for (int k = 0; k < n; k++) {
		size_t off;
		int tr;
		model_tensor(cfg, &lay, k, t[k].name, sizeof(t[k].name), &off, t[k].shape,
			     &t[k].ndim, &tr);
		size_t numel = t[k].shape[0] * t[k].shape[1];
		t[k].dtype = "F32";
		t[k].bytes = numel * sizeof(float);
		if (tr) {
			/* ours (out, in) = (shape[1], shape[0]) */
			transpose(tbuf + used, params + off, t[k].shape[1], t[k].shape[0]);
			t[k].data = tbuf + used;
			used += numel;
		} else {
			t[k].data = params + off;
		}
	}
	json_t *meta = json_object();
	json_object_set_new(meta, "format", json_string("pt"));
	meta_set(meta, "n_layer", (unsigned long long)cfg->L);
	meta_set(meta, "n_head", (unsigned long long)cfg->H);
	meta_set(meta, "n_embd", (unsigned long long)cfg->C);
	meta_set(meta, "n_positions", (unsigned long long)cfg->T);
	meta_set(meta, "vocab_size", (unsigned long long)cfg->V);
	enum ng_status st = write_safetensors(path, t, n, meta);
	free(t);
	free(tbuf);
	return st;
}

enum ng_status ng_ckpt_write_state(const char *path, const struct ng_train_state *s)
{
	const char *dt = s->elem_size == 8 ? "F64" : "F32";
	struct out_tensor t[3] = {
		{ "params", dt, 1, { s->n, 1 }, s->params, s->n * (size_t)s->elem_size },
		{ "adam_m", dt, 1, { s->n, 1 }, s->m, s->n * (size_t)s->elem_size },
		{ "adam_v", dt, 1, { s->n, 1 }, s->v, s->n * (size_t)s->elem_size },
	};
	json_t *meta = json_object();
	json_object_set_new(meta, "nanograph_state", json_string("1"));
	meta_set(meta, "step", (unsigned long long)s->step);
	meta_set(meta, "n_skipped", (unsigned long long)s->n_skipped);
	meta_set(meta, "seed", s->seed);
	meta_set(meta, "L", (unsigned long long)s->cfg.L);
	meta_set(meta, "H", (unsigned long long)s->cfg.H);
	meta_set(meta, "C", (unsigned long long)s->cfg.C);
	meta_set(meta, "T", (unsigned long long)s->cfg.T);
	meta_set(meta, "V", (unsigned long long)s->cfg.V);
	meta_set(meta, "B", (unsigned long long)s->B);
	meta_set(meta, "Tseq", (unsigned long long)s->T);
	meta_set(meta, "K", (unsigned long long)s->K);
	meta_set(meta, "has_pos", s->has_pos);
	meta_set(meta, "pos_seed", s->pos.seed);
	meta_set(meta, "pos_windows", s->pos.windows);
	meta_set(meta, "pos_epoch", s->pos.epoch);
	meta_set(meta, "pos_batch", s->pos.batch);
	return write_safetensors(path, t, 3, meta);
}

/* ---- reading ---- */

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
		model_tensor(cfg, &lay, k, name, sizeof(name), &off, shape, &ndim, &tr);
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
			transpose(*params + off, tmp, shape[0], shape[1]);
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

enum ng_status ng_ckpt_state_alloc(struct ng_train_state *s, int elem_size, size_t n)
{
	s->elem_size = elem_size;
	s->n = n;
	s->params = calloc(n, (size_t)elem_size);
	s->m = calloc(n, (size_t)elem_size);
	s->v = calloc(n, (size_t)elem_size);
	if (!s->params || !s->m || !s->v) {
		ng_ckpt_state_free(s);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory for the training state (%zu "
			       "elements)", n);
	}
	return NG_OK;
}

void ng_ckpt_state_free(struct ng_train_state *s)
{
	free(s->params);
	free(s->m);
	free(s->v);
	s->params = s->m = s->v = NULL;
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
	s->step = meta_get(&f, "step");
	s->n_skipped = meta_get(&f, "n_skipped");
	s->seed = meta_u64(&f, "seed");
	s->has_pos = meta_get(&f, "has_pos") == 1;
	s->pos = (struct ng_loader_pos){ meta_u64(&f, "pos_seed"), meta_u64(&f, "pos_windows"),
					 meta_u64(&f, "pos_epoch"), meta_u64(&f, "pos_batch") };
	if (s->step < 0 || s->n_skipped < 0 || s->B <= 0 || s->T <= 0 || s->K <= 0) {
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
out:
	if (st)
		ng_ckpt_state_free(s);
	in_close(&f);
	return st;
}

void ng_ckpt_path(char *out, size_t n, const char *dir, const char *kind, long long step)
{
	snprintf(out, n, "%s/%s_%08lld.safetensors", dir, kind, step);
}

enum ng_status ng_ckpt_save(const char *dir, const struct ng_train_state *s,
			    const float *params32)
{
	char path[4096];
	if (mkdir(dir, 0755) != 0 && errno != EEXIST)
		return ng_fail(NG_ERR_INPUT, "cannot create the checkpoint directory %s: %s", dir,
			       strerror(errno));
	ng_ckpt_path(path, sizeof(path), dir, "model", s->step);
	enum ng_status st = ng_ckpt_write_model(path, &s->cfg, params32);
	ng_ckpt_path(path, sizeof(path), dir, "state", s->step);
	if (!st)
		st = ng_ckpt_write_state(path, s);
	if (st)
		return st;
	/* `latest` is plain text, through the same temporary-fsync-rename path */
	char text[32];
	struct out_tensor t = { "latest", "", 0, { 0, 0 }, text, 0 };
	t.bytes = (size_t)snprintf(text, sizeof(text), "%lld\n", s->step);
	snprintf(path, sizeof(path), "%s/latest", dir);
	return write_atomic(path, NULL, 0, &t, 1);
}

enum ng_status ng_ckpt_latest(const char *dir, long long *step)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/latest", dir);
	FILE *fp = fopen(path, "r");
	if (!fp) {
		ng_fail(NG_ERR_INPUT, "--resume: no checkpoint in %s (%s: %s)", dir, path,
			strerror(errno));
		ng_hint("write checkpoints with --ckpt-every N (and SIGINT/SIGTERM) into --out DIR");
		return NG_ERR_INPUT;
	}
	long long s = -1;
	int ok = fscanf(fp, "%lld", &s);
	fclose(fp);
	if (ok != 1 || s < 0)
		return ng_fail(NG_ERR_INPUT, "%s does not hold a step number", path);
	*step = s;
	return NG_OK;
}
