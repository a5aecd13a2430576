/*
 * src/checkpoint.c — writing safetensors model and training-state files (see checkpoint.h):
 * the JSON header through jansson, HF GPT-2 names with Conv1D (in, out) transposes, an FNV-1a
 * checksum of the whole file (header and data), atomic writes (temporary, fsync, rename, fsync of the
 * directory). Reading is src/checkpoint_read.c.
 */
#define _POSIX_C_SOURCE 200809L
#include "src/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util/file.h"


uint64_t ng_ckpt_fnv1a_(uint64_t h, const void *data, size_t n)
{
	const unsigned char *p = data;
	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= 1099511628211ull;
	}
	return h;
}

uint64_t ng_ckpt_checksum(const void *data, size_t n)
{
	return ng_ckpt_fnv1a_(NG_CKPT_FNV_INIT, data, n);
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

/* Build the header for tensors t[0..n) laid out back to back, with `meta` (consumed), and write.
 * The checksum (checkpoint.h) is the last metadata entry: its 16 digits are written as '0',
 * the whole file hashed so, and the digits filled in. */
static enum ng_status write_safetensors(const char *path, const struct out_tensor *t, int n,
					json_t *meta)
{
	json_t *root = json_object();
	size_t off = 0;
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
	}
	json_object_set_new(meta, "checksum",
			    json_string(NG_CKPT_CHECKSUM_PREFIX "0000000000000000"));
	json_object_set_new(root, "__metadata__", meta);
	char *js = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
	json_decref(root);
	if (!js)
		return ng_fail(NG_ERR_RUNTIME, "cannot format the safetensors header of %s", path);
	size_t len = strlen(js), padded = (len + 7) / 8 * 8;
	char *hdr = malloc(padded);
	char *digits = strstr(js, "\"checksum\":\"" NG_CKPT_CHECKSUM_PREFIX);
	if (!hdr || !digits) {
		free(hdr);
		free(js);
		return ng_fail(NG_ERR_RUNTIME, "cannot format the safetensors header of %s", path);
	}
	memcpy(hdr, js, len);
	memset(hdr + len, ' ', padded - len); /* the format allows trailing spaces */
	digits = hdr + (digits - js) + strlen("\"checksum\":\"" NG_CKPT_CHECKSUM_PREFIX);
	free(js);
	unsigned char len8[8];
	for (int i = 0; i < 8; i++)
		len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
	uint64_t h = ng_ckpt_fnv1a_(NG_CKPT_FNV_INIT, len8, 8);
	h = ng_ckpt_fnv1a_(h, hdr, padded);
	for (int i = 0; i < n; i++)
		h = ng_ckpt_fnv1a_(h, t[i].data, t[i].bytes);
	char ck[24];
	snprintf(ck, sizeof(ck), "%016" PRIx64, h);
	memcpy(digits, ck, 16);
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
_Static_assert(sizeof(layer_names) / sizeof(layer_names[0]) == NG_CKPT_LAYER_TENSORS,
	       "one HF name per per-layer tensor");
#define N_LAYER_NAMES NG_CKPT_LAYER_TENSORS

void ng_ckpt_model_tensor_(const struct ng_gpt_config *cfg, const struct ng_gpt_layout *lay,
			   int k, char *name, size_t nname, size_t *off, size_t shape[2], int *ndim,
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

void ng_ckpt_transpose_(float *dst, const float *src, size_t rows, size_t cols)
{
	for (size_t r = 0; r < rows; r++)
		for (size_t c = 0; c < cols; c++)
			dst[c * rows + r] = src[r * cols + c];
}

/* The shape of a model file's model (both families), as Hugging Face's GPT-2 config names it. */
static void model_meta(json_t *meta, const struct ng_gpt_config *cfg)
{
	meta_set(meta, "n_layer", (unsigned long long)cfg->L);
	meta_set(meta, "n_head", (unsigned long long)cfg->H);
	meta_set(meta, "n_embd", (unsigned long long)cfg->C);
	meta_set(meta, "n_positions", (unsigned long long)cfg->T);
	meta_set(meta, "vocab_size", (unsigned long long)cfg->V);
}

/* Entry *n of t (when t is not NULL) with a printf-formatted name; *n += 1. */
__attribute__((format(printf, 7, 8)))
static void spr_put(struct ng_ckpt_spr_tensor_ *t, int *n, size_t off, int ndim, size_t s0,
		    size_t s1, const char *fmt, ...)
{
	if (t) {
		t[*n] = (struct ng_ckpt_spr_tensor_){ "", off, ndim, { s0, s1 } };
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(t[*n].name, sizeof(t[*n].name), fmt, ap);
		va_end(ap);
	}
	(*n)++;
}

/* The speedrun model's tensors (checkpoint.h), named for what they are: "wte", "ve.<t>" (the
 * real V rows of each table), "blocks.<l>.<name>" for each block's slice of a per-layer tensor
 * (the block without attention has no attention tensors), "headw" (Vp, C: every padded column
 * is a trained output), "skipw" (L/2). */
int ng_ckpt_spr_tensors_(const struct ng_gpt_config *cfg, const struct ng_gpt_layout *lay,
			 struct ng_ckpt_spr_tensor_ *t)
{
	const struct ng_param_spec *p = lay->p;
	size_t V = (size_t)cfg->V, C = (size_t)cfg->C, VpC = (size_t)cfg->Vp * cfg->C;
	int n = 0;
	spr_put(t, &n, p[NG_P_WTE].offset, 2, V, C, "wte");
	for (int k = 0; k < NG_SPR_VE; k++)
		spr_put(t, &n, p[NG_P_VE].offset + k * VpC, 2, V, C, "ve.%d", k);
	static const int per_block[] = { NG_P_QKVW, NG_P_ATTPROJW, NG_P_FCW, NG_P_FCPROJW,
					 NG_P_XLAMBDA, NG_P_VLAMBDA };
	for (int l = 0; l < cfg->L; l++) {
		for (size_t i = 0; i < sizeof(per_block) / sizeof(per_block[0]); i++) {
			const struct ng_param_spec *s = &p[per_block[i]];
			int attn = per_block[i] != NG_P_FCW && per_block[i] != NG_P_FCPROJW &&
				   per_block[i] != NG_P_XLAMBDA;
			int slot = attn ? ng_spr_attn_slot(cfg, l) : l;
			if (slot < 0)
				continue;
			size_t per = s->numel / s->shape[0];
			spr_put(t, &n, s->offset + (size_t)slot * per, s->ndim - 1, s->shape[1],
				s->ndim > 2 ? s->shape[2] : 1, "blocks.%d.%s", l, s->name);
		}
	}
	spr_put(t, &n, p[NG_P_HEADW].offset, 2, (size_t)cfg->Vp, C, "headw");
	spr_put(t, &n, p[NG_P_SKIPW].offset, 1, p[NG_P_SKIPW].numel, 1, "skipw");
	return n;
}

static enum ng_status write_model_speedrun(const char *path, const struct ng_gpt_config *cfg,
					   const struct ng_gpt_layout *lay, const float *params)
{
	int n = ng_ckpt_spr_tensors_(cfg, lay, NULL);
	struct ng_ckpt_spr_tensor_ *d = calloc((size_t)n, sizeof(*d));
	struct out_tensor *t = calloc((size_t)n, sizeof(*t));
	if (!d || !t) {
		free(d);
		free(t);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory writing %s", path);
	}
	ng_ckpt_spr_tensors_(cfg, lay, d);
	for (int k = 0; k < n; k++) {
		size_t numel = d[k].shape[0] * d[k].shape[1];
		t[k] = (struct out_tensor){ "", "F32", d[k].ndim, { d[k].shape[0], d[k].shape[1] },
					    params + d[k].off, numel * sizeof(float) };
		snprintf(t[k].name, sizeof(t[k].name), "%s", d[k].name);
	}
	json_t *meta = json_object();
	json_object_set_new(meta, "format", json_string("nanograph-speedrun"));
	model_meta(meta, cfg);
	enum ng_status st = write_safetensors(path, t, n, meta);
	free(d);
	free(t);
	return st;
}

enum ng_status ng_ckpt_write_model(const char *path, const struct ng_gpt_config *cfg,
				   const float *params)
{
	struct ng_gpt_layout lay;
	ng_gpt_layout(cfg, &lay);
	if (cfg->arch == NG_ARCH_SPEEDRUN)
		return write_model_speedrun(path, cfg, &lay, params);
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
		ng_ckpt_model_tensor_(cfg, &lay, k, t[k].name, sizeof(t[k].name), &off, t[k].shape,
			     &t[k].ndim, &tr);
		size_t numel = t[k].shape[0] * t[k].shape[1];
		t[k].dtype = "F32";
		t[k].bytes = numel * sizeof(float);
		if (tr) {
			/* ours (out, in) = (shape[1], shape[0]) */
			ng_ckpt_transpose_(tbuf + used, params + off, t[k].shape[1], t[k].shape[0]);
			t[k].data = tbuf + used;
			used += numel;
		} else {
			t[k].data = params + off;
		}
	}
	json_t *meta = json_object();
	json_object_set_new(meta, "format", json_string("pt"));
	model_meta(meta, cfg);
	enum ng_status st = write_safetensors(path, t, n, meta);
	free(t);
	free(tbuf);
	return st;
}

enum ng_status ng_ckpt_write_state(const char *path, const struct ng_train_state *s)
{
	const char *dt = s->elem_size == 8 ? "F64" : "F32";
	struct out_tensor t[4] = {
		{ "params", dt, 1, { s->n, 1 }, s->params, s->n * (size_t)s->elem_size },
		{ "adam_m", dt, 1, { s->n, 1 }, s->m, s->n * (size_t)s->elem_size },
		{ "adam_v", dt, 1, { s->n, 1 }, s->v, s->n * (size_t)s->elem_size },
		{ "fp8_state", "F32", 1, { s->n_fp8, 1 }, s->fp8, s->n_fp8 * sizeof(float) },
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
	if (s->cfg.arch != NG_ARCH_GPT2) /* absent: GPT-2 (files written before the family) */
		meta_set(meta, "arch", (unsigned long long)s->cfg.arch);
	meta_set(meta, "B", (unsigned long long)s->B);
	meta_set(meta, "Tseq", (unsigned long long)s->T);
	meta_set(meta, "K", (unsigned long long)s->K);
	meta_set(meta, "world", (unsigned long long)(s->world > 1 ? s->world : 1));
	if (s->shuffle >= 0)
		meta_set(meta, "shuffle", (unsigned long long)s->shuffle);
	if (s->train_us >= 0)
		meta_set(meta, "train_us", (unsigned long long)s->train_us);
	meta_set(meta, "has_pos", s->has_pos);
	meta_set(meta, "optimizer_muon", (unsigned long long)(s->muon != 0));
	meta_set(meta, "pos_seed", s->pos.seed);
	meta_set(meta, "pos_windows", s->pos.windows);
	meta_set(meta, "pos_epoch", s->pos.epoch);
	meta_set(meta, "pos_batch", s->pos.batch);
	return write_safetensors(path, t, s->fp8 && s->n_fp8 ? 4 : 3, meta);
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
	free(s->fp8);
	s->params = s->m = s->v = NULL;
	s->fp8 = NULL;
	s->n_fp8 = 0;
}

void ng_ckpt_path(char *out, size_t n, const char *dir, const char *kind, long long step)
{
	snprintf(out, n, "%s/%s_%08lld.safetensors", dir, kind, step);
}

enum ng_status ng_ckpt_check_dir(const char *dir)
{
	struct stat sb;
	if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
		ng_fail(NG_ERR_INPUT, "cannot create the checkpoint directory %s: %s", dir,
			strerror(errno));
		ng_hint("give --out a directory that exists or whose parent is writable");
		return NG_ERR_INPUT;
	}
	if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
		ng_fail(NG_ERR_INPUT, "the checkpoint directory %s is not a directory", dir);
		ng_hint("give --out a directory");
		return NG_ERR_INPUT;
	}
	char probe[4200];
	snprintf(probe, sizeof(probe), "%s/.nanograph-probe-XXXXXX", dir);
	int fd = mkstemp(probe);
	if (fd < 0) {
		ng_fail(NG_ERR_INPUT, "cannot write into the checkpoint directory %s: %s", dir,
			strerror(errno));
		ng_hint("give --out a writable directory");
		return NG_ERR_INPUT;
	}
	close(fd);
	unlink(probe);
	return NG_OK;
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
	struct stat sb;
	int fd = ng_file_open_regular(path, &sb);
	if (fd < 0) {
		ng_fail(NG_ERR_INPUT, "--resume: no checkpoint in %s (%s: %s)", dir, path,
			fd == -2 ? ng_file_kind(sb.st_mode) : strerror(errno));
		ng_hint("write checkpoints with --ckpt-every N (and SIGINT/SIGTERM) into --out DIR");
		return NG_ERR_INPUT;
	}
	char text[32];
	ssize_t n = read(fd, text, sizeof(text) - 1);
	close(fd);
	/* digits and one newline, as ng_ckpt_save writes it; a step of at most 2^62 */
	long long s = 0;
	bool ok = n > 0;
	ssize_t i = 0;
	for (; ok && i < n && text[i] >= '0' && text[i] <= '9'; i++) {
		int d = text[i] - '0';
		ok = s <= ((1ll << 62) - d) / 10;
		s = ok ? s * 10 + d : s;
	}
	ok = ok && i > 0 && (i == n || (text[i] == '\n' && i + 1 == n));
	if (!ok)
		return ng_fail(NG_ERR_INPUT, "%s does not hold a step number", path);
	*step = s;
	return NG_OK;
}
