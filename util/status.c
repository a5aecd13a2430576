/*
 * util/status.c — the recorded error line and hint (see status.h). Thread-local, so the loader
 * thread's errors do not race with the main thread's. Messages often quote what the user gave
 * (a line of a vocabulary file, a tensor name, a flag value): control bytes and bytes that are
 * not UTF-8 are written as \xNN, so an error can neither move the cursor nor break the one-line
 * rule, whatever it quotes.
 */
#include "util/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char err_msg[1024];
static _Thread_local char err_hint[512];
static _Thread_local int err_set;

/* Bytes of the valid UTF-8 sequence at p (n bytes left) that is safe to print, or 0: not
 * UTF-8, an overlong form, a surrogate, or a C1 control (U+0080..U+009F). */
static size_t printable_utf8(const unsigned char *p, size_t n)
{
	unsigned c = p[0];
	size_t len = c >= 0xf0 && c <= 0xf4   ? 4
		     : c >= 0xe0 && c < 0xf0 ? 3
		     : c >= 0xc2 && c < 0xe0 ? 2
					     : 0;
	if (len == 0 || len > n)
		return 0;
	unsigned cp = c & (len == 2 ? 0x1f : len == 3 ? 0x0f : 0x07);
	for (size_t i = 1; i < len; i++) {
		if ((p[i] & 0xc0) != 0x80)
			return 0;
		cp = cp << 6 | (p[i] & 0x3f);
	}
	if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
	    (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0x80 && cp <= 0x9f))
		return 0;
	return len;
}

void ng_escape_text(char *out, size_t cap, const char *in)
{
	const unsigned char *p = (const unsigned char *)in;
	size_t n = strlen(in), o = 0;
	if (cap == 0)
		return;
	for (size_t i = 0; i < n;) {
		size_t u = p[i] >= 0x80 ? printable_utf8(p + i, n - i) : 0;
		if (u) { /* a whole printable character, or nothing of it */
			if (o + u >= cap)
				break;
			memcpy(out + o, p + i, u);
			o += u;
			i += u;
		} else if (p[i] >= 0x20 && p[i] != 0x7f && p[i] < 0x80) {
			if (o + 1 >= cap)
				break;
			out[o++] = (char)p[i++];
		} else {
			if (o + 4 >= cap)
				break;
			snprintf(out + o, 5, "\\x%02x", p[i++]);
			o += 4;
		}
	}
	out[o] = '\0';
}

enum ng_status ng_fail(enum ng_status status, const char *fmt, ...)
{
	if (!err_set) {
		char raw[sizeof(err_msg)];
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(raw, sizeof(raw), fmt, ap);
		va_end(ap);
		ng_escape_text(err_msg, sizeof(err_msg), raw);
		err_hint[0] = '\0';
		err_set = 1;
	}
	return status;
}

void ng_hint(const char *fmt, ...)
{
	if (err_hint[0])
		return;
	char raw[sizeof(err_hint)];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(raw, sizeof(raw), fmt, ap);
	va_end(ap);
	ng_escape_text(err_hint, sizeof(err_hint), raw);
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
