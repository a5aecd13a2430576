/*
 * data/loader.h — the prefetching batch loader over token shards.
 *
 * A batch is B windows of T+1 consecutive tokens, (B, T+1) uint16 row-major: inputs are
 * columns 0..T-1, targets 1..T. Window w of a shard is tokens [w*T, w*T + T] (windows overlap
 * by one token, so a shard of N tokens holds (N-1)/T windows).
 *
 * Order. Epoch e's window stream is: the shards in an order shuffled from (seed, e), and within
 * each shard its windows in an order shuffled from (seed, e, shard). Batch k of the epoch is
 * stream windows [k*B*world, (k+1)*B*world); rank r takes the r-th run of B of them, so ranks
 * read disjoint windows. An epoch has floor(total windows / (B*world)) batches; then the next
 * epoch starts. shuffle = false (validation): shards in sorted order, windows in file order,
 * every epoch the same.
 *
 * Because every order derives from (seed, epoch), a position is just (epoch, batch): saving
 * and restoring it (ng_loader_tell / ng_loader_seek) resumes exactly.
 *
 * Shards are listed and their headers checked at open; each shard's tokens are checked against
 * vocab the first time the thread maps it (an error there reaches ng_loader_next). A shard
 * smaller than one window (T+1 tokens) contributes nothing and is counted in `skipped`; if all
 * windows together are fewer than one batch, open fails naming the file(s).
 *
 * Threads: one background thread fills a ring of `prefetch` host buffers (from cfg->alloc, e.g.
 * cudaHostAlloc'ed pinned memory) ahead of the consumer. ng_loader_* must be called from one
 * thread.
 */
#ifndef NG_DATA_LOADER_H
#define NG_DATA_LOADER_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ng_loader_config {
	const char *pattern;  /* glob of shard files */
	int B, T;             /* a batch is B windows of T+1 consecutive tokens (uint16) */
	int vocab;            /* every token must be < vocab (validated when a shard is opened) */
	int rank, world;      /* ranks read disjoint windows; 0 <= rank < world */
	uint64_t seed;        /* shard order and window order shuffled per epoch from it */
	bool shuffle;         /* false for validation: shards in sorted order, windows in order */
	int prefetch;         /* ring depth (host buffers filled ahead by the thread), >= 2 */
	void *(*alloc)(size_t bytes, void *ctx); /* buffer allocator (NULL: malloc) — the GPU */
	void (*free)(void *p, void *ctx);        /* path passes cudaHostAlloc here */
	void *alloc_ctx;      /* passed to alloc and free */
};

/* Where the loader is: the position of one batch. Everything else (shard order, window order)
 * is derived from (seed, epoch), so these fields restore the loader exactly. */
struct ng_loader_pos {
	uint64_t seed;    /* the config's seed (seek refuses a position made with another) */
	uint64_t windows; /* windows in an epoch (seek refuses a position over other shards) */
	uint64_t epoch;   /* 0, 1, ... */
	uint64_t batch;   /* batch index within the epoch */
};

struct ng_loader_shard_ {
	char *path;       /* file name (from the glob, sorted) */
	size_t count;     /* tokens, from the header */
	uint64_t windows; /* (count-1)/T, 0 when the shard is smaller than one window */
	bool checked;     /* tokens validated against vocab once */
};

struct ng_loader {
	struct ng_loader_config cfg;      /* copy of the configuration (pattern not owned) */
	struct ng_loader_shard_ *shards;  /* (nshards,) sorted by path */
	int nshards;                      /* files matched by the glob */
	int skipped;                      /* shards smaller than one window (contribute nothing) */
	uint64_t windows;                 /* windows per epoch, all shards */
	uint64_t batches_per_epoch;       /* floor(windows / (B * world)) */
	size_t batch_tokens;              /* B * (T+1) */
	uint16_t **ring;                  /* (prefetch,) buffers of batch_tokens tokens */
	struct ng_loader_pos *ring_pos;   /* (prefetch,) position of the batch in each buffer */
	int head;                         /* ring index of the next batch to hand out */
	int filled;                       /* ready buffers starting at head (the held one included) */
	bool holding;                     /* the consumer holds ring[head] (returned by next) */
	struct ng_loader_pos next;        /* position of the next batch ng_loader_next returns */
	struct ng_loader_pos fill;        /* position of the next batch the thread fills */
	uint64_t generation;              /* bumped by seek: buffers filled before are dropped */
	bool stop;                        /* close asks the thread to exit */
	enum ng_status error;             /* the thread's failure (NG_OK when none) */
	char error_msg[1024];             /* its message, copied out of the thread-local slot */
	char error_hint[512];             /* its hint */
	pthread_t thread;                 /* the prefetch thread */
	bool thread_started;              /* thread is running (join on close) */
	pthread_mutex_t mu;               /* guards head..error_hint */
	pthread_cond_t cv;                /* signalled on every state change */
};

enum ng_status ng_loader_open(struct ng_loader *ld, const struct ng_loader_config *cfg);
/* Blocks until the next batch is ready; *batch points at B*(T+1) uint16 tokens in a ring
 * buffer owned by the loader, valid until the next ng_loader_next / seek / close call. */
enum ng_status ng_loader_next(struct ng_loader *ld, const uint16_t **batch);
/* Position of the NEXT batch ng_loader_next will return. */
void ng_loader_tell(const struct ng_loader *ld, struct ng_loader_pos *pos);
/* Continue from `pos` (from ng_loader_tell, maybe in an earlier run). */
enum ng_status ng_loader_seek(struct ng_loader *ld, const struct ng_loader_pos *pos);
/* Back to epoch 0, batch 0 (validation passes start here). */
enum ng_status ng_loader_rewind(struct ng_loader *ld);
void ng_loader_close(struct ng_loader *ld);

#ifdef __cplusplus
}
#endif

#endif
