/*
 * util/status.c — the recorded error line and hint (see status.h). Thread-local, so the loader
 * thread's errors do not race with the main thread's.
 */
#include "util/status.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char err_msg[1024];
static _Thread_local char err_hint[512];
static _Thread_local int err_set;

enum ng_status ng_fail(enum ng_status status, const char *fmt, ...)
{
	if (!err_set) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err_msg, sizeof(err_msg), fmt, ap);
		va_end(ap);
		err_hint[0] = '\0';
		err_set = 1;
	}
	return status;
}

void ng_hint(const char *fmt, ...)
{
	if (err_hint[0])
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err_hint, sizeof(err_hint), fmt, ap);
	va_end(ap);
}

const char *ng_error_message(void) { return err_msg; }
const char *ng_error_hint(void) { return err_hint; }

void ng_clear_error(void)
{
	err_msg[0] = err_hint[0] = '\0';
	err_set = 0;
}

void ng_print_error(void)
{
	fprintf(stderr, "nanograph: %s\n", err_set ? err_msg : "unknown error");
	if (err_hint[0])
		fprintf(stderr, "---> HINT: %s\n", err_hint);
}
