/*
 * util/status.h — how every module reports failure.
 *
 * A function that can fail returns an enum ng_status. On failure it first records ONE line naming
 * the problem (and, optionally, a hint) with ng_fail(); the caller passes the status up
 * unchanged, and main() prints the line and exits with the status as the exit code
 * (docs/DESIGN.md: 0 success, 1 runtime failure, 2 bad usage or bad input). Nothing below main()
 * prints errors or exits; that is what keeps "one clear line, no crash" true everywhere.
 */
#ifndef NG_UTIL_STATUS_H
#define NG_UTIL_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum ng_status {
	NG_OK = 0,
	NG_ERR_RUNTIME = 1, /* the machine failed us: CUDA, disk full, out of memory */
	NG_ERR_INPUT = 2,   /* the user's flags, files or sizes are wrong */
};

/* Record the error line (printf-style) and return `status`, so callers write
 * `return ng_fail(NG_ERR_INPUT, "shard %s: bad magic %d", path, magic);`. The first error
 * recorded since the last ng_clear_error() wins: it is the root cause. */
enum ng_status ng_fail(enum ng_status status, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* Attach a hint to the recorded error ("---> HINT: ..." when printed). */
void ng_hint(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

const char *ng_error_message(void); /* "" when none */
const char *ng_error_hint(void);    /* "" when none */
void ng_clear_error(void);

/* Copy the NUL-terminated `in` to out (cap bytes, always terminated), each control byte, DEL,
 * C1 control and byte that is not part of valid UTF-8 written as \xNN (so the text prints as
 * one harmless line). ng_fail and ng_hint pass every message through it. */
void ng_escape_text(char *out, size_t cap, const char *in);

/* Print "nanograph: <message>" and the hint, if any, to stderr. */
void ng_print_error(void);

#ifdef __cplusplus
}
#endif

#endif
