/*
 * util/file.c — opening regular files without blocking on FIFOs and devices, and checked size
 * arithmetic (see file.h).
 */
#include "util/file.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

int ng_file_open_regular(const char *path, struct stat *sb)
{
	/* O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one */
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	if (fd < 0)
		return -1;
	if (fstat(fd, sb) != 0) {
		int e = errno;
		close(fd);
		errno = e;
		return -1;
	}
	if (!S_ISREG(sb->st_mode)) {
		close(fd);
		return -2;
	}
	/* a regular file: ordinary blocking reads from here on */
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
	return fd;
}

const char *ng_file_kind(mode_t mode)
{
	if (S_ISDIR(mode))
		return "a directory";
	if (S_ISFIFO(mode))
		return "a FIFO";
	if (S_ISCHR(mode))
		return "a character device";
	if (S_ISBLK(mode))
		return "a block device";
	if (S_ISSOCK(mode))
		return "a socket";
	if (S_ISREG(mode))
		return "a regular file";
	return "not a regular file";
}

bool ng_size_mul(size_t a, size_t b, size_t *out)
{
	size_t r;
	if (__builtin_mul_overflow(a, b, &r))
		return false;
	*out = r;
	return true;
}

bool ng_size_add(size_t a, size_t b, size_t *out)
{
	size_t r;
	if (__builtin_add_overflow(a, b, &r))
		return false;
	*out = r;
	return true;
}
