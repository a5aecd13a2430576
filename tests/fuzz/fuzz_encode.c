/*
 * tests/fuzz/fuzz_encode.c — libFuzzer harness of the GPT-2 tokenizer (data/tokenizer.c) on the
 * tree's vocabulary (data/gpt2, or $NG_GPT2_DIR): any bytes are encoded with and without the
 * per-thread cache and decoded. Checked: no crash, leak or out-of-bounds access; both encodings
 * equal; every token inside the vocabulary; decode(encode(x)) == x.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/tokenizer.h"

static struct ng_tokenizer tok;
static struct ng_bpe_cache cache;

static void release(void)
{
	ng_bpe_cache_free(&cache);
	ng_tokenizer_free(&tok);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc, (void)argv;
	if (ng_tokenizer_load(&tok, ng_tokenizer_default_dir()) != NG_OK) {
		fprintf(stderr, "fuzz_encode: %s\n", ng_error_message());
		exit(1);
	}
	atexit(release);
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct ng_token_buf a = { 0 }, b = { 0 };
	char *back = NULL;
	size_t blen;
	if (ng_tokenizer_encode(&tok, &cache, (const char *)data, size, &a) != NG_OK ||
	    ng_tokenizer_encode(&tok, NULL, (const char *)data, size, &b) != NG_OK)
		abort();
	if (a.len != b.len || (a.len && memcmp(a.data, b.data, a.len * sizeof(uint16_t)) != 0))
		abort();
	for (size_t i = 0; i < a.len; i++)
		if (a.data[i] >= tok.n_vocab)
			abort();
	if (ng_tokenizer_decode(&tok, a.data, a.len, &back, &blen) != NG_OK || blen != size ||
	    (size && memcmp(back, data, size) != 0))
		abort();
	free(back);
	free(a.data);
	free(b.data);
	return 0;
}
