/*
 * data/shard.c — read, validate and atomically write token shards (format in shard.h). A path
 * is opened without blocking and refused unless it is a regular file, so a FIFO or a device
 * given as a shard is one error line, not a hang.
 */
#include "data/shard.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util/file.h"

/* Check a header against the file size; shared by read_header and open. */
static enum ng_status check_header(const char *path, const int32_t *h, size_t file_bytes,
				   size_t *count)
{
	if (h[0] != NG_SHARD_MAGIC) {
		ng_fail(NG_ERR_INPUT, "shard %s: bad magic %d (expected %d)", path, h[0],
			NG_SHARD_MAGIC);
		ng_hint("is this a token shard? nanograph prepare writes them");
		return NG_ERR_INPUT;
	}
	if (h[1] != NG_SHARD_VERSION)
		return ng_fail(NG_ERR_INPUT, "shard %s: unsupported version %d (expected %d)", path,
			       h[1], NG_SHARD_VERSION);
	if (h[2] < 0)
		return ng_fail(NG_ERR_INPUT, "shard %s: negative token count %d in the header", path,
			       h[2]);
	size_t n = (size_t)(uint32_t)h[2];
	size_t want = NG_SHARD_HEADER_BYTES + 2 * n;
	if (file_bytes < want) {
		ng_fail(NG_ERR_INPUT,
			"shard %s: truncated: the header says %zu tokens (%zu bytes) but the file has "
			"%zu bytes", path, n, want, file_bytes);
		ng_hint("the file was cut short (interrupted copy or download?)");
		return NG_ERR_INPUT;
	}
	if (file_bytes > want)
		return ng_fail(NG_ERR_INPUT,
			       "shard %s: %zu bytes of trailing data after the %zu tokens of the header",
			       path, file_bytes - want, n);
	*count = n;
	return NG_OK;
}

/* A descriptor of the regular file `path`, or an error line naming what it is instead. */
static enum ng_status open_regular(const char *path, int *fd, struct stat *st)
{
	*fd = ng_file_open_regular(path, st);
	if (*fd == -2) {
		ng_fail(NG_ERR_INPUT, "shard %s: not a regular file (%s)", path,
			ng_file_kind(st->st_mode));
		ng_hint("give token shard files written by nanograph prepare");
		return NG_ERR_INPUT;
	}
	if (*fd < 0)
		return ng_fail(NG_ERR_INPUT, "shard %s: cannot open: %s", path, strerror(errno));
	return NG_OK;
}

enum ng_status ng_shard_read_header(const char *path, size_t *count)
{
	int fd;
	struct stat st;
	enum ng_status rc = open_regular(path, &fd, &st);
	if (rc)
		return rc;
	int32_t h[3];
	ssize_t got = pread(fd, h, sizeof(h), 0);
	close(fd);
	if (got < 0)
		return ng_fail(NG_ERR_INPUT, "shard %s: cannot read: %s", path, strerror(errno));
	if ((size_t)st.st_size < NG_SHARD_HEADER_BYTES || got != (ssize_t)sizeof(h))
		return ng_fail(NG_ERR_INPUT,
			       "shard %s: truncated: %lld bytes, shorter than the %d-byte header", path,
			       (long long)st.st_size, NG_SHARD_HEADER_BYTES);
	return check_header(path, h, (size_t)st.st_size, count);
}

enum ng_status ng_shard_open(struct ng_shard *s, const char *path, int vocab)
{
	memset(s, 0, sizeof(*s));
	size_t n;
	enum ng_status st = ng_shard_read_header(path, &n);
	if (st)
		return st;
	int fd;
	struct stat sb;
	st = open_regular(path, &fd, &sb); /* again: the path may name another file by now */
	if (st)
		return st;
	size_t bytes = NG_SHARD_HEADER_BYTES + 2 * n;
	if ((size_t)sb.st_size != bytes) {
		close(fd);
		return ng_fail(NG_ERR_INPUT, "shard %s: changed while being opened", path);
	}
	void *map = mmap(NULL, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
	int err = errno;
	close(fd);
	if (map == MAP_FAILED)
		return ng_fail(NG_ERR_RUNTIME, "shard %s: mmap of %zu bytes failed: %s", path, bytes,
			       strerror(err));
	/* The file may have changed between the header read and the map: check again. */
	size_t n2;
	st = check_header(path, (const int32_t *)map, bytes, &n2);
	if (st == NG_OK && n2 != n)
		st = ng_fail(NG_ERR_INPUT, "shard %s: changed while being opened", path);
	if (st) {
		munmap(map, bytes);
		return st;
	}
	const uint16_t *tok = (const uint16_t *)((const char *)map + NG_SHARD_HEADER_BYTES);
	if (vocab > 0) {
		madvise(map, bytes, MADV_SEQUENTIAL);
		for (size_t i = 0; i < n; i++) {
			if (tok[i] >= vocab) {
				ng_fail(NG_ERR_INPUT,
					"shard %s: token %u at byte offset %zu (token index %zu) is >= "
					"the vocabulary size %d", path, tok[i],
					NG_SHARD_HEADER_BYTES + 2 * i, i, vocab);
				ng_hint("the shard was made for a larger vocabulary; pass --vocab");
				munmap(map, bytes);
				return NG_ERR_INPUT;
			}
		}
		madvise(map, bytes, MADV_RANDOM);
	}
	s->map_ = map;
	s->map_bytes_ = bytes;
	s->tokens = tok;
	s->count = n;
	return NG_OK;
}

void ng_shard_close(struct ng_shard *s)
{
	if (s->map_)
		munmap(s->map_, s->map_bytes_);
	memset(s, 0, sizeof(*s));
}

static enum ng_status write_all(int fd, const void *buf, size_t n, const char *path)
{
	const char *p = buf;
	while (n > 0) {
		ssize_t w = write(fd, p, n > (1u << 30) ? (1u << 30) : n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return ng_fail(NG_ERR_RUNTIME, "shard %s: write failed: %s", path,
				       w < 0 ? strerror(errno) : "no progress");
		p += w;
		n -= (size_t)w;
	}
	return NG_OK;
}

enum ng_status ng_shard_write_temp(const char *path, const uint16_t *tokens, size_t count,
				   char *tmp, size_t tmp_size)
{
	if (count > INT32_MAX)
		return ng_fail(NG_ERR_INPUT, "shard %s: %zu tokens do not fit the int32 header", path,
			       count);
	if ((size_t)snprintf(tmp, tmp_size, "%s.tmp-XXXXXX", path) >= tmp_size)
		return ng_fail(NG_ERR_INPUT, "shard %s: path too long", path);
	int fd = mkostemp(tmp, O_CLOEXEC);
	if (fd < 0) {
		ng_fail(NG_ERR_INPUT, "shard %s: cannot create a file in its directory: %s", path,
			strerror(errno));
		ng_hint("check that the output directory exists and is writable");
		return NG_ERR_INPUT;
	}
	int32_t h[NG_SHARD_HEADER_INTS] = { NG_SHARD_MAGIC, NG_SHARD_VERSION, (int32_t)count };
	enum ng_status st = write_all(fd, h, sizeof(h), path);
	if (!st)
		st = write_all(fd, tokens, 2 * count, path);
	if (!st && fsync(fd) != 0)
		st = ng_fail(NG_ERR_RUNTIME, "shard %s: fsync failed: %s", path, strerror(errno));
	if (close(fd) != 0 && !st)
		st = ng_fail(NG_ERR_RUNTIME, "shard %s: close failed: %s", path, strerror(errno));
	/* mkostemp makes the file 0600; shards are ordinary data files. */
	if (!st)
		chmod(tmp, 0644);
	if (st)
		unlink(tmp);
	return st;
}

enum ng_status ng_shard_commit(const char *tmp, const char *path)
{
	if (rename(tmp, path) != 0) {
		int err = errno;
		unlink(tmp);
		return ng_fail(NG_ERR_RUNTIME, "shard %s: rename from %s failed: %s", path, tmp,
			       strerror(err));
	}
	char dir[4096];
	snprintf(dir, sizeof(dir), "%s", path);
	int dfd = open(dirname(dir), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd >= 0) {
		fsync(dfd); /* best effort: some filesystems refuse fsync on directories */
		close(dfd);
	}
	return NG_OK;
}

enum ng_status ng_shard_write(const char *path, const uint16_t *tokens, size_t count)
{
	char tmp[4096];
	enum ng_status st = ng_shard_write_temp(path, tokens, count, tmp, sizeof(tmp));
	if (st)
		return st;
	return ng_shard_commit(tmp, path);
}
