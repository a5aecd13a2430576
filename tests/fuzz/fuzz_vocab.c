/*
 * tests/fuzz/fuzz_vocab.c — libFuzzer harness of the vocabulary loaders (data/tokenizer.c): the
 * input is encoder.json, a NUL byte, then vocab.bpe (no NUL: all of it is encoder.json and
 * vocab.bpe is empty), written into a directory of this process and loaded with
 * ng_tokenizer_load. Refusing is fine; what is checked is no crash, leak or out-of-bounds
 * access, and that an accepted vocabulary is what the loader promises: the merge count
 * n_vocab - 256 - specials, every byte's token decoding to that byte, and any text round-
 * tripping through encode and decode.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "data/tokenizer.h"

static char dir[64];

static void put(const char *name, const uint8_t *data, size_t n)
{
	char path[128];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) {
		perror(path);
		abort();
	}
}

static void remove_dir(void)
{
	char path[128];
	snprintf(path, sizeof(path), "%s/encoder.json", dir);
	unlink(path);
	snprintf(path, sizeof(path), "%s/vocab.bpe", dir);
	unlink(path);
	rmdir(dir);
}

/* Load the vocabulary directory of one input; the directory is made for it and removed after
 * (libFuzzer ends the process without atexit handlers, so nothing may outlive an input). */
static int load_and_check(void);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	snprintf(dir, sizeof(dir), "/dev/shm/ng_fuzz_vocab_XXXXXX");
	if (!mkdtemp(dir)) {
		snprintf(dir, sizeof(dir), "/tmp/ng_fuzz_vocab_XXXXXX");
		if (!mkdtemp(dir))
			abort();
	}
	const uint8_t *nul = memchr(data, 0, size);
	size_t n_enc = nul ? (size_t)(nul - data) : size;
	put("encoder.json", data, n_enc);
	put("vocab.bpe", nul ? nul + 1 : data, nul ? size - n_enc - 1 : 0);
	int rc = load_and_check();
	remove_dir();
	return rc;
}

static int load_and_check(void)
{
	struct ng_tokenizer tok;
	ng_clear_error();
	if (ng_tokenizer_load(&tok, dir) != NG_OK)
		return 0;
	if (tok.n_merges != tok.n_vocab - 256 - tok.n_special)
		abort();
	for (int b = 0; b < 256; b++) {
		size_t len;
		const char *t = ng_tokenizer_token_bytes(&tok, tok.byte_id[b], &len);
		if (!t || len != 1 || (uint8_t)t[0] != b)
			abort();
	}
	static const char text[] = "Hello world, it's 2024! \xc3\xa9t\xc3\xa9 \xff\xfe  \n\tab ab";
	struct ng_token_buf out = { 0 };
	char *back = NULL;
	size_t blen;
	if (ng_tokenizer_encode(&tok, NULL, text, sizeof(text) - 1, &out) != NG_OK ||
	    ng_tokenizer_decode(&tok, out.data, out.len, &back, &blen) != NG_OK ||
	    blen != sizeof(text) - 1 || memcmp(back, text, blen) != 0)
		abort();
	free(back);
	free(out.data);
	ng_tokenizer_free(&tok);
	return 0;
}
