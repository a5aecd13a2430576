/*
 * tests/test_cli.c — the command-line contract of docs/DESIGN.md: bad usage is one line and exit 2,
 * --help and --version work, impossible models are refused with the reason, no GPU means exit 1
 * with a hint (train and eval), control bytes quoted in an error are escaped, and
 * `train --device cpu --model tiny` cuts the loss by >= 30% in 200 steps.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/check.h"
#include "src/commands.h"
#include "tests/cli_testing.h"

static void expect_input_error(enum ng_status st, const char *needle)
{
	cr_expect_eq(st, NG_ERR_INPUT, "status %d, message '%s'", st, ng_error_message());
	cr_expect(strstr(ng_error_message(), needle) != NULL, "message '%s' lacks '%s'",
		  ng_error_message(), needle);
	cr_expect(strchr(ng_error_message(), '\n') == NULL, "more than one line: '%s'",
		  ng_error_message());
}

Test(cli, version_and_help)
{
	cr_expect_eq(ng_test_cli_run("--version", NULL), NG_OK);
	cr_expect_eq(ng_test_cli_run("--help", NULL), NG_OK);
	const char *cmds[] = { "train", "plan", "dump", "prepare" };
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
		cr_expect_eq(ng_test_cli_run(cmds[i], "--help", NULL), NG_OK, "%s --help: %s", cmds[i],
			     ng_error_message());
}

Test(cli, bad_usage_is_exit_2)
{
	expect_input_error(ng_test_cli_run(NULL), "no command given");
	expect_input_error(ng_test_cli_run("fly", NULL), "unknown command");
	expect_input_error(ng_test_cli_run("train", "--stepz", "3", NULL), "unknown flag '--stepz'");
	expect_input_error(ng_test_cli_run("train", "--steps", NULL), "needs a value");
	expect_input_error(ng_test_cli_run("train", "--steps", "0", NULL), "out of range");
	expect_input_error(ng_test_cli_run("train", "--steps", "ten", NULL), "not a valid integer");
	expect_input_error(ng_test_cli_run("train", "--lr", "-1", NULL), "out of range");
	expect_input_error(ng_test_cli_run("train", "--model", "d13", NULL), "unknown model 'd13'");
	expect_input_error(ng_test_cli_run("train", "--device", "tpu", NULL), "not cuda or cpu");
	expect_input_error(ng_test_cli_run("train", "--schedule", "step", NULL), "not cosine or linear");
	expect_input_error(ng_test_cli_run("plan", "--batch", "0", NULL), "out of range");
	expect_input_error(ng_test_cli_run("train", "--device", "cpu", "--fp8", "--model", "tiny", "--steps",
			       "1", NULL), "no FP8 path");
	expect_input_error(ng_test_cli_run("train", "--fp8-dw", "--model", "tiny", NULL), "need --fp8");
	expect_input_error(ng_test_cli_run("plan", "--fp8-dw", NULL), "need --fp8");
	expect_input_error(ng_test_cli_run("train", "--recompute", "gelu,sometimes", NULL), "unknown item");
	expect_input_error(ng_test_cli_run("train", "--gpu-mem", "20", NULL), "only --recompute auto");
	expect_input_error(ng_test_cli_run("train", "--recompute", "gelu", "--gpu-mem", "20", NULL),
			   "only --recompute auto");
	expect_input_error(ng_test_cli_run("train", "--recompute", "auto", "--gpu-mem", "0", NULL),
			   "out of range");
	/* plan --recompute auto: a budget to fit, or the reason it cannot */
	if (ng_cuda_device_count() == 0)
		expect_input_error(ng_test_cli_run("plan", "--model", "d24", "--recompute", "auto", NULL),
				   "how much memory");
	expect_input_error(ng_test_cli_run("plan", "--model", "d24", "--batch", "32", "--recompute", "auto",
			       "--gpu-mem", "15", NULL), "with every recompute");
	cr_expect_eq(ng_test_cli_run("plan", "--model", "d24", "--batch", "32", "--recompute", "auto",
			 "--gpu-mem", "26", "--json", NULL), NG_OK, "%s", ng_error_message());
}

Test(cli, impossible_models_are_refused)
{
	expect_input_error(ng_test_cli_run("train", "--model", "tiny", "--channels", "65", NULL),
			   "not divisible by heads");
	expect_input_error(ng_test_cli_run("train", "--model", "tiny", "--heads", "4", "--channels", "72",
			       NULL), "head size 18");
	expect_input_error(ng_test_cli_run("train", "--model", "tiny", "--channels", "1024", "--heads", "2",
			       NULL), "head size 512");
	expect_input_error(ng_test_cli_run("train", "--model", "tiny", "--total-batch", "1000", NULL),
			   "not a multiple");
	expect_input_error(ng_test_cli_run("train", "--model", "tiny", "--vocab", "70000", NULL),
			   "out of range");
}

Test(cli, no_gpu_means_exit_1_with_a_hint)
{
	if (ng_cuda_device_count() > 0)
		cr_skip_test("a CUDA device is present");
	enum ng_status st = ng_test_cli_run("train", "--model", "tiny", "--steps", "1", NULL);
	cr_expect_eq(st, NG_ERR_RUNTIME);
	cr_expect(strstr(ng_error_message(), "no CUDA device") != NULL, "%s", ng_error_message());
	cr_expect(strstr(ng_error_hint(), "--device cpu") != NULL, "%s", ng_error_hint());
}

/* --model speedrun brings the reference run's validation cadence with --val: a target loss
 * needs no --val-every of its own (without a GPU the run then stops at the device). */
Test(cli, speedrun_preset_validates_every_125_steps)
{
	if (ng_cuda_device_count() > 0)
		cr_skip_test("a CUDA device is present");
	enum ng_status st = ng_test_cli_run("train", "--model", "speedrun", "--train", "x.bin",
					    "--val", "y.bin", "--target-val-loss", "3.28", NULL);
	cr_expect_eq(st, NG_ERR_RUNTIME, "%s", ng_error_message());
	cr_expect(strstr(ng_error_message(), "no CUDA device") != NULL, "%s", ng_error_message());
}

/* --device cpu with a model whose double-precision reference cannot fit the machine: one input
 * error with a hint, before any allocation (the speedrun model at batch 8 needs ~1.1 TB). */
Test(cli, cpu_reference_too_large_is_refused)
{
	enum ng_status st = ng_test_cli_run("train", "--model", "speedrun", "--device", "cpu",
					    "--batch", "8", "--steps", "1", NULL);
	cr_expect_eq(st, NG_ERR_INPUT, "%s", ng_error_message());
	cr_expect(strstr(ng_error_message(), "more than this machine's") != NULL, "%s",
		  ng_error_message());
	cr_expect(strstr(ng_error_hint(), "speedrun-tiny") != NULL, "%s", ng_error_hint());
}

/* eval on the default device without a GPU: the same line and hint as train (it used to end in
 * a raw cudaGetDevice error). */
Test(cli, eval_without_gpu_says_use_device_cpu)
{
	if (ng_cuda_device_count() > 0)
		cr_skip_test("a CUDA device is present");
	enum ng_status st = ng_test_cli_run("eval", "--ckpt", "/nonexistent.safetensors", "--val", "x", NULL);
	cr_expect_eq(st, NG_ERR_RUNTIME);
	cr_expect(strstr(ng_error_message(), "no CUDA device found") != NULL, "%s",
		  ng_error_message());
	cr_expect(strstr(ng_error_hint(), "--device cpu") != NULL, "%s", ng_error_hint());
}

/* A flag value quoted in an error keeps its control bytes out of the terminal: \xNN, one line. */
Test(cli, control_bytes_in_errors_are_escaped)
{
	enum ng_status st = ng_test_cli_run("train", "--schedule", "\x1b[2J\x1b]0;x\x07\ncosine", NULL);
	expect_input_error(st, "'\\x1b[2J\\x1b]0;x\\x07\\x0acosine' is not cosine or linear");
	for (const char *p = ng_error_message(); *p; p++)
		cr_expect((unsigned char)*p >= 0x20 && *p != 0x7f, "raw byte 0x%02x",
			  (unsigned char)*p);
	st = ng_test_cli_run("\xe2\x80\xae\xc3\xa9t\xc2\x9b\xff", NULL); /* valid UTF-8 kept, C1 and junk not */
	cr_expect(strstr(ng_error_message(), "'\xe2\x80\xae\xc3\xa9t\\xc2\\x9b\\xff'") != NULL,
		  "%s", ng_error_message());
}

Test(cli, cpu_tiny_cuts_the_loss_by_30_percent, .timeout = 600)
{
	char path[] = "/tmp/ng_cli_metricsXXXXXX";
	int fd = mkstemp(path);
	cr_assert(fd >= 0);
	close(fd);
	enum ng_status st = ng_test_cli_run("train", "--device", "cpu", "--model", "tiny", "--steps", "200",
				"--metrics", path, NULL);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	FILE *f = fopen(path, "r");
	cr_assert(f);
	char line[512];
	double first = -1, last = -1;
	int n = 0;
	while (fgets(line, sizeof(line), f)) {
		double loss;
		char *p = strstr(line, "\"loss\":");
		if (!p || sscanf(p + 7, "%lf", &loss) != 1)
			continue;
		if (first < 0)
			first = loss;
		last = loss;
		n++;
	}
	fclose(f);
	unlink(path);
	cr_expect_eq(n, 200, "%d step lines in the metrics file", n);
	cr_expect(last <= 0.7 * first, "loss %.4f -> %.4f: cut by only %.1f%%", first, last,
		  100 * (1 - last / first));
}

/* A step's time in the metrics leaves out the validation before it: with validations far
 * longer than a step (40 batches against one forward and backward), the step after one is no
 * slower than the others by more than timing noise. */
Test(cli, step_times_leave_validation_out, .timeout = 300)
{
	char path[] = "/tmp/ng_cli_valmsXXXXXX";
	int fd = mkstemp(path);
	cr_assert(fd >= 0);
	close(fd);
	enum ng_status st = ng_test_cli_run("train", "--device", "cpu", "--model", "tiny", "--steps",
					    "6", "--val-every", "3", "--val-batches", "40",
					    "--metrics", path, NULL);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	FILE *f = fopen(path, "r");
	cr_assert(f);
	char line[512];
	double ms[7] = { 0 };
	int step;
	while (fgets(line, sizeof(line), f)) {
		char *p = strstr(line, "\"ms\":");
		if (p && sscanf(line, "{\"step\":%d", &step) == 1 && step >= 1 && step <= 6)
			ms[step] = strtod(p + 5, NULL);
	}
	fclose(f);
	unlink(path);
	double others = 0;
	for (int i = 2; i <= 6; i++) {
		cr_assert(ms[i] > 0, "no time for step %d", i);
		if (i != 4 && ms[i] > others)
			others = ms[i];
	}
	cr_expect(ms[4] < 4 * others, "step 4 (after the validation) took %.1f ms, the others at "
		  "most %.1f ms", ms[4], others);
}

/* --target-val-loss stops after the first validation at or below it (steps, not time, are
 * checked here), and needs a validation to compare with. */
Test(cli, target_val_loss_stops_the_run, .timeout = 300)
{
	char path[] = "/tmp/ng_cli_targetXXXXXX", out[] = "/tmp/ng_cli_target_outXXXXXX";
	int fd = mkstemp(path);
	cr_assert(fd >= 0 && mkdtemp(out));
	close(fd);
	enum ng_status st = ng_test_cli_run("train", "--device", "cpu", "--model", "tiny", "--steps",
					    "60", "--val-every", "5", "--val-batches", "2",
					    "--target-val-loss", "5.5", "--metrics", path, "--out",
					    out, NULL);
	cr_assert_eq(st, NG_OK, "%s", ng_error_message());
	FILE *f = fopen(path, "r");
	cr_assert(f);
	char line[512];
	int steps = 0, vals = 0;
	double last_val = -1;
	while (fgets(line, sizeof(line), f)) {
		char *p = strstr(line, "\"val_loss\":");
		if (p && sscanf(p + 11, "%lf", &last_val) == 1)
			vals++;
		else if (strstr(line, "\"loss\":"))
			steps++;
	}
	fclose(f);
	unlink(path);
	cr_expect(steps < 60 && steps % 5 == 0, "%d steps ran", steps);
	cr_expect(last_val >= 0 && last_val <= 5.5, "last validation %.4f", last_val);
	cr_expect_eq(vals, steps / 5, "%d validations after %d steps", vals, steps);
	expect_input_error(ng_test_cli_run("train", "--device", "cpu", "--model", "tiny",
					   "--target-val-loss", "3", NULL), "no validation");
	rmdir(out); /* empty: no checkpoint was asked for */
}
