/*
 * tests/test_train_faults.c — `nanograph train` and `eval` on the CPU reference (a tiny model)
 * against the faults a user meets, driven in-process through ng_main: every error path
 * releases what it started (no prefetch thread outlives a failed --init or --resume), a FIFO
 * given as a shard or a model is an error and not a hang, a failed metrics write fails the run
 * after keeping its steps, an unusable --out is found before step 1, --resume refuses a changed
 * --no-shuffle, a bad token in a later shard fails with its offset after checkpointing the
 * steps before it (and the run resumes once the shard is fixed), SIGTERM writes a checkpoint
 * and exits 0 (in a child process), eval without a GPU says to use --device cpu.
 */
#define _XOPEN_SOURCE 700
#define _DEFAULT_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "data/shard.h"
#include "graph/gpt.h"
#include "kernels/check.h"
#include "src/checkpoint.h"
#include "src/commands.h"
#include "tests/cli_testing.h"
#include "tests/test_tmpdir.h"
#include "util/rng.h"

static void setup(void) { ng_test_dir_make("ng_faults_test_"); }

TestSuite(train_faults, .init = setup);

/* The tiny model's flags: `train` + these + the rest. */
#define TINY "train", "--device", "cpu", "--model", "tiny", "--batch", "2", "--seq-len", "32"

static void path_in(char *out, size_t n, const char *name)
{
	snprintf(out, n, "%s/%s", ng_test_dir, name);
}

/* A shard of n random tokens below the tiny model's vocabulary (512); bad_at > 0: token 600
 * there. */
static void make_shard(const char *path, size_t n, size_t bad_at, uint64_t seed)
{
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	uint16_t *t = malloc(n * sizeof(uint16_t));
	for (size_t i = 0; i < n; i++)
		t[i] = (uint16_t)ng_rng_below(&r, 512);
	if (bad_at)
		t[bad_at] = 600;
	cr_assert_eq(ng_shard_write(path, t, n), NG_OK, "%s", ng_error_message());
	free(t);
}

/* Prefetch threads of this process: threads named "ng-prefetch" (data/loader.c names them) in
 * /proc/self/task (OpenMP's pool of the CPU reference stays, and is not counted). A joined
 * thread can stay listed for a moment while the kernel finishes its exit; one that outlived
 * its loader waits on its condition variable for ever: so wait up to 2 s for the count to drop
 * to `want`. */
static int threads_(void);

static int threads_settled(int want)
{
	int n = threads_();
	for (int i = 0; i < 200 && n > want; i++) {
		usleep(10000);
		n = threads_();
	}
	return n;
}

static int threads_(void)
{
	DIR *d = opendir("/proc/self/task");
	cr_assert(d);
	int n = 0;
	for (struct dirent *e; (e = readdir(d));) {
		if (e->d_name[0] == '.')
			continue;
		char p[300], name[32] = "";
		snprintf(p, sizeof(p), "/proc/self/task/%s/comm", e->d_name);
		FILE *f = fopen(p, "r");
		if (f && fgets(name, sizeof(name), f))
			n += strncmp(name, "ng-prefetch", 11) == 0;
		if (f)
			fclose(f);
	}
	closedir(d);
	return n;
}

static void expect_error(enum ng_status st, enum ng_status want, const char *needle,
			 const char *what)
{
	cr_assert_eq(st, want, "%s: status %d, message '%s'", what, st, ng_error_message());
	cr_assert(strstr(ng_error_message(), needle), "%s: message '%s' lacks '%s'", what,
		  ng_error_message(), needle);
	cr_assert_null(strchr(ng_error_message(), '\n'), "%s: more than one line", what);
}

static long long latest_step(const char *dir)
{
	long long step = -1;
	cr_assert_eq(ng_ckpt_latest(dir, &step), NG_OK, "%s", ng_error_message());
	return step;
}

/* Step lines ("loss", not "val_loss") of a metrics file (0 when it does not exist). */
static int count_lines(const char *path)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	int n = 0;
	char line[1024];
	while (fgets(line, sizeof(line), f))
		n += strstr(line, "{\"step\":") && strstr(line, "\"loss\"") != NULL;
	fclose(f);
	return n;
}

/* A failed --init, --resume or --val after the training loader has started its prefetch thread:
 * the error line, and the thread gone (it used to outlive the frame holding its state and
 * abort in pthread_mutex_lock). Repeated, so a use after return would show. */
Test(train_faults, failed_start_releases_the_loader)
{
	char shard[300], bad[300], out[300], missing[300], state[400];
	path_in(shard, sizeof(shard), "train.bin");
	path_in(bad, sizeof(bad), "bad.safetensors");
	path_in(out, sizeof(out), "out");
	path_in(missing, sizeof(missing), "missing_*.bin");
	make_shard(shard, 5000, 0, 1);
	FILE *f = fopen(bad, "wb");
	cr_assert(f);
	fputs("certainly not safetensors", f);
	fclose(f);
	int before = threads_();
	cr_assert_eq(before, 0);
	for (int i = 0; i < 20; i++) {
		enum ng_status st = ng_test_cli_run(TINY, "--steps", "2", "--train", shard, "--init", bad, "--out",
					out, NULL);
		expect_error(st, NG_ERR_INPUT, bad, "--init of a bad file");
		cr_assert_eq(threads_settled(before), before, "a thread outlived the failed --init");
	}
	/* --resume whose state file does not load */
	mkdir(out, 0755);
	char latest[400];
	snprintf(latest, sizeof(latest), "%s/latest", out);
	f = fopen(latest, "w");
	fputs("1\n", f);
	fclose(f);
	ng_ckpt_path(state, sizeof(state), out, "state", 1);
	f = fopen(state, "wb");
	fputs("garbage garbage", f);
	fclose(f);
	for (int i = 0; i < 5; i++) {
		enum ng_status st = ng_test_cli_run(TINY, "--steps", "2", "--train", shard, "--resume", "--out",
					out, NULL);
		expect_error(st, NG_ERR_INPUT, state, "--resume of a bad state");
		cr_assert_eq(threads_settled(before), before, "a thread outlived the failed --resume");
	}
	/* --val that matches nothing, after --train opened */
	enum ng_status st = ng_test_cli_run(TINY, "--steps", "2", "--train", shard, "--val", missing, NULL);
	expect_error(st, NG_ERR_INPUT, missing, "--val of no files");
	cr_assert_eq(threads_settled(before), before, "a thread outlived the failed --val");
}

/* A FIFO as a shard (train --train, eval --val) or as a model (--init, eval --ckpt) is one error
 * line at once; before, open() waited for a writer forever. */
Test(train_faults, fifo_is_an_error_not_a_hang, .timeout = 60)
{
	char fifo[300], model[300];
	path_in(fifo, sizeof(fifo), "fifo.bin");
	path_in(model, sizeof(model), "model.safetensors");
	cr_assert_eq(mkfifo(fifo, 0644), 0);
	struct ng_gpt_config cfg;
	cr_assert_eq(ng_gpt_preset(&cfg, "tiny"), NG_OK);
	cr_assert_eq(ng_gpt_check(&cfg), NG_OK);
	struct ng_gpt_layout lay;
	ng_gpt_layout(&cfg, &lay);
	float *p = calloc(lay.total, sizeof(float));
	ng_gpt_init(&cfg, &lay, 1, p);
	cr_assert_eq(ng_ckpt_write_model(model, &cfg, p), NG_OK, "%s", ng_error_message());
	free(p);
	expect_error(ng_test_cli_run(TINY, "--steps", "1", "--train", fifo, NULL), NG_ERR_INPUT, "a FIFO",
		     "train --train FIFO");
	expect_error(ng_test_cli_run("eval", "--device", "cpu", "--ckpt", model, "--val", fifo, NULL),
		     NG_ERR_INPUT, "a FIFO", "eval --val FIFO");
	expect_error(ng_test_cli_run(TINY, "--steps", "1", "--init", fifo, NULL), NG_ERR_INPUT, "a FIFO",
		     "train --init FIFO");
	expect_error(ng_test_cli_run("eval", "--device", "cpu", "--ckpt", fifo, "--val", fifo, NULL),
		     NG_ERR_INPUT, "a FIFO", "eval --ckpt FIFO");
}

/* --metrics on a full device: the first failed flush fails the run with exit 1 and one line
 * (it used to end with exit 0 and an empty file), after a checkpoint keeps the steps done. */
Test(train_faults, metrics_write_failure_fails_the_run, .timeout = 120)
{
	char out[300];
	path_in(out, sizeof(out), "out");
	enum ng_status st = ng_test_cli_run(TINY, "--steps", "5", "--metrics", "/dev/full", "--out", out, NULL);
	expect_error(st, NG_ERR_RUNTIME, "--metrics /dev/full", "metrics on /dev/full");
	cr_assert(strstr(ng_error_message(), strerror(ENOSPC)), "%s", ng_error_message());
	cr_assert_eq(latest_step(out), 1, "the step done before the failure was not kept");
	/* it continues from there once the metrics can be written; a line an earlier run left
	 * half written is cut off first, so the file stays whole lines */
	char metrics[300];
	path_in(metrics, sizeof(metrics), "m.jsonl");
	FILE *f = fopen(metrics, "w");
	fputs("{\"step\":1,\"loss\":6.2}\n{\"step\":2,\"lo", f);
	fclose(f);
	st = ng_test_cli_run(TINY, "--steps", "3", "--metrics", metrics, "--out", out, "--resume", NULL);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	cr_assert_eq(count_lines(metrics), 3);
	f = fopen(metrics, "r");
	char line[1024];
	while (fgets(line, sizeof(line), f))
		cr_assert(line[0] == '{' && strchr(line, '\n') && strstr(line, "}\n"),
			  "not a whole line: '%s'", line);
	fclose(f);
	/* a FIFO nobody reads: an error at once, not a wait for a reader */
	char fifo[300];
	path_in(fifo, sizeof(fifo), "m.fifo");
	cr_assert_eq(mkfifo(fifo, 0644), 0);
	expect_error(ng_test_cli_run(TINY, "--steps", "3", "--metrics", fifo, NULL), NG_ERR_INPUT, fifo,
		     "--metrics FIFO without a reader");
}

/* An --out that cannot take a checkpoint fails before step 1 (no step runs, so no metrics line
 * is written), not at the first checkpoint after the steps before it were computed. */
Test(train_faults, unusable_out_is_found_before_step_1)
{
	char metrics[300], afile[300];
	path_in(metrics, sizeof(metrics), "m.jsonl");
	path_in(afile, sizeof(afile), "afile");
	enum ng_status st = ng_test_cli_run(TINY, "--steps", "30", "--ckpt-every", "25", "--out",
				"/nonexistent/dir", "--metrics", metrics, NULL);
	expect_error(st, NG_ERR_INPUT, "/nonexistent/dir", "--out in a missing directory");
	cr_assert_neq(access(metrics, F_OK), 0, "a step ran before the --out check");
	FILE *f = fopen(afile, "w");
	fclose(f);
	st = ng_test_cli_run(TINY, "--steps", "30", "--stop-after", "20", "--out", afile, "--metrics", metrics,
		 NULL);
	expect_error(st, NG_ERR_INPUT, "not a directory", "--out naming a file");
	cr_assert_neq(access(metrics, F_OK), 0, "a step ran before the --out check");
	if (geteuid() != 0) { /* root writes anywhere */
		char ro[300];
		path_in(ro, sizeof(ro), "ro");
		mkdir(ro, 0555);
		st = ng_test_cli_run(TINY, "--steps", "30", "--ckpt-every", "25", "--out", ro, NULL);
		expect_error(st, NG_ERR_INPUT, "cannot write", "read-only --out");
	}
}

/* --resume refuses a --no-shuffle that differs from the run that wrote the checkpoint (the
 * window order depends on it), like the other data flags. */
Test(train_faults, resume_refuses_a_changed_no_shuffle)
{
	char shard[300], a[300], b[300];
	path_in(shard, sizeof(shard), "train.bin");
	path_in(a, sizeof(a), "a");
	path_in(b, sizeof(b), "b");
	make_shard(shard, 5000, 0, 2);
	cr_assert_eq(ng_test_cli_run(TINY, "--steps", "4", "--stop-after", "2", "--train", shard,
			 "--no-shuffle", "--out", a, NULL), NG_OK, "%s", ng_error_message());
	expect_error(ng_test_cli_run(TINY, "--steps", "4", "--train", shard, "--out", a, "--resume", NULL),
		     NG_ERR_INPUT, "--no-shuffle", "resume dropping --no-shuffle");
	cr_assert_eq(ng_test_cli_run(TINY, "--steps", "4", "--train", shard, "--no-shuffle", "--out", a,
			 "--resume", NULL), NG_OK, "%s", ng_error_message());
	cr_assert_eq(ng_test_cli_run(TINY, "--steps", "4", "--stop-after", "2", "--train", shard, "--out", b,
			 NULL), NG_OK, "%s", ng_error_message());
	expect_error(ng_test_cli_run(TINY, "--steps", "4", "--train", shard, "--no-shuffle", "--out", b,
			 "--resume", NULL), NG_ERR_INPUT, "--no-shuffle", "resume adding --no-shuffle");
}

/* A token >= the vocabulary in the second shard (checked when the loader first maps it): the
 * run fails naming the shard and the byte offset, after checkpointing the steps done on the
 * first shard; once the shard is fixed, --resume continues from there to the end. */
Test(train_faults, bad_token_in_a_later_shard)
{
	char s0[300], s1[300], pattern[300], out[300];
	path_in(s0, sizeof(s0), "train_000000.bin");
	path_in(s1, sizeof(s1), "train_000001.bin");
	path_in(pattern, sizeof(pattern), "train_*.bin");
	path_in(out, sizeof(out), "out");
	/* 321 tokens: 10 windows of T+1 = 33, 5 batches of B = 2, in file order (--no-shuffle) */
	make_shard(s0, 321, 0, 3);
	make_shard(s1, 321, 100, 4);
	enum ng_status st = ng_test_cli_run(TINY, "--steps", "8", "--train", pattern, "--no-shuffle", "--out",
				out, NULL);
	expect_error(st, NG_ERR_INPUT, s1, "bad token in the second shard");
	cr_assert(strstr(ng_error_message(), "byte offset 1224"), "%s", ng_error_message());
	cr_assert_eq(latest_step(out), 5, "the 5 steps on the first shard were not kept");
	make_shard(s1, 321, 0, 4); /* fixed: same length, the same windows */
	st = ng_test_cli_run(TINY, "--steps", "8", "--train", pattern, "--no-shuffle", "--out", out, "--resume",
		 "--ckpt-every", "8", NULL);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	cr_assert_eq(latest_step(out), 8);
}

/* SIGTERM in the middle of a run (a child process): a checkpoint of the steps done, exit 0, and
 * --resume goes on from it. */
Test(train_faults, sigterm_checkpoints_and_exits_cleanly, .timeout = 120)
{
	char out[300], metrics[300];
	path_in(out, sizeof(out), "out");
	path_in(metrics, sizeof(metrics), "m.jsonl");
	pid_t child = fork();
	cr_assert(child >= 0);
	if (child == 0) {
		int fd = open("/dev/null", O_WRONLY);
		dup2(fd, 2); /* the step lines */
		_exit((int)ng_test_cli_run(TINY, "--steps", "100000", "--metrics", metrics, "--out", out, NULL));
	}
	time_t t0 = time(NULL);
	while (count_lines(metrics) < 3 && time(NULL) - t0 < 90)
		usleep(20000);
	cr_assert_geq(count_lines(metrics), 3, "the run made no progress");
	kill(child, SIGTERM);
	int status;
	waitpid(child, &status, 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "wait status %d", status);
	long long step = latest_step(out);
	cr_assert_geq(step, 3);
	cr_assert_eq(count_lines(metrics), step, "%d metrics lines, checkpoint at %lld",
		     count_lines(metrics), step);
	char sp[400];
	ng_ckpt_path(sp, sizeof(sp), out, "state", step);
	struct ng_train_state s;
	cr_assert_eq(ng_ckpt_read_state(sp, &s), NG_OK, "%s", ng_error_message());
	cr_assert_eq(s.step, step);
	ng_ckpt_state_free(&s);
	char steps[32];
	snprintf(steps, sizeof(steps), "%lld", step + 2);
	cr_assert_eq(ng_test_cli_run(TINY, "--steps", steps, "--metrics", metrics, "--out", out, "--resume",
			 "--ckpt-every", "1", NULL), NG_OK, "%s", ng_error_message());
	cr_assert_eq(latest_step(out), step + 2);
}
