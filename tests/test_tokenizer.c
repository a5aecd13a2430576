/*
 * tests/test_tokenizer.c — the GPT-2 BPE tokenizer: exact encodings of
 * data/gpt2/encode_cases.json, decode(encode(x)) == x for random bytes (invalid UTF-8
 * included), long words (an enormous one in bounded pieces), cache on/off agreement, missing /
 * corrupt / truncated / mismatched vocabulary files (a FIFO too), and error lines that quote a
 * bad line with its control bytes escaped.
 * The vocabulary is the tree's own data/gpt2 (its path fixed at build time, so the tests run
 * from any directory and never skip).
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "data/tokenizer.h"
#include "ng_config.h"
#include "util/rng.h"

/* The vocabulary in the tree, always there: these tests never skip. */
static const char *gpt2_dir(void) { return NG_GPT2_DIR_DEFAULT; }

static struct ng_tokenizer tok;

static void load(void)
{
	const char *dir = gpt2_dir();
	ng_clear_error();
	cr_assert_eq(ng_tokenizer_load(&tok, dir), NG_OK, "load %s: %s", dir, ng_error_message());
}

static void unload(void) { ng_tokenizer_free(&tok); }

TestSuite(tokenizer, .init = load, .fini = unload);

Test(tokenizer, encode_cases_exact)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/encode_cases.json", gpt2_dir());
	json_error_t err;
	json_t *cases = json_load_file(path, 0, &err);
	cr_assert(cases && json_is_array(cases), "%s: %s", path, err.text);
	cr_assert_eq(tok.n_vocab, 50257);
	size_t i;
	json_t *c;
	struct ng_bpe_cache cache = { 0 };
	json_array_foreach(cases, i, c) {
		const char *text = json_string_value(json_object_get(c, "text"));
		json_t *want = json_object_get(c, "tokens");
		for (int pass = 0; pass < 3; pass++) { /* no cache, cold cache, warm cache */
			struct ng_token_buf out = { 0 };
			cr_assert_eq(ng_tokenizer_encode(&tok, pass ? &cache : NULL, text, strlen(text),
							 &out), NG_OK);
			cr_assert_eq(out.len, json_array_size(want), "case %zu \"%s\": %zu tokens, want "
				     "%zu", i, text, out.len, json_array_size(want));
			for (size_t k = 0; k < out.len; k++)
				cr_assert_eq(out.data[k],
					     json_integer_value(json_array_get(want, k)),
					     "case %zu \"%s\" token %zu: %u, want %lld", i, text, k,
					     out.data[k],
					     (long long)json_integer_value(json_array_get(want, k)));
			char *back;
			size_t blen;
			cr_assert_eq(ng_tokenizer_decode(&tok, out.data, out.len, &back, &blen), NG_OK);
			cr_assert(blen == strlen(text) && memcmp(back, text, blen) == 0,
				  "case %zu: decode differs", i);
			free(back);
			free(out.data);
		}
	}
	ng_bpe_cache_free(&cache);
	json_decref(cases);
}

/* Unicode White_Space is exactly what \s means: U+180E and U+001C are not spaces, NBSP, U+3000,
 * U+2029 and U+0085 are (tokens from an independent reference implementation). */
Test(tokenizer, unicode_whitespace)
{
	static const char text[] = "a  \xe1\xa0\x8e" "b\xc2\xa0" "c \xe3\x80\x80 d\xe2\x80\xa9"
				   "e\x1c" "f \xc2\x85g";
	static const uint16_t want[] = { 64, 220, 28053, 254, 236, 65, 1849, 66, 220, 5099, 222,
					 288, 447, 102, 68, 216, 69, 220, 126, 227, 70 };
	struct ng_token_buf out = { 0 };
	cr_assert_eq(ng_tokenizer_encode(&tok, NULL, text, sizeof(text) - 1, &out), NG_OK);
	size_t n = sizeof(want) / sizeof(want[0]), bad = n;
	for (size_t i = 0; i < n && i < out.len && bad == n; i++)
		if (out.data[i] != want[i])
			bad = i;
	cr_assert(out.len == n && bad == n, "%zu tokens (want %zu), first difference at %zu",
		  out.len, n, bad);
	free(out.data);
}

Test(tokenizer, eot_token)
{
	size_t n;
	const char *b = ng_tokenizer_token_bytes(&tok, NG_TOKENIZER_EOT, &n);
	cr_assert(b && n == 13 && memcmp(b, "<|endoftext|>", 13) == 0);
	cr_assert_null(ng_tokenizer_token_bytes(&tok, 50257, &n));
}

/* Random byte strings mixing ASCII words, valid multi-byte UTF-8 and raw garbage. */
static size_t random_text(struct ng_rng *r, char *buf, size_t cap)
{
	static const char *pieces[] = { " the", "'s", "  ", "\n\n", "\t", "ü", "—", "🙂", "123",
					"é", "'ll", "x", "\xff", "\xc3", "\xe2\x80", "\x80", "\0",
					"\xf0\x9f", ".", "," };
	size_t n = 0;
	while (n + 8 < cap) {
		if (ng_rng_below(r, 3) == 0) {
			buf[n++] = (char)ng_rng_below(r, 256);
		} else {
			const char *p = pieces[ng_rng_below(r, sizeof(pieces) / sizeof(pieces[0]))];
			size_t l = p[0] ? strlen(p) : 1;
			memcpy(buf + n, p, l);
			n += l;
		}
		if (ng_rng_below(r, 200) == 0)
			break;
	}
	return n;
}

Test(tokenizer, roundtrip_any_bytes)
{
	uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	struct ng_bpe_cache cache = { 0 };
	char buf[4096];
	for (int it = 0; it < 3000; it++) {
		size_t n = random_text(&r, buf, sizeof(buf));
		struct ng_token_buf a = { 0 }, b = { 0 };
		cr_assert_eq(ng_tokenizer_encode(&tok, &cache, buf, n, &a), NG_OK, "seed %llu: %s",
			     (unsigned long long)seed, ng_error_message());
		cr_assert_eq(ng_tokenizer_encode(&tok, NULL, buf, n, &b), NG_OK);
		cr_assert(a.len == b.len && memcmp(a.data, b.data, a.len * 2) == 0,
			  "seed %llu iter %d: cached and uncached encodings differ",
			  (unsigned long long)seed, it);
		char *back;
		size_t blen;
		cr_assert_eq(ng_tokenizer_decode(&tok, a.data, a.len, &back, &blen), NG_OK);
		size_t bad = 0;
		while (bad < n && bad < blen && back[bad] == buf[bad])
			bad++;
		cr_assert(blen == n && bad == n, "seed %llu iter %d: decode(encode(x)) != x "
			  "(%zu vs %zu bytes, first difference at byte %zu)",
			  (unsigned long long)seed, it, blen, n, bad);
		free(back);
		free(a.data);
		free(b.data);
	}
	ng_bpe_cache_free(&cache);
}

/* A pre-token of many megabytes (a line without spaces) is encoded in pieces of
 * NG_TOKENIZER_MAX_WORD bytes: its tokens are the pieces' tokens, in bounded time and memory,
 * and it still decodes to itself. */
Test(tokenizer, enormous_word_is_cut_into_bounded_pieces)
{
	size_t n = 4u << 20, piece = NG_TOKENIZER_MAX_WORD;
	struct ng_rng r;
	ng_rng_seed(&r, 11);
	char *w = malloc(n);
	for (size_t i = 0; i < n; i++)
		w[i] = (char)('a' + ng_rng_below(&r, 26));
	struct ng_token_buf all = { 0 }, parts = { 0 };
	clock_t t0 = clock();
	cr_assert_eq(ng_tokenizer_encode(&tok, NULL, w, n, &all), NG_OK);
	double s = (double)(clock() - t0) / CLOCKS_PER_SEC;
	cr_assert_lt(s, 8.0, "a 4 MB word took %.2f s", s);
	for (size_t at = 0; at < n; at += piece)
		cr_assert_eq(ng_tokenizer_encode(&tok, NULL, w + at, n - at < piece ? n - at : piece,
						 &parts), NG_OK);
	cr_assert(all.len == parts.len && memcmp(all.data, parts.data, 2 * all.len) == 0,
		  "the word's tokens are not its pieces' tokens");
	char *back;
	size_t blen;
	cr_assert_eq(ng_tokenizer_decode(&tok, all.data, all.len, &back, &blen), NG_OK);
	cr_assert(blen == n && memcmp(back, w, n) == 0);
	free(back);
	free(all.data);
	free(parts.data);
	free(w);
}

Test(tokenizer, long_word_is_fast_and_exact)
{
	size_t n = 1 << 20; /* one 1 MB pre-token: quadratic BPE would take minutes */
	char *w = malloc(n);
	for (size_t i = 0; i < n; i++)
		w[i] = "abcdefghij"[i % 7];
	struct ng_token_buf out = { 0 };
	clock_t t0 = clock();
	cr_assert_eq(ng_tokenizer_encode(&tok, NULL, w, n, &out), NG_OK);
	double s = (double)(clock() - t0) / CLOCKS_PER_SEC;
	cr_assert_lt(s, 5.0, "1 MB word took %.2f s", s);
	char *back;
	size_t blen;
	cr_assert_eq(ng_tokenizer_decode(&tok, out.data, out.len, &back, &blen), NG_OK);
	cr_assert(blen == n && memcmp(back, w, n) == 0);
	cr_assert_lt(out.len, n / 2, "BPE merged too little: %zu tokens", out.len);
	free(back);
	free(out.data);
	free(w);
}

/* ---- bad vocabulary directories (no suite init: these build their own) ---- */

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "wb");
	cr_assert(f, "cannot write %s", path);
	fputs(text, f);
	fclose(f);
}

static void expect_load_error(const char *dir, const char *needle)
{
	struct ng_tokenizer t;
	ng_clear_error();
	cr_assert_eq(ng_tokenizer_load(&t, dir), NG_ERR_INPUT, "dir %s loaded", dir);
	cr_assert(strstr(ng_error_message(), needle), "error '%s' does not name '%s'",
		  ng_error_message(), needle);
	cr_assert_null(strchr(ng_error_message(), '\n'), "error is more than one line");
}

Test(tokenizer_files, missing_and_corrupt)
{
	const char *src = gpt2_dir();
	char dir[] = "/tmp/ng_tok_XXXXXX", a[4200], b[4200], cmd[9000];
	cr_assert(mkdtemp(dir));
	snprintf(a, sizeof(a), "%s/encoder.json", dir);
	snprintf(b, sizeof(b), "%s/vocab.bpe", dir);
	expect_load_error(dir, "encoder.json"); /* both missing */
	expect_load_error("/nonexistent/gpt2", "/nonexistent/gpt2/encoder.json");
	write_file(a, "{\"a\": 1, ");
	expect_load_error(dir, "encoder.json"); /* truncated JSON */
	write_file(a, "[1, 2, 3]");
	expect_load_error(dir, "encoder.json"); /* not an object */
	snprintf(cmd, sizeof(cmd), "cp '%s/encoder.json' '%s/'", src, dir);
	cr_assert_eq(system(cmd), 0);
	expect_load_error(dir, "vocab.bpe"); /* merges missing */
	write_file(b, "#version: 0.2\n\xc4\xa0 t\nno_space_here\n");
	expect_load_error(dir, "vocab.bpe line 3");
	write_file(b, "#version: 0.2\nzzzzqqq xxyyq\n");
	expect_load_error(dir, "vocab.bpe line 2");
	write_file(b, "#version: 0.2\n\xc4\xa0 t\n"); /* well-formed, but 49999 merges short */
	expect_load_error(dir, "holds 1 merges, its encoder.json needs 50000");
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}

/* A directory with GPT-2's 256 byte tokens (ids 0..255 of the real encoder.json), the tokens
 * `extra` (name -> id), and vocab.bpe = `merges`. */
static void small_vocab(const char *dir, const char *extra, const char *merges)
{
	char path[4200];
	snprintf(path, sizeof(path), "%s/encoder.json", gpt2_dir());
	json_error_t err;
	json_t *enc = json_load_file(path, 0, &err), *out = json_loads(extra, 0, &err);
	cr_assert(enc && out, "%s", err.text);
	const char *k;
	json_t *v;
	json_object_foreach(enc, k, v) {
		if (json_integer_value(v) < 256)
			json_object_set(out, k, v);
	}
	snprintf(path, sizeof(path), "%s/encoder.json", dir);
	cr_assert_eq(json_dump_file(out, path, 0), 0);
	json_decref(enc);
	json_decref(out);
	snprintf(path, sizeof(path), "%s/vocab.bpe", dir);
	write_file(path, merges);
}

/* The merges and the encoder must be one vocabulary: counts, ids, order. */
Test(tokenizer_files, merges_and_encoder_must_agree)
{
	char dir[] = "/tmp/ng_tok_XXXXXX", path[4200], cmd[9000];
	cr_assert(mkdtemp(dir));
	/* a consistent small vocabulary loads: 256 bytes, one merge, one special token */
	small_vocab(dir, "{\"\u0120t\": 256, \"<|endoftext|>\": 257}", "#version: 0.2\n\xc4\xa0 t\n");
	struct ng_tokenizer t;
	ng_clear_error();
	cr_assert_eq(ng_tokenizer_load(&t, dir), NG_OK, "%s", ng_error_message());
	cr_assert(t.n_merges == 1 && t.n_special == 1 && t.n_vocab == 258);
	ng_tokenizer_free(&t);
	/* a token no merge makes */
	small_vocab(dir, "{\"\u0120t\": 256, \"ab\": 257}", "\xc4\xa0 t\n");
	expect_load_error(dir, "holds 1 merges, its encoder.json needs 2");
	/* an id given twice, and a gap in the ids */
	small_vocab(dir, "{\"\u0120t\": 256, \"ab\": 256}", "\xc4\xa0 t\n");
	expect_load_error(dir, "each once");
	small_vocab(dir, "{\"\u0120t\": 300}", "\xc4\xa0 t\n");
	expect_load_error(dir, "each once");
	/* an id out of range: the message quotes the token (it used to be read after the JSON
	 * holding it was freed; found by tests/fuzz/fuzz_vocab.c) */
	small_vocab(dir, "{\"bad\\u001bid\": 70000}", "\xc4\xa0 t\n");
	expect_load_error(dir, "token \"bad\\x1bid\" has a bad id");
	/* a merge repeated, and a merge that uses a token made only later */
	small_vocab(dir, "{\"\u0120t\": 256, \"\u0120th\": 257}", "\xc4\xa0 t\n\xc4\xa0 t\n");
	expect_load_error(dir, "vocab.bpe line 2: merge");
	small_vocab(dir, "{\"\u0120t\": 256, \"\u0120th\": 257}", "\xc4\xa0t h\n\xc4\xa0 t\n");
	expect_load_error(dir, "uses a token no earlier merge made");

	/* GPT-2's vocab.bpe cut after 1000 lines: 999 merges where 50000 belong */
	snprintf(cmd, sizeof(cmd), "cp '%s/encoder.json' '%s/' && head -n 1000 '%s/vocab.bpe' > "
		 "'%s/vocab.bpe'", gpt2_dir(), dir, gpt2_dir(), dir);
	cr_assert_eq(system(cmd), 0);
	expect_load_error(dir, "holds 999 merges, its encoder.json needs 50000");
	/* ... and cut in the middle of its last line */
	snprintf(cmd, sizeof(cmd), "head -c -3 '%s/vocab.bpe' > '%s/v' && mv '%s/v' "
		 "'%s/vocab.bpe'", gpt2_dir(), dir, dir, dir);
	cr_assert_eq(system(cmd), 0);
	expect_load_error(dir, "vocab.bpe");

	/* a FIFO in place of a file is refused at once, not read forever */
	snprintf(path, sizeof(path), "%s/vocab.bpe", dir);
	unlink(path);
	cr_assert_eq(mkfifo(path, 0644), 0);
	expect_load_error(dir, "not a regular file (a FIFO)");
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}

/* An error quoting a bad line shows its control bytes as \xNN: nothing reaches the terminal
 * raw, and the message stays one line. */
Test(tokenizer_files, control_bytes_in_errors_are_escaped)
{
	char dir[] = "/tmp/ng_tok_XXXXXX", path[4200], cmd[9000];
	cr_assert(mkdtemp(dir));
	snprintf(cmd, sizeof(cmd), "cp '%s/encoder.json' '%s/'", gpt2_dir(), dir);
	cr_assert_eq(system(cmd), 0);
	snprintf(path, sizeof(path), "%s/vocab.bpe", dir);
	write_file(path, "#version: 0.2\n\x1b[2J\x1b]0;owned\x07 \xff\x85\xc2\x9b\r\r\n");
	expect_load_error(dir, "merge \"\\x1b[2J\\x1b]0;owned\\x07 \\xff\\x85\\xc2\\x9b\"");
	for (const char *p = ng_error_message(); *p; p++)
		cr_assert((unsigned char)*p >= 0x20 && (unsigned char)*p != 0x7f,
			  "raw byte 0x%02x in '%s'", (unsigned char)*p, ng_error_message());
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}
