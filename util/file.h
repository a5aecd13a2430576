/*
 * util/file.h — opening input files without hanging on them, and size arithmetic that cannot
 * wrap. A FIFO, a terminal or a device given where a file is expected would block open() or
 * read() forever; ng_file_open_regular opens with O_NONBLOCK, looks at the file's type with
 * fstat, and hands back a blocking descriptor only for a regular file. The checked products
 * are for every place a header's shape is multiplied out (safetensors, shards, batches).
 */
#ifndef NG_UTIL_FILE_H
#define NG_UTIL_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/stat.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A read-only, close-on-exec descriptor of `path`, which must be a regular file; *sb its stat.
 * Returns the descriptor, -1 with errno set when open or fstat fails, or -2 when the path is
 * not a regular file (then sb->st_mode says what it is; see ng_file_kind). */
int ng_file_open_regular(const char *path, struct stat *sb);

/* "a directory", "a FIFO", "a character device", ... for an st_mode that is not a regular file. */
const char *ng_file_kind(mode_t mode);

/* *out = a * b, false (and *out unchanged) when the product does not fit a size_t. */
bool ng_size_mul(size_t a, size_t b, size_t *out);
/* *out = a + b, false (and *out unchanged) when the sum does not fit a size_t. */
bool ng_size_add(size_t a, size_t b, size_t *out);

#ifdef __cplusplus
}
#endif

#endif
