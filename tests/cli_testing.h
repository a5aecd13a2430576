/*
 * tests/cli_testing.h — run `nanograph ARGS...` in-process for the tests of the command line
 * (test_cli.c, test_train_faults.c): the status comes back, the error line stays in
 * ng_error_message(). Include once per test program.
 */
#ifndef NG_TESTS_CLI_TESTING_H
#define NG_TESTS_CLI_TESTING_H

#include <stdarg.h>

#include "src/commands.h"
#include "util/status.h"

/* ARGS: NULL-terminated, at most 63 of them. */
static enum ng_status ng_test_cli_run(const char *first, ...)
{
	char *argv[64] = { "nanograph" };
	int argc = 1;
	va_list ap;
	va_start(ap, first);
	for (const char *a = first; a && argc < 64; a = va_arg(ap, const char *))
		argv[argc++] = (char *)a;
	va_end(ap);
	ng_clear_error();
	return ng_main(argc, argv);
}

#endif
