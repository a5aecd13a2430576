/*
 * src/train.c — the training loop (see train.h): feeds K micro-batches per step into the
 * backend's input buffer, collects results as the backend produces them (the GPU a step late,
 * through its pinned metrics ring), validates, logs, and prints a summary.
 */
#include "src/train.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "data/loader.h"
#include "data/synth.h"
#include "graph/step_spr.h"
#include "util/file.h"

struct feed {
	struct ng_synth synth;     /* when no --train */
	bool synthetic;
	struct ng_loader train;    /* when --train */
	bool train_open;           /* train is open (close it on every path out) */
	uint16_t *val;             /* val_batches micro-batches of B*(T+1), read once */
	int n_val;
	double floor;              /* synthetic: the entropy floor in nats; NAN otherwise */
	int rank, world;           /* this process's share: disjoint batches per rank */
};

/* Set by SIGINT/SIGTERM: the loop writes a checkpoint after the current step and stops. */
static volatile sig_atomic_t stop_requested;

static void on_stop_signal(int sig)
{
	(void)sig;
	stop_requested = 1;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void feed_close(struct feed *f);

static enum ng_status feed_open(struct feed *f, const struct ng_train_opts *o)
{
	const struct ng_shape *s = &o->shape;
	size_t window = (size_t)s->B * (s->T + 1);
	enum ng_status st;
	memset(f, 0, sizeof(*f));
	f->floor = NAN;
	f->world = o->world > 1 ? o->world : 1;
	f->rank = f->world > 1 ? o->rank : 0;
	f->synthetic = o->train_glob == NULL;
	if (f->synthetic) {
		st = ng_synth_init(&f->synth, s->model.V, (uint64_t)o->seed);
		if (st)
			return st;
		f->floor = ng_synth_entropy(&f->synth);
	} else {
		struct ng_loader_config lc = {
			.pattern = o->train_glob, .B = s->B, .T = s->T, .vocab = s->model.V,
			.rank = f->rank, .world = f->world, .seed = (uint64_t)o->seed,
			.shuffle = !o->no_shuffle,
			.prefetch = 4,
		};
		st = ng_loader_open(&f->train, &lc);
		if (st)
			return st;
		f->train_open = true;
	}
	f->n_val = (int)o->val_batches;
	if (f->n_val == 0 || (!f->synthetic && !o->val_glob))
		return NG_OK;
	size_t bytes;
	if (!ng_size_mul(window, (size_t)f->n_val * sizeof(uint16_t), &bytes) ||
	    !(f->val = malloc(bytes))) {
		st = ng_fail(NG_ERR_RUNTIME, "out of host memory for %d validation batches",
			     f->n_val);
		goto fail;
	}
	if (f->synthetic) {
		for (int i = 0; i < f->n_val; i++)
			ng_synth_batch(&f->synth, 1, (uint64_t)i, s->B, s->T, f->val + i * window);
		return NG_OK;
	}
	struct ng_loader vl;
	struct ng_loader_config vc = {
		.pattern = o->val_glob, .B = s->B, .T = s->T, .vocab = s->model.V, .rank = 0,
		.world = 1, .seed = 0, .shuffle = false, .prefetch = 2,
	};
	st = ng_loader_open(&vl, &vc);
	if (st)
		goto fail;
	for (int i = 0; i < f->n_val && !st; i++) {
		const uint16_t *b;
		st = ng_loader_next(&vl, &b);
		if (!st)
			memcpy(f->val + i * window, b, window * sizeof(uint16_t));
	}
	ng_loader_close(&vl);
	if (!st)
		return NG_OK;
fail: /* release what was started: the training loader's prefetch thread reads f->train */
	feed_close(f);
	return st;
}

/* Release whatever feed_open started; safe on a feed it left half open or already closed. */
static void feed_close(struct feed *f)
{
	if (f->synthetic)
		ng_synth_free(&f->synth);
	if (f->train_open)
		ng_loader_close(&f->train);
	f->train_open = false;
	f->synthetic = false;
	free(f->val);
	f->val = NULL;
}

/* Fill K micro-batches of step `step` (0-based). */
static enum ng_status feed_step(struct feed *f, const struct ng_shape *s, long long step,
				uint16_t *buf)
{
	size_t window = (size_t)s->B * (s->T + 1);
	for (int k = 0; k < s->K; k++) {
		if (f->synthetic) {
			/* rank r of W takes every W-th batch: W ranks see the batches one rank
			 * with K*W micro-batches would */
			ng_synth_batch(&f->synth, 0, ((uint64_t)step * s->K + k) * f->world + f->rank,
				       s->B, s->T, buf + k * window);
			continue;
		}
		const uint16_t *b;
		enum ng_status st = ng_loader_next(&f->train, &b);
		if (st)
			return st;
		memcpy(buf + k * window, b, window * sizeof(uint16_t));
	}
	return NG_OK;
}

struct logger {
	FILE *out;                 /* step lines: stderr on rank 0, /dev/null elsewhere */
	bool tty;                  /* out is a terminal: draw the progress bar */
	FILE *metrics;
	const char *metrics_path;
	int metrics_errno;         /* the first failed write of the metrics (0: none); writing
	                            * stops there and the loop fails after keeping its work */
	double t_start, t_last;    /* wall clock of the start and the last printed result */
	double t_val;              /* wall clock spent validating during the loop */
	double t_ckpt;             /* ... and writing checkpoints */
	double t_prior;            /* training time of the parts before a --resume (0 for a
	                            * fresh run; -1: not recorded in the checkpoint) */
	long long last_step;       /* step of the last result */
	double tokens_per_step, flops_per_token, peak;
	long long steps;
	double first_loss, last_loss;
	double sum_tok_s;          /* steady-state throughput: sum over steps after the first */
	int n_tok_s;
	long long skipped;
	long long stop_at;         /* data parallelism: the step every rank stops after (0: none) */
};

/* Data parallelism: a signal reaches the ranks at different steps, so a rank that gets one only
 * flags its next steps (request_stop); the flag is reduced over ranks inside the step, and the
 * first step s whose record carries it is the same on every rank: all stop after s + STOP_LAG.
 * The loop keeps fewer than STOP_LAG steps beyond its last collected record in flight, so no rank
 * has gone past that step when it learns of it. */
enum { STOP_LAG = 8 };

/* "[########............] 40% 80/200 | loss 3.1234 | ETA 1m12s" on one line, redrawn in place. */
static void progress_bar(FILE *f, long long step, long long steps, double loss, double eta)
{
	enum { WIDTH = 30 };
	char bar[WIDTH + 1];
	int fill = (int)(WIDTH * step / steps);
	memset(bar, '#', (size_t)fill);
	memset(bar + fill, '.', (size_t)(WIDTH - fill));
	bar[WIDTH] = '\0';
	long long e = (long long)(eta + 0.5);
	fprintf(f, "[%s] %3.0f%% %lld/%lld | loss %.4f | ETA ", bar, 100.0 * step / steps, step,
		steps, loss);
	if (e >= 3600)
		fprintf(f, "%lldh%02lldm", e / 3600, e / 60 % 60);
	else if (e >= 60)
		fprintf(f, "%lldm%02llds", e / 60, e % 60);
	else
		fprintf(f, "%llds", e);
	fflush(f);
}

/* Push the metrics line out now (each line is on disk as its step completes); a failed write
 * (disk full, /dev/full, a quota) is remembered, and the metrics are closed: nothing more is
 * written to a file that has lost lines. */
static void metrics_flush(struct logger *lg)
{
	errno = 0;
	if (fflush(lg->metrics) == 0 && !ferror(lg->metrics))
		return;
	lg->metrics_errno = errno ? errno : EIO;
	fclose(lg->metrics);
	lg->metrics = NULL;
}

static void log_result(struct logger *lg, const struct ng_step_result *r, bool print)
{
	double t = now_s();
	double ms = r->ms > 0 ? r->ms : (t - lg->t_last) * 1e3 / (double)(r->step - lg->last_step);
	lg->t_last = t;
	lg->last_step = r->step;
	double tok_s = lg->tokens_per_step / (ms * 1e-3);
	double mfu = lg->peak > 0 ? tok_s * lg->flops_per_token / lg->peak : 0;
	if (isnan(lg->first_loss))
		lg->first_loss = r->loss;
	else {
		lg->sum_tok_s += tok_s;
		lg->n_tok_s++;
	}
	lg->last_loss = r->loss;
	lg->skipped += r->skipped;
	if (r->stop && !lg->stop_at)
		lg->stop_at = r->step + STOP_LAG;
	double eta = (lg->steps - r->step) * ms * 1e-3;
	if (lg->tty)
		fputs("\r\033[K", lg->out); /* the progress bar gives way to a step line */
	if (print || r->skipped || r->step == lg->steps) {
		char mfu_s[16] = "-";
		if (lg->peak > 0)
			snprintf(mfu_s, sizeof(mfu_s), "%.1f%%", mfu * 100);
		fprintf(lg->out, "step %*lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.1f ms | %.0f tok/s"
			" | MFU %s | ETA %.0fs%s\n", (int)(snprintf(NULL, 0, "%lld", lg->steps)),
			r->step, lg->steps, r->loss, r->lr, r->grad_norm, ms, tok_s, mfu_s, eta,
			r->skipped ? " | SKIPPED: non-finite loss or gradient" : "");
	}
	if (lg->tty && r->step < lg->steps)
		progress_bar(lg->out, r->step, lg->steps, r->loss, eta);
	if (lg->metrics) {
		fprintf(lg->metrics, "{\"step\":%lld,\"loss\":%.6g,\"lr\":%.6g,\"grad_norm\":%.6g,"
			"\"ms\":%.4g,\"tok_per_s\":%.6g,\"mfu\":%.4g%s}\n", r->step,
			isfinite(r->loss) ? r->loss : -1.0, r->lr,
			isfinite(r->grad_norm) ? r->grad_norm : -1.0, ms, tok_s, mfu,
			r->skipped ? ",\"skipped\":true" : "");
		metrics_flush(lg);
	}
}

static enum ng_status drain(struct ng_backend *be, struct logger *lg, bool wait, long long every)
{
	struct ng_step_result r[16];
	int n;
	do {
		enum ng_status st = be->collect(be->ctx, r, 16, wait, &n);
		if (st)
			return st;
		for (int i = 0; i < n; i++)
			log_result(lg, &r[i], every <= 1 || r[i].step % every == 0 || r[i].step == 1);
	} while (n == 16);
	return NG_OK;
}

/* The validation after `step` of `steps` steps; *out (may be NULL): its loss, NAN when this
 * rank does not validate. */
static enum ng_status validate(struct ng_backend *be, struct feed *f, struct logger *lg,
			       long long step, long long steps, double *out)
{
	if (out)
		*out = NAN;
	if (!f->val || f->rank != 0) /* the same batches on every rank: rank 0 evaluates */
		return NG_OK;
	double loss;
	/* the speedrun model attends within the window of the step that comes next, as the
	 * reference run validates (the widest at the end) */
	enum ng_status st = be->evaluate(be->ctx, f->val, f->n_val,
					 ng_spr_window_blocks((int)step, (int)steps), &loss);
	if (st)
		return st;
	if (out)
		*out = loss;
	if (lg->tty)
		fputs("\r\033[K", lg->out);
	if (isfinite(f->floor))
		fprintf(lg->out, "step %lld | val loss %.4f | floor %.4f (entropy of the synthetic "
			"corpus) | gap %.4f\n", step, loss, f->floor, loss - f->floor);
	else
		fprintf(lg->out, "step %lld | val loss %.4f | perplexity %.2f\n", step, loss,
			exp(loss));
	if (lg->metrics) {
		fprintf(lg->metrics, "{\"step\":%lld,\"val_loss\":%.6g", step, loss);
		if (isfinite(f->floor))
			fprintf(lg->metrics, ",\"val_floor\":%.6g", f->floor);
		fprintf(lg->metrics, "}\n");
		metrics_flush(lg);
	}
	return NG_OK;
}

/* Checkpoint after `step` steps (everything collected first; rank 0 writes). The loader
 * position saved is `pos`, or (NULL) where the loader is: the start of step + 1. */
static enum ng_status checkpoint(const struct ng_train_opts *o, struct ng_backend *be,
				 struct feed *f, struct logger *lg, long long step,
				 const struct ng_loader_pos *pos)
{
	enum ng_status st = drain(be, lg, true, o->log_every);
	if (st)
		return st;
	struct ng_train_state s = { 0 };
	float *p32 = NULL;
	double t0 = now_s();
	if (f->rank != 0) /* ZeRO-1: rank 0 gathers every rank's shard of the moments */
		return f->world > 1 && o->zero1 ? be->save_state(be->ctx, &s, &p32) : NG_OK;
	st = be->save_state(be->ctx, &s, &p32);
	if (st)
		return st;
	if (s.step != step)
		st = ng_fail(NG_ERR_RUNTIME, "checkpoint: the backend is at step %lld, the loop at "
			     "%lld", s.step, step);
	s.cfg = o->shape.model;
	s.B = o->shape.B;
	s.T = o->shape.T;
	s.K = o->shape.K;
	s.seed = (uint64_t)o->seed;
	s.world = f->world;
	s.has_pos = !f->synthetic;
	s.muon = ng_train_is_muon(o);
	s.shuffle = f->synthetic ? -1 : !o->no_shuffle;
	double trained = lg->t_prior + t0 - lg->t_start - lg->t_val - lg->t_ckpt;
	s.train_us = lg->t_prior < 0 ? -1 : (long long)(1e6 * trained);
	if (s.has_pos && pos)
		s.pos = *pos;
	else if (s.has_pos)
		ng_loader_tell(&f->train, &s.pos);
	if (!st)
		st = ng_ckpt_save(o->out_dir, &s, p32);
	double dt = now_s() - t0;
	lg->t_ckpt += dt;
	lg->t_last += dt; /* the next step's time leaves the checkpoint out */
	if (!st)
		fprintf(lg->out, "checkpoint: step %lld -> %s/{model,state}_%08lld.safetensors "
			"(%.2f s)\n", step, o->out_dir, step, dt);
	free(p32);
	ng_ckpt_state_free(&s);
	return st;
}

/* The name of a model family (enum ng_arch) in messages. */
static const char *family(int arch)
{
	return arch == NG_ARCH_SPEEDRUN ? "speedrun" : "GPT-2";
}

/* --resume: the latest checkpoint of out_dir into the backend and the loader; *start = its step. */
static enum ng_status resume(const struct ng_train_opts *o, struct ng_backend *be, struct feed *f,
			     struct logger *lg, long long *start)
{
	long long step;
	char path[4096];
	enum ng_status st = ng_ckpt_latest(o->out_dir, &step);
	if (st)
		return st;
	ng_ckpt_path(path, sizeof(path), o->out_dir, "state", step);
	struct ng_train_state s;
	st = ng_ckpt_read_state(path, &s);
	if (st)
		return st;
	const struct ng_gpt_config *m = &o->shape.model;
	if (s.cfg.arch != m->arch) {
		ng_fail(NG_ERR_INPUT, "--resume: %s holds a %s model, this run trains a %s model",
			path, family(s.cfg.arch), family(m->arch));
		ng_hint("resume with the --model of that run");
		ng_ckpt_state_free(&s);
		return NG_ERR_INPUT;
	}
	if (s.cfg.L != m->L || s.cfg.H != m->H || s.cfg.C != m->C || s.cfg.T != m->T ||
	    s.cfg.V != m->V || s.B != o->shape.B || s.T != o->shape.T || s.K != o->shape.K ||
	    s.seed != (uint64_t)o->seed || s.has_pos == f->synthetic) {
		ng_fail(NG_ERR_INPUT, "--resume: %s was written by another run (L=%d H=%d C=%d T=%d "
			"V=%d batch %dx%dx%d seed %llu, %s data)", path, s.cfg.L, s.cfg.H, s.cfg.C,
			s.cfg.T, s.cfg.V, s.K, s.B, s.T, (unsigned long long)s.seed,
			s.has_pos ? "shard" : "synthetic");
		ng_hint("resume with the same model, batch, --seed and data flags as that run");
		ng_ckpt_state_free(&s);
		return NG_ERR_INPUT;
	}
	if (s.has_pos && s.shuffle >= 0 && s.shuffle != !o->no_shuffle) {
		ng_fail(NG_ERR_INPUT, "--resume: %s was written by a run %s --no-shuffle, this one "
			"is %s it", path, s.shuffle ? "without" : "with", s.shuffle ? "with" : "without");
		ng_hint("resume with the same data flags as that run: the order of the training "
			"windows depends on --no-shuffle");
		ng_ckpt_state_free(&s);
		return NG_ERR_INPUT;
	}
	if (s.world && s.world != f->world) {
		ng_fail(NG_ERR_INPUT, "--resume: %s was written by a run of %d process%s, this one has "
			"%d", path, s.world, s.world == 1 ? "" : "es", f->world);
		ng_hint("resume with the same number of processes: the global batch and each rank's "
			"data windows depend on it");
		ng_ckpt_state_free(&s);
		return NG_ERR_INPUT;
	}
	if (s.muon != ng_train_is_muon(o)) {
		ng_fail(NG_ERR_INPUT, "--resume: %s was written with --optimizer %s, this run has "
			"--optimizer %s", path, s.muon ? "muon" : "adamw",
			ng_train_is_muon(o) ? "muon" : "adamw");
		ng_hint("resume with the optimizer of that run: the moments mean different things");
		ng_ckpt_state_free(&s);
		return NG_ERR_INPUT;
	}
	if (s.step > o->steps) {
		ng_ckpt_state_free(&s);
		return ng_fail(NG_ERR_INPUT, "--resume: %s is at step %lld, past --steps %lld", path,
			       s.step, o->steps);
	}
	st = be->load_state(be->ctx, &s);
	if (!st && s.has_pos)
		st = ng_loader_seek(&f->train, &s.pos);
	if (!st)
		fprintf(lg->out, "resume: step %lld from %s\n", s.step, path);
	lg->t_prior = s.train_us >= 0 ? (double)s.train_us * 1e-6 : -1;
	*start = s.step;
	ng_ckpt_state_free(&s);
	return st;
}

/* --init FILE: start from a model file's weights (ours of either family, or Hugging Face
 * GPT-2's), fresh optimizer moments, step 0. The file's family and shape must be the run's. */
static enum ng_status init_from(const struct ng_train_opts *o, struct ng_backend *be,
				struct logger *lg)
{
	struct ng_gpt_config c;
	float *p;
	enum ng_status st = ng_ckpt_read_model(o->init_path, &c, &p);
	if (st)
		return st;
	const struct ng_gpt_config *m = &o->shape.model;
	if (c.arch != m->arch || c.L != m->L || c.H != m->H || c.C != m->C || c.T != m->T ||
	    c.V != m->V) {
		free(p);
		ng_fail(NG_ERR_INPUT, "--init %s is a %s model L=%d H=%d C=%d T=%d V=%d, the run a "
			"%s model L=%d H=%d C=%d T=%d V=%d", o->init_path, family(c.arch), c.L, c.H,
			c.C, c.T, c.V, family(m->arch), m->L, m->H, m->C, m->T, m->V);
		ng_hint("give the model flags of the file (GPT-2 124M: --model d12; a speedrun "
			"model: --model speedrun or speedrun-tiny, with --layers ... where its sizes "
			"differ)");
		return NG_ERR_INPUT;
	}
	struct ng_gpt_layout lay;
	ng_gpt_layout(&c, &lay);
	struct ng_train_state s = { 0 };
	st = ng_ckpt_state_alloc(&s, 4, lay.total);
	if (!st) {
		memcpy(s.params, p, lay.total * sizeof(float));
		st = be->load_state(be->ctx, &s);
	}
	if (!st)
		fprintf(lg->out, "init: weights from %s\n", o->init_path);
	ng_ckpt_state_free(&s);
	free(p);
	return st;
}

/* Before step 1: the checkpoint directory. With checkpoints planned (--ckpt-every,
 * --stop-after, --resume) it is made and a file is created in it, so a bad --out fails now
 * rather than after the steps before the first checkpoint. Otherwise only a signal would write
 * one: nothing is created, and a directory that could not take it is named in a note. */
static enum ng_status check_out_dir(const struct ng_train_opts *o, struct logger *lg)
{
	if (o->rank != 0 && o->world > 1)
		return NG_OK;
	if (o->ckpt_every > 0 || o->stop_after > 0 || o->resume)
		return ng_ckpt_check_dir(o->out_dir);
	struct stat sb;
	char parent[4096];
	snprintf(parent, sizeof(parent), "%s", o->out_dir);
	char *slash = strrchr(parent, '/');
	if (slash && slash != parent)
		*slash = '\0';
	else
		snprintf(parent, sizeof(parent), "%s", slash ? "/" : ".");
	bool ok = stat(o->out_dir, &sb) == 0 ? S_ISDIR(sb.st_mode) && access(o->out_dir, W_OK | X_OK)
					    == 0 : access(parent, W_OK | X_OK) == 0;
	if (!ok)
		fprintf(lg->out, "note: --out %s is not a writable directory: a checkpoint on "
			"SIGINT/SIGTERM would fail\n", o->out_dir);
	return NG_OK;
}

/* A fault in the middle of the run (a bad token in a later shard, a failed metrics write):
 * before failing, keep the `done` steps completed since the last checkpoint, with the loader
 * at `pos` (where step done + 1 starts). One process only (the ranks of a data-parallel run
 * would have to agree on it). The fault stays the error reported. */
static enum ng_status keep_work(const struct ng_train_opts *o, struct ng_backend *be,
				struct feed *f, struct logger *lg, long long start, long long done,
				const struct ng_loader_pos *pos, enum ng_status fault)
{
	if (f->world > 1 || done <= start || (o->ckpt_every > 0 && done % o->ckpt_every == 0))
		return fault;
	char msg[1024], hint[512];
	snprintf(msg, sizeof(msg), "%s", ng_error_message());
	snprintf(hint, sizeof(hint), "%s", ng_error_hint());
	ng_clear_error();
	if (checkpoint(o, be, f, lg, done, pos))
		fprintf(lg->out, "checkpoint after the error failed too: %s\n", ng_error_message());
	else
		fprintf(lg->out, "the %lld completed steps are kept: continue with --resume once "
			"the problem below is fixed\n", done);
	ng_clear_error();
	ng_fail(fault, "%s", msg);
	if (hint[0])
		ng_hint("%s", hint);
	return fault;
}

/* --metrics FILE: truncated, or with --resume appended to. Opened without blocking: a FIFO
 * nobody reads is an error, not a hang (one with a reader, or a pipe, works). A line that an
 * earlier run could not finish (a full disk, a kill) is cut off before appending, so the file
 * stays whole JSON lines. */
static enum ng_status metrics_open(struct logger *lg, const char *path, bool append)
{
	lg->metrics_path = path;
	int fd = open(path, O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC | O_NOCTTY |
			    (append ? O_APPEND : O_TRUNC), 0644);
	if (fd < 0) {
		ng_fail(NG_ERR_INPUT, "cannot write --metrics %s: %s", path, strerror(errno));
		if (errno == ENXIO)
			ng_hint("it is a FIFO with no reader: start the reader first");
		return NG_ERR_INPUT;
	}
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
	struct stat sb;
	if (append && fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0) {
		char tail[4096];
		off_t end = sb.st_size, keep = 0;
		for (off_t at = end; at > 0 && !keep;) {
			size_t n = at < (off_t)sizeof(tail) ? (size_t)at : sizeof(tail);
			at -= (off_t)n;
			if (pread(fd, tail, n, at) != (ssize_t)n) {
				keep = end; /* unreadable: leave the file as it is */
				break;
			}
			for (size_t i = n; i > 0 && !keep; i--)
				if (tail[i - 1] == '\n')
					keep = at + (off_t)i;
			if (at == 0 && !keep)
				keep = -1; /* no newline at all: nothing whole */
		}
		if (keep != end && ftruncate(fd, keep > 0 ? keep : 0) != 0) {
			int e = errno;
			close(fd);
			return ng_fail(NG_ERR_RUNTIME, "cannot write --metrics %s: %s", path,
				       strerror(e));
		}
	}
	lg->metrics = fdopen(fd, append ? "a" : "w");
	if (!lg->metrics) {
		int e = errno;
		close(fd);
		return ng_fail(NG_ERR_RUNTIME, "cannot write --metrics %s: %s", path, strerror(e));
	}
	return NG_OK;
}

static enum ng_status metrics_error(const struct logger *lg, long long step)
{
	ng_fail(NG_ERR_RUNTIME, "cannot write --metrics %s: %s (at step %lld)", lg->metrics_path,
		strerror(lg->metrics_errno), step);
	ng_hint("free space on its filesystem (or give another --metrics FILE) and continue with "
		"--resume");
	return NG_ERR_RUNTIME;
}

enum ng_status ng_train_run(const struct ng_train_opts *o, struct ng_backend *be)
{
	const struct ng_shape *s = &o->shape;
	struct feed f;
	bool feed_opened = false;
	struct logger lg = { 0 };
	/* rank 0 logs and writes the metrics (already the mean over ranks); the others are quiet */
	lg.out = o->world > 1 && o->rank != 0 ? fopen("/dev/null", "w") : stderr;
	if (!lg.out)
		lg.out = stderr;
	lg.tty = isatty(fileno(lg.out));
	long long start = 0;
	struct sigaction sa, old_int, old_term;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_stop_signal;
	sigemptyset(&sa.sa_mask);
	stop_requested = 0;
	sigaction(SIGINT, &sa, &old_int);
	sigaction(SIGTERM, &sa, &old_term);
	lg.first_loss = NAN;
	enum ng_status st = check_out_dir(o, &lg);
	if (!st && o->metrics_path && (o->world <= 1 || o->rank == 0))
		st = metrics_open(&lg, o->metrics_path, o->resume);
	if (st)
		goto out;
	st = feed_open(&f, o);
	if (st)
		goto out;
	feed_opened = true;
	if (o->init_path && !o->resume)
		st = init_from(o, be, &lg);
	if (!st && o->resume)
		st = resume(o, be, &f, &lg, &start);
	if (st)
		goto out;
	lg.tokens_per_step = (double)s->K * s->B * s->T * f.world;
	lg.flops_per_token = ng_gpt_flops_per_token(&s->model, s->T);
	lg.peak = be->peak_flops;
	lg.steps = o->steps;
	fprintf(lg.out, "data: %s", f.synthetic ? "synthetic Markov corpus" : o->train_glob);
	if (isfinite(f.floor))
		fprintf(lg.out, " (entropy floor %.4f nats/token)", f.floor);
	fprintf(lg.out, " | %d x %d x %d", s->K, s->B, s->T);
	if (f.world > 1)
		fprintf(lg.out, " x %d ranks", f.world);
	fprintf(lg.out, " = %.0f tokens per step\n", lg.tokens_per_step);
	lg.t_start = lg.t_last = now_s();
	lg.last_step = start;
	bool stop_flagged = false;
	long long end = o->steps; /* the last step: o->steps, or where the target was reached */
	for (long long step = start; step < o->steps; step++) {
		uint16_t *buf;
		if (be->request_stop && step - lg.last_step >= STOP_LAG - 1 &&
		    (st = drain(be, &lg, true, o->log_every)))
			goto out; /* not reached while the token buffer keeps the host 2 steps ahead */
		if (be->request_stop && stop_requested && !stop_flagged) {
			be->request_stop(be->ctx);
			stop_flagged = true;
		}
		struct ng_loader_pos step_pos; /* where this step's data starts */
		if (!f.synthetic)
			ng_loader_tell(&f.train, &step_pos);
		st = be->input_buffer(be->ctx, &buf);
		if (!st)
			st = feed_step(&f, s, step, buf);
		if (st && !f.synthetic) { /* the data failed (a bad later shard): keep the steps */
			st = keep_work(o, be, &f, &lg, start, step, &step_pos, st);
			goto out;
		}
		if (!st)
			st = be->submit(be->ctx);
		if (!st)
			st = drain(be, &lg, false, o->log_every);
		if (st)
			goto out;
		if (lg.metrics_errno) {
			st = keep_work(o, be, &f, &lg, start, step + 1, NULL,
				       metrics_error(&lg, step + 1));
			goto out;
		}
		bool by_signal = be->request_stop ? lg.stop_at == step + 1 : stop_requested;
		bool stop = by_signal || (o->stop_after > 0 && step + 1 == o->stop_after);
		/* a validation due at this step comes before its checkpoint, so that a run stopped
		 * here (--stop-after) and resumed validates where the straight run does; a signal
		 * stops without it */
		bool reached = false;
		if (!by_signal && o->val_every > 0 && (step + 1) % o->val_every == 0 &&
		    step + 1 < o->steps) {
			st = drain(be, &lg, true, o->log_every);
			double t0 = now_s(), vl = NAN;
			if (!st)
				st = validate(be, &f, &lg, step + 1, o->steps, &vl);
			double dt = now_s() - t0;
			lg.t_val += dt;
			lg.t_last += dt; /* the next step's time leaves the validation out */
			if (st)
				goto out;
			reached = o->target_val_loss > 0 && vl <= o->target_val_loss;
		}
		if (stop || (o->ckpt_every > 0 && (step + 1) % o->ckpt_every == 0)) {
			st = checkpoint(o, be, &f, &lg, step + 1, NULL);
			if (st)
				goto out;
		}
		if (reached) {
			end = step + 1;
			break;
		}
		if (stop) {
			fprintf(lg.out, "stopped after step %lld%s; continue with --resume\n",
				step + 1, by_signal ? " (signal)" : " (--stop-after)");
			goto out;
		}
	}
	st = drain(be, &lg, true, o->log_every);
	/* this process's training time (validation and checkpoints excluded) */
	double here = now_s() - lg.t_start - lg.t_val - lg.t_ckpt;
	/* the final model, with --ckpt-every or after a signal too late to stop before the end
	 * (every rank has the same stop_at once all steps are collected) */
	bool written = o->ckpt_every > 0 && end % o->ckpt_every == 0;
	if (!st && start < end && !written && (o->ckpt_every > 0 || lg.stop_at))
		st = checkpoint(o, be, &f, &lg, end, NULL);
	if (!st && end == o->steps) /* a run stopped at its target validated there already */
		st = validate(be, &f, &lg, end, o->steps, NULL);
	if (!st && lg.metrics_errno)
		st = metrics_error(&lg, end);
	if (st)
		goto out;
	double wall = now_s() - lg.t_start;
	if (end < o->steps && (start == 0 || lg.t_prior >= 0))
		fprintf(lg.out, "target: val loss <= %g reached after step %lld: %.2f s of "
			"training%s (validation and checkpoints excluded), %.0f tokens\n",
			o->target_val_loss, end, lg.t_prior + here,
			start > 0 ? " over all the run's parts" : "", (double)end * lg.tokens_per_step);
	else if (end < o->steps)
		fprintf(lg.out, "target: val loss <= %g reached after step %lld: %.2f s of training "
			"(validation and checkpoints excluded), %.0f tokens since the resumed step "
			"(its checkpoint holds no earlier time)\n", o->target_val_loss, end, here,
			(double)(end - start) * lg.tokens_per_step);
	else if (o->target_val_loss > 0)
		fprintf(lg.out, "target: val loss <= %g not reached in %lld steps\n",
			o->target_val_loss, o->steps);
	fprintf(lg.out, "done: %lld steps in %.1f s | loss %.4f -> %.4f (%.1f%% lower)", end,
		wall, lg.first_loss, lg.last_loss, 100 * (1 - lg.last_loss / lg.first_loss));
	if (lg.n_tok_s)
		fprintf(lg.out, " | mean %.0f tok/s after step 1", lg.sum_tok_s / lg.n_tok_s);
	if (lg.skipped)
		fprintf(lg.out, " | %lld updates skipped", lg.skipped);
	fprintf(lg.out, "\n");
out:
	sigaction(SIGINT, &old_int, NULL);
	sigaction(SIGTERM, &old_term, NULL);
	if (lg.metrics) {
		errno = 0;
		/* the last lines reach the file here: a full disk shows now, and it is an error */
		if (fclose(lg.metrics) != 0 && !st) {
			lg.metrics_errno = errno ? errno : EIO;
			st = metrics_error(&lg, o->steps);
		}
	}
	if (lg.out != stderr)
		fclose(lg.out);
	if (feed_opened)
		feed_close(&f);
	return st;
}
