/*
 * data/tokenizer.h — the GPT-2 byte-level BPE tokenizer, from the released encoder.json (token
 * string -> id, read with jansson) and vocab.bpe (the merges, in rank order).
 *
 * Encoding: the text is cut into pre-tokens by the GPT-2 pattern
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * through PCRE2 (UTF + UCP, JIT). Bytes that are not valid UTF-8 never match; each run of them
 * between matches becomes a pre-token of its own, so ANY byte string encodes and
 * decode(encode(x)) == x. Each pre-token's bytes start as single-byte tokens and are merged
 * lowest-rank pair first (a heap over a linked list: O(n log n)); results per pre-token are
 * cached per thread in a struct ng_bpe_cache. A pre-token longer than NG_TOKENIZER_MAX_WORD
 * bytes (no word of text is: a 50 MB line without a space is) is encoded in pieces of at most
 * that size, so time and memory per byte stay bounded; its tokens then differ from unbounded
 * BPE's only next to the cuts.
 * The tokenizer holds everything in raw bytes: the byte-to-unicode mapping of GPT-2 is undone
 * once, at load.
 *
 * Text "<|endoftext|>" inside the input is ordinary text; callers that want the special token
 * append NG_TOKENIZER_EOT themselves (prepare does, before every document).
 * References: Radford et al. 2019 (GPT-2), the released encoder.py; PCRE2 pcre2unicode(3).
 */
#ifndef NG_DATA_TOKENIZER_H
#define NG_DATA_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NG_TOKENIZER_EOT 50256 /* <|endoftext|> */
#define NG_TOKENIZER_MAX_WORD 16384 /* bytes of a pre-token encoded as one piece */

struct ng_tokenizer {
	int n_vocab;          /* largest id + 1 (50257 for GPT-2) */
	char *bytes_;         /* decode table: token i is bytes_[off_[i] .. off_[i+1]) */
	uint32_t *off_;       /* (n_vocab + 1,) offsets into bytes_ */
	uint16_t byte_id[256]; /* token of each single byte */
	uint64_t *merge_key_; /* (merge_cap_,) open addressing: (left << 32 | right), 0 = empty */
	uint64_t *merge_val_; /* (merge_cap_,) (rank << 32 | merged id) */
	size_t merge_cap_;    /* power of two */
	int n_merges;         /* lines of vocab.bpe: n_vocab - 256 - n_special */
	int n_special;        /* tokens "<|...|>" (GPT-2: <|endoftext|>), made by no merge */
	void *re_;            /* pcre2_code_8 *, the compiled (JIT) pre-tokenizer pattern */
};

/* A growable array of tokens; encode appends to it. Free data with free(). */
struct ng_token_buf {
	uint16_t *data; /* (cap,) tokens, the first len valid */
	size_t len;     /* tokens held */
	size_t cap;     /* allocated */
};

/* Per-thread scratch: PCRE2 match data and the pre-token -> tokens cache. Zero-initialise,
 * use from one thread, release with ng_bpe_cache_free. */
struct ng_bpe_cache {
	void *match_;         /* pcre2_match_data_8 * (lazily created) */
	uint64_t *hash_;      /* (cap_,) hash of each entry's key, 0 = empty */
	uint32_t *entry_;     /* (cap_, 4) key offset, key length, value offset, value length */
	size_t cap_, count_;  /* table size (power of two) and entries */
	char *keys_;          /* key bytes arena */
	size_t keys_len_, keys_cap_;
	uint16_t *vals_;      /* value tokens arena */
	size_t vals_len_, vals_cap_;
	const void *owner_;   /* the tokenizer the cached results belong to */
};

/* The vocabulary directory used when none is given: $NG_GPT2_DIR if set, else the GPT-2 files in
 * the source tree (data/gpt2, its path fixed at build time). */
const char *ng_tokenizer_default_dir(void);

/* Load dir/encoder.json and dir/vocab.bpe. A missing or corrupt file is one error naming it. */
enum ng_status ng_tokenizer_load(struct ng_tokenizer *tok, const char *dir);
void ng_tokenizer_free(struct ng_tokenizer *tok);

/* Append the tokens of bytes[0..len) to out. cache may be NULL (slower). Thread-safe for
 * distinct caches. */
enum ng_status ng_tokenizer_encode(const struct ng_tokenizer *tok, struct ng_bpe_cache *cache,
				   const char *bytes, size_t len, struct ng_token_buf *out);
/* Decode n tokens into a malloc'ed buffer *text of *text_len bytes (plus a NUL). */
enum ng_status ng_tokenizer_decode(const struct ng_tokenizer *tok, const uint16_t *ids, size_t n,
				   char **text, size_t *text_len);
/* The bytes of one token (not NUL-terminated), NULL for an id outside the vocabulary. */
const char *ng_tokenizer_token_bytes(const struct ng_tokenizer *tok, int id, size_t *len);

/* Append one token (grows the buffer). */
enum ng_status ng_token_buf_push(struct ng_token_buf *b, uint16_t id);
void ng_bpe_cache_free(struct ng_bpe_cache *c);

#ifdef __cplusplus
}
#endif

#endif
