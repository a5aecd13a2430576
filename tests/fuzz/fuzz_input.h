/*
 * tests/fuzz/fuzz_input.h — the fuzzer's input as a file: the readers under test take a path
 * (they stat, open and map it), so each input is written to a memfd, a file in memory, and
 * passed as /proc/self/fd/N. One memfd per process, rewritten for every input.
 */
#ifndef NG_TESTS_FUZZ_INPUT_H
#define NG_TESTS_FUZZ_INPUT_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

/* The path of a file holding exactly data[0..n). */
static const char *fuzz_input_path(const unsigned char *data, size_t n)
{
	static int fd = -1;
	static char path[64];
	if (fd < 0) {
		fd = memfd_create("ng-fuzz-input", MFD_CLOEXEC);
		if (fd < 0) {
			perror("memfd_create");
			abort();
		}
		snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	}
	if (ftruncate(fd, 0) != 0 || pwrite(fd, data, n, 0) != (ssize_t)n) {
		perror("fuzz input");
		abort();
	}
	return path;
}

#endif
