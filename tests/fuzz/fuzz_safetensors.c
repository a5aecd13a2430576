/*
 * tests/fuzz/fuzz_safetensors.c — libFuzzer harness of the safetensors reader
 * (src/checkpoint_read.c): any bytes as a model file (ng_ckpt_read_model) and as a training-state
 * file (ng_ckpt_read_state). Built with FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION, under which a
 * well-formed checksum counts as matching, so the fuzzer reaches the checks behind it. What is
 * checked: no crash, leak, overflow or out-of-bounds read; an accepted model has a valid
 * configuration and finite-sized parameters that can be written back; an accepted state keeps
 * the invariants the reader promises (0 <= n_skipped <= step).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "src/checkpoint.h"
#include "tests/fuzz/fuzz_input.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *path = fuzz_input_path(data, size);
	struct ng_gpt_config cfg;
	float *params = NULL;
	ng_clear_error();
	if (ng_ckpt_read_model(path, &cfg, &params) == NG_OK) {
		struct ng_gpt_config c = cfg;
		if (!params || ng_gpt_check(&c) != NG_OK || c.Vp != cfg.Vp)
			abort();
		struct ng_gpt_layout lay;
		ng_gpt_layout(&cfg, &lay);
		volatile float x = params[lay.total - 1]; /* the whole buffer is there */
		(void)x;
	} else if (params) {
		abort(); /* a refused file hands back nothing */
	}
	free(params);
	struct ng_train_state s;
	ng_clear_error();
	if (ng_ckpt_read_state(path, &s) == NG_OK) {
		if (s.step < 0 || s.n_skipped < 0 || s.n_skipped > s.step || !s.params || !s.m ||
		    !s.v || (s.elem_size != 4 && s.elem_size != 8) || s.B < 1 || s.K < 1 ||
		    s.T < 1 || s.T > s.cfg.T || (s.n_fp8 && !s.fp8))
			abort();
		ng_ckpt_state_free(&s);
	} else if (s.params || s.fp8) {
		abort();
	}
	return 0;
}
