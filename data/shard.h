/*
 * data/shard.h — token shards in the llm.c / modded-nanogpt format (docs/DESIGN.md "Data"):
 *   header: 256 int32, [0] = 20240520 (magic), [1] = 1 (version), [2] = token count N
 *   body:   N uint16 tokens (little-endian, as every machine we run on)
 * so a valid file is exactly 1024 + 2*N bytes. Reading maps the file read-only and validates all
 * of it once (magic, version, count against the file size, every token < vocab); errors name the
 * file and what is wrong (the byte offset of a bad token). Writing is atomic: a temporary file in
 * the same directory, fsync, rename, fsync of the directory — a crash never leaves a half shard
 * under the final name.
 */
#ifndef NG_DATA_SHARD_H
#define NG_DATA_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NG_SHARD_MAGIC 20240520
#define NG_SHARD_VERSION 1
#define NG_SHARD_HEADER_INTS 256
#define NG_SHARD_HEADER_BYTES (NG_SHARD_HEADER_INTS * 4)

struct ng_shard {
	const uint16_t *tokens; /* (count,) inside the mapping; NULL when closed */
	size_t count;           /* tokens in the shard */
	void *map_;             /* the whole file, mmap'ed read-only */
	size_t map_bytes_;      /* length of the mapping */
};

/* Read only the header of `path` and check magic, version and count against the file size.
 * On success *count is the number of tokens. */
enum ng_status ng_shard_read_header(const char *path, size_t *count);

/* Map `path` and validate it. vocab > 0: every token must be < vocab (the error gives the byte
 * offset of the first bad one); vocab <= 0 skips the token scan (already validated). */
enum ng_status ng_shard_open(struct ng_shard *s, const char *path, int vocab);
void ng_shard_close(struct ng_shard *s);

/* Write `count` tokens to a fresh temporary file beside `path` (same directory) and fsync it;
 * the temporary name is returned in tmp (tmp_size bytes). Nothing is renamed: commit it with
 * ng_shard_commit or delete it with unlink. */
enum ng_status ng_shard_write_temp(const char *path, const uint16_t *tokens, size_t count,
				   char *tmp, size_t tmp_size);
/* Rename tmp to path and fsync the directory. */
enum ng_status ng_shard_commit(const char *tmp, const char *path);
/* Write a whole shard atomically (write_temp + commit). */
enum ng_status ng_shard_write(const char *path, const uint16_t *tokens, size_t count);

#ifdef __cplusplus
}
#endif

#endif
