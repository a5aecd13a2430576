/*
 * data/tokenizer.c — loading encoder.json / vocab.bpe, pre-tokenizing with PCRE2, byte-level
 * BPE and decoding (see tokenizer.h). Loading checks that the two files belong together: ids
 * unique and dense, and the merges make every token that is neither a byte nor a special
 * token exactly once, each from tokens that exist before it — a truncated vocab.bpe or one of
 * another vocabulary is refused instead of encoding differently.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <pcre2.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ng_config.h"
#include "util/file.h"
#include "util/rng.h"

/* \s spelled out as Unicode White_Space, which the reference implementation (Python's regex
 * module) uses; PCRE2's own \s also takes U+180E, and the token stream would differ there. */
#define WS "\\t\\n\\x0b\\f\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}" \
	   "\\x{205f}\\x{3000}"
static const char GPT2_PATTERN[] =
	"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS
	"])|[" WS "]+";

/* GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68 bytes to code points
 * 256, 257, ... in byte order. */
static void byte_to_cp_table(int cp_of[256])
{
	int extra = 0;
	for (int b = 0; b < 256; b++) {
		bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
		cp_of[b] = printable ? b : 256 + extra++;
	}
}

/* Decode a byte-level-unicode key (UTF-8 text) into raw bytes; false when it is not one. */
static bool key_to_bytes(const char *key, const int byte_of_cp[512], char *out, size_t *n)
{
	const unsigned char *p = (const unsigned char *)key;
	*n = 0;
	while (*p) {
		int cp;
		if (p[0] < 0x80) {
			cp = p[0];
			p += 1;
		} else if ((p[0] & 0xe0) == 0xc0 && (p[1] & 0xc0) == 0x80) {
			cp = ((p[0] & 0x1f) << 6) | (p[1] & 0x3f);
			p += 2;
		} else {
			return false; /* byte-level keys only use code points < 512 */
		}
		if (cp >= 512 || byte_of_cp[cp] < 0)
			return false;
		out[(*n)++] = (char)byte_of_cp[cp];
	}
	return true;
}

static void cp_to_utf8(int cp, char *out)
{
	if (cp < 0x80) {
		out[0] = (char)cp;
		out[1] = 0;
	} else {
		out[0] = (char)(0xc0 | (cp >> 6));
		out[1] = (char)(0x80 | (cp & 0x3f));
		out[2] = 0;
	}
}

/* A stream of the regular file `path` (a FIFO or a device would block the read forever). */
static enum ng_status open_vocab_file(const char *path, FILE **out)
{
	struct stat sb;
	int fd = ng_file_open_regular(path, &sb);
	if (fd == -2)
		return ng_fail(NG_ERR_INPUT, "tokenizer: %s is not a regular file (%s)", path,
			       ng_file_kind(sb.st_mode));
	if (fd < 0) {
		ng_fail(NG_ERR_INPUT, "tokenizer: cannot open %s: %s", path, strerror(errno));
		ng_hint("--vocab DIR must hold GPT-2's encoder.json and vocab.bpe");
		return NG_ERR_INPUT;
	}
	*out = fdopen(fd, "rb");
	if (!*out) {
		close(fd);
		return ng_fail(NG_ERR_RUNTIME, "tokenizer: cannot read %s: %s", path,
			       strerror(errno));
	}
	return NG_OK;
}

/* A special token: "<|...|>", as GPT-2's <|endoftext|>; never made by a merge. */
static bool is_special(const char *key)
{
	size_t n = strlen(key);
	return n > 4 && strncmp(key, "<|", 2) == 0 && strcmp(key + n - 2, "|>") == 0;
}

static enum ng_status load_encoder(struct ng_tokenizer *tok, const char *path, json_t **enc_out)
{
	json_error_t jerr;
	FILE *f;
	enum ng_status st = open_vocab_file(path, &f);
	if (st)
		return st;
	json_t *enc = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
	fclose(f);
	if (!enc)
		return ng_fail(NG_ERR_INPUT, "tokenizer: %s is not valid JSON (line %d: %s)", path,
			       jerr.line, jerr.text);
	if (!json_is_object(enc) || json_object_size(enc) < 256) {
		json_decref(enc);
		return ng_fail(NG_ERR_INPUT, "tokenizer: %s is not a GPT-2 encoder (expected an "
			       "object of at least 256 token -> id entries)", path);
	}
	int cp_of[256], byte_of_cp[512];
	byte_to_cp_table(cp_of);
	for (int i = 0; i < 512; i++)
		byte_of_cp[i] = -1;
	for (int b = 0; b < 256; b++)
		byte_of_cp[cp_of[b]] = b;
	int max_id = -1;
	size_t total = 0;
	const char *key;
	json_t *val;
	json_object_foreach(enc, key, val) {
		json_int_t id = json_is_integer(val) ? json_integer_value(val) : -1;
		if (id < 0 || id > 65535) { /* the message quotes key: before the JSON is freed */
			ng_fail(NG_ERR_INPUT, "tokenizer: %s: token \"%s\" has a bad id (must be an "
				"integer 0..65535)", path, key);
			json_decref(enc);
			return NG_ERR_INPUT;
		}
		max_id = id > max_id ? (int)id : max_id;
		total += strlen(key);
		tok->n_special += is_special(key);
	}
	tok->n_vocab = max_id + 1;
	if (total > UINT32_MAX) { /* the decode table's offsets are 32-bit */
		json_decref(enc);
		return ng_fail(NG_ERR_INPUT, "tokenizer: %s: %zu bytes of token text, more than 4 GiB",
			       path, total);
	}
	if ((size_t)tok->n_vocab != json_object_size(enc)) { /* then some id repeats or is missing */
		json_decref(enc);
		return ng_fail(NG_ERR_INPUT, "tokenizer: %s: %zu tokens with ids up to %d: the ids "
			       "must be 0..%zu, each once", path, json_object_size(enc), max_id,
			       json_object_size(enc) - 1);
	}
	tok->off_ = calloc((size_t)tok->n_vocab + 1, sizeof(uint32_t));
	uint32_t *len = calloc((size_t)tok->n_vocab, sizeof(uint32_t));
	char **ptr = calloc((size_t)tok->n_vocab, sizeof(char *));
	char *scratch = malloc(total + 1);
	tok->bytes_ = malloc(total + 1);
	if (!tok->off_ || !len || !ptr || !scratch || !tok->bytes_) {
		free(len);
		free(ptr);
		free(scratch);
		json_decref(enc);
		return ng_fail(NG_ERR_RUNTIME, "tokenizer: out of memory loading %s", path);
	}
	/* Raw bytes of every key into scratch, then laid out by id into bytes_. */
	size_t at = 0;
	json_object_foreach(enc, key, val) {
		size_t n;
		int id = (int)json_integer_value(val);
		if (ptr[id]) {
			st = ng_fail(NG_ERR_INPUT, "tokenizer: %s: id %d is given to two tokens", path,
				     id);
			break;
		}
		if (!key_to_bytes(key, byte_of_cp, scratch + at, &n) &&
		    strcmp(key, "<|endoftext|>") != 0) {
			st = ng_fail(NG_ERR_INPUT, "tokenizer: %s: key \"%s\" is not byte-level BPE "
				     "text", path, key);
			break;
		}
		if (strcmp(key, "<|endoftext|>") == 0) { /* the special token decodes as its text */
			n = strlen(key);
			memcpy(scratch + at, key, n);
		}
		ptr[id] = scratch + at;
		len[id] = (uint32_t)n;
		at += n;
	}
	at = 0;
	for (int i = 0; i < tok->n_vocab && !st; i++) {
		tok->off_[i] = (uint32_t)at;
		if (ptr[i])
			memcpy(tok->bytes_ + at, ptr[i], len[i]);
		at += len[i];
	}
	tok->off_[tok->n_vocab] = (uint32_t)at;
	free(len);
	free(ptr);
	free(scratch);
	if (st) {
		json_decref(enc);
		return st;
	}
	for (int b = 0; b < 256; b++) {
		char k[4];
		cp_to_utf8(cp_of[b], k);
		json_t *v = json_object_get(enc, k);
		if (!v) {
			json_decref(enc);
			return ng_fail(NG_ERR_INPUT, "tokenizer: %s has no token for byte %d", path, b);
		}
		tok->byte_id[b] = (uint16_t)json_integer_value(v);
	}
	*enc_out = enc;
	return NG_OK;
}

static void merge_put(struct ng_tokenizer *tok, uint64_t key, uint64_t val)
{
	size_t mask = tok->merge_cap_ - 1, i = ng_rng_mix64(key) & mask;
	while (tok->merge_key_[i] && tok->merge_key_[i] != key)
		i = (i + 1) & mask;
	if (!tok->merge_key_[i]) { /* the first rank of a duplicated rule wins */
		tok->merge_key_[i] = key;
		tok->merge_val_[i] = val;
	}
}

/* (rank << 32 | merged id) of the pair, or UINT64_MAX. */
static uint64_t merge_get(const struct ng_tokenizer *tok, uint32_t a, uint32_t b)
{
	uint64_t key = ((uint64_t)a << 32 | b) + 1; /* +1: never 0 (the empty mark) */
	size_t mask = tok->merge_cap_ - 1, i = ng_rng_mix64(key) & mask;
	while (tok->merge_key_[i]) {
		if (tok->merge_key_[i] == key)
			return tok->merge_val_[i];
		i = (i + 1) & mask;
	}
	return UINT64_MAX;
}

static enum ng_status load_merges(struct ng_tokenizer *tok, const char *path, json_t *enc)
{
	FILE *f;
	enum ng_status st = open_vocab_file(path, &f);
	if (st)
		return st;
	tok->merge_cap_ = 1 << 17;
	tok->merge_key_ = calloc(tok->merge_cap_, sizeof(uint64_t));
	tok->merge_val_ = calloc(tok->merge_cap_, sizeof(uint64_t));
	/* made[id]: the token exists by this point of vocab.bpe (a byte, or made by a merge above);
	 * specials are marked too, so that no merge may make or use them */
	unsigned char *made = calloc((size_t)tok->n_vocab, 1);
	if (!tok->merge_key_ || !tok->merge_val_ || !made) {
		free(made);
		fclose(f);
		return ng_fail(NG_ERR_RUNTIME, "tokenizer: out of memory loading %s", path);
	}
	for (int b = 0; b < 256; b++)
		made[tok->byte_id[b]] = 1;
	const char *key;
	json_t *val;
	json_object_foreach(enc, key, val) {
		if (is_special(key))
			made[json_integer_value(val)] = 2;
	}
	char *line = NULL;
	size_t cap = 0;
	ssize_t n;
	int lineno = 0;
	while ((n = getline(&line, &cap, f)) >= 0) {
		lineno++;
		while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
			line[--n] = '\0';
		if (n == 0 || (lineno == 1 && strncmp(line, "#version", 8) == 0))
			continue;
		char *sp = strchr(line, ' ');
		if (!sp || sp == line || !sp[1] || strchr(sp + 1, ' ')) {
			st = ng_fail(NG_ERR_INPUT, "tokenizer: %s line %d: expected two tokens "
				     "separated by one space", path, lineno);
			break;
		}
		*sp = '\0';
		if (strlen(line) != (size_t)n - strlen(sp + 1) - 1 || (size_t)n >= 1024) {
			st = ng_fail(NG_ERR_INPUT, "tokenizer: %s line %d: a NUL byte or more than "
				     "1023 bytes", path, lineno);
			break;
		}
		json_t *a = json_object_get(enc, line), *b = json_object_get(enc, sp + 1);
		char both[1024];
		snprintf(both, sizeof(both), "%s%s", line, sp + 1);
		json_t *ab = json_object_get(enc, both);
		if (!a || !b || !ab) {
			st = ng_fail(NG_ERR_INPUT, "tokenizer: %s line %d: merge \"%s %s\" uses a "
				     "token missing from encoder.json", path, lineno, line, sp + 1);
			break;
		}
		json_int_t ia = json_integer_value(a), ib = json_integer_value(b);
		json_int_t iab = json_integer_value(ab);
		if (made[ia] != 1 || made[ib] != 1 || made[iab]) {
			st = ng_fail(NG_ERR_INPUT, "tokenizer: %s line %d: merge \"%s %s\" %s", path,
				     lineno, line, sp + 1, made[iab] ? "makes a token that is a byte, "
				     "a special token or made by an earlier merge" : "uses a token "
				     "no earlier merge made");
			break;
		}
		made[iab] = 1;
		if ((size_t)tok->n_merges * 2 >= tok->merge_cap_) {
			st = ng_fail(NG_ERR_INPUT, "tokenizer: %s: more than %zu merges", path,
				     tok->merge_cap_ / 2);
			break;
		}
		uint64_t key = ((uint64_t)json_integer_value(a) << 32 |
				(uint64_t)json_integer_value(b)) + 1;
		merge_put(tok, key, (uint64_t)tok->n_merges << 32 | (uint64_t)json_integer_value(ab));
		tok->n_merges++;
	}
	if (!st && ferror(f))
		st = ng_fail(NG_ERR_INPUT, "tokenizer: cannot read %s", path);
	if (!st && tok->n_merges == 0)
		st = ng_fail(NG_ERR_INPUT, "tokenizer: %s holds no merges", path);
	/* each merge made a distinct token: the counts agree exactly when every token is made */
	int want = tok->n_vocab - 256 - tok->n_special;
	if (!st && tok->n_merges != want) {
		ng_fail(NG_ERR_INPUT, "tokenizer: %s holds %d merges, its encoder.json needs %d (%d "
			"tokens - 256 bytes - %d special)", path, tok->n_merges, want, tok->n_vocab,
			tok->n_special);
		ng_hint("vocab.bpe is truncated or belongs to another vocabulary: take both files "
			"from the same release");
		st = NG_ERR_INPUT;
	}
	free(made);
	free(line);
	fclose(f);
	return st;
}

const char *ng_tokenizer_default_dir(void)
{
	const char *env = getenv("NG_GPT2_DIR");
	return env && *env ? env : NG_GPT2_DIR_DEFAULT;
}

enum ng_status ng_tokenizer_load(struct ng_tokenizer *tok, const char *dir)
{
	memset(tok, 0, sizeof(*tok));
	char path[4096];
	json_t *enc = NULL;
	snprintf(path, sizeof(path), "%s/encoder.json", dir);
	enum ng_status st = load_encoder(tok, path, &enc);
	if (!st) {
		snprintf(path, sizeof(path), "%s/vocab.bpe", dir);
		st = load_merges(tok, path, enc);
	}
	json_decref(enc);
	if (!st) {
		int err;
		PCRE2_SIZE at;
		pcre2_code *re = pcre2_compile((PCRE2_SPTR)GPT2_PATTERN, PCRE2_ZERO_TERMINATED,
					       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF,
					       &err, &at, NULL);
		if (!re) {
			PCRE2_UCHAR msg[256];
			pcre2_get_error_message(err, msg, sizeof(msg));
			st = ng_fail(NG_ERR_RUNTIME, "tokenizer: PCRE2 rejects the GPT-2 pattern at %zu: "
				     "%s", (size_t)at, (const char *)msg);
		} else {
			pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* interpreted if JIT is missing */
			tok->re_ = re;
		}
	}
	if (st)
		ng_tokenizer_free(tok);
	return st;
}

void ng_tokenizer_free(struct ng_tokenizer *tok)
{
	pcre2_code_free((pcre2_code *)tok->re_);
	free(tok->bytes_);
	free(tok->off_);
	free(tok->merge_key_);
	free(tok->merge_val_);
	memset(tok, 0, sizeof(*tok));
}

enum ng_status ng_token_buf_push(struct ng_token_buf *b, uint16_t id)
{
	if (b->len == b->cap) {
		size_t cap = b->cap ? 2 * b->cap : 1024;
		uint16_t *d = realloc(b->data, cap * sizeof(uint16_t));
		if (!d)
			return ng_fail(NG_ERR_RUNTIME, "tokenizer: out of memory for %zu tokens", cap);
		b->data = d;
		b->cap = cap;
	}
	b->data[b->len++] = id;
	return NG_OK;
}

/* ---- BPE of one pre-token: a doubly linked list of tokens and a binary min-heap of candidate
 * merges keyed by (rank, left position); stale heap entries are skipped when popped. ---- */

struct bpe_cand {
	uint64_t key;  /* rank << 32 | left position: lowest rank first, then leftmost */
	uint32_t left, right; /* positions of the pair */
	uint16_t a, b; /* token ids the pair had when pushed */
	uint16_t merged; /* id of the merged token */
};

static void heap_push(struct bpe_cand *h, size_t *n, struct bpe_cand c)
{
	size_t i = (*n)++;
	while (i > 0 && h[(i - 1) / 2].key > c.key) {
		h[i] = h[(i - 1) / 2];
		i = (i - 1) / 2;
	}
	h[i] = c;
}

static struct bpe_cand heap_pop(struct bpe_cand *h, size_t *n)
{
	struct bpe_cand top = h[0], last = h[--(*n)];
	size_t i = 0;
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= *n)
			break;
		if (c + 1 < *n && h[c + 1].key < h[c].key)
			c++;
		if (h[c].key >= last.key)
			break;
		h[i] = h[c];
		i = c;
	}
	if (*n)
		h[i] = last;
	return top;
}

static void try_pair(const struct ng_tokenizer *tok, const uint16_t *id, struct bpe_cand *h,
		     size_t *nh, uint32_t l, uint32_t r)
{
	uint64_t v = merge_get(tok, id[l], id[r]);
	if (v == UINT64_MAX)
		return;
	struct bpe_cand c = { (v >> 32) << 32 | l, l, r, id[l], id[r], (uint16_t)v };
	heap_push(h, nh, c);
}

/* Tokens of word[0..n) appended to out. */
static enum ng_status bpe_word(const struct ng_tokenizer *tok, const unsigned char *w, size_t n,
			       struct ng_token_buf *out)
{
	if (n == 1)
		return ng_token_buf_push(out, tok->byte_id[w[0]]);
	uint16_t *id = malloc(n * sizeof(uint16_t));
	uint32_t *next = malloc(n * sizeof(uint32_t)), *prev = malloc(n * sizeof(uint32_t));
	struct bpe_cand *h = malloc(2 * n * sizeof(struct bpe_cand));
	enum ng_status st = NG_OK;
	if (!id || !next || !prev || !h) {
		st = ng_fail(NG_ERR_RUNTIME, "tokenizer: out of memory for a %zu-byte word", n);
		goto out;
	}
	const uint32_t NIL = UINT32_MAX;
	size_t nh = 0, cap = 2 * n;
	for (size_t i = 0; i < n; i++) {
		id[i] = tok->byte_id[w[i]];
		next[i] = i + 1 < n ? (uint32_t)(i + 1) : NIL;
		prev[i] = i > 0 ? (uint32_t)(i - 1) : NIL;
	}
	for (size_t i = 0; i + 1 < n; i++)
		try_pair(tok, id, h, &nh, (uint32_t)i, (uint32_t)(i + 1));
	while (nh) {
		struct bpe_cand c = heap_pop(h, &nh);
		/* stale: either side was merged away or changed since the push */
		if (id[c.left] != c.a || next[c.left] != c.right || id[c.right] != c.b ||
		    prev[c.right] != c.left)
			continue;
		id[c.left] = c.merged;
		next[c.left] = next[c.right];
		if (next[c.right] != NIL)
			prev[next[c.right]] = c.left;
		prev[c.right] = next[c.right] = NIL;
		id[c.right] = UINT16_MAX; /* dead */
		if (nh + 2 > cap) { /* each merge adds at most 2 candidates and removes 1 node */
			cap *= 2;
			struct bpe_cand *g = realloc(h, cap * sizeof(*h));
			if (!g) {
				st = ng_fail(NG_ERR_RUNTIME, "tokenizer: out of memory");
				goto out;
			}
			h = g;
		}
		if (prev[c.left] != NIL)
			try_pair(tok, id, h, &nh, prev[c.left], c.left);
		if (next[c.left] != NIL)
			try_pair(tok, id, h, &nh, c.left, next[c.left]);
	}
	for (uint32_t i = 0; i != NIL && !st; i = next[i])
		st = ng_token_buf_push(out, id[i]);
out:
	free(id);
	free(next);
	free(prev);
	free(h);
	return st;
}

/* ---- the per-thread pre-token cache ---- */

#define CACHE_MAX_WORD 256        /* longer pre-tokens are not cached */
#define CACHE_MAX_ENTRIES (1u << 18) /* then the cache starts over */

static uint64_t hash_bytes(const unsigned char *p, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, finished with mix64 */
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 0x100000001b3ull;
	h = ng_rng_mix64(h ^ n);
	return h ? h : 1;
}

static void cache_reset(struct ng_bpe_cache *c)
{
	if (c->hash_)
		memset(c->hash_, 0, c->cap_ * sizeof(uint64_t));
	c->count_ = c->keys_len_ = c->vals_len_ = 0;
}

/* Entry index of (w, n), or -1; *slot gets the probe end (an empty slot) when not found. */
static long cache_find(const struct ng_bpe_cache *c, const unsigned char *w, size_t n,
		       uint64_t h, size_t *slot)
{
	size_t mask = c->cap_ - 1, i = h & mask;
	while (c->hash_[i]) {
		const uint32_t *e = c->entry_ + 4 * i;
		if (c->hash_[i] == h && e[1] == n && memcmp(c->keys_ + e[0], w, n) == 0)
			return (long)i;
		i = (i + 1) & mask;
	}
	*slot = i;
	return -1;
}

static bool grow(void **p, size_t *cap, size_t need, size_t elem)
{
	if (need <= *cap)
		return true;
	size_t c = *cap ? *cap : 4096;
	while (c < need)
		c *= 2;
	void *q = realloc(*p, c * elem);
	if (!q)
		return false;
	*p = q;
	*cap = c;
	return true;
}

/* Tokens of one pre-token, through the cache when there is one. */
static enum ng_status encode_word(const struct ng_tokenizer *tok, struct ng_bpe_cache *c,
				  const unsigned char *w, size_t n, struct ng_token_buf *out)
{
	if (!c || n > CACHE_MAX_WORD || n == 1)
		return bpe_word(tok, w, n, out);
	if (!c->hash_ || c->owner_ != tok) {
		free(c->hash_);
		free(c->entry_);
		c->cap_ = 2 * CACHE_MAX_ENTRIES;
		c->hash_ = calloc(c->cap_, sizeof(uint64_t));
		c->entry_ = malloc(c->cap_ * 4 * sizeof(uint32_t));
		if (!c->hash_ || !c->entry_)
			return ng_fail(NG_ERR_RUNTIME, "tokenizer: out of memory for the BPE cache");
		c->owner_ = tok;
		cache_reset(c);
	}
	uint64_t h = hash_bytes(w, n);
	size_t slot = 0;
	long i = cache_find(c, w, n, h, &slot);
	if (i >= 0) {
		const uint32_t *e = c->entry_ + 4 * i;
		for (uint32_t k = 0; k < e[3]; k++) {
			enum ng_status st = ng_token_buf_push(out, c->vals_[e[2] + k]);
			if (st)
				return st;
		}
		return NG_OK;
	}
	size_t before = out->len;
	enum ng_status st = bpe_word(tok, w, n, out);
	if (st)
		return st;
	size_t m = out->len - before;
	if (c->count_ >= CACHE_MAX_ENTRIES || c->keys_len_ + n > UINT32_MAX / 2) {
		cache_reset(c);
		cache_find(c, w, n, h, &slot);
	}
	if (!grow((void **)&c->keys_, &c->keys_cap_, c->keys_len_ + n, 1) ||
	    !grow((void **)&c->vals_, &c->vals_cap_, c->vals_len_ + m, sizeof(uint16_t)))
		return NG_OK; /* no room to cache: the result is still right */
	memcpy(c->keys_ + c->keys_len_, w, n);
	memcpy(c->vals_ + c->vals_len_, out->data + before, m * sizeof(uint16_t));
	uint32_t *e = c->entry_ + 4 * slot;
	e[0] = (uint32_t)c->keys_len_;
	e[1] = (uint32_t)n;
	e[2] = (uint32_t)c->vals_len_;
	e[3] = (uint32_t)m;
	c->hash_[slot] = h;
	c->keys_len_ += n;
	c->vals_len_ += m;
	c->count_++;
	return NG_OK;
}

/* One pre-token, in pieces of at most NG_TOKENIZER_MAX_WORD bytes (each cut moved back to a
 * UTF-8 lead byte where one is near): BPE's time and memory stay bounded by the piece, and a
 * pre-token of ordinary text, far shorter, is encoded whole as before. */
static enum ng_status encode_pretoken(const struct ng_tokenizer *tok, struct ng_bpe_cache *c,
				      const unsigned char *w, size_t n, struct ng_token_buf *out)
{
	while (n > NG_TOKENIZER_MAX_WORD) {
		size_t cut = NG_TOKENIZER_MAX_WORD;
		for (int k = 0; k < 3 && (w[cut] & 0xc0) == 0x80; k++)
			cut--;
		enum ng_status st = encode_word(tok, c, w, cut, out);
		if (st)
			return st;
		w += cut;
		n -= cut;
	}
	return encode_word(tok, c, w, n, out);
}

void ng_bpe_cache_free(struct ng_bpe_cache *c)
{
	pcre2_match_data_free((pcre2_match_data *)c->match_);
	free(c->hash_);
	free(c->entry_);
	free(c->keys_);
	free(c->vals_);
	memset(c, 0, sizeof(*c));
}

enum ng_status ng_tokenizer_encode(const struct ng_tokenizer *tok, struct ng_bpe_cache *cache,
				   const char *bytes, size_t len, struct ng_token_buf *out)
{
	const pcre2_code *re = tok->re_;
	pcre2_match_data *md = cache ? cache->match_ : NULL;
	if (!md) {
		md = pcre2_match_data_create_from_pattern(re, NULL);
		if (!md)
			return ng_fail(NG_ERR_RUNTIME, "tokenizer: out of memory (PCRE2 match data)");
		if (cache)
			cache->match_ = md;
	}
	const unsigned char *s = (const unsigned char *)bytes;
	size_t at = 0;
	enum ng_status st = NG_OK;
	while (at < len && !st) {
		int rc = pcre2_match(re, s, len, at, 0, md, NULL);
		size_t m0 = len, m1 = len;
		if (rc >= 0) {
			PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
			m0 = ov[0];
			m1 = ov[1];
		} else if (rc != PCRE2_ERROR_NOMATCH) {
			PCRE2_UCHAR msg[256];
			pcre2_get_error_message(rc, msg, sizeof(msg));
			st = ng_fail(NG_ERR_RUNTIME, "tokenizer: PCRE2 match failed at byte %zu: %s",
				     at, (const char *)msg);
			break;
		}
		if (m0 > at) /* bytes no pattern branch matches (invalid UTF-8): a pre-token */
			st = encode_pretoken(tok, cache, s + at, m0 - at, out);
		if (!st && m1 > m0)
			st = encode_pretoken(tok, cache, s + m0, m1 - m0, out);
		at = m1 > at ? m1 : at + 1; /* matches are never empty; guard anyway */
	}
	if (!cache)
		pcre2_match_data_free(md);
	return st;
}

const char *ng_tokenizer_token_bytes(const struct ng_tokenizer *tok, int id, size_t *len)
{
	if (id < 0 || id >= tok->n_vocab) {
		*len = 0;
		return NULL;
	}
	*len = tok->off_[id + 1] - tok->off_[id];
	return tok->bytes_ + tok->off_[id];
}

enum ng_status ng_tokenizer_decode(const struct ng_tokenizer *tok, const uint16_t *ids, size_t n,
				   char **text, size_t *text_len)
{
	*text = NULL;
	*text_len = 0;
	size_t total = 0;
	for (size_t i = 0; i < n; i++) {
		if (ids[i] >= tok->n_vocab)
			return ng_fail(NG_ERR_INPUT, "tokenizer: token %u at index %zu is outside the "
				       "vocabulary (%d tokens)", ids[i], i, tok->n_vocab);
		total += tok->off_[ids[i] + 1] - tok->off_[ids[i]];
	}
	char *t = malloc(total + 1);
	if (!t)
		return ng_fail(NG_ERR_RUNTIME, "tokenizer: out of memory decoding %zu tokens", n);
	size_t at = 0;
	for (size_t i = 0; i < n; i++) {
		size_t l = tok->off_[ids[i] + 1] - tok->off_[ids[i]];
		memcpy(t + at, tok->bytes_ + tok->off_[ids[i]], l);
		at += l;
	}
	t[at] = '\0';
	*text = t;
	*text_len = at;
	return NG_OK;
}
