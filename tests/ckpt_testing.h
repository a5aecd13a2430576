/*
 * tests/ckpt_testing.h — helpers of the checkpoint tests (test_checkpoint.c, test_spr_cpu.c,
 * test_resume_gpu.c) and of test_race_tools.c: whole files in and out, the safetensors header
 * length, two state files compared but for their training time, a file re-serialised with its
 * header edited (and its checksum kept, re-stamped or dropped), the losses and validation losses
 * of a metrics file, a `train` with optional extra flags, and the loss `eval --device cpu`
 * prints.
 * Include once per test program, after Criterion.
 */
#ifndef NG_TESTS_CKPT_TESTING_H
#define NG_TESTS_CKPT_TESTING_H

#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "src/checkpoint.h"
#include "src/commands.h"

static inline unsigned char *read_file(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	cr_assert(f, "cannot open %s", path);
	fseek(f, 0, SEEK_END);
	*n = (size_t)ftell(f);
	fseek(f, 0, SEEK_SET);
	unsigned char *b = malloc(*n + 1);
	cr_assert_eq(fread(b, 1, *n, f), *n);
	fclose(f);
	return b;
}

/* The whole of a file as text (NUL-terminated); *n its size. */
static inline char *read_text(const char *path, size_t *n)
{
	char *b = (char *)read_file(path, n);
	b[*n] = '\0';
	return b;
}

/* The safetensors header length: the first 8 bytes, little-endian. */
static inline uint64_t header_len(const unsigned char *b)
{
	uint64_t hl = 0;
	for (int i = 0; i < 8; i++)
		hl |= (uint64_t)b[i] << (8 * i);
	return hl;
}

/* Whether two state files hold the same tensors, byte for byte, and the same header but for
 * "train_us" (the wall-clock training time, which no two runs share) and the "checksum" that
 * covers it: what a resumed run must reproduce of the straight one. */
static inline bool same_state_but_time(const char *pa, const char *pb)
{
	size_t na, nb;
	unsigned char *a = read_file(pa, &na), *b = read_file(pb, &nb);
	uint64_t ha = na >= 8 ? header_len(a) : na, hb = nb >= 8 ? header_len(b) : nb;
	bool same = na >= 8 + ha && nb >= 8 + hb && na - ha == nb - hb &&
		    memcmp(a + 8 + ha, b + 8 + hb, na - 8 - ha) == 0;
	json_t *j[2] = { NULL, NULL };
	if (same) {
		j[0] = json_loadb((const char *)a + 8, ha, 0, NULL);
		j[1] = json_loadb((const char *)b + 8, hb, 0, NULL);
		for (int i = 0; i < 2; i++) {
			json_t *m = j[i] ? json_object_get(j[i], "__metadata__") : NULL;
			same = same && m && json_object_get(m, "train_us");
			if (m) {
				json_object_del(m, "train_us");
				json_object_del(m, "checksum");
			}
		}
		same = same && json_equal(j[0], j[1]);
	}
	json_decref(j[0]);
	json_decref(j[1]);
	free(a);
	free(b);
	return same;
}

static inline void write_file(const char *path, const void *b, size_t n)
{
	FILE *f = fopen(path, "wb");
	cr_assert(f);
	cr_assert_eq(fwrite(b, 1, n, f), n);
	fclose(f);
}

/* What an edit does to a file: keep its checksum as it was, stamp a checksum that matches the
 * edited file (as nanograph would write it: what is then tested is the check behind the
 * checksum), or none at all. */
enum stamp { KEEP, STAMP, NONE };

/* Parse the header of file b (n bytes), apply edit, and write the re-serialised file (header
 * padded with spaces to 8 bytes, the same data) to path. */
static inline void rewrite(const unsigned char *b, size_t n, const char *path,
		    void (*edit)(json_t *root, void *ctx), void *ctx, enum stamp stamp)
{
	uint64_t hl = header_len(b);
	json_error_t e;
	json_t *root = json_loadb((const char *)b + 8, hl, 0, &e);
	cr_assert(root, "%s", e.text);
	edit(root, ctx);
	json_t *meta = json_object_get(root, "__metadata__");
	if (stamp != KEEP && meta) {
		json_object_del(meta, "checksum");
		if (stamp == STAMP) /* last, as the writer puts it */
			json_object_set_new(meta, "checksum",
					    json_string(NG_CKPT_CHECKSUM_PREFIX "0000000000000000"));
	}
	char *js = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
	json_decref(root);
	size_t len = strlen(js), padded = (len + 7) / 8 * 8, data = n - 8 - hl;
	unsigned char *o = malloc(8 + padded + data);
	for (int i = 0; i < 8; i++)
		o[i] = (unsigned char)((uint64_t)padded >> (8 * i));
	memcpy(o + 8, js, len);
	memset(o + 8 + len, ' ', padded - len);
	memcpy(o + 8 + padded, b + 8 + hl, data);
	if (stamp == STAMP) {
		char *d = strstr((char *)o + 8, "\"checksum\":\"" NG_CKPT_CHECKSUM_PREFIX);
		cr_assert(d);
		d += strlen("\"checksum\":\"" NG_CKPT_CHECKSUM_PREFIX);
		char hex[24];
		snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)ng_ckpt_fnv1a_(
			 NG_CKPT_FNV_INIT, o, 8 + padded + data));
		memcpy(d, hex, 16);
	}
	write_file(path, o, 8 + padded + data);
	free(o);
	free(js);
}

/* The `key` fields ("loss", "val_loss") of a metrics file in order, as text, at most max; their
 * steps into steps[] when it is not NULL. */
static inline int metric_texts(const char *path, const char *key, char out[][32], int *steps,
			       int max)
{
	FILE *f = fopen(path, "r");
	cr_assert(f, "no metrics %s", path);
	char line[512], needle[40];
	snprintf(needle, sizeof(needle), "\"%s\":", key);
	int n = 0;
	while (fgets(line, sizeof(line), f) && n < max) {
		char *l = strstr(line, needle);
		if (!l)
			continue;
		if (steps && sscanf(line, "{\"step\":%d", &steps[n]) != 1)
			continue;
		sscanf(l + strlen(needle), "%31[^,}]", out[n++]);
	}
	fclose(f);
	return n;
}

/* The "loss" fields of a metrics file, in order (as text: %.6g). */
static inline int losses(const char *path, char out[][32], int max)
{
	return metric_texts(path, "loss", out, NULL, max);
}

/* `nanograph` ARGV[0..argc) (at most 30) then extra1 and extra2 where not NULL, in-process. */
static inline enum ng_status train_with(char **argv, int argc, const char *extra1,
					const char *extra2)
{
	char *all[32];
	cr_assert(argc <= 30, "%d arguments", argc);
	memcpy(all, argv, sizeof(char *) * (size_t)argc);
	if (extra1)
		all[argc++] = (char *)extra1;
	if (extra2)
		all[argc++] = (char *)extra2;
	return ng_cmd_train(argc, all);
}

/* `nanograph eval --ckpt model --val shard --batch 2 --device cpu [--window W]` (window NULL:
 * without the flag), its stdout captured in out: the val_loss it prints. */
static inline double eval_cpu_loss(const char *model, const char *shard, const char *out,
				   const char *window)
{
	fflush(stdout);
	int saved = dup(1), fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	dup2(fd, 1);
	close(fd);
	char *argv[] = { "eval", "--ckpt", (char *)model, "--val", (char *)shard, "--batch", "2",
			 "--device", "cpu", "--window", (char *)window };
	enum ng_status st = ng_cmd_eval(window ? 11 : 9, argv);
	fflush(stdout);
	dup2(saved, 1);
	close(saved);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	size_t n;
	char *text = (char *)read_file(out, &n);
	text[n] = '\0';
	char *v = strstr(text, "\"val_loss\":");
	cr_assert(v, "no val_loss in '%s'", text);
	double got = strtod(v + 11, NULL);
	free(text);
	return got;
}

#endif
