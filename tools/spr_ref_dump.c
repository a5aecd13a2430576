/*
 * tools/spr_ref_dump.c — one forward + backward of the speedrun model's CPU reference
 * (graph/cpu_spr.h), written to a file for tools/peer/speedrun_peer.py --check to compare with
 * its PyTorch model: the parameters used, the tokens, the summed loss, every gradient, and a
 * table of FP8 roundings.
 *
 * The parameters are the seeded init (ng_gpt_init) with the zero-initialised tensors (attprojw,
 * fcprojw, headw) and the scalars randomised from the same seed (ng_cpu_spr_randomize), so every
 * gradient carries signal. The tokens are random in [0, V - 1) with documents starting (token bos = V - 1) at
 * t = T/8 and 7T/8 of sequence 0 and T/5 of every other sequence, so the longest documents
 * (3T/4 and 4T/5 tokens) outlast a window of 128 tokens when T > 170.
 *
 * Usage: spr_ref_dump MODEL SEED B T WINDOW HEAD_FP8 OUT [LAYERS]
 * (LAYERS: another even L >= 6 in place of the preset's, e.g. 8, whose block 3 has attention
 * but no value embedding.)
 *
 * File (little-endian): "NGSPRREF", int32 [16] = { 1 (version), L, H, C, Tctx, V, Vp, B, T,
 * window, head_fp8, bos, n8, 0, 0, 0 }, int64 total, float64 params[total], int32 inputs[B T],
 * int32 targets[B T], float64 loss_sum, float64 grads[total] (of the summed loss), float64
 * x[n8], e4m3(x)[n8], e5m2(x)[n8].
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/cpu_spr.h"
#include "graph/cpu_spr_ops.h"
#include "graph/gpt.h"
#include "util/rng.h"

#define N_FP8 4096 /* FP8 rounding samples */

/* FP8 samples: every scale from below the subnormals to beyond the largest finite value of
 * either format, both signs, plus exact midpoints of E4M3 (ties). */
static void fp8_samples(double *x, int n, struct ng_rng *r)
{
	for (int i = 0; i < n; i++) {
		double mag = ldexp(1.0 + ng_rng_uniform(r), (int)ng_rng_below(r, 40) - 22);
		if (i % 4 == 3) { /* an E4M3 tie: 17, 19, .. 31 (odd, between multiples of 2) */
			int e = (int)ng_rng_below(r, 14) - 11;
			mag = ldexp((double)(2 * ng_rng_below(r, 8) + 17), e);
		}
		x[i] = i % 2 ? -mag : mag;
	}
}

static int write_all(FILE *f, const void *p, size_t size, size_t n)
{
	return fwrite(p, size, n, f) == n;
}

int main(int argc, char **argv)
{
	if (argc != 8 && argc != 9) {
		fprintf(stderr, "usage: spr_ref_dump speedrun|speedrun-tiny SEED B T WINDOW "
			"HEAD_FP8 OUT [LAYERS]\n");
		return 2;
	}
	struct ng_gpt_config cfg;
	if (ng_gpt_preset(&cfg, argv[1]) != NG_OK) {
		ng_print_error();
		return 2;
	}
	if (argc == 9)
		cfg.L = atoi(argv[8]);
	uint64_t seed = strtoull(argv[2], NULL, 10);
	int B = atoi(argv[3]), T = atoi(argv[4]), window = atoi(argv[5]), fp8 = atoi(argv[6]);
	struct ng_cpu_spr_model m;
	if (ng_cpu_spr_init(&m, &cfg, B, T, seed) != NG_OK) {
		ng_print_error();
		return 2;
	}
	m.head_fp8 = fp8 != 0;
	ng_cpu_spr_randomize(&m, ng_rng_mix64(seed));
	struct ng_rng r;
	ng_rng_seed(&r, ng_rng_mix64(seed ^ 0x5350524455ull));
	size_t N = (size_t)B * T;
	int32_t *tok = malloc(2 * N * sizeof(int32_t));
	double *x8 = malloc(3 * N_FP8 * sizeof(double));
	if (!tok || !x8)
		return 1;
	int32_t *inp = tok, *tgt = tok + N;
	for (size_t i = 0; i < 2 * N; i++)
		tok[i] = (int32_t)ng_rng_below(&r, (uint64_t)cfg.V - 1);
	inp[T / 8] = inp[7 * T / 8] = m.bos;
	for (int b = 1; b < B; b++)
		inp[(size_t)b * T + T / 5] = m.bos;
	double loss = 0.0;
	if (ng_cpu_spr_forward(&m, inp, tgt, window, &loss) != NG_OK ||
	    ng_cpu_spr_backward(&m, 1.0) != NG_OK) {
		ng_print_error();
		return 2;
	}
	fp8_samples(x8, N_FP8, &r);
	for (int i = 0; i < N_FP8; i++) {
		x8[N_FP8 + i] = ng_ref_round_e4m3(x8[i]);
		x8[2 * N_FP8 + i] = ng_ref_round_e5m2(x8[i]);
	}
	int32_t hdr[16] = { 1, cfg.L, cfg.H, cfg.C, cfg.T, cfg.V, cfg.Vp, B, T, window, m.head_fp8,
			    m.bos, N_FP8, 0, 0, 0 };
	int64_t total = (int64_t)m.lay.total;
	FILE *f = fopen(argv[7], "wb");
	int ok = f && write_all(f, "NGSPRREF", 1, 8) && write_all(f, hdr, sizeof(hdr[0]), 16) &&
		 write_all(f, &total, sizeof(total), 1) &&
		 write_all(f, m.params, sizeof(double), m.lay.total) &&
		 write_all(f, tok, sizeof(int32_t), 2 * N) &&
		 write_all(f, &loss, sizeof(loss), 1) &&
		 write_all(f, m.grads, sizeof(double), m.lay.total) &&
		 write_all(f, x8, sizeof(double), 3 * N_FP8);
	if (f && fclose(f) != 0)
		ok = 0;
	if (!ok) {
		fprintf(stderr, "spr_ref_dump: cannot write %s\n", argv[7]);
		return 1;
	}
	printf("spr_ref_dump: %s seed %llu B %d T %d window %d fp8 %d: loss %.17g -> %s\n",
	       argv[1], (unsigned long long)seed, B, T, window, m.head_fp8, loss, argv[7]);
	free(tok);
	free(x8);
	ng_cpu_spr_free(&m);
	return 0;
}
