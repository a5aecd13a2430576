/*
 * src/cmd_prepare.c — `nanograph prepare`: text files -> GPT-2 token shards.
 *
 *   nanograph prepare [--vocab DIR] --out DIR [--split whole|blank|LINE] [--val-tokens N]
 *                     [--shard-tokens N] FILE...
 *
 * Each file splits into documents (the whole file; runs of non-blank lines; or the text between
 * separator lines equal to LINE, e.g. "%" in fortune files); documents of only whitespace are
 * skipped. A document keeps its own line ends. Every document is encoded as
 * <|endoftext|> followed by its tokens. The token stream's first N tokens (--val-tokens) go to
 * val_000000.bin (more val shards if N > --shard-tokens), the rest to train_000000.bin,
 * train_000001.bin, ... of at most --shard-tokens each.
 *
 * Speed: files are read in rounds of ~32 MB; a round's documents are grouped into ~1 MB chunks
 * (a longer document is cut where the cut provably does not change its tokens) that all cores
 * encode (each thread with its own BPE cache); chunks are appended in order, so the
 * output does not depend on the thread count. A progress bar goes to stderr on a terminal.
 *
 * Safety: every input, the vocabulary and the output directory are checked before any work;
 * shards are written under temporary names and renamed into place only when everything
 * succeeded, so a failure leaves earlier outputs untouched and no half shard behind. SIGINT and
 * SIGTERM remove the temporaries too: the handler unlinks the sinks' temporary names (unlink,
 * write and raise only: async-signal-safe) and ends the process by the signal. The sinks change
 * only with both signals blocked in the main thread, and the worker threads block them, so the
 * handler always reads a whole list; renaming into place is one blocked section too, so a
 * signal leaves all shards or none.
 */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "src/cli.h"
#include "src/commands.h"
#include "util/file.h"

#define ROUND_BYTES (32u << 20) /* text per round */
#define CHUNK_BYTES (1u << 20)  /* text per work item */
#define MAX_FILES 65536

enum split_mode { SPLIT_WHOLE, SPLIT_BLANK, SPLIT_LINE };

struct doc {
	const char *text; /* inside a file buffer */
	size_t len;       /* bytes */
	bool cont;        /* continues the previous piece of a long document: no EOT before it */
};

struct chunk {
	size_t first, count;     /* documents docs[first .. first+count) */
	struct ng_token_buf out; /* their tokens, EOT before each */
};

/* One round of parallel encoding. */
struct round {
	const struct ng_tokenizer *tok; /* shared, read-only */
	const struct doc *docs;         /* (ndocs,) */
	struct chunk *chunks;           /* (nchunks,) */
	size_t nchunks;                 /* work items */
	atomic_size_t next;             /* next chunk to take */
	atomic_size_t done_bytes;       /* text encoded so far in this round */
	atomic_int failed;              /* a thread failed: stop taking work */
	pthread_mutex_t mu;             /* guards err */
	enum ng_status err;             /* first failure */
	char err_msg[1024];             /* its message (errors are thread-local) */
};

/* Shards of one kind (val or train) written to temporary names. */
struct sink {
	const char *dir, *prefix; /* DIR/prefix_000000.bin */
	size_t cap;               /* tokens per shard */
	uint16_t *buf;            /* (cap,) the shard being filled */
	size_t n;                 /* tokens in buf */
	int index;                /* next shard number */
	size_t total;             /* tokens written by this sink */
	char (*tmp)[4200];        /* (index,) temporary names */
	char (*final)[4200];      /* (index,) final names */
};

/* The sinks whose temporaries a signal removes (NULL: none yet). */
static struct sink *volatile signal_sinks[2];

static void on_signal(int sig)
{
	for (int k = 0; k < 2; k++) {
		struct sink *s = signal_sinks[k];
		for (int i = 0; s && s->tmp && i < s->index; i++)
			unlink(s->tmp[i]);
	}
	static const char msg[] = "nanograph: prepare: interrupted; its temporary shards are "
				  "removed, nothing was written\n";
	ssize_t w = write(2, msg, sizeof(msg) - 1);
	(void)w;
	struct sigaction dfl = { .sa_handler = SIG_DFL };
	sigaction(sig, &dfl, NULL);
	raise(sig); /* delivered when the handler returns: the exit status says which signal */
}

/* Block SIGINT and SIGTERM in this thread (old: the mask before), or restore `old`. */
static void block_signals(sigset_t *old)
{
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	pthread_sigmask(SIG_BLOCK, &set, old);
}

static void restore_signals(const sigset_t *old) { pthread_sigmask(SIG_SETMASK, old, NULL); }

struct bar {
	bool on;          /* stderr is a terminal */
	double t0, last;  /* start and last draw, seconds */
	size_t total;     /* bytes of all inputs */
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void bar_draw(struct bar *b, size_t done, bool final)
{
	double t = now_s();
	if (!b->on || (!final && t - b->last < 0.1))
		return;
	b->last = t;
	double f = b->total ? (double)done / (double)b->total : 1.0;
	int w = (int)(f * 30 + 0.5);
	fprintf(stderr, "\rprepare [%.*s%*s] %5.1f%%  %.1f MB  %.1f MB/s", w,
		"##############################", 30 - w, "", 100 * f, done / 1e6,
		done / 1e6 / (t - b->t0 > 1e-9 ? t - b->t0 : 1e-9));
	if (final)
		fputc('\n', stderr);
	fflush(stderr);
}

static enum ng_status read_file(const char *path, char **data, size_t *len)
{
	*data = NULL;
	*len = 0;
	struct stat st;
	int fd = ng_file_open_regular(path, &st); /* never blocks on a FIFO */
	if (fd == -2)
		return ng_fail(NG_ERR_INPUT, "prepare: %s is not a regular file (%s)", path,
			       ng_file_kind(st.st_mode));
	if (fd < 0)
		return ng_fail(NG_ERR_INPUT, "prepare: cannot read %s: %s", path, strerror(errno));
	char *buf = malloc((size_t)st.st_size + 1);
	if (!buf) {
		close(fd);
		return ng_fail(NG_ERR_RUNTIME, "prepare: out of memory reading %s", path);
	}
	size_t got = 0;
	while (got < (size_t)st.st_size) {
		ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			int e = errno;
			free(buf);
			close(fd);
			return ng_fail(NG_ERR_INPUT, "prepare: cannot read %s: %s", path,
				       r < 0 ? strerror(e) : "file shrank while reading");
		}
		got += (size_t)r;
	}
	close(fd);
	*data = buf;
	*len = got;
	return NG_OK;
}

static bool blank(const char *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r' && p[i] != '\n' && p[i] != '\f' &&
		    p[i] != '\v')
			return false;
	return true;
}

/* Append the documents of text[0..len) to *docs. */
static enum ng_status split_docs(const char *text, size_t len, enum split_mode mode,
				 const char *sep, struct doc **docs, size_t *n, size_t *cap)
{
	size_t seplen = sep ? strlen(sep) : 0, start = 0, at = 0;
	for (;;) {
		bool end = at >= len;
		size_t eol = at;
		if (!end) {
			const char *nl = memchr(text + at, '\n', len - at);
			eol = nl ? (size_t)(nl - text) + 1 : len;
		}
		size_t ll = eol - at; /* line length with its newline */
		size_t body = ll - (ll && text[eol - 1] == '\n');
		body -= body && text[at + body - 1] == '\r';
		bool cut = end || (mode == SPLIT_BLANK && blank(text + at, ll)) ||
			   (mode == SPLIT_LINE && body == seplen &&
			    memcmp(text + at, sep, seplen) == 0);
		if (mode == SPLIT_WHOLE)
			cut = end;
		if (cut) {
			if (at > start && !blank(text + start, at - start)) {
				if (*n == *cap) {
					*cap = *cap ? 2 * *cap : 4096;
					struct doc *d = realloc(*docs, *cap * sizeof(**docs));
					if (!d)
						return ng_fail(NG_ERR_RUNTIME, "prepare: out of memory");
					*docs = d;
				}
				(*docs)[(*n)++] = (struct doc){ text + start, at - start, false };
			}
			start = eol;
		}
		if (end)
			return NG_OK;
		at = eol;
	}
}

/* Take chunks until none are left (or a thread failed). bar != NULL: the calling thread also
 * draws the progress bar between its chunks, `done_before` bytes being from earlier rounds. */
static void encode_chunks(struct round *r, struct bar *bar, size_t done_before)
{
	struct ng_bpe_cache cache = { 0 };
	ng_clear_error();
	for (;;) {
		size_t c = atomic_fetch_add(&r->next, 1);
		if (c >= r->nchunks || atomic_load(&r->failed))
			break;
		struct chunk *ch = &r->chunks[c];
		enum ng_status st = NG_OK;
		for (size_t d = ch->first; d < ch->first + ch->count && !st; d++) {
			if (!r->docs[d].cont)
				st = ng_token_buf_push(&ch->out, NG_TOKENIZER_EOT);
			if (!st)
				st = ng_tokenizer_encode(r->tok, &cache, r->docs[d].text,
							 r->docs[d].len, &ch->out);
			atomic_fetch_add(&r->done_bytes, r->docs[d].len);
		}
		if (bar)
			bar_draw(bar, done_before + atomic_load(&r->done_bytes), false);
		if (st) {
			pthread_mutex_lock(&r->mu);
			if (!r->err) {
				r->err = st;
				snprintf(r->err_msg, sizeof(r->err_msg), "%s", ng_error_message());
			}
			pthread_mutex_unlock(&r->mu);
			atomic_store(&r->failed, 1);
			break;
		}
	}
	ng_bpe_cache_free(&cache);
}

static bool ascii_letter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

/* Cut documents longer than CHUNK_BYTES into pieces so that all threads share the work. A cut
 * goes only between an ASCII letter and " <ASCII letter>": the GPT-2 pattern always ends a
 * pre-token there (a letter run stops at the space, and nothing else matches a letter), so the
 * pieces encode to exactly the tokens of the whole. Rewrites docs[from..*n). */
static enum ng_status cut_long_docs(struct doc **docs, size_t from, size_t *n, size_t *cap)
{
	for (size_t i = from; i < *n; i++) {
		struct doc d = (*docs)[i];
		if (d.len <= 2 * CHUNK_BYTES)
			continue;
		size_t at = CHUNK_BYTES;
		while (at + 1 < d.len && !(ascii_letter(d.text[at - 1]) && d.text[at] == ' ' &&
					    ascii_letter(d.text[at + 1])))
			at++;
		if (at + 1 >= d.len)
			continue; /* no safe cut: one piece */
		if (*n == *cap) {
			*cap *= 2;
			struct doc *g = realloc(*docs, *cap * sizeof(**docs));
			if (!g)
				return ng_fail(NG_ERR_RUNTIME, "prepare: out of memory");
			*docs = g;
		}
		memmove(*docs + i + 2, *docs + i + 1, (*n - i - 1) * sizeof(**docs));
		(*n)++;
		(*docs)[i].len = at;
		(*docs)[i + 1] = (struct doc){ d.text + at, d.len - at, true };
	}
	return NG_OK;
}

static void *encode_worker(void *arg)
{
	encode_chunks(arg, NULL, 0);
	return NULL;
}

static enum ng_status sink_flush_(struct sink *s)
{
	void *t = realloc(s->tmp, (size_t)(s->index + 1) * sizeof(*s->tmp));
	if (t)
		s->tmp = t;
	void *f = realloc(s->final, (size_t)(s->index + 1) * sizeof(*s->final));
	if (f)
		s->final = f;
	if (!t || !f)
		return ng_fail(NG_ERR_RUNTIME, "prepare: out of memory");
	snprintf(s->final[s->index], sizeof(s->final[0]), "%s/%s_%06d.bin", s->dir, s->prefix,
		 s->index);
	enum ng_status st = ng_shard_write_temp(s->final[s->index], s->buf, s->n,
						 s->tmp[s->index], sizeof(s->tmp[0]));
	if (st)
		return st;
	s->index++;
	s->total += s->n;
	s->n = 0;
	return NG_OK;
}

/* Write the filled part of the buffer as the next temporary shard. Signals wait until its name
 * is in the list (the handler would miss a file mkstemp made a moment before). */
static enum ng_status sink_flush(struct sink *s)
{
	if (s->n == 0)
		return NG_OK;
	sigset_t old;
	block_signals(&old);
	enum ng_status st = sink_flush_(s);
	restore_signals(&old);
	return st;
}

static enum ng_status sink_push(struct sink *s, const uint16_t *t, size_t n)
{
	while (n) {
		size_t k = s->cap - s->n < n ? s->cap - s->n : n;
		memcpy(s->buf + s->n, t, k * sizeof(uint16_t));
		s->n += k;
		t += k;
		n -= k;
		if (s->n == s->cap) {
			enum ng_status st = sink_flush(s);
			if (st)
				return st;
		}
	}
	return NG_OK;
}

/* Remove the temporaries (failure) or rename them into place (success). Called with the
 * signals blocked: the list is emptied before a signal can look at it. */
static enum ng_status sink_finish(struct sink *s, bool commit)
{
	enum ng_status st = NG_OK;
	for (int i = 0; i < s->index; i++) {
		if (commit && !st)
			st = ng_shard_commit(s->tmp[i], s->final[i]);
		else
			unlink(s->tmp[i]);
	}
	free(s->tmp);
	free(s->final);
	free(s->buf);
	s->tmp = s->final = NULL;
	s->buf = NULL;
	return st;
}

/* Encode one round of documents on `threads` threads and append the tokens in order. */
static enum ng_status encode_round(const struct ng_tokenizer *tok, const struct doc *docs,
				   size_t ndocs, int threads, struct sink *val, size_t *val_left,
				   struct sink *train, struct bar *bar, size_t *done)
{
	struct round r = { .tok = tok, .docs = docs };
	r.chunks = calloc(ndocs ? ndocs : 1, sizeof(struct chunk));
	if (!r.chunks)
		return ng_fail(NG_ERR_RUNTIME, "prepare: out of memory");
	for (size_t d = 0; d < ndocs;) {
		struct chunk *c = &r.chunks[r.nchunks++];
		size_t bytes = 0;
		c->first = d;
		while (d < ndocs && (bytes == 0 || bytes + docs[d].len <= CHUNK_BYTES))
			bytes += docs[d++].len;
		c->count = d - c->first;
	}
	pthread_mutex_init(&r.mu, NULL);
	pthread_t th[16];
	int started = 0;
	sigset_t old;
	block_signals(&old); /* the workers start with SIGINT/SIGTERM blocked: the main thread
			      * takes them, outside its blocked sections */
	for (int i = 1; i < threads; i++)
		if (pthread_create(&th[started], NULL, encode_worker, &r) == 0)
			started++;
	restore_signals(&old);
	encode_chunks(&r, bar, *done); /* the calling thread works too */
	for (int i = 0; i < started; i++)
		pthread_join(th[i], NULL);
	enum ng_status st = r.err ? ng_fail(r.err, "%s", r.err_msg) : NG_OK;
	for (size_t c = 0; c < r.nchunks && !st; c++) {
		const uint16_t *t = r.chunks[c].out.data;
		size_t n = r.chunks[c].out.len;
		size_t k = *val_left < n ? *val_left : n;
		if (k)
			st = sink_push(val, t, k);
		*val_left -= k;
		if (!st)
			st = sink_push(train, t + k, n - k);
	}
	for (size_t c = 0; c < r.nchunks; c++)
		free(r.chunks[c].out.data);
	free(r.chunks);
	pthread_mutex_destroy(&r.mu);
	*done += atomic_load(&r.done_bytes);
	return st;
}

static enum ng_status check_out_dir(const char *dir)
{
	if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
		ng_fail(NG_ERR_INPUT, "prepare: cannot create output directory %s: %s", dir,
			strerror(errno));
		ng_hint("check --out: its parent must exist and be writable");
		return NG_ERR_INPUT;
	}
	char probe[4200];
	snprintf(probe, sizeof(probe), "%s/.nanograph-probe-XXXXXX", dir);
	int fd = mkstemp(probe);
	if (fd < 0) {
		ng_fail(NG_ERR_INPUT, "prepare: cannot write to output directory %s: %s", dir,
			strerror(errno));
		ng_hint("choose a writable --out directory");
		return NG_ERR_INPUT;
	}
	close(fd);
	unlink(probe);
	return NG_OK;
}

/* Files DIR/prefix_*.bin beyond the `written` ones just made (left by an earlier run). */
static int older_shards(const char *dir, const char *prefix, int written)
{
	char pat[4200];
	snprintf(pat, sizeof(pat), "%s/%s_*.bin", dir, prefix);
	glob_t g;
	if (glob(pat, 0, NULL, &g) != 0)
		return 0;
	int n = (int)g.gl_pathc - written;
	globfree(&g);
	return n > 0 ? n : 0;
}

struct prepare_args {
	const char *vocab;      /* --vocab DIR */
	const char *out;        /* --out DIR */
	const char *split;      /* --split whole|blank|LINE */
	long long val_tokens;   /* --val-tokens N */
	long long shard_tokens; /* --shard-tokens N */
};

static int thread_count(void)
{
	long n = sysconf(_SC_NPROCESSORS_ONLN);
	return n < 1 ? 1 : n > 16 ? 16 : (int)n;
}

/* Encode every file, in rounds of ~ROUND_BYTES, into the sinks; *ndocs_out counts documents. */
static enum ng_status run_files(const struct ng_tokenizer *tok, char **files, int nfiles,
				enum split_mode mode, const char *sep, struct sink *val,
				size_t *val_left, struct sink *train, struct bar *bar,
				size_t *ndocs_out)
{
	enum ng_status st = NG_OK;
	struct doc *docs = NULL;
	size_t ndocs = 0, cap = 0, done = 0;
	char **bufs = calloc((size_t)nfiles, sizeof(char *));
	if (!bufs)
		return ng_fail(NG_ERR_RUNTIME, "prepare: out of memory");
	int f = 0;
	while (f < nfiles && !st) {
		int first = f;
		size_t bytes = 0;
		ndocs = 0;
		while (f < nfiles && !st && (bytes == 0 || bytes < ROUND_BYTES)) {
			size_t len, before = ndocs;
			st = read_file(files[f], &bufs[f], &len);
			if (!st)
				st = split_docs(bufs[f], len, mode, sep, &docs, &ndocs, &cap);
			*ndocs_out += ndocs - before;
			if (!st)
				st = cut_long_docs(&docs, before, &ndocs, &cap);
			bytes += len;
			f++;
		}
		if (!st)
			st = encode_round(tok, docs, ndocs, thread_count(), val, val_left, train, bar,
					  &done);
		for (int i = first; i < f; i++)
			free(bufs[i]);
	}
	free(docs);
	free(bufs);
	return st;
}

enum ng_status ng_cmd_prepare(int argc, char **argv)
{
	struct prepare_args a = { .split = "whole", .val_tokens = 0, .shard_tokens = 100000000 };
	struct ng_flag flags[] = {
		{ "--vocab", NG_FLAG_STRING, &a.vocab, 0, 0, "DIR",
		  "directory with GPT-2's encoder.json and vocab.bpe (default $NG_GPT2_DIR, else the "
		  "tree's data/gpt2)", false },
		{ "--out", NG_FLAG_STRING, &a.out, 0, 0, "DIR",
		  "output directory for val_*.bin and train_*.bin (created if missing; required)",
		  false },
		{ "--split", NG_FLAG_STRING, &a.split, 0, 0, "whole|blank|LINE",
		  "documents: whole files, blank-line separated, or separated by lines equal to LINE "
		  "(e.g. %) (default whole)", false },
		{ "--val-tokens", NG_FLAG_INT, &a.val_tokens, 0, 1e12, "N",
		  "the first N tokens go to val shards (default 0: no val shard)", false },
		{ "--shard-tokens", NG_FLAG_INT, &a.shard_tokens, 1, INT32_MAX, "N",
		  "tokens per shard at most (default 100000000)", false },
	};
	struct ng_command_spec spec = {
		"prepare", "turn text files into GPT-2 token shards (every document starts with "
		"<|endoftext|>)", "[--vocab DIR] --out DIR [--split whole|blank|LINE] [--val-tokens N] "
		"[--shard-tokens N] FILE...", flags, (int)(sizeof(flags) / sizeof(flags[0])),
		MAX_FILES
	};
	char *files[MAX_FILES];
	int nfiles = 0;
	bool help;
	enum ng_status st = ng_cli_parse(&spec, argc, argv, files, &nfiles, &help);
	if (st || help)
		return st;
	if (!a.out || nfiles == 0) {
		ng_fail(NG_ERR_INPUT, "prepare: %s", !a.out ? "--out DIR is required"
			: "no input FILE given");
		ng_hint("nanograph prepare --out DIR FILE...");
		return NG_ERR_INPUT;
	}
	enum split_mode mode = strcmp(a.split, "whole") == 0 ? SPLIT_WHOLE
			       : strcmp(a.split, "blank") == 0 ? SPLIT_BLANK : SPLIT_LINE;
	if (mode == SPLIT_LINE && (!a.split[0] || strchr(a.split, '\n')))
		return ng_fail(NG_ERR_INPUT, "prepare --split: the separator line must be one "
			       "non-empty line");
	/* Check everything before any work: inputs, vocabulary, output directory. */
	struct bar bar = { .on = isatty(2), .t0 = now_s() };
	for (int i = 0; i < nfiles; i++) {
		struct stat sb;
		if (stat(files[i], &sb) != 0 || access(files[i], R_OK) != 0)
			return ng_fail(NG_ERR_INPUT, "prepare: cannot read %s: %s", files[i],
				       strerror(errno));
		if (!S_ISREG(sb.st_mode))
			return ng_fail(NG_ERR_INPUT, "prepare: %s is not a regular file (%s)", files[i],
				       ng_file_kind(sb.st_mode));
		bar.total += (size_t)sb.st_size;
	}
	struct ng_tokenizer tok;
	st = ng_tokenizer_load(&tok, a.vocab ? a.vocab : ng_tokenizer_default_dir());
	if (st)
		return st;
	double t_vocab = now_s() - bar.t0; /* one-time cost, reported apart from the text rate */
	bar.t0 = now_s();
	sigset_t old_mask;
	block_signals(&old_mask); /* the probe file of check_out_dir, and installing the handler */
	st = check_out_dir(a.out);
	if (st) {
		restore_signals(&old_mask);
		ng_tokenizer_free(&tok);
		return st;
	}
	size_t cap = (size_t)a.shard_tokens;
	struct sink val = { .dir = a.out, .prefix = "val", .cap = cap };
	struct sink train = { .dir = a.out, .prefix = "train", .cap = cap };
	struct sigaction sa = { .sa_handler = on_signal, .sa_flags = SA_RESTART }, old_int, old_term;
	sigemptyset(&sa.sa_mask);
	signal_sinks[0] = &val;
	signal_sinks[1] = &train;
	sigaction(SIGINT, &sa, &old_int);
	sigaction(SIGTERM, &sa, &old_term);
	restore_signals(&old_mask);
	val.buf = a.val_tokens ? malloc(cap * sizeof(uint16_t)) : NULL;
	train.buf = malloc(cap * sizeof(uint16_t));
	if ((a.val_tokens && !val.buf) || !train.buf)
		st = ng_fail(NG_ERR_RUNTIME, "prepare: out of memory for a %lld-token shard",
			     a.shard_tokens);
	size_t val_left = (size_t)a.val_tokens, ndocs = 0;
	if (!st)
		st = run_files(&tok, files, nfiles, mode, mode == SPLIT_LINE ? a.split : NULL, &val,
			       &val_left, &train, &bar, &ndocs);
	if (!st)
		st = sink_flush(&val);
	if (!st)
		st = sink_flush(&train);
	if (!st && train.total == 0) {
		ng_fail(NG_ERR_INPUT, "prepare: the input holds %zu tokens, none left for training "
			"after --val-tokens %lld", val.total, a.val_tokens);
		ng_hint("lower --val-tokens or give more text");
		st = NG_ERR_INPUT;
	}
	bar_draw(&bar, bar.total, true);
	/* Rename into place only now: a failure above leaves the output directory as it was. A
	 * signal waits for all of it (then the output is whole, and the signal ends the process
	 * once the handlers are restored: its default action). */
	block_signals(&old_mask);
	enum ng_status st2 = sink_finish(&val, st == NG_OK);
	enum ng_status st3 = sink_finish(&train, st == NG_OK && st2 == NG_OK);
	signal_sinks[0] = signal_sinks[1] = NULL;
	sigaction(SIGINT, &old_int, NULL);
	sigaction(SIGTERM, &old_term, NULL);
	restore_signals(&old_mask);
	st = st ? st : st2 ? st2 : st3;
	ng_tokenizer_free(&tok);
	if (st)
		return st;
	int stale = older_shards(a.out, "val", val.index) + older_shards(a.out, "train", train.index);
	if (stale)
		fprintf(stderr, "prepare: note: %s also holds %d older val_*/train_*.bin shards from "
			"an earlier run; remove them or they join these in a glob\n", a.out, stale);
	double dt = now_s() - bar.t0;
	fprintf(stderr, "prepare: %d files, %zu documents, %.2f MB -> %zu tokens (%zu val, %zu "
		"train) in %.2f s: %.1f MB/s of text (%.1f MB/s with the %.2f s vocabulary load); "
		"%d val + %d train shards in %s\n", nfiles, ndocs, bar.total / 1e6,
		val.total + train.total, val.total, train.total, dt,
		bar.total / 1e6 / (dt > 1e-9 ? dt : 1e-9), bar.total / 1e6 / (dt + t_vocab),
		t_vocab, val.index, train.index, a.out);
	return NG_OK;
}
