/*
 * tests/test_prepare.c — `nanograph prepare` driven in-process through ng_main: the shards hold
 * exactly <|endoftext|> + encode(document) for every document in order (val first, then train,
 * split at --val-tokens and --shard-tokens), for each --split mode and for input large enough to
 * be encoded by several threads; and every bad input gives exit status 2, one line naming the
 * file, and leaves the output directory as it was. Whitespace-only documents are skipped.
 * SIGINT / SIGTERM while temporary shards exist removes them and writes nothing; a FIFO given
 * as input is refused without blocking.
 */
#include <criterion/criterion.h>
#include <glob.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "ng_config.h"
#include "src/commands.h"
#include "util/rng.h"

static const char *vocab;
static char dir[64];
static struct ng_tokenizer tok;
static uint64_t seed;

static void setup(void)
{
	vocab = NG_GPT2_DIR_DEFAULT; /* the tree's own vocabulary: never skipped */
	cr_assert_eq(ng_tokenizer_load(&tok, vocab), NG_OK, "%s", ng_error_message());
	snprintf(dir, sizeof(dir), "/tmp/ng_prepare_XXXXXX");
	cr_assert(mkdtemp(dir));
	seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 16);
}

static void teardown(void)
{
	ng_tokenizer_free(&tok);
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	if (dir[0])
		cr_assert_eq(system(cmd), 0);
}

TestSuite(prepare, .init = setup, .fini = teardown);

static void write_text(const char *path, const char *text, size_t n)
{
	FILE *f = fopen(path, "wb");
	cr_assert(f);
	fwrite(text, 1, n, f);
	fclose(f);
}

/* Run nanograph with a NULL-terminated argument list. */
static enum ng_status run(const char **args)
{
	char *argv[64];
	int argc = 0;
	argv[argc++] = "nanograph";
	for (; *args; args++)
		argv[argc++] = (char *)*args;
	argv[argc] = NULL;
	ng_clear_error();
	return ng_main(argc, argv);
}

/* All tokens of DIR/prefix_*.bin in order; checks each shard holds at most max tokens. */
static struct ng_token_buf read_shards(const char *out, const char *prefix, size_t max)
{
	char pat[256];
	snprintf(pat, sizeof(pat), "%s/%s_*.bin", out, prefix);
	glob_t g;
	struct ng_token_buf all = { 0 };
	if (glob(pat, 0, NULL, &g) != 0)
		return all;
	for (size_t i = 0; i < g.gl_pathc; i++) {
		struct ng_shard s;
		cr_assert_eq(ng_shard_open(&s, g.gl_pathv[i], 50257), NG_OK, "%s", ng_error_message());
		cr_assert_leq(s.count, max, "%s: %zu tokens > --shard-tokens", g.gl_pathv[i], s.count);
		for (size_t k = 0; k < s.count; k++)
			ng_token_buf_push(&all, s.tokens[k]);
		ng_shard_close(&s);
	}
	globfree(&g);
	return all;
}

/* The expected stream: EOT + encode(doc) for each document. */
static void expect_stream(const char *out, const char **docs, int ndocs, size_t val, size_t cap)
{
	struct ng_token_buf want = { 0 };
	for (int d = 0; d < ndocs; d++) {
		ng_token_buf_push(&want, NG_TOKENIZER_EOT);
		cr_assert_eq(ng_tokenizer_encode(&tok, NULL, docs[d], strlen(docs[d]), &want), NG_OK);
	}
	struct ng_token_buf v = read_shards(out, "val", cap), t = read_shards(out, "train", cap);
	cr_assert_eq(v.len, val < want.len ? val : want.len, "val shards hold %zu tokens", v.len);
	size_t n = v.len + t.len < want.len ? v.len + t.len : want.len, bad = n;
	for (size_t i = 0; i < n && bad == n; i++)
		if ((i < v.len ? v.data[i] : t.data[i - v.len]) != want.data[i])
			bad = i;
	cr_assert_eq(bad, n, "token %zu of %zu differs", bad, want.len);
	cr_assert_eq(v.len + t.len, want.len, "%zu + %zu tokens, want %zu", v.len, t.len, want.len);
	free(want.data);
	free(v.data);
	free(t.data);
}

/* Without --vocab, prepare reads the tree's GPT-2 files. */
Test(prepare, default_vocabulary)
{
	char a[128], out[128];
	snprintf(a, sizeof(a), "%s/a.txt", dir);
	snprintf(out, sizeof(out), "%s/out", dir);
	write_text(a, "Hello world.\n", 13);
	const char *docs[] = { "Hello world.\n" };
	const char *args[] = { "prepare", "--out", out, a, NULL };
	cr_assert_eq(run(args), NG_OK, "%s", ng_error_message());
	expect_stream(out, docs, 1, 0, 100000000);
}

Test(prepare, split_modes_val_and_shards)
{
	char a[128], b[128], out[128];
	snprintf(a, sizeof(a), "%s/a.txt", dir);
	snprintf(b, sizeof(b), "%s/b.txt", dir);
	snprintf(out, sizeof(out), "%s/out", dir);
	write_text(a, "First fortune.\n%\nSecond one,\nwith two lines.\n%\n%\n", 49);
	write_text(b, "Para one.\n\n \nPara two\r\nends.\n%\nlast", 35);
	const char *sep_docs[] = { "First fortune.\n", "Second one,\nwith two lines.\n",
				   "Para one.\n\n \nPara two\r\nends.\n", "last" };
	const char *args[] = { "prepare", "--vocab", vocab, "--out", out, "--split", "%",
			       "--val-tokens", "5", "--shard-tokens", "7", a, b, NULL };
	cr_assert_eq(run(args), NG_OK, "%s", ng_error_message());
	expect_stream(out, sep_docs, 4, 5, 7);

	const char *blank_docs[] = { "First fortune.\n%\nSecond one,\nwith two lines.\n%\n%\n",
				     "Para one.\n", "Para two\r\nends.\n%\nlast" };
	snprintf(out, sizeof(out), "%s/out2", dir); /* a fresh directory: no val shard in it */
	args[6] = "blank";
	args[8] = "0";
	args[10] = "100";
	cr_assert_eq(run(args), NG_OK, "%s", ng_error_message());
	expect_stream(out, blank_docs, 3, 0, 100);

	const char *whole_docs[] = { "First fortune.\n%\nSecond one,\nwith two lines.\n%\n%\n",
				     "Para one.\n\n \nPara two\r\nends.\n%\nlast" };
	args[6] = "whole";
	args[8] = "1000000"; /* all to val: no training tokens is an error */
	cr_assert_eq(run(args), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "--val-tokens"), "%s", ng_error_message());
	args[8] = "0";
	cr_assert_eq(run(args), NG_OK, "%s", ng_error_message());
	expect_stream(out, whole_docs, 2, 0, 100);
}

Test(prepare, large_input_parallel_equals_serial)
{
	/* ~3 MB of random words in ~3000 documents: several chunks on several threads */
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	static const char *words[] = { "the", "quick", "Ünïcödé", "42", "don't", "  ", "\n",
				       "—", "fox", ",", "🙂", "x\xff" };
	size_t cap = 3u << 20, n = 0;
	char *text = malloc(cap + 64);
	int ndocs = 0;
	while (n < cap) {
		const char *w = words[ng_rng_below(&r, sizeof(words) / sizeof(words[0]))];
		n += (size_t)sprintf(text + n, "%s ", w);
		if (ng_rng_below(&r, 300) == 0) {
			n += (size_t)sprintf(text + n, "\n%%\n");
			ndocs++;
		}
	}
	char in[128], out[128];
	snprintf(in, sizeof(in), "%s/big.txt", dir);
	snprintf(out, sizeof(out), "%s/big", dir);
	write_text(in, text, n);
	const char *args[] = { "prepare", "--vocab", vocab, "--out", out, "--split", "%",
			       "--val-tokens", "1000", in, NULL };
	cr_assert_eq(run(args), NG_OK, "%s", ng_error_message());
	/* one 3 MB document, cut into pieces for the threads: still the tokens of the whole */
	const char *whole[] = { text };
	text[n] = '\0';
	char wout[140];
	snprintf(wout, sizeof(wout), "%s/whole", dir);
	const char *wargs[] = { "prepare", "--vocab", vocab, "--out", wout, "--split", "whole",
				"--shard-tokens", "999999", in, NULL };
	cr_assert_eq(run(wargs), NG_OK, "%s", ng_error_message());
	expect_stream(wout, whole, 1, 0, 999999);
	/* the serial expectation: split by hand at "\n%\n" (the "%" lines) */
	const char **docs = malloc(sizeof(char *) * (size_t)(ndocs + 2));
	int nd = 0;
	text[n] = '\0';
	for (char *p = text; *p;) {
		char *e = strstr(p, "\n%\n");
		if (e)
			e[1] = '\0'; /* keep the document's own newline */
		if (p[strspn(p, " \n")]) /* whitespace-only documents are skipped */
			docs[nd++] = p;
		if (!e)
			break;
		p = e + 3;
	}
	expect_stream(out, docs, nd, 1000, 100000000);
	free(docs);
	free(text);
}

/* Run, expect exit 2 with one line containing `needle`, and the sentinel shard untouched. */
static void expect_bad(const char **args, const char *needle, const char *sentinel)
{
	enum ng_status st = run(args);
	cr_assert_eq(st, NG_ERR_INPUT, "status %d, expected 2 (%s)", st, needle);
	cr_assert(strstr(ng_error_message(), needle), "error '%s' does not name '%s'",
		  ng_error_message(), needle);
	cr_assert_null(strchr(ng_error_message(), '\n'));
	struct ng_shard s;
	cr_assert_eq(ng_shard_open(&s, sentinel, 50257), NG_OK, "earlier output damaged: %s",
		     ng_error_message());
	cr_assert_eq(s.count, 3);
	ng_shard_close(&s);
}

Test(prepare, bad_input_leaves_output_alone)
{
	char good[128], out[128], sentinel[160], missing[128], notdir[128], baddir[160], bv[128];
	snprintf(good, sizeof(good), "%s/good.txt", dir);
	snprintf(out, sizeof(out), "%s/out", dir);
	snprintf(missing, sizeof(missing), "%s/missing.txt", dir);
	snprintf(notdir, sizeof(notdir), "%s/afile", dir);
	snprintf(baddir, sizeof(baddir), "%s/afile/out", dir);
	snprintf(bv, sizeof(bv), "%s/badvocab", dir);
	write_text(good, "Hello there.\n", 13);
	write_text(notdir, "x", 1);
	mkdir(out, 0755);
	mkdir(bv, 0755);
	snprintf(sentinel, sizeof(sentinel), "%s/train_000000.bin", out);
	uint16_t three[3] = { 1, 2, 3 };
	cr_assert_eq(ng_shard_write(sentinel, three, 3), NG_OK);

	const char *a1[] = { "prepare", "--vocab", vocab, "--out", out, good, missing, NULL };
	expect_bad(a1, missing, sentinel);
	const char *a2[] = { "prepare", "--vocab", vocab, "--out", out, dir, NULL };
	expect_bad(a2, "not a regular file", sentinel);
	const char *a3[] = { "prepare", "--vocab", bv, "--out", out, good, NULL };
	expect_bad(a3, "badvocab/encoder.json", sentinel);
	char enc[200];
	snprintf(enc, sizeof(enc), "%s/encoder.json", bv);
	write_text(enc, "{\"broken\": ", 11);
	expect_bad(a3, "badvocab/encoder.json", sentinel);
	const char *a4[] = { "prepare", "--vocab", vocab, "--out", baddir, good, NULL };
	expect_bad(a4, baddir, sentinel);
	const char *a5[] = { "prepare", "--vocab", vocab, "--out", out, "--val-tokens", "100",
			     good, NULL };
	expect_bad(a5, "--val-tokens", sentinel);
	const char *a6[] = { "prepare", "--vocab", vocab, "--out", out, NULL };
	expect_bad(a6, "no input FILE", sentinel);
	const char *a7[] = { "prepare", good, NULL };
	expect_bad(a7, "--out", sentinel);
	const char *a8[] = { "prepare", "--vocab", vocab, "--out", out, "--shard-tokens", "0",
			     good, NULL };
	expect_bad(a8, "--shard-tokens", sentinel);
	/* no temporaries left anywhere */
	glob_t g;
	char pat[200];
	snprintf(pat, sizeof(pat), "%s/*tmp*", out);
	cr_assert_eq(glob(pat, GLOB_PERIOD, NULL, &g), GLOB_NOMATCH, "left %s",
		     g.gl_pathc ? g.gl_pathv[0] : "");
}

/* Files in dir matching pattern. */
static size_t count_files(const char *pattern)
{
	glob_t g;
	if (glob(pattern, GLOB_PERIOD, NULL, &g) != 0)
		return 0;
	size_t n = g.gl_pathc;
	globfree(&g);
	return n;
}

/* prepare in a child, signalled the moment its first temporary shard appears: the child dies of
 * the signal, no temporary is left, and no shard was renamed into place (or, had the signal come
 * after the renames, all were). For SIGINT and SIGTERM, a few times each. */
Test(prepare, signal_removes_the_temporary_shards, .timeout = 120)
{
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	size_t cap = 1u << 20, n = 0;
	char *text = malloc(cap + 64);
	while (n < cap)
		n += (size_t)sprintf(text + n, "word%u and more ", (unsigned)ng_rng_below(&r, 5000));
	char in[128];
	snprintf(in, sizeof(in), "%s/in.txt", dir);
	write_text(in, text, n);
	free(text);
	for (int round = 0; round < 6; round++) {
		int sig = round % 2 ? SIGTERM : SIGINT;
		char out[160], tmps[200], shards[200];
		snprintf(out, sizeof(out), "%s/out%d", dir, round);
		snprintf(tmps, sizeof(tmps), "%s/*.tmp-*", out);
		snprintf(shards, sizeof(shards), "%s/train_*.bin", out);
		pid_t child = fork();
		cr_assert(child >= 0);
		if (child == 0) {
			const char *args[] = { "prepare", "--vocab", vocab, "--out", out,
					       "--shard-tokens", "2000", in, NULL };
			_exit((int)run(args));
		}
		time_t t0 = time(NULL);
		while (count_files(tmps) == 0 && time(NULL) - t0 < 60 &&
		       waitpid(child, NULL, WNOHANG) == 0)
			usleep(200);
		cr_assert_gt(count_files(tmps), 0, "round %d: no temporary shard appeared", round);
		kill(child, sig);
		int status;
		waitpid(child, &status, 0);
		cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == sig,
			  "round %d: the child did not end by signal %d (wait status %d)", round, sig,
			  status);
		cr_assert_eq(count_files(tmps), 0, "round %d: temporary shards left", round);
		size_t done = count_files(shards);
		cr_assert(done == 0 || done > 100, "round %d: %zu shards renamed, not all or none",
			  round, done);
	}
}

Test(prepare, fifo_input_refused_without_blocking, .timeout = 30)
{
	char fifo[128], out[128];
	snprintf(fifo, sizeof(fifo), "%s/in.fifo", dir);
	snprintf(out, sizeof(out), "%s/out", dir);
	cr_assert_eq(mkfifo(fifo, 0644), 0);
	const char *args[] = { "prepare", "--vocab", vocab, "--out", out, fifo, NULL };
	cr_assert_eq(run(args), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "a FIFO"), "%s", ng_error_message());
}
