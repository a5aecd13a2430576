/*
 * tests/test_resume_gpu.c — `train --resume` on the GPU is bit-exact for the speedrun model: a
 * run of 6 steps and one stopped after 3 (--stop-after, which checkpoints) then resumed give
 * the same loss at every step (the metrics' text) and the same final state file (parameters,
 * Muon's momentum and Adam's moments, the FP8 head's scales and their history, the step, the
 * data position): every tensor byte and header field but the wall-clock training time
 * (tests/ckpt_testing.h same_state_but_time). speedrun-tiny, one sequence of 512 tokens on
 * the built-in synthetic corpus, the speedrun's defaults (Muon, the FP8 head where the GPU has FP8, the window growing
 * from 1 to 14 blocks over the 6 steps), --deterministic (the attention backward's).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/check.h"
#include "src/checkpoint.h"
#include "tests/ckpt_testing.h"
#include "tests/test_tmpdir.h"

static enum ng_status train(const char *out, const char *metrics, const char *extra1,
			    const char *extra2)
{
	char *argv[] = { "train", "--model", "speedrun-tiny", "--steps", "6", "--deterministic",
			 "--seed", "7", "--val-batches", "0", "--ckpt-every", "3", "--out",
			 (char *)out, "--metrics", (char *)metrics };
	return train_with(argv, (int)(sizeof(argv) / sizeof(argv[0])), extra1, extra2);
}

Test(resume_gpu, speedrun_resume_is_bit_identical)
{
	if (ng_cuda_device_count() == 0)
		cr_skip_test("no CUDA device");
	ng_test_dir_make("ng_resume_gpu_");
	char a[512], b[512], ma[512], mb[512];
	snprintf(a, sizeof(a), "%s/a", ng_test_dir);
	snprintf(b, sizeof(b), "%s/b", ng_test_dir);
	snprintf(ma, sizeof(ma), "%s/a.jsonl", ng_test_dir);
	snprintf(mb, sizeof(mb), "%s/b.jsonl", ng_test_dir);
	cr_assert_eq(train(a, ma, NULL, NULL), NG_OK, "%s", ng_error_message());
	cr_assert_eq(train(b, mb, "--stop-after", "3"), NG_OK, "%s", ng_error_message());
	cr_assert_eq(train(b, mb, "--resume", NULL), NG_OK, "%s", ng_error_message());
	char la[8][32], lb[8][32];
	int na = losses(ma, la, 8), nb = losses(mb, lb, 8);
	cr_assert_eq(na, 6, "the straight run logged %d steps", na);
	cr_assert_eq(nb, 6, "stopped + resumed logged %d steps", nb);
	for (int i = 0; i < 6; i++)
		cr_expect_str_eq(la[i], lb[i], "step %d: loss %s straight, %s resumed", i + 1, la[i],
				 lb[i]);
	char pa[600], pb[600];
	ng_ckpt_path(pa, sizeof(pa), a, "state", 6);
	ng_ckpt_path(pb, sizeof(pb), b, "state", 6);
	cr_expect(same_state_but_time(pa, pb), "the final state files differ");
	fprintf(stderr, "speedrun resume: losses %s .. %s equal, states equal\n", la[0], la[5]);
}
