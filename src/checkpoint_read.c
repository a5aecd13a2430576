/*
 * src/checkpoint_read.c — reading safetensors model and training-state files (see
 * checkpoint.h). The whole file is read and checked before any tensor is used: the header
 * length, the JSON (duplicate keys refused: two readers must not see two different files),
 * every tensor's dtype, shape (products checked for overflow) and byte count, offsets
 * contiguous and covering the data, and the checksum. Our files' checksum covers the header as
 * well as the data, so an edited shape, offset or metadata value is refused; files of other
 * writers (Hugging Face's GPT-2) carry none and are checked for consistency only: metadata
 * that is present must be a well-formed integer in range and agree with the tensors.
 * Model tensors are found by their HF GPT-2 names (with or without "transformer."),
 * F32/F64/BF16/F16 converted to float, Conv1D weights transposed back to our (out, in); a
 * speedrun model's file (format nanograph-speedrun) by its own names, exactly the tensors its
 * configuration has, already in our layout. A state
 * file's invariants (0 <= n_skipped <= step, the loader position that step implies) are checked
 * too: a file that passes loads a run that can continue.
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
#include <unistd.h>

#include "util/file.h"

#define MAX_HEADER (64u << 20) /* a header larger than this is a corrupt length */

/* Fuzzing builds (tools/fuzz) take any well-formed checksum as matching: a fuzzer cannot forge
 * FNV-1a, and the checks behind the checksum are what it is there to reach. */
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
static const bool fuzzing = true;
#else
static const bool fuzzing = false;
#endif
#define N_LAYER_NAMES NG_CKPT_LAYER_TENSORS

struct in_tensor {
	const char *name;    /* into the JSON */
	int elem;            /* bytes per element; 0: a dtype we do not read */
	char dtype[8];
	int ndim;
	size_t shape[4];
	size_t numel;        /* product of shape (checked not to overflow) */
	size_t begin, end;   /* in the data section */
};

/* What the file's checksum proved. */
enum in_check { CHECK_NONE, CHECK_DATA, CHECK_FILE };

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
	enum in_check check; /* NONE: another writer's file; DATA: ours from before the header was
	                      * covered; FILE: ours, header and data verified */
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
	ng_hint("the file is corrupt, truncated, edited or not a checkpoint of this model; use an "
		"earlier checkpoint");
	return NG_ERR_INPUT;
}

static bool is_hex16(const char *s)
{
	for (int i = 0; i < 16; i++)
		if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
			return false;
	return s[16] == '\0';
}

/* The checksum entry, as checkpoint.h defines it: "header+data:<16 hex>" over the whole file
 * with those 16 digits read as '0' (ours), "<16 hex>" over the data only (ours, earlier
 * versions), or none (another writer's). */
static enum ng_status in_verify(struct in_file *f, size_t hlen)
{
	json_t *ck = f->meta ? json_object_get(f->meta, "checksum") : NULL;
	f->check = CHECK_NONE;
	if (!ck)
		return NG_OK;
	const char *v = json_string_value(ck); /* a string: the metadata was checked */
	char m[200];
	if (is_hex16(v)) {
		char want[24];
		snprintf(want, sizeof(want), "%016" PRIx64, ng_ckpt_checksum(f->data, f->data_bytes));
		if (strcmp(v, want) != 0 && !fuzzing) {
			snprintf(m, sizeof(m), "checksum mismatch (header %s, data %s)", v, want);
			return bad(f->path, m);
		}
		f->check = CHECK_DATA;
		return NG_OK;
	}
	size_t plen = strlen(NG_CKPT_CHECKSUM_PREFIX);
	if (strncmp(v, NG_CKPT_CHECKSUM_PREFIX, plen) != 0 || !is_hex16(v + plen))
		return bad(f->path, "the checksum metadata is not \"" NG_CKPT_CHECKSUM_PREFIX
			   "<16 hex digits>\"");
	/* The value as it stands in the header bytes: exactly once, so the digits zeroed below are
	 * the ones the JSON holds (an escaped spelling of the key is refused, not guessed at). */
	static const char key[] = "\"checksum\":\"" NG_CKPT_CHECKSUM_PREFIX;
	const unsigned char *hdr = f->buf + 8, *at = NULL;
	size_t klen = strlen(key);
	for (size_t i = 0; i + klen + 16 <= hlen; i++) {
		if (memcmp(hdr + i, key, klen) != 0)
			continue;
		if (at)
			return bad(f->path, "the checksum entry appears twice in the header");
		at = hdr + i + klen;
	}
	if (!at)
		return bad(f->path, "the checksum entry is not written as nanograph writes it");
	static const char zeros[16] = "0000000000000000";
	uint64_t h = ng_ckpt_fnv1a_(NG_CKPT_FNV_INIT, f->buf, (size_t)(at - f->buf));
	h = ng_ckpt_fnv1a_(h, zeros, 16);
	h = ng_ckpt_fnv1a_(h, at + 16, f->size - (size_t)(at - f->buf) - 16);
	char want[24];
	snprintf(want, sizeof(want), "%016" PRIx64, h);
	if (memcmp(at, want, 16) != 0 && !fuzzing) {
		ng_fail(NG_ERR_INPUT, "checkpoint %s: checksum mismatch (header says %.16s, the file "
			"hashes to %s): its header, metadata or data changed after it was written",
			f->path, (const char *)at, want);
		ng_hint("use an earlier checkpoint; a file another tool re-saved with our metadata "
			"copied loads once its \"checksum\" entry is removed");
		return NG_ERR_INPUT;
	}
	f->check = CHECK_FILE;
	return NG_OK;
}

/* Read all of path (a regular file) into f->buf. */
static enum ng_status in_read(struct in_file *f, const char *path)
{
	struct stat sb;
	int fd = ng_file_open_regular(path, &sb);
	if (fd == -2) {
		ng_fail(NG_ERR_INPUT, "checkpoint %s: not a regular file (%s)", path,
			ng_file_kind(sb.st_mode));
		ng_hint("give a model_*.safetensors / state_*.safetensors file or a checkpoint "
			"directory");
		return NG_ERR_INPUT;
	}
	if (fd < 0)
		return ng_fail(NG_ERR_INPUT, "cannot open checkpoint %s: %s", path, strerror(errno));
	if (sb.st_size < 8) {
		close(fd);
		return bad(path, "shorter than the 8-byte header length");
	}
	f->size = (size_t)sb.st_size;
	f->buf = malloc(f->size);
	if (!f->buf) {
		close(fd);
		return ng_fail(NG_ERR_RUNTIME, "out of host memory reading %s (%zu bytes)", path,
			       f->size);
	}
	size_t got = 0;
	while (got < f->size) {
		ssize_t r = read(fd, f->buf + got, f->size - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			int e = errno;
			close(fd);
			if (r == 0)
				return bad(path, "the file shrank while being read");
			return ng_fail(NG_ERR_RUNTIME, "cannot read checkpoint %s: %s", path,
				       strerror(e));
		}
		got += (size_t)r;
	}
	close(fd);
	return NG_OK;
}

/* One tensor entry of the header into t. */
static enum ng_status in_tensor_parse(struct in_file *f, const char *key, json_t *v,
				      struct in_tensor *t)
{
	char m[320];
	json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape");
	json_t *of = json_object_get(v, "data_offsets");
	if (!json_is_object(v) || !json_is_string(dt) || !json_is_array(sh) ||
	    json_array_size(sh) > 4 || !json_is_array(of) || json_array_size(of) != 2)
		return bad(f->path, "a tensor entry lacks dtype, shape (at most 4-D) or data_offsets");
	t->name = key;
	snprintf(t->dtype, sizeof(t->dtype), "%s", json_string_value(dt));
	t->elem = !strcmp(t->dtype, "F64") ? 8 : !strcmp(t->dtype, "F32") ? 4 :
		  (!strcmp(t->dtype, "BF16") || !strcmp(t->dtype, "F16")) ? 2 : 0;
	t->ndim = (int)json_array_size(sh);
	t->numel = 1;
	for (int d = 0; d < t->ndim; d++) {
		json_t *x = json_array_get(sh, (size_t)d);
		if (!json_is_integer(x) || json_integer_value(x) < 0) {
			snprintf(m, sizeof(m), "tensor %s: dimension %d is not a non-negative integer",
				 key, d);
			return bad(f->path, m);
		}
		t->shape[d] = (size_t)json_integer_value(x);
		if (!ng_size_mul(t->numel, t->shape[d], &t->numel)) {
			snprintf(m, sizeof(m), "tensor %s: its shape's element count overflows", key);
			return bad(f->path, m);
		}
	}
	json_t *jb = json_array_get(of, 0), *je = json_array_get(of, 1);
	json_int_t b = json_integer_value(jb), e = json_integer_value(je);
	if (!json_is_integer(jb) || !json_is_integer(je) || b < 0 || e < b ||
	    (uint64_t)e > f->data_bytes) {
		snprintf(m, sizeof(m), "tensor %s lies past the end of the data (%zu bytes; "
			 "truncated?)", key, f->data_bytes);
		return bad(f->path, m);
	}
	t->begin = (size_t)b;
	t->end = (size_t)e;
	size_t bytes = 0;
	bool fits = t->elem == 0 || ng_size_mul(t->numel, (size_t)t->elem, &bytes);
	if (!fits || (t->elem && bytes != t->end - t->begin)) {
		char need[32] = "more than 2^64";
		if (fits)
			snprintf(need, sizeof(need), "%zu", bytes);
		snprintf(m, sizeof(m), "tensor %s: its shape needs %s bytes, the file has %zu", key,
			 need, t->end - t->begin);
		return bad(f->path, m);
	}
	return NG_OK;
}

static enum ng_status in_open(struct in_file *f, const char *path)
{
	memset(f, 0, sizeof(*f));
	f->path = path;
	enum ng_status st = in_read(f, path);
	if (st)
		return st;
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
	f->root = json_loadb((const char *)f->buf + 8, hlen, JSON_REJECT_DUPLICATES, &je);
	if (!f->root || !json_is_object(f->root))
		return bad(path, "the JSON header does not parse (or repeats a key)");
	f->data = f->buf + 8 + hlen;
	f->data_bytes = f->size - 8 - hlen;
	f->meta = json_object_get(f->root, "__metadata__");
	if (f->meta) {
		const char *k;
		json_t *v;
		if (!json_is_object(f->meta))
			return bad(path, "__metadata__ is not an object");
		json_object_foreach(f->meta, k, v) {
			if (!json_is_string(v)) {
				char m[200];
				snprintf(m, sizeof(m), "metadata %.64s is not a string", k);
				return bad(path, m);
			}
		}
	}
	size_t cap = json_object_size(f->root);
	f->t = calloc(cap ? cap : 1, sizeof(*f->t));
	if (!f->t)
		return ng_fail(NG_ERR_RUNTIME, "out of host memory");
	const char *key;
	json_t *v;
	json_object_foreach(f->root, key, v) {
		if (strcmp(key, "__metadata__") == 0)
			continue;
		st = in_tensor_parse(f, key, v, &f->t[f->n]);
		if (st)
			return st;
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
	return in_verify(f, (size_t)hlen);
}

static const struct in_tensor *in_find(const struct in_file *f, const char *name)
{
	for (int i = 0; i < f->n; i++)
		if (strcmp(f->t[i].name, name) == 0)
			return &f->t[i];
	return NULL;
}

/* Metadata `key` as a decimal integer in [lo, hi] into *v. Absent: NG_OK with *present false
 * (or an error when `required`). Present, it must be digits only and in range: a value that
 * overflows is an error, never "absent". */
static enum ng_status meta_uint(const struct in_file *f, const char *key, uint64_t lo,
				uint64_t hi, bool required, uint64_t *v, bool *present)
{
	json_t *j = f->meta ? json_object_get(f->meta, key) : NULL;
	char m[240];
	if (present)
		*present = j != NULL;
	if (!j) {
		if (!required)
			return NG_OK;
		snprintf(m, sizeof(m), "metadata %s is missing", key);
		return bad(f->path, m);
	}
	const char *s = json_string_value(j);
	uint64_t x = 0;
	bool ok = s[0] != '\0';
	for (const char *p = s; *p && ok; p++) {
		unsigned d = (unsigned)(*p - '0');
		ok = d <= 9 && !__builtin_mul_overflow(x, 10, &x) && !__builtin_add_overflow(x, d, &x);
	}
	if (!ok || x < lo || x > hi) {
		snprintf(m, sizeof(m), "metadata %s = \"%.40s\" is not an integer in [%" PRIu64 ", %"
			 PRIu64 "]", key, s, lo, hi);
		return bad(f->path, m);
	}
	*v = x;
	return NG_OK;
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

/* A dimension read from a header as a config int: in [1, max] or an error. */
static enum ng_status dim_int(const struct in_file *f, const char *what, size_t x, int max,
			      int *out)
{
	if (x < 1 || x > (size_t)max) {
		char m[200];
		snprintf(m, sizeof(m), "%s %zu is out of range (1..%d)", what, x, max);
		return bad(f->path, m);
	}
	*out = (int)x;
	return NG_OK;
}

/* Metadata `key`, when present, must equal the value the tensors give. */
static enum ng_status meta_agrees(const struct in_file *f, const char *key, int have)
{
	uint64_t v;
	bool present;
	enum ng_status st = meta_uint(f, key, 1, 1u << 30, false, &v, &present);
	if (!st && present && v != (uint64_t)have) {
		char m[200];
		snprintf(m, sizeof(m), "metadata %s = %" PRIu64 ", but the tensors give %d", key, v,
			 have);
		st = bad(f->path, m);
	}
	return st;
}

/* The configuration of a model file: V, C from wte, T from wpe, L from the layers present
 * (the metadata, where present, must agree), H from the metadata or C/64. */
static enum ng_status model_config(const struct in_file *f, struct ng_gpt_config *cfg)
{
	const struct in_tensor *wte = find_hf(f, "transformer.wte.weight");
	const struct in_tensor *wpe = find_hf(f, "transformer.wpe.weight");
	if (!wte || !wpe || wte->ndim != 2 || wpe->ndim != 2)
		return bad(f->path, "no 2-D transformer.wte.weight / transformer.wpe.weight: not a "
			   "GPT-2 model file");
	memset(cfg, 0, sizeof(*cfg));
	enum ng_status st = dim_int(f, "vocabulary (wte rows)", wte->shape[0], 65536, &cfg->V);
	if (!st)
		st = dim_int(f, "channels (wte columns)", wte->shape[1], 65536, &cfg->C);
	if (!st)
		st = dim_int(f, "context (wpe rows)", wpe->shape[0], 131072, &cfg->T);
	if (st)
		return st;
	int L = 0;
	for (char nm[96];; L++) {
		snprintf(nm, sizeof(nm), "transformer.h.%d.ln_1.weight", L);
		if (L > 1024 || !find_hf(f, nm))
			break;
	}
	if (L == 0)
		return bad(f->path, "no layer tensors (transformer.h.0.ln_1.weight is missing)");
	cfg->L = L;
	uint64_t H;
	bool has_h;
	st = meta_uint(f, "n_head", 1, 1024, false, &H, &has_h);
	if (!st)
		st = meta_agrees(f, "n_layer", cfg->L);
	if (!st)
		st = meta_agrees(f, "n_embd", cfg->C);
	if (!st)
		st = meta_agrees(f, "n_positions", cfg->T);
	if (!st)
		st = meta_agrees(f, "vocab_size", cfg->V);
	if (st)
		return st;
	cfg->H = has_h ? (int)H : cfg->C / 64;
	st = ng_gpt_check(cfg);
	if (st)
		ng_hint("checkpoint %s: its tensors and metadata give L=%d H=%d C=%d T=%d V=%d",
			f->path, cfg->L, cfg->H, cfg->C, cfg->T, cfg->V);
	return st;
}

/* A speedrun model file (format nanograph-speedrun, checkpoint.h): V and C from wte, L, H and
 * T from the metadata (required: no tensor gives H or T; n_embd and vocab_size, where present,
 * must agree), then exactly the tensors write_model_speedrun writes, each with its shape and a
 * dtype we read, checked before the model is allocated (so the file holds at least 2 bytes a
 * parameter, which bounds what the header can ask for). */
static enum ng_status read_model_speedrun(const struct in_file *f, struct ng_gpt_config *cfg,
					  float **params)
{
	char m[320];
	const struct in_tensor *wte = in_find(f, "wte");
	if (!wte || wte->ndim != 2)
		return bad(f->path, "a speedrun model file without a 2-D tensor wte");
	memset(cfg, 0, sizeof(*cfg));
	cfg->arch = NG_ARCH_SPEEDRUN;
	uint64_t L, H, T;
	enum ng_status st = dim_int(f, "vocabulary (wte rows)", wte->shape[0], 65536, &cfg->V);
	if (!st)
		st = dim_int(f, "channels (wte columns)", wte->shape[1], 65536, &cfg->C);
	if (!st)
		st = meta_uint(f, "n_layer", 1, 1024, true, &L, NULL);
	if (!st)
		st = meta_uint(f, "n_head", 1, 1024, true, &H, NULL);
	if (!st)
		st = meta_uint(f, "n_positions", 1, 131072, true, &T, NULL);
	if (!st)
		st = meta_agrees(f, "n_embd", cfg->C);
	if (!st)
		st = meta_agrees(f, "vocab_size", cfg->V);
	if (st)
		return st;
	cfg->L = (int)L;
	cfg->H = (int)H;
	cfg->T = (int)T;
	st = ng_gpt_check(cfg);
	if (st) {
		ng_hint("checkpoint %s: its tensors and metadata give a speedrun model of L=%d H=%d "
			"C=%d T=%d V=%d", f->path, cfg->L, cfg->H, cfg->C, cfg->T, cfg->V);
		return st;
	}
	struct ng_gpt_layout lay;
	ng_gpt_layout(cfg, &lay);
	int n = ng_ckpt_spr_tensors_(cfg, &lay, NULL);
	struct ng_ckpt_spr_tensor_ *d = calloc((size_t)n, sizeof(*d));
	const struct in_tensor **found = calloc((size_t)n, sizeof(*found));
	if (!d || !found) {
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory reading %s", f->path);
		goto out;
	}
	ng_ckpt_spr_tensors_(cfg, &lay, d);
	for (int k = 0; k < n && !st; k++) {
		const struct in_tensor *t = in_find(f, d[k].name);
		if (!t) {
			snprintf(m, sizeof(m), "tensor %s of the speedrun model L=%d is missing",
				 d[k].name, cfg->L);
			st = bad(f->path, m);
		} else if (t->ndim != d[k].ndim || t->shape[0] != d[k].shape[0] ||
			   (t->ndim > 1 && t->shape[1] != d[k].shape[1]) || !t->elem) {
			snprintf(m, sizeof(m), "tensor %s has shape [%zu%s%zu] dtype %s, expected "
				 "[%zu%s%zu] F32/F64/BF16/F16", d[k].name,
				 t->ndim ? t->shape[0] : 0, t->ndim > 1 ? ", " : "",
				 t->ndim > 1 ? t->shape[1] : 0, t->dtype, d[k].shape[0],
				 d[k].ndim > 1 ? ", " : "", d[k].ndim > 1 ? d[k].shape[1] : 0);
			st = bad(f->path, m);
		}
		found[k] = t;
	}
	/* every tensor found, so any further one is not the model's */
	for (int i = 0; i < f->n && !st && f->n != n; i++) {
		int k = 0;
		while (k < n && strcmp(f->t[i].name, d[k].name) != 0)
			k++;
		if (k == n) {
			snprintf(m, sizeof(m), "tensor %.64s is not part of a speedrun model of L=%d",
				 f->t[i].name, cfg->L);
			st = bad(f->path, m);
		}
	}
	if (st)
		goto out;
	*params = calloc(lay.total, sizeof(float));
	if (!*params) {
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory reading %s", f->path);
		goto out;
	}
	for (int k = 0; k < n; k++)
		in_floats(f, found[k], *params + d[k].off, d[k].shape[0] * d[k].shape[1]);
out:
	free(d);
	free(found);
	return st;
}

enum ng_status ng_ckpt_read_model(const char *path, struct ng_gpt_config *cfg, float **params)
{
	struct in_file f;
	const struct in_tensor **found = NULL;
	float *tmp = NULL;
	*params = NULL;
	enum ng_status st = in_open(&f, path);
	json_t *fmt = !st && f.meta ? json_object_get(f.meta, "format") : NULL;
	if (fmt && json_is_string(fmt) && strcmp(json_string_value(fmt), "nanograph-speedrun") == 0) {
		st = read_model_speedrun(&f, cfg, params);
		goto out;
	}
	if (!st)
		st = model_config(&f, cfg);
	if (st)
		goto out;
	struct ng_gpt_layout lay;
	ng_gpt_layout(cfg, &lay);
	int n = 4 + N_LAYER_NAMES * cfg->L;
	found = calloc((size_t)n, sizeof(*found));
	if (!found) {
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory reading %s", path);
		goto out;
	}
	/* every tensor present with its shape before anything is allocated for the model: the
	 * file then holds at least 2 bytes a parameter, which bounds what the header can ask for */
	for (int k = 0; k < n; k++) {
		char name[96], m[320];
		size_t off, shape[2];
		int ndim, tr;
		ng_ckpt_model_tensor_(cfg, &lay, k, name, sizeof(name), &off, shape, &ndim, &tr);
		const struct in_tensor *t = find_hf(&f, name);
		if (!t) {
			snprintf(m, sizeof(m), "tensor %s is missing", name);
			st = bad(path, m);
			goto out;
		}
		if (t->ndim != ndim || t->shape[0] != shape[0] || (ndim > 1 && t->shape[1] != shape[1])
		    || !t->elem) {
			snprintf(m, sizeof(m), "tensor %s has shape [%zu%s%zu] dtype %s, expected "
				 "[%zu, %zu] F32/F64/BF16/F16", name, t->ndim ? t->shape[0] : 0,
				 t->ndim > 1 ? ", " : "", t->ndim > 1 ? t->shape[1] : 0, t->dtype,
				 shape[0], ndim > 1 ? shape[1] : 1);
			st = bad(path, m);
			goto out;
		}
		found[k] = t;
	}
	*params = calloc(lay.total, sizeof(float));
	tmp = malloc((size_t)cfg->C * 4 * cfg->C * sizeof(float));
	if (!*params || !tmp) {
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory reading %s", path);
		goto out;
	}
	for (int k = 0; k < n; k++) {
		char name[96];
		size_t off, shape[2];
		int ndim, tr;
		ng_ckpt_model_tensor_(cfg, &lay, k, name, sizeof(name), &off, shape, &ndim, &tr);
		size_t want = shape[0] * (ndim > 1 ? shape[1] : 1);
		if (tr) {
			in_floats(&f, found[k], tmp, want);
			ng_ckpt_transpose_(*params + off, tmp, shape[0], shape[1]);
		} else {
			in_floats(&f, found[k], *params + off, want);
		}
	}
out:
	free(tmp);
	free(found);
	if (st) {
		free(*params);
		*params = NULL;
	}
	in_close(&f);
	return st;
}

/* The metadata of a state file into s, every value range-checked, then the invariants a run
 * that wrote it keeps: 0 <= n_skipped <= step, and with shards the loader K batches a step
 * ahead: epoch * batches_per_epoch + batch == step * K, batch < batches_per_epoch. */
static enum ng_status state_meta(const struct in_file *f, struct ng_train_state *s)
{
	const char *path = f->path;
	uint64_t v[13];
	static const struct {
		const char *key;
		uint64_t lo, hi;
	} keys[13] = {
		{ "nanograph_state", 1, 1 }, { "L", 1, 1024 }, { "H", 1, 1024 },
		{ "C", 1, 65536 }, { "T", 1, 131072 }, { "V", 2, 65536 }, { "B", 1, 1u << 30 },
		{ "Tseq", 1, 131072 }, { "K", 1, 1u << 30 }, { "step", 0, 1ull << 62 },
		{ "n_skipped", 0, 1ull << 62 }, { "seed", 0, UINT64_MAX }, { "has_pos", 0, 1 },
	};
	enum ng_status st = NG_OK;
	for (int i = 0; i < 13 && !st; i++)
		st = meta_uint(f, keys[i].key, keys[i].lo, keys[i].hi, true, &v[i], NULL);
	if (st)
		return st;
	uint64_t arch = NG_ARCH_GPT2;
	st = meta_uint(f, "arch", NG_ARCH_GPT2, NG_ARCH_SPEEDRUN, false, &arch, NULL);
	if (st)
		return st;
	s->cfg = (struct ng_gpt_config){ (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5], 0,
					 (int)arch };
	st = ng_gpt_check(&s->cfg);
	if (st) {
		ng_hint("checkpoint %s: its metadata gives L=%d H=%d C=%d T=%d V=%d", path,
			s->cfg.L, s->cfg.H, s->cfg.C, s->cfg.T, s->cfg.V);
		return st;
	}
	s->B = (int)v[6];
	s->T = (int)v[7];
	s->K = (int)v[8];
	s->step = (long long)v[9];
	s->n_skipped = (long long)v[10];
	s->seed = v[11];
	s->has_pos = v[12] == 1;
	uint64_t world = 0;
	bool has_world;
	st = meta_uint(f, "world", 1, 1u << 20, false, &world, &has_world);
	if (st)
		return st;
	s->world = (int)world; /* absent in files of earlier versions: 0, not checked on resume */
	uint64_t shuffle;
	bool has_shuffle;
	st = meta_uint(f, "shuffle", 0, 1, false, &shuffle, &has_shuffle);
	if (st)
		return st;
	s->shuffle = has_shuffle ? (int)shuffle : -1;
	uint64_t train_us;
	bool has_train_us;
	st = meta_uint(f, "train_us", 0, (uint64_t)1 << 62, false, &train_us, &has_train_us);
	if (st)
		return st;
	s->train_us = has_train_us ? (long long)train_us : -1;
	uint64_t muon = 0;
	st = meta_uint(f, "optimizer_muon", 0, 1, false, &muon, NULL);
	if (st)
		return st;
	s->muon = muon == 1; /* absent: an AdamW run */
	const char *pk[4] = { "pos_seed", "pos_windows", "pos_epoch", "pos_batch" };
	uint64_t p[4];
	for (int i = 0; i < 4 && !st; i++)
		st = meta_uint(f, pk[i], 0, UINT64_MAX, true, &p[i], NULL);
	if (st)
		return st;
	s->pos = (struct ng_loader_pos){ p[0], p[1], p[2], p[3] };
	char m[400];
	if (s->T > s->cfg.T) {
		snprintf(m, sizeof(m), "metadata Tseq %d exceeds the model's context T %d", s->T,
			 s->cfg.T);
		return bad(path, m);
	}
	if (s->n_skipped > s->step) {
		snprintf(m, sizeof(m), "metadata n_skipped %lld exceeds step %lld (at most every "
			 "step can have been skipped)", s->n_skipped, s->step);
		return bad(path, m);
	}
	if (s->has_pos) {
		uint64_t per = (uint64_t)s->B * (world ? world : 1), bpe = s->pos.windows / per;
		uint64_t at = 0, want = 0;
		bool fits = !__builtin_mul_overflow(s->pos.epoch, bpe, &at) &&
			    !__builtin_add_overflow(at, s->pos.batch, &at) &&
			    !__builtin_mul_overflow((uint64_t)s->step, (uint64_t)s->K, &want);
		if (s->pos.seed != s->seed || bpe == 0 || s->pos.batch >= bpe || !fits ||
		    at != want) {
			snprintf(m, sizeof(m), "the loader position (seed %" PRIu64 ", %" PRIu64
				 " windows, epoch %" PRIu64 ", batch %" PRIu64 ") is not where %lld "
				 "steps of %d batches of %d x %" PRIu64 " rank(s) lead (seed %" PRIu64
				 ")", s->pos.seed, s->pos.windows, s->pos.epoch, s->pos.batch,
				 s->step, s->K, s->B, world ? world : 1, s->seed);
			return bad(path, m);
		}
	}
	return NG_OK;
}

enum ng_status ng_ckpt_read_state(const char *path, struct ng_train_state *s)
{
	struct in_file f;
	memset(s, 0, sizeof(*s));
	enum ng_status st = in_open(&f, path);
	if (st)
		goto out;
	uint64_t ver;
	bool has_ver;
	if (meta_uint(&f, "nanograph_state", 1, 1, false, &ver, &has_ver) || !has_ver) {
		ng_clear_error();
		st = bad(path, "not a nanograph training-state file (no nanograph_state metadata)");
		goto out;
	}
	if (f.check == CHECK_NONE) {
		st = bad(path, "the state file carries no checksum");
		goto out;
	}
	st = state_meta(&f, s);
	if (st)
		goto out;
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
	const struct in_tensor *t8 = in_find(&f, "fp8_state"); /* --fp8 runs only */
	if (t8 && (t8->ndim != 1 || strcmp(t8->dtype, "F32") != 0 || t8->shape[0] == 0)) {
		st = bad(path, "tensor fp8_state is not a 1-D F32 tensor");
		goto out;
	}
	st = ng_ckpt_state_alloc(s, t[0]->elem, lay.total);
	if (st)
		goto out;
	void *dst[3] = { s->params, s->m, s->v };
	for (int i = 0; i < 3; i++)
		memcpy(dst[i], f.data + t[i]->begin, t[i]->end - t[i]->begin);
	if (t8) { /* its byte count equals 4 x its shape (checked without overflow at open) */
		s->n_fp8 = t8->shape[0];
		s->fp8 = malloc(t8->end - t8->begin);
		if (!s->fp8) {
			st = ng_fail(NG_ERR_RUNTIME, "out of host memory for %s", path);
			goto out;
		}
		memcpy(s->fp8, f.data + t8->begin, t8->end - t8->begin);
	}
out:
	if (st)
		ng_ckpt_state_free(s);
	in_close(&f);
	return st;
}
