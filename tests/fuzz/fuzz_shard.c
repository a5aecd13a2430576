/*
 * tests/fuzz/fuzz_shard.c — libFuzzer harness of the shard reader (data/shard.c): any bytes as
 * a shard file through ng_shard_read_header and ng_shard_open. Either may refuse the file; what
 * is checked is that neither crashes, leaks or reads out of bounds, that an accepted shard's
 * size is exactly its header plus its tokens, and that every token of a shard opened with a
 * vocabulary is below it.
 */
#include <stdint.h>
#include <stdlib.h>

#include "data/shard.h"
#include "tests/fuzz/fuzz_input.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *path = fuzz_input_path(data, size);
	size_t count;
	ng_clear_error();
	enum ng_status st = ng_shard_read_header(path, &count);
	if (st == NG_OK && NG_SHARD_HEADER_BYTES + 2 * count != size)
		abort();
	int vocabs[3] = { 0, 50257, 300 };
	for (int k = 0; k < 3; k++) {
		struct ng_shard s;
		ng_clear_error();
		if (ng_shard_open(&s, path, vocabs[k]) != NG_OK)
			continue;
		if (st != NG_OK || s.count != count)
			abort(); /* open accepted what read_header refused, or counted differently */
		unsigned sum = 0;
		for (size_t i = 0; i < s.count; i++) {
			if (vocabs[k] > 0 && s.tokens[i] >= vocabs[k])
				abort();
			sum += s.tokens[i]; /* touch every token: ASan sees a read past the map */
		}
		(void)sum;
		ng_shard_close(&s);
	}
	return 0;
}
