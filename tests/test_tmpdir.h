/*
 * tests/test_tmpdir.h — a fresh directory under /tmp for a test that writes files, removed with
 * everything in it when the test's process exits (Criterion runs each test in its own process).
 * Include once per test program, after defining _XOPEN_SOURCE 700 (for nftw).
 */
#ifndef NG_TESTS_TEST_TMPDIR_H
#define NG_TESTS_TEST_TMPDIR_H

#include <criterion/criterion.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static char ng_test_dir[256]; /* the directory of this process's test, once made */

static int ng_test_dir_remove_(const char *path, const struct stat *sb, int flag,
			       struct FTW *ftw)
{
	(void)sb, (void)flag, (void)ftw;
	return remove(path);
}

static void ng_test_dir_cleanup_(void)
{
	if (ng_test_dir[0])
		nftw(ng_test_dir, ng_test_dir_remove_, 16, FTW_DEPTH | FTW_PHYS);
}

/* Make /tmp/<prefix>XXXXXX into ng_test_dir. */
static void ng_test_dir_make(const char *prefix)
{
	snprintf(ng_test_dir, sizeof(ng_test_dir), "/tmp/%sXXXXXX", prefix);
	cr_assert(mkdtemp(ng_test_dir), "mkdtemp %s failed", ng_test_dir);
	atexit(ng_test_dir_cleanup_);
}

#endif
