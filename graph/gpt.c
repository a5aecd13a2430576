/*
 * graph/gpt.c — presets, checks, the flat parameter layout and the seeded init (see gpt.h).
 */
#include "graph/gpt.h"

#include <math.h>
#include <string.h>

#include "util/rng.h"

enum ng_status ng_gpt_preset(struct ng_gpt_config *cfg, const char *name)
{
	static const struct {
		const char *name;
		struct ng_gpt_config c;
	} presets[] = {
		{ "tiny", { 2, 2, 64, 64, 512, 0, NG_ARCH_GPT2 } },
		{ "d12", { 12, 12, 768, 1024, 50257, 0, NG_ARCH_GPT2 } },
		{ "d24", { 24, 16, 1024, 1024, 50257, 0, NG_ARCH_GPT2 } },
		{ "d36", { 36, 20, 1280, 1024, 50257, 0, NG_ARCH_GPT2 } },
		{ "d48", { 48, 25, 1600, 1024, 50257, 0, NG_ARCH_GPT2 } },
		{ "speedrun", { 12, 6, 768, 49152, 50257, 0, NG_ARCH_SPEEDRUN } },
		{ "speedrun-tiny", { 6, 2, 64, 512, 512, 0, NG_ARCH_SPEEDRUN } },
	};
	for (size_t i = 0; i < sizeof(presets) / sizeof(presets[0]); i++) {
		if (strcmp(name, presets[i].name) == 0) {
			*cfg = presets[i].c;
			cfg->Vp = (cfg->V + 127) / 128 * 128;
			return NG_OK;
		}
	}
	ng_fail(NG_ERR_INPUT, "unknown model '%s'", name);
	ng_hint("use --model tiny|d12|d24|d36|d48|speedrun|speedrun-tiny, or --layers --heads "
		"--channels --seq-len --vocab");
	return NG_ERR_INPUT;
}

enum ng_status ng_gpt_check(struct ng_gpt_config *cfg)
{
	if (cfg->L < 1 || cfg->L > 1024)
		return ng_fail(NG_ERR_INPUT, "--layers %d is out of range (1..1024)", cfg->L);
	if (cfg->H < 1 || cfg->H > 1024)
		return ng_fail(NG_ERR_INPUT, "--heads %d is out of range (1..1024)", cfg->H);
	if (cfg->C < 8 || cfg->C > 65536)
		return ng_fail(NG_ERR_INPUT, "--channels %d is out of range (8..65536)", cfg->C);
	if (cfg->T < 1 || cfg->T > 131072)
		return ng_fail(NG_ERR_INPUT, "--seq-len %d is out of range (1..131072)", cfg->T);
	if (cfg->V < 2 || cfg->V > 65536) {
		ng_fail(NG_ERR_INPUT, "--vocab %d is out of range (2..65536)", cfg->V);
		ng_hint("token shards store uint16 tokens, so the vocabulary is at most 65536");
		return NG_ERR_INPUT;
	}
	if (cfg->C % cfg->H != 0) {
		ng_fail(NG_ERR_INPUT, "channels %d is not divisible by heads %d", cfg->C, cfg->H);
		ng_hint("choose --channels as heads x head size, e.g. %d", cfg->H * 64);
		return NG_ERR_INPUT;
	}
	int D = cfg->C / cfg->H;
	if (D % 8 != 0 || D > 256) {
		ng_fail(NG_ERR_INPUT, "head size %d (channels %d / heads %d) must be a multiple of 8 "
			"and at most 256", D, cfg->C, cfg->H);
		ng_hint("flash attention reads heads in 16-byte vectors; try head size 64");
		return NG_ERR_INPUT;
	}
	if (cfg->arch != NG_ARCH_GPT2 && cfg->arch != NG_ARCH_SPEEDRUN)
		return ng_fail(NG_ERR_INPUT, "unknown model family %d", cfg->arch);
	if (cfg->arch == NG_ARCH_SPEEDRUN && (cfg->L < 6 || cfg->L % 2 != 0)) {
		ng_fail(NG_ERR_INPUT, "the speedrun model needs an even number of layers, at least 6 "
			"(--layers %d)", cfg->L);
		ng_hint("its value embeddings use the first and last three blocks and its U-net pairs "
			"the two halves; try --layers 12");
		return NG_ERR_INPUT;
	}
	if (cfg->arch == NG_ARCH_SPEEDRUN && D % 4 != 0) {
		ng_fail(NG_ERR_INPUT, "head size %d is not a multiple of 4", D);
		ng_hint("the half-truncated rotary rotates a quarter of each head's pairs");
		return NG_ERR_INPUT;
	}
	cfg->Vp = (cfg->V + 127) / 128 * 128;
	return NG_OK;
}

struct layout_row {
	const char *name;
	int ndim;
	size_t s0, s1, s2;
	bool decay, per_layer;
};

/* The speedrun model's rows (GPT-2's tensors absent: numel 0). */
static void speedrun_rows(const struct ng_gpt_config *cfg, struct layout_row *d)
{
	size_t L = cfg->L, La = L - 1, C = cfg->C, Vp = cfg->Vp;
	static const char *const absent[NG_P_COUNT] = {
		[NG_P_WPE] = "wpe", [NG_P_LN1W] = "ln1w", [NG_P_LN1B] = "ln1b",
		[NG_P_QKVB] = "qkvb", [NG_P_ATTPROJB] = "attprojb", [NG_P_LN2W] = "ln2w",
		[NG_P_LN2B] = "ln2b", [NG_P_FCB] = "fcb", [NG_P_FCPROJB] = "fcprojb",
		[NG_P_LNFW] = "lnfw", [NG_P_LNFB] = "lnfb",
	};
	for (int i = 0; i < NG_P_COUNT; i++)
		d[i] = (struct layout_row){ absent[i], 1, 0, 0, 0, false, false };
	d[NG_P_WTE] = (struct layout_row){ "wte", 2, Vp, C, 0, false, false };
	d[NG_P_VE] = (struct layout_row){ "ve", 3, NG_SPR_VE, Vp, C, false, false };
	d[NG_P_QKVW] = (struct layout_row){ "qkvw", 3, La, 3 * C, C, false, true };
	d[NG_P_ATTPROJW] = (struct layout_row){ "attprojw", 3, La, C, C, false, true };
	d[NG_P_FCW] = (struct layout_row){ "fcw", 3, L, 4 * C, C, false, true };
	d[NG_P_FCPROJW] = (struct layout_row){ "fcprojw", 3, L, C, 4 * C, false, true };
	d[NG_P_HEADW] = (struct layout_row){ "headw", 2, Vp, C, 0, false, false };
	d[NG_P_XLAMBDA] = (struct layout_row){ "xlambda", 2, L, 2, 0, false, true };
	d[NG_P_VLAMBDA] = (struct layout_row){ "vlambda", 2, La, 2, 0, false, true };
	d[NG_P_SKIPW] = (struct layout_row){ "skipw", 1, L / 2, 0, 0, false, false };
}

void ng_gpt_layout(const struct ng_gpt_config *cfg, struct ng_gpt_layout *lay)
{
	size_t L = cfg->L, C = cfg->C, T = cfg->T, Vp = cfg->Vp;
	struct layout_row d[NG_P_COUNT] = {
		[NG_P_WTE] = { "wte", 2, Vp, C, 0, true, false },
		[NG_P_WPE] = { "wpe", 2, T, C, 0, true, false },
		[NG_P_LN1W] = { "ln1w", 2, L, C, 0, false, true },
		[NG_P_LN1B] = { "ln1b", 2, L, C, 0, false, true },
		[NG_P_QKVW] = { "qkvw", 3, L, 3 * C, C, true, true },
		[NG_P_QKVB] = { "qkvb", 2, L, 3 * C, 0, false, true },
		[NG_P_ATTPROJW] = { "attprojw", 3, L, C, C, true, true },
		[NG_P_ATTPROJB] = { "attprojb", 2, L, C, 0, false, true },
		[NG_P_LN2W] = { "ln2w", 2, L, C, 0, false, true },
		[NG_P_LN2B] = { "ln2b", 2, L, C, 0, false, true },
		[NG_P_FCW] = { "fcw", 3, L, 4 * C, C, true, true },
		[NG_P_FCB] = { "fcb", 2, L, 4 * C, 0, false, true },
		[NG_P_FCPROJW] = { "fcprojw", 3, L, C, 4 * C, true, true },
		[NG_P_FCPROJB] = { "fcprojb", 2, L, C, 0, false, true },
		[NG_P_LNFW] = { "lnfw", 1, C, 0, 0, false, false },
		[NG_P_LNFB] = { "lnfb", 1, C, 0, 0, false, false },
		[NG_P_VE] = { "ve", 1, 0, 0, 0, false, false },
		[NG_P_HEADW] = { "headw", 1, 0, 0, 0, false, false },
		[NG_P_XLAMBDA] = { "xlambda", 1, 0, 0, 0, false, false },
		[NG_P_VLAMBDA] = { "vlambda", 1, 0, 0, 0, false, false },
		[NG_P_SKIPW] = { "skipw", 1, 0, 0, 0, false, false },
	};
	if (cfg->arch == NG_ARCH_SPEEDRUN)
		speedrun_rows(cfg, d);
	size_t off = 0;
	lay->n_params = 0;
	for (int i = 0; i < NG_P_COUNT; i++) {
		struct ng_param_spec *p = &lay->p[i];
		p->name = d[i].name;
		p->ndim = d[i].ndim;
		p->shape[0] = d[i].s0;
		p->shape[1] = d[i].ndim > 1 ? d[i].s1 : 1;
		p->shape[2] = d[i].ndim > 2 ? d[i].s2 : 1;
		p->numel = p->shape[0] * p->shape[1] * p->shape[2];
		p->decay = d[i].decay;
		p->per_layer = d[i].per_layer;
		p->offset = off;
		off += (p->numel + NG_PARAM_ALIGN - 1) / NG_PARAM_ALIGN * NG_PARAM_ALIGN;
		lay->n_params += p->numel;
	}
	lay->total = off;
}

/* Normal(0, std) (or uniform) values into x[0..n): block k of NG_INIT_BLOCK values has its own RNG stream
 * (seeded from seed, tensor and k), so the blocks fill in parallel and the values do not depend
 * on the thread count. */
#define NG_INIT_BLOCK ((size_t)1 << 18)
static void fill(float *x, size_t n, double std, uint64_t seed, int tensor, int uniform)
{
	double bound = sqrt(3.0) * std; /* a uniform of standard deviation std */
	long long nb = (long long)((n + NG_INIT_BLOCK - 1) / NG_INIT_BLOCK);
#pragma omp parallel for schedule(static)
	for (long long k = 0; k < nb; k++) {
		struct ng_rng r;
		ng_rng_seed(&r, ng_rng_mix64(seed * 1000003ull + (uint64_t)tensor) ^
				(uint64_t)k * 0x9e3779b97f4a7c15ull);
		size_t end = ((size_t)k + 1) * NG_INIT_BLOCK < n ? ((size_t)k + 1) * NG_INIT_BLOCK : n;
		for (size_t j = (size_t)k * NG_INIT_BLOCK; j < end; j++)
			x[j] = (float)(uniform ? bound * (2.0 * ng_rng_uniform(&r) - 1.0)
					       : std * ng_rng_normal(&r));
	}
}

static void fill_normal(float *x, size_t n, double std, uint64_t seed, int tensor)
{
	fill(x, n, std, seed, tensor, 0);
}

/* Uniform values of standard deviation std, streams as fill_normal's. */
static void fill_uniform(float *x, size_t n, double std, uint64_t seed, int tensor)
{
	fill(x, n, std, seed, tensor, 1);
}

static void speedrun_init(const struct ng_gpt_config *cfg, const struct ng_gpt_layout *lay,
			  uint64_t seed, float *params)
{
	size_t VC = (size_t)cfg->V * cfg->C, VpC = (size_t)cfg->Vp * cfg->C;
	const struct ng_param_spec *p = lay->p;
	fill_normal(params + p[NG_P_WTE].offset, VC, 1.0, seed, NG_P_WTE);
	for (int t = 0; t < NG_SPR_VE; t++) /* a stream per table */
		fill_normal(params + p[NG_P_VE].offset + t * VpC, VC, 1.0, seed,
			    NG_P_COUNT + t);
	fill_uniform(params + p[NG_P_QKVW].offset, p[NG_P_QKVW].numel, 0.5 / sqrt(cfg->C), seed,
		     NG_P_QKVW);
	fill_uniform(params + p[NG_P_FCW].offset, p[NG_P_FCW].numel, 0.5 / sqrt(cfg->C), seed,
		     NG_P_FCW);
	float *xl = params + p[NG_P_XLAMBDA].offset, *vl = params + p[NG_P_VLAMBDA].offset;
	for (int l = 0; l < cfg->L; l++) {
		xl[2 * l] = 1.0f;
		xl[2 * l + 1] = 0.0f;
	}
	for (size_t j = 0; j < p[NG_P_VLAMBDA].numel; j++)
		vl[j] = 0.5f;
	for (size_t j = 0; j < p[NG_P_SKIPW].numel; j++)
		params[p[NG_P_SKIPW].offset + j] = 1.0f;
	/* attprojw, fcprojw and headw stay zero */
}

void ng_gpt_init(const struct ng_gpt_config *cfg, const struct ng_gpt_layout *lay, uint64_t seed,
		 float *params)
{
	memset(params, 0, lay->total * sizeof(float));
	if (cfg->arch == NG_ARCH_SPEEDRUN) {
		speedrun_init(cfg, lay, seed, params);
		return;
	}
	const double std = 0.02, proj_std = 0.02 / sqrt(2.0 * cfg->L);
	for (int i = 0; i < NG_P_COUNT; i++) {
		const struct ng_param_spec *p = &lay->p[i];
		float *x = params + p->offset;
		/* streams per tensor, so adding a tensor does not move the others' values */
		switch (i) {
		case NG_P_LN1W: case NG_P_LN2W: case NG_P_LNFW:
			for (size_t j = 0; j < p->numel; j++)
				x[j] = 1.0f;
			break;
		case NG_P_WTE: /* padded rows stay zero */
			fill_normal(x, (size_t)cfg->V * cfg->C, std, seed, i);
			break;
		case NG_P_WPE: case NG_P_QKVW: case NG_P_FCW:
			fill_normal(x, p->numel, std, seed, i);
			break;
		case NG_P_ATTPROJW: case NG_P_FCPROJW:
			fill_normal(x, p->numel, proj_std, seed, i);
			break;
		default:
			break; /* biases: zero */
		}
	}
}

double ng_gpt_flops_per_token(const struct ng_gpt_config *cfg, int T)
{
	struct ng_gpt_layout lay;
	ng_gpt_layout(cfg, &lay);
	if (cfg->arch == NG_ARCH_SPEEDRUN) {
		/* the matrices a token multiplies (no lookup tables), and attention over each
		 * block's largest window (14 blocks of 128 tokens long, 7 short; the full context
		 * when T is shorter): 785 MFLOP a token for the reference model */
		const struct ng_param_spec *p = lay.p;
		double mat = (double)(p[NG_P_QKVW].numel + p[NG_P_ATTPROJW].numel +
				      p[NG_P_FCW].numel + p[NG_P_FCPROJW].numel + p[NG_P_HEADW].numel);
		double ctx = 0;
		for (int l = 0; l < cfg->L; l++) {
			int w = (ng_spr_long_window(cfg, l) ? 14 : 7) * NG_SPR_WINDOW_BLOCK;
			ctx += ng_spr_has_attn(cfg, l) ? (w < T ? w : T) : 0;
		}
		return 6.0 * mat + 6.0 * (double)cfg->C * ctx;
	}
	return 6.0 * (double)lay.n_params + 6.0 * cfg->L * (double)cfg->C * T;
}
