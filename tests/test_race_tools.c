/*
 * tests/test_race_tools.c — the scripts of the speedrun race, run from the source root (where
 * tools/run-tests and meson test run):
 *  - tools/corpus: the same files give the same shards byte for byte; the documents go into the
 *    stream in the order of their SHA-256 (the manifest's third column ascends), and
 *    --path-order takes the same files in path order (the first column ascends in bytes). On 2
 *    MB of this machine's text, with the nanograph binary of this build;
 *  - tools/speedrun-race report: tokens/s and the times to the two target losses (linear
 *    between checkpoints, validation excluded) from made-up logs of the three runs; with
 *    repeated (--tag) runs, each kind's mean and range at the checkpoints all runs share;
 *  - tools/fp8-parity report: the FP8 runs' loss differences from bf16's, from made-up metrics;
 *  - tools/ab: three sides (a build, its flags, its environment) in interleaved rounds, each
 *    run with a fresh autotune cache, against a stand-in nanograph; a deadline (-t) that stops
 *    before a run would pass it; bad arguments exit 2;
 *  - tools/export_init with shape flags (the peers' and ref_check's init): the file holds
 *    ng_gpt_init's floats for that shape, bit for bit; a bad flag exits 2 with one line.
 */
#define _XOPEN_SOURCE 700
#include <criterion/criterion.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "graph/gpt.h"
#include "tests/ckpt_testing.h"
#include "tests/test_tmpdir.h"

/* Run tools/corpus into <test dir>/name with extra flags; fail on a non-zero exit. */
static void corpus(const char *bin, const char *name, const char *extra)
{
	char cmd[2048];
	snprintf(cmd, sizeof(cmd), "NANOGRAPH='%s' python3 tools/corpus '%s/%s' --max-mb 2 "
		 "--val-tokens 20000 %s >/dev/null 2>&1", bin, ng_test_dir, name, extra);
	cr_assert_eq(system(cmd), 0, "failed: %s", cmd);
}

/* Field k (0-based, tab-separated) of each manifest line, in order; returns the count. */
static int fields(char *text, int k, char **out, int max)
{
	int n = 0;
	for (char *line = strtok(text, "\n"); line && n < max; line = strtok(NULL, "\n")) {
		char *f = line;
		for (int i = 0; i < k && f; i++)
			f = strchr(f, '\t') ? strchr(f, '\t') + 1 : NULL;
		cr_assert(f, "manifest line without field %d: %s", k, line);
		out[n++] = f;
	}
	return n;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

Test(corpus, deterministic_and_ordered_by_content, .timeout = 300)
{
	if (access("tools/corpus", X_OK) != 0)
		cr_skip_test("tools/corpus not here: run from the source root");
	if (system("python3 -c pass >/dev/null 2>&1") != 0)
		cr_skip_test("no python3");
	char exe[PATH_MAX], bin[PATH_MAX + 16];
	ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	cr_assert(len > 0);
	exe[len] = '\0';
	*strrchr(exe, '/') = '\0'; /* <build>/tests */
	snprintf(bin, sizeof(bin), "%s/../nanograph", exe);
	cr_assert(access(bin, X_OK) == 0, "no nanograph binary at %s", bin);
	ng_test_dir_make("ng_corpus_");
	corpus(bin, "a", "");
	corpus(bin, "b", "");
	corpus(bin, "p", "--path-order");
	const char *files[] = { "train_000000.bin", "val_000000.bin", "manifest.tsv" };
	for (int i = 0; i < 3; i++) {
		char pa[512], pb[512];
		snprintf(pa, sizeof(pa), "%s/a/%s", ng_test_dir, files[i]);
		snprintf(pb, sizeof(pb), "%s/b/%s", ng_test_dir, files[i]);
		size_t na, nb;
		char *x = read_text(pa, &na), *y = read_text(pb, &nb);
		cr_expect(na == nb && memcmp(x, y, na) == 0, "two runs made different %s", files[i]);
		free(x);
		free(y);
	}
	enum { MAX = 100000 };
	char pa[512], pp[512];
	snprintf(pa, sizeof(pa), "%s/a/manifest.tsv", ng_test_dir);
	snprintf(pp, sizeof(pp), "%s/p/manifest.tsv", ng_test_dir);
	size_t na, np;
	char *ma = read_text(pa, &na), *mp = read_text(pp, &np), *ma2 = strdup(ma), *mp2 = strdup(mp);
	char **ha = malloc(MAX * sizeof(char *)), **pth = malloc(MAX * sizeof(char *));
	char **la = malloc(MAX * sizeof(char *)), **lp = malloc(MAX * sizeof(char *));
	int n = fields(ma, 2, ha, MAX), m = fields(mp, 0, pth, MAX);
	cr_assert(n > 1 && n == m, "%d files by content, %d by path", n, m);
	for (int i = 1; i < n; i++) {
		cr_expect(strcmp(ha[i - 1], ha[i]) < 0, "stream order: line %d's sha256 does not "
			  "ascend", i + 1);
		cr_expect(strcmp(pth[i - 1], pth[i]) < 0, "--path-order: line %d's path does not "
			  "ascend", i + 1);
	}
	/* the same files either way */
	fields(ma2, 0, la, MAX);
	fields(mp2, 0, lp, MAX);
	qsort(la, (size_t)n, sizeof(char *), cmp_str);
	qsort(lp, (size_t)n, sizeof(char *), cmp_str);
	for (int i = 0; i < n; i++)
		cr_expect_str_eq(la[i], lp[i], "line %d of the sorted manifests", i + 1);
	free(ma), free(mp), free(ma2), free(mp2), free(ha), free(pth), free(la), free(lp);
}

/* Write text to <test dir>/out/name. */
static void put(const char *name, const char *text)
{
	char p[512];
	snprintf(p, sizeof(p), "%s/out/%s", ng_test_dir, name);
	FILE *f = fopen(p, "w");
	cr_assert(f, "cannot write %s", p);
	fputs(text, f);
	fclose(f);
}

/* Skips the test without tools/<tool> (run from the source root) or python3; then makes the
 * test dir (/tmp/<prefix>XXXXXX). */
static void tool_test_dir(const char *tool, const char *prefix)
{
	char path[256];
	snprintf(path, sizeof(path), "tools/%s", tool);
	if (access(path, X_OK) != 0)
		cr_skip_test("%s not here: run from the source root", path);
	if (system("python3 -c pass >/dev/null 2>&1") != 0)
		cr_skip_test("no python3");
	ng_test_dir_make(prefix);
}

/* A fresh <test dir>/out for the logs of tools/<tool>, in dir. */
static void race_dir(const char *tool, char *dir, size_t n)
{
	tool_test_dir(tool, "ng_race_");
	snprintf(dir, n, "%s/out", ng_test_dir);
	cr_assert(mkdir(dir, 0700) == 0);
}

/* The output (stdout and stderr) of the shell command cmd, through <test dir>/cmd.txt; its
 * exit status in *rc. */
static char *output_of(const char *cmd, int *rc)
{
	char full[4096], log[512];
	snprintf(log, sizeof(log), "%s/cmd.txt", ng_test_dir);
	snprintf(full, sizeof(full), "%s >'%s' 2>&1", cmd, log);
	int st = system(full);
	*rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
	size_t n;
	return read_text(log, &n);
}

/* `tools/<tool> report` over the logs in dir: its output. */
static char *tool_report(const char *tool, const char *dir)
{
	char cmd[2048];
	snprintf(cmd, sizeof(cmd), "OUT='%s' python3 tools/%s report", dir, tool);
	int rc;
	char *r = output_of(cmd, &rc);
	cr_assert_eq(rc, 0, "failed (exit %d): %s\n%s", rc, cmd, r);
	return r;
}

/* `tools/speedrun-race report` over the logs in dir. */
static char *report(const char *dir)
{
	return tool_report("speedrun-race", dir);
}

/* Each of want[0..n) in r, in that order. */
static void expect_in_order(const char *r, const char *const *want, size_t n)
{
	const char *at = r;
	for (size_t i = 0; i < n; i++) {
		const char *p = strstr(at, want[i]);
		cr_expect(p != NULL, "no '%s' (in order) in the report:\n%s", want[i], r);
		if (p)
			at = p + strlen(want[i]);
	}
}

Test(race, report_reads_the_three_logs, .timeout = 60)
{
	char dir[512];
	race_dir("speedrun-race", dir, sizeof(dir));
	/* the reference: validations at 0, 2, 4 of 4 steps (2 s a checkpoint) */
	put("ref.log", "step:0/4 val_loss:10.8000 train_time:0ms step_avg:0.02ms\n"
		       "step:1/4 train_time:1000ms step_avg:1000.00ms\n"
		       "step:2/4 train_time:2000ms step_avg:1000.00ms\n"
		       "step:2/4 val_loss:5.0000 train_time:2000ms step_avg:1000.00ms\n"
		       "step:4/4 train_time:4000ms step_avg:1000.00ms\n"
		       "step:4/4 val_loss:3.0000 train_time:4000ms step_avg:1000.00ms\n");
	/* ours: 500 ms a step; gpt2: 1000 ms a step */
	put("ours.jsonl", "{\"step\":1,\"loss\":9,\"ms\":500}\n{\"step\":2,\"loss\":8,\"ms\":500}\n"
			  "{\"step\":2,\"val_loss\":4.0}\n{\"step\":3,\"loss\":7,\"ms\":500}\n"
			  "{\"step\":4,\"loss\":6,\"ms\":500}\n{\"step\":4,\"val_loss\":2.5}\n");
	put("gpt2.jsonl", "{\"step\":1,\"loss\":9,\"ms\":1000}\n{\"step\":2,\"loss\":8,\"ms\":1000}\n"
			  "{\"step\":2,\"val_loss\":6.0}\n{\"step\":3,\"loss\":7,\"ms\":1000}\n"
			  "{\"step\":4,\"loss\":6,\"ms\":1000}\n{\"step\":4,\"val_loss\":4.5}\n");
	char *r = report(dir);
	/* tok/s: the reference 49152 x 4 steps / 4 s; ours and gpt2 over the steps after the
	 * first; the GPT-2 final 4.5: the reference between 5.0 at 2 s and 3.0 at 4 s, ours
	 * already at its first checkpoint; the reference's final 3.0: ours between 4.0 at 1 s and
	 * 2.5 at 2 s */
	const char *want[] = {
		"reference (PyTorch + Triton): 49152 tok/s",
		"reaches 4.5000 (the GPT-2 run's final): at 2.5 s",
		"reaches 3.0000 (the reference's final): at 4.0 s",
		"nanograph speedrun: 98304 tok/s",
		"reaches 4.5000 (the GPT-2 run's final): at 1.0 s",
		"reaches 3.0000 (the reference's final): at 1.7 s",
		"nanograph GPT-2 d12: 65536 tok/s",
		"reaches 4.5000 (the GPT-2 run's final): at 4.0 s",
		"reaches 3.0000 (the reference's final): not in this run",
	};
	expect_in_order(r, want, sizeof(want) / sizeof(want[0]));
	free(r);
}

/* Two runs of the reference (ref.log, ref-b.log), two of ours (ours.jsonl, ours-s2.jsonl) and
 * one of the PyTorch peer (peer.jsonl, its first window untimed: NaN): the report gives, at the
 * checkpoints all five share, each kind's mean and range, the difference of each mean from the
 * reference's and the reference's own range, and the ratios of the mean tok/s. */
Test(race, report_summarises_repeated_runs, .timeout = 60)
{
	char dir[512];
	race_dir("speedrun-race", dir, sizeof(dir));
	put("ref.log", "step:0/4 val_loss:10.8000 train_time:0ms step_avg:0.02ms\n"
		       "step:2/4 val_loss:5.0000 train_time:2000ms step_avg:1000.00ms\n"
		       "step:4/4 train_time:4000ms step_avg:1000.00ms\n"
		       "step:4/4 val_loss:3.0000 train_time:4000ms step_avg:1000.00ms\n");
	put("ref-b.log", "step:0/4 val_loss:10.8000 train_time:0ms step_avg:0.02ms\n"
			 "step:2/4 val_loss:5.1000 train_time:2000ms step_avg:1000.00ms\n"
			 "step:4/4 train_time:2000ms step_avg:500.00ms\n"
			 "step:4/4 val_loss:3.1000 train_time:2000ms step_avg:500.00ms\n");
	put("ours.jsonl", "{\"step\":1,\"loss\":9,\"ms\":500}\n{\"step\":2,\"loss\":8,\"ms\":500}\n"
			  "{\"step\":2,\"val_loss\":4.0}\n{\"step\":3,\"loss\":7,\"ms\":500}\n"
			  "{\"step\":4,\"loss\":6,\"ms\":500}\n{\"step\":4,\"val_loss\":2.5}\n");
	put("ours-s2.jsonl", "{\"step\":1,\"loss\":9,\"ms\":500}\n{\"step\":2,\"loss\":8,"
			     "\"ms\":500}\n{\"step\":2,\"val_loss\":4.2}\n{\"step\":3,\"loss\":7,"
			     "\"ms\":500}\n{\"step\":4,\"loss\":6,\"ms\":500}\n"
			     "{\"step\":4,\"val_loss\":2.7}\n");
	put("peer.jsonl", "{\"step\": 1, \"loss\": 9, \"ms\": NaN}\n{\"step\": 2, \"loss\": 8, "
			  "\"ms\": 250}\n{\"step\": 2, \"val_loss\": 4.1}\n{\"step\": 3, \"loss\": 7, "
			  "\"ms\": 250}\n{\"step\": 4, \"loss\": 6, \"ms\": 250}\n"
			  "{\"step\": 4, \"val_loss\": 2.4}\n");
	char *r = report(dir);
	/* tok/s: the reference's runs 49152 and 98304 (4 steps in 4 s and in 2 s), ours 98304,
	 * the peer 196608 over the steps after its untimed first one */
	const char *want[] = {
		"reference (PyTorch + Triton) [b]: 98304 tok/s",
		"nanograph speedrun [s2]: 98304 tok/s",
		"PyTorch peer: 196608 tok/s",
		"step     2       0.2 s  val loss 4.1000", /* the untimed first step left out */
		"validation at the shared checkpoints, reference 2 runs, ours 2 runs, peer 1 run",
		"step     2  5.0500 [5.0000, 5.1000]   4.1000 [4.0000, 4.2000]   4.1000 [4.1000, 4.1000]",
		"-0.9500", "-0.9500",
		"step     4  3.0500 [3.0000, 3.1000]   2.6000 [2.5000, 2.7000]   2.4000 [2.4000, 2.4000]",
		"-0.4500", "-0.6500",
		"ours - reference, means: -0.9500 to -0.4500",
		"peer - reference, means: -0.9500 to -0.6500",
		"the reference's own range: up to 0.1000",
		"tok/s, means: ours 98304, reference 73728: 1.333x",
		"tok/s, means: peer 196608, reference 73728: 2.667x",
	};
	expect_in_order(r, want, sizeof(want) / sizeof(want[0]));
	free(r);
}

/* The reference from our init (refinit.log, `ref --init-seed`) is a kind of its own: its mean
 * beside the reference's own-init runs, not pooled with them. */
Test(race, report_keeps_the_reference_from_our_init_apart, .timeout = 60)
{
	char dir[512];
	race_dir("speedrun-race", dir, sizeof(dir));
	put("ref.log", "step:0/4 val_loss:10.8000 train_time:0ms step_avg:0.02ms\n"
		       "step:4/4 train_time:4000ms step_avg:1000.00ms\n"
		       "step:4/4 val_loss:3.0000 train_time:4000ms step_avg:1000.00ms\n");
	put("refinit.log", "step:0/4 val_loss:10.8000 train_time:0ms step_avg:0.02ms\n"
			   "step:4/4 train_time:4000ms step_avg:1000.00ms\n"
			   "step:4/4 val_loss:2.8000 train_time:4000ms step_avg:1000.00ms\n");
	put("ours.jsonl", "{\"step\":1,\"loss\":9,\"ms\":500}\n{\"step\":4,\"loss\":6,\"ms\":500}\n"
			  "{\"step\":4,\"val_loss\":2.7}\n");
	char *r = report(dir);
	const char *want[] = {
		"reference (PyTorch + Triton): 49152 tok/s",
		"reference from nanograph's init: 49152 tok/s",
		"validation at the shared checkpoints, reference 1 run, ours 1 run, ref (our init) 1 run",
		"step     4  3.0000 [3.0000, 3.0000]   2.7000 [2.7000, 2.7000]   2.8000 [2.8000, 2.8000]",
		"ours - reference, means: -0.3000 to -0.3000",
		"ref (our init) - reference, means: -0.2000 to -0.2000",
	};
	expect_in_order(r, want, sizeof(want) / sizeof(want[0]));
	free(r);
}

/* Metrics of `steps` steps into <test dir>/out/name: loss 5 - step / 100, plus shift(step). */
static void put_losses(const char *name, int steps, double (*shift)(int))
{
	size_t cap = (size_t)steps * 64 + 1, at = 0;
	char *text = malloc(cap);
	cr_assert(text);
	for (int s = 1; s <= steps; s++)
		at += (size_t)snprintf(text + at, cap - at, "{\"step\":%d,\"loss\":%.6f,\"ms\":100}\n",
				       s, 5.0 - s / 100.0 + shift(s));
	put(name, text);
	free(text);
}

static double no_shift(int s) { return 0 * s; }
/* +0.02 for the first 150 steps, -0.01 after, but +0.29 at step 200 */
static double fp8_shift(int s) { return s <= 150 ? 0.02 : s == 200 ? 0.29 : -0.01; }

/* tools/fp8-parity report: over steps 151-300 the mean difference (-0.01 x 149 + 0.29) / 150 =
 * -0.0080 and the mean |difference| 1.78 / 150 = 0.0119; the first tenth's +0.0200; the
 * largest, at step 200; the last step's losses; a shorter --fp8-dw run compared over the
 * steps it shares with bf16; tagged runs (one FP8 kind, bf16 again) after their kind's, and
 * the other bf16 runs last. */
static double half_shift(int s) { return fp8_shift(s) / 2; }
Test(race, fp8_parity_report, .timeout = 60)
{
	char dir[512];
	race_dir("fp8-parity", dir, sizeof(dir));
	put_losses("bf16.jsonl", 300, no_shift);
	put_losses("bf16-again.jsonl", 300, half_shift);
	put_losses("fp8.jsonl", 300, fp8_shift);
	put_losses("fp8-qkv.jsonl", 300, half_shift);
	put_losses("fp8dw.jsonl", 100, no_shift);
	char *r = tool_report("fp8-parity", dir);
	const char *want[] = {
		"--fp8 against bf16: 300 shared steps (1 to 300)",
		"steps 151-300: mean (run - bf16) -0.0080, mean |run - bf16| 0.0119",
		"steps 1-30: mean +0.0200, mean abs 0.0200",
		"largest |run - bf16| 0.2900 at step 200",
		"step 300: --fp8 1.9900, bf16 2.0000",
		"--fp8 [qkv] against bf16: 300 shared steps (1 to 300)",
		"steps 151-300: mean (run - bf16) -0.0040, mean |run - bf16| 0.0059",
		"largest |run - bf16| 0.1450 at step 200",
		"--fp8 --fp8-dw against bf16: 100 shared steps (1 to 100)",
		"largest |run - bf16| 0.0000 at step",
		"step 100: --fp8 --fp8-dw 4.0000, bf16 4.0000",
		"bf16 [again] against bf16: 300 shared steps (1 to 300)",
		"step 300: bf16 [again] 1.9950, bf16 2.0000",
	};
	expect_in_order(r, want, sizeof(want) / sizeof(want[0]));
	free(r);
}

/* A bash script at path, made executable: the text of fmt with its arguments. */
static void put_script(const char *path, const char *fmt, ...)
{
	FILE *f = fopen(path, "w");
	cr_assert(f, "%s", path);
	va_list ap;
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	fclose(f);
	cr_assert(chmod(path, 0700) == 0);
}

/* tools/fp8-parity run with --tag and --extra: a stand-in nanograph records its arguments and
 * writes three metrics rows; the run's files carry the tag, its flags follow the kind's and
 * --flags; --extra without a tag, and a tag that is no file name, are refused. */
Test(race, fp8_parity_run_tagged, .timeout = 60)
{
	char dir[512], stub[600], cmd[2048];
	race_dir("fp8-parity", dir, sizeof(dir));
	snprintf(stub, sizeof(stub), "%s/nanograph", ng_test_dir);
	put_script(stub, "#!/usr/bin/env bash\n"
		   "echo \"$*\" >> '%s/args'\n"
		   "while [ $# -gt 0 ]; do [ \"$1\" = --metrics ] && m=$2; shift; done\n"
		   "for s in 1 2 3; do echo \"{\\\"step\\\":$s,\\\"loss\\\":4}\"; done > \"$m\"\n"
		   "echo 'done: 3 steps'\n",
		   ng_test_dir);
	snprintf(cmd, sizeof(cmd), "NANOGRAPH='%s' OUT='%s' python3 tools/fp8-parity run fp8 "
		 "--model tiny --steps 3 --flags=--autotune --tag qkv --extra='--recompute fp8'",
		 stub, dir);
	int rc;
	char *r = output_of(cmd, &rc);
	cr_assert_eq(rc, 0, "%s\n%s", cmd, r);
	cr_expect(strstr(r, "fp8-qkv: exit status 0"), "%s", r);
	free(r);
	char path[700];
	snprintf(path, sizeof(path), "%s/fp8-qkv.jsonl", dir);
	cr_expect(access(path, R_OK) == 0, "no %s", path);
	snprintf(path, sizeof(path), "%s/args", ng_test_dir);
	size_t n;
	char *args = read_text(path, &n);
	cr_expect(strstr(args, "--fp8 --autotune --recompute fp8"), "%s", args);
	cr_expect(strstr(args, "fp8-qkv.jsonl"), "%s", args);
	free(args);
	const char *bad[2][2] = { { "fp8 --extra=--fp8-dw", "--extra needs a --tag" },
				  { "bf16 --tag ../x", "letters, digits and _ only" } };
	for (int i = 0; i < 2; i++) {
		snprintf(cmd, sizeof(cmd), "NANOGRAPH='%s' OUT='%s' python3 tools/fp8-parity run %s",
			 stub, dir, bad[i][0]);
		r = output_of(cmd, &rc);
		cr_expect_eq(rc, 2, "%s: %s", bad[i][0], r);
		cr_expect(strstr(r, bad[i][1]), "%s: %s", bad[i][0], r);
		free(r);
	}
}

/* tools/corpus hands prepare this tree's vocabulary (a nanograph built elsewhere looks for it
 * where it was built), and none when $NG_GPT2_DIR names one: a stand-in nanograph records its
 * arguments and writes no shards, so the script fails after it, as it should. */
Test(corpus, prepare_gets_the_tree_vocabulary, .timeout = 60)
{
	tool_test_dir("corpus", "ng_corpus_");
	char stub[600], cmd[2048], cwd[PATH_MAX], want[PATH_MAX + 32];
	snprintf(stub, sizeof(stub), "%s/nanograph", ng_test_dir);
	put_script(stub, "#!/usr/bin/env bash\necho \"$*\" >> '%s/args'\n", ng_test_dir);
	cr_assert(getcwd(cwd, sizeof(cwd)));
	snprintf(want, sizeof(want), "--vocab %s/data/gpt2 ", cwd);
	for (int env = 0; env < 2; env++) {
		snprintf(cmd, sizeof(cmd), "%sNANOGRAPH='%s' python3 tools/corpus '%s/out%d' --max-mb 1 "
			 ">/dev/null 2>&1", env ? "NG_GPT2_DIR=/nowhere " : "", stub, ng_test_dir,
			 env);
		cr_assert_neq(system(cmd), 0, "%s: succeeded without shards", cmd);
	}
	char path[700];
	snprintf(path, sizeof(path), "%s/args", ng_test_dir);
	size_t n;
	char *args = read_text(path, &n);
	char *second = strchr(args, '\n');
	cr_assert(second && strstr(args, "prepare"), "%s", args);
	*second++ = 0;
	cr_expect(strstr(args, want), "no '%s' in: %s", want, args);
	cr_expect(strstr(second, "prepare") && !strstr(second, "--vocab"), "with $NG_GPT2_DIR: %s",
		  second);
	free(args);
}

/* A stand-in nanograph in <test dir>/stub: `train` writes 20 metrics rows at 1000 tok/s (1100
 * with --fast, 2 more a unit of NG_BUMP), records its XDG_CACHE_HOME, prints a plan line, and
 * sleeps NG_SLEEP seconds. Returns the command prefix that runs tools/ab with OUT in the test
 * dir. */
static void ab_stub(char *pre, size_t n)
{
	tool_test_dir("ab", "ng_ab_");
	char p[512];
	snprintf(p, sizeof(p), "%s/stub", ng_test_dir);
	cr_assert(mkdir(p, 0700) == 0);
	snprintf(p, sizeof(p), "%s/stub/nanograph", ng_test_dir);
	put_script(p, "#!/usr/bin/env bash\n"
		   "[ \"$1\" = train ] || exit 3\n"
		   "m='' r=1000\n"
		   "for a in \"$@\"; do [ \"$a\" = --fast ] && r=1100; done\n"
		   "while [ $# -gt 0 ]; do [ \"$1\" = --metrics ] && m=$2; shift; done\n"
		   "r=$(( r + 2 * ${NG_BUMP:-0} ))\n"
		   "echo \"$XDG_CACHE_HOME\" >> '%s/caches'\n"
		   "echo \"plan: rate $r\"\n"
		   "for s in $(seq 1 20); do echo \"{\\\"step\\\":$s,\\\"ms\\\":10,"
		   "\\\"tok_per_s\\\":$r}\"; done > \"$m\"\n"
		   "sleep ${NG_SLEEP:-0}\n",
		   ng_test_dir);
	snprintf(pre, n, "OUT='%s/out' tools/ab", ng_test_dir);
}

/* tools/ab's output for the arguments after the prefix; its exit status in *rc. */
static char *ab_run(const char *pre, const char *args, int *rc)
{
	char cmd[3328];
	snprintf(cmd, sizeof(cmd), "%s %s", pre, args);
	return output_of(cmd, rc);
}

/* Three sides, 2 rounds: A (the stub), B (its --fast flag: 1100 tok/s), C (NG_BUMP=5 in its
 * environment: 1010); runs interleaved A1 B1 C1 A2 ..., SHOW's lines from each side's first
 * log, each run its own cache (6 different directories), each side against A. */
Test(ab, three_sides_in_rounds, .timeout = 60)
{
	char pre[1024], args[2048];
	ab_stub(pre, sizeof(pre));
	snprintf(args, sizeof(args), "-n 2 '%s/stub' '%s/stub+--fast' '%s/stub:NG_BUMP=5' -- "
		 "--steps 20", ng_test_dir, ng_test_dir, ng_test_dir);
	char with_show[1200];
	snprintf(with_show, sizeof(with_show), "SHOW='^plan:' %s", pre);
	int rc;
	char *r = ab_run(with_show, args, &rc);
	cr_expect_eq(rc, 0, "tools/ab exited %d:\n%s", rc, r);
	const char *want[] = {
		"A1 1000 tok/s", "plan: rate 1000", "B1 1100 tok/s", "plan: rate 1100",
		"C1 1010 tok/s", "A2 1000 tok/s", "B2 1100 tok/s", "C2 1010 tok/s",
		"A: mean 1,000 (1,000-1,000), 2 run(s)", "B: mean 1,100 (1,100-1,100), 2 run(s)",
		"C: mean 1,010 (1,010-1,010), 2 run(s)",
		"B/A 1.1000 (+10.00%): the ranges do not overlap",
		"C/A 1.0100 (+1.00%): the ranges do not overlap",
	};
	expect_in_order(r, want, sizeof(want) / sizeof(want[0]));
	cr_expect(strstr(r, "plan: rate 1000\n    plan") == NULL && !strstr(r, "A2 1000 tok/s\n  "),
		  "SHOW printed more than the first run's lines:\n%s", r);
	free(r);
	char cmd[1024], log[512];
	snprintf(log, sizeof(log), "%s/n.txt", ng_test_dir);
	snprintf(cmd, sizeof(cmd), "sort -u '%s/caches' | wc -l > '%s'", ng_test_dir, log);
	cr_assert_eq(system(cmd), 0);
	size_t n;
	char *count = read_text(log, &n);
	cr_expect_eq(atoi(count), 6, "%d distinct autotune caches for 6 runs", atoi(count));
	free(count);
}

/* -t 1 with runs of 1 s: A1 runs, then B1 would end past the deadline, so the comparison stops
 * and sums up A alone; bad arguments exit 2 with one line. */
Test(ab, deadline_and_bad_arguments, .timeout = 60)
{
	char pre[1024], args[2048];
	ab_stub(pre, sizeof(pre));
	snprintf(args, sizeof(args), "-t 1 '%s/stub:NG_SLEEP=1' '%s/stub' -- --steps 20",
		 ng_test_dir, ng_test_dir);
	int rc;
	char *r = ab_run(pre, args, &rc);
	cr_expect_eq(rc, 0, "tools/ab exited %d:\n%s", rc, r);
	const char *want[] = {
		"A1 1000 tok/s",
		"stopped before round 1, side B: the next run would pass the 1 s deadline",
		"A: mean 1,000 (1,000-1,000), 1 run(s)",
	};
	expect_in_order(r, want, sizeof(want) / sizeof(want[0]));
	cr_expect(strstr(r, "B1") == NULL, "a run started past the deadline:\n%s", r);
	free(r);
	const char *bad[] = { "-n 0 a b -- x", "-t 1s a b -- x", "a -- x", "a b x" };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		r = ab_run(pre, bad[i], &rc);
		cr_expect_eq(rc, 2, "tools/ab %s exited %d:\n%s", bad[i], rc, r);
		free(r);
	}
	snprintf(args, sizeof(args), "'%s/stub' '%s/none' -- x", ng_test_dir, ng_test_dir);
	r = ab_run(pre, args, &rc);
	cr_expect(rc == 2 && strstr(r, "none/nanograph (hint:"), "a missing build: exit %d:\n%s",
		  rc, r);
	free(r);
}

/* export_init speedrun-tiny SEED FILE --layers 12 --heads 1 --channels 128 --vocab 300: the
 * preset's shape changed as the flags say, the floats ng_gpt_init writes for it; a flag with no
 * count, an unknown flag and an impossible shape (channels not a multiple of heads) exit 2. */
Test(export_init, shape_flags_and_bad_input)
{
	char exe[PATH_MAX], bin[PATH_MAX + 32], cmd[4 * PATH_MAX], out[PATH_MAX];
	ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	cr_assert(len > 0);
	exe[len] = '\0';
	*strrchr(exe, '/') = '\0'; /* <build>/tests */
	snprintf(bin, sizeof(bin), "%s/../tools/export_init", exe);
	if (access(bin, X_OK) != 0)
		cr_skip_test("no tools/export_init in this build");
	ng_test_dir_make("ng_export_init_");
	snprintf(out, sizeof(out), "%s/init.bin", ng_test_dir);
	snprintf(cmd, sizeof(cmd), "'%s' speedrun-tiny 7 '%s' --layers 12 --heads 1 --channels 128 "
		 "--vocab 300 >/dev/null", bin, out);
	cr_assert_eq(system(cmd), 0, "failed: %s", cmd);
	struct ng_gpt_config cfg;
	cr_assert_eq(ng_gpt_preset(&cfg, "speedrun-tiny"), NG_OK);
	cfg.L = 12, cfg.H = 1, cfg.C = 128, cfg.V = 300;
	cr_assert_eq(ng_gpt_check(&cfg), NG_OK);
	struct ng_gpt_layout lay;
	ng_gpt_layout(&cfg, &lay);
	float *want = malloc(lay.total * sizeof(float));
	cr_assert(want);
	ng_gpt_init(&cfg, &lay, 7, want);
	size_t n;
	char *got = read_text(out, &n);
	cr_expect_eq(n, lay.total * sizeof(float), "%zu bytes, the layout has %zu floats", n,
		     lay.total);
	cr_expect(n == lay.total * sizeof(float) && memcmp(got, want, n) == 0,
		  "the file is not ng_gpt_init's floats for L=12 H=1 C=128 V=300");
	free(got), free(want);
	const char *bad[] = { "--layers", "--layers x", "--width 64", "--heads 3" };
	for (int i = 0; i < 4; i++) {
		char err[PATH_MAX];
		snprintf(err, sizeof(err), "%s/err.txt", ng_test_dir);
		snprintf(cmd, sizeof(cmd), "'%s' speedrun-tiny 7 '%s' %s >/dev/null 2>'%s'", bin, out,
			 bad[i], err);
		int st = system(cmd);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 2, "'%s': exit status %d, not 2", bad[i],
			  WIFEXITED(st) ? WEXITSTATUS(st) : -1);
		char *msg = read_text(err, &n);
		cr_expect(n > 0 && strchr(msg, '\n') != NULL, "'%s': no error line", bad[i]);
		free(msg);
	}
}
