/*
 * data/loader.c — the prefetching shard loader (order, positions and threading in loader.h).
 *
 * The consumer (ng_loader_next) and the prefetch thread share a ring of `prefetch` buffers:
 * buffers head .. head+filled-1 are ready, the thread fills buffer head+filled. A seek bumps
 * `generation`, so a buffer the thread was filling when the position changed is dropped.
 */
#include "data/loader.h"

#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/shard.h"
#include "util/rng.h"

/* The thread's view of the current epoch's order, the current shard's window order and the
 * mapped shard; rebuilt lazily as the fill position moves. */
struct fill_state {
	uint64_t epoch;      /* epoch of order/cum (UINT64_MAX: none yet) */
	uint64_t *order;     /* (nshards,) shard visiting order of that epoch */
	uint64_t *cum;       /* (nshards+1,) windows before each position of order */
	int perm_shard;      /* shard whose window order is in perm (-1: none) */
	uint64_t *perm;      /* (windows of perm_shard,) window order; NULL when not shuffled */
	int mapped;          /* shard index mapped in `shard` (-1: none) */
	struct ng_shard shard; /* the mapped shard */
};

static void shuffle_u64(uint64_t *a, uint64_t n, uint64_t seed)
{
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	for (uint64_t i = n; i > 1; i--) {
		uint64_t j = ng_rng_below(&r, i);
		uint64_t t = a[i - 1];
		a[i - 1] = a[j];
		a[j] = t;
	}
}

static void set_epoch(struct ng_loader *ld, struct fill_state *fs, uint64_t epoch)
{
	int n = ld->nshards;
	for (int i = 0; i < n; i++)
		fs->order[i] = (uint64_t)i;
	if (ld->cfg.shuffle)
		shuffle_u64(fs->order, (uint64_t)n, ng_rng_mix64(ld->cfg.seed ^ ng_rng_mix64(epoch)));
	fs->cum[0] = 0;
	for (int i = 0; i < n; i++)
		fs->cum[i + 1] = fs->cum[i] + ld->shards[fs->order[i]].windows;
	fs->epoch = epoch;
	fs->perm_shard = -1;
}

/* Window order of `shard` in the current epoch. */
static enum ng_status set_perm(struct ng_loader *ld, struct fill_state *fs, int shard)
{
	fs->perm_shard = shard;
	if (!ld->cfg.shuffle)
		return NG_OK;
	uint64_t n = ld->shards[shard].windows;
	free(fs->perm);
	fs->perm = malloc((n ? n : 1) * sizeof(uint64_t));
	if (!fs->perm)
		return ng_fail(NG_ERR_RUNTIME, "loader: out of memory for %llu window indices",
			       (unsigned long long)n);
	for (uint64_t i = 0; i < n; i++)
		fs->perm[i] = i;
	uint64_t key = ng_rng_mix64(ld->cfg.seed ^ ng_rng_mix64(fs->epoch));
	shuffle_u64(fs->perm, n, ng_rng_mix64(key + (uint64_t)shard));
	return NG_OK;
}

/* Fill `out` with the batch at `pos` for this rank. */
static enum ng_status fill_batch(struct ng_loader *ld, struct fill_state *fs,
				 struct ng_loader_pos pos, uint16_t *out)
{
	const int B = ld->cfg.B, T = ld->cfg.T;
	if (fs->epoch != pos.epoch)
		set_epoch(ld, fs, pos.epoch);
	uint64_t base = pos.batch * (uint64_t)B * ld->cfg.world + (uint64_t)ld->cfg.rank * B;
	for (int i = 0; i < B; i++) {
		uint64_t s = base + (uint64_t)i;
		int lo = 0, hi = ld->nshards; /* find j with cum[j] <= s < cum[j+1] */
		while (hi - lo > 1) {
			int mid = (lo + hi) / 2;
			if (fs->cum[mid] <= s)
				lo = mid;
			else
				hi = mid;
		}
		while (fs->cum[lo + 1] <= s) /* skip empty shards at equal cum */
			lo++;
		int shard = (int)fs->order[lo];
		if (fs->perm_shard != shard) {
			enum ng_status st = set_perm(ld, fs, shard);
			if (st)
				return st;
		}
		uint64_t w = s - fs->cum[lo];
		if (ld->cfg.shuffle)
			w = fs->perm[w];
		if (fs->mapped != shard) {
			ng_shard_close(&fs->shard);
			fs->mapped = -1;
			struct ng_loader_shard_ *sh = &ld->shards[shard];
			enum ng_status st = ng_shard_open(&fs->shard, sh->path,
							  sh->checked ? 0 : ld->cfg.vocab);
			if (st)
				return st;
			if (fs->shard.count != sh->count)
				return ng_fail(NG_ERR_INPUT, "shard %s: changed on disk (%zu tokens, "
					       "%zu at open)", sh->path, fs->shard.count, sh->count);
			sh->checked = true;
			fs->mapped = shard;
		}
		memcpy(out + (size_t)i * (T + 1), fs->shard.tokens + w * (uint64_t)T,
		       (size_t)(T + 1) * sizeof(uint16_t));
	}
	return NG_OK;
}

static struct ng_loader_pos advance(const struct ng_loader *ld, struct ng_loader_pos p)
{
	if (++p.batch >= ld->batches_per_epoch) {
		p.batch = 0;
		p.epoch++;
	}
	return p;
}

static void *prefetch_main(void *arg)
{
	struct ng_loader *ld = arg;
	pthread_setname_np(pthread_self(), "ng-prefetch"); /* for top, gdb and the tests */
	struct fill_state fs = { .epoch = UINT64_MAX, .perm_shard = -1, .mapped = -1 };
	fs.order = malloc((size_t)ld->nshards * sizeof(uint64_t));
	fs.cum = malloc((size_t)(ld->nshards + 1) * sizeof(uint64_t));
	pthread_mutex_lock(&ld->mu);
	if (!fs.order || !fs.cum) {
		ld->error = NG_ERR_RUNTIME;
		snprintf(ld->error_msg, sizeof(ld->error_msg), "loader: out of memory");
		pthread_cond_broadcast(&ld->cv);
	}
	for (;;) {
		while (!ld->stop && (ld->filled == ld->cfg.prefetch || ld->error))
			pthread_cond_wait(&ld->cv, &ld->mu);
		if (ld->stop)
			break;
		int slot = (ld->head + ld->filled) % ld->cfg.prefetch;
		struct ng_loader_pos pos = ld->fill;
		uint64_t gen = ld->generation;
		pthread_mutex_unlock(&ld->mu);
		ng_clear_error();
		enum ng_status st = fill_batch(ld, &fs, pos, ld->ring[slot]);
		pthread_mutex_lock(&ld->mu);
		if (gen != ld->generation)
			continue; /* a seek happened meanwhile: this batch is stale */
		if (st) {
			ld->error = st;
			snprintf(ld->error_msg, sizeof(ld->error_msg), "%s", ng_error_message());
			snprintf(ld->error_hint, sizeof(ld->error_hint), "%s", ng_error_hint());
		} else {
			ld->ring_pos[slot] = pos;
			ld->filled++;
			ld->fill = advance(ld, pos);
		}
		pthread_cond_broadcast(&ld->cv);
	}
	pthread_mutex_unlock(&ld->mu);
	ng_shard_close(&fs.shard);
	free(fs.order);
	free(fs.cum);
	free(fs.perm);
	return NULL;
}

static void *default_alloc(size_t bytes, void *ctx)
{
	(void)ctx;
	return malloc(bytes);
}

static void default_free(void *p, void *ctx)
{
	(void)ctx;
	free(p);
}

/* Fail open when the shards hold less than one batch, naming the file(s). */
static enum ng_status too_small(const struct ng_loader *ld)
{
	const struct ng_loader_config *c = &ld->cfg;
	unsigned long long need = (unsigned long long)c->B * c->world;
	unsigned long long need_tok = need * (unsigned long long)c->T + 1;
	if (ld->nshards == 1)
		ng_fail(NG_ERR_INPUT,
			"shard %s: %zu tokens hold %llu windows of T+1=%d tokens, fewer than one "
			"batch of B x world = %llu windows (%llu tokens)", ld->shards[0].path,
			ld->shards[0].count, (unsigned long long)ld->windows, c->T + 1, need,
			need_tok);
	else {
		int small = 0; /* the largest shard, to name one file */
		for (int i = 1; i < ld->nshards; i++)
			if (ld->shards[i].count > ld->shards[small].count)
				small = i;
		ng_fail(NG_ERR_INPUT,
			"shards '%s': %d files (%d smaller than one window of T+1=%d tokens; the "
			"largest, %s, has %zu tokens) hold %llu windows in all, fewer than one batch "
			"of B x world = %llu windows", c->pattern, ld->nshards, ld->skipped, c->T + 1,
			ld->shards[small].path, ld->shards[small].count,
			(unsigned long long)ld->windows, need);
	}
	ng_hint("use a smaller --batch or --seq-len, or more data");
	return NG_ERR_INPUT;
}

enum ng_status ng_loader_open(struct ng_loader *ld, const struct ng_loader_config *cfg)
{
	memset(ld, 0, sizeof(*ld));
	if (!cfg->pattern || !cfg->pattern[0])
		return ng_fail(NG_ERR_INPUT, "loader: no shard pattern given");
	if (cfg->B < 1 || cfg->T < 1 || cfg->vocab < 1 || cfg->vocab > 65536 || cfg->world < 1 ||
	    cfg->rank < 0 || cfg->rank >= cfg->world || cfg->prefetch < 2)
		return ng_fail(NG_ERR_INPUT, "loader '%s': bad configuration B=%d T=%d vocab=%d "
			       "rank=%d world=%d prefetch=%d", cfg->pattern, cfg->B, cfg->T,
			       cfg->vocab, cfg->rank, cfg->world, cfg->prefetch);
	if (!cfg->alloc != !cfg->free)
		return ng_fail(NG_ERR_INPUT, "loader '%s': give both alloc and free, or neither",
			       cfg->pattern);
	ld->cfg = *cfg;
	if (!ld->cfg.alloc) {
		ld->cfg.alloc = default_alloc;
		ld->cfg.free = default_free;
	}
	glob_t g;
	int gr = glob(cfg->pattern, 0, NULL, &g);
	if (gr == GLOB_NOMATCH) {
		ng_fail(NG_ERR_INPUT, "no files match '%s'", cfg->pattern);
		ng_hint("check the path; nanograph prepare writes train_*.bin and val_*.bin");
		return NG_ERR_INPUT;
	}
	if (gr != 0)
		return ng_fail(NG_ERR_INPUT, "cannot list '%s' (%s)", cfg->pattern,
			       gr == GLOB_NOSPACE ? "out of memory" : "read error");
	enum ng_status st = NG_OK;
	ld->shards = calloc(g.gl_pathc, sizeof(*ld->shards));
	if (!ld->shards) {
		globfree(&g);
		return ng_fail(NG_ERR_RUNTIME, "loader: out of memory");
	}
	ld->nshards = (int)g.gl_pathc;
	for (size_t i = 0; i < g.gl_pathc && !st; i++) {
		struct ng_loader_shard_ *sh = &ld->shards[i];
		sh->path = strdup(g.gl_pathv[i]);
		if (!sh->path) {
			st = ng_fail(NG_ERR_RUNTIME, "loader: out of memory");
			break;
		}
		st = ng_shard_read_header(sh->path, &sh->count);
		if (st)
			break;
		sh->windows = sh->count >= (size_t)cfg->T + 1 ? (sh->count - 1) / cfg->T : 0;
		ld->skipped += sh->windows == 0;
		ld->windows += sh->windows;
	}
	globfree(&g);
	ld->batches_per_epoch = ld->windows / ((uint64_t)cfg->B * cfg->world);
	if (!st && ld->batches_per_epoch == 0)
		st = too_small(ld);
	if (st)
		goto fail;
	ld->batch_tokens = (size_t)cfg->B * (cfg->T + 1);
	ld->ring = calloc((size_t)cfg->prefetch, sizeof(*ld->ring));
	ld->ring_pos = calloc((size_t)cfg->prefetch, sizeof(*ld->ring_pos));
	if (!ld->ring || !ld->ring_pos) {
		st = ng_fail(NG_ERR_RUNTIME, "loader: out of memory");
		goto fail;
	}
	for (int i = 0; i < cfg->prefetch; i++) {
		ld->ring[i] = ld->cfg.alloc(ld->batch_tokens * sizeof(uint16_t), ld->cfg.alloc_ctx);
		if (!ld->ring[i]) {
			st = ng_fail(NG_ERR_RUNTIME, "loader: cannot allocate a %zu-byte batch buffer",
				     ld->batch_tokens * sizeof(uint16_t));
			goto fail;
		}
	}
	ld->next = (struct ng_loader_pos){ .seed = cfg->seed, .windows = ld->windows };
	ld->fill = ld->next;
	pthread_mutex_init(&ld->mu, NULL);
	pthread_cond_init(&ld->cv, NULL);
	if (pthread_create(&ld->thread, NULL, prefetch_main, ld) != 0) {
		pthread_mutex_destroy(&ld->mu);
		pthread_cond_destroy(&ld->cv);
		st = ng_fail(NG_ERR_RUNTIME, "loader: cannot start the prefetch thread");
		goto fail;
	}
	ld->thread_started = true;
	return NG_OK;
fail:
	ng_loader_close(ld);
	return st;
}

enum ng_status ng_loader_next(struct ng_loader *ld, const uint16_t **batch)
{
	*batch = NULL;
	pthread_mutex_lock(&ld->mu);
	if (ld->holding) {
		ld->head = (ld->head + 1) % ld->cfg.prefetch;
		ld->filled--;
		ld->holding = false;
		pthread_cond_broadcast(&ld->cv);
	}
	while (ld->filled == 0 && !ld->error)
		pthread_cond_wait(&ld->cv, &ld->mu);
	if (ld->filled == 0) {
		enum ng_status st = ld->error;
		char msg[sizeof(ld->error_msg)], hint[sizeof(ld->error_hint)];
		memcpy(msg, ld->error_msg, sizeof(msg));
		memcpy(hint, ld->error_hint, sizeof(hint));
		pthread_mutex_unlock(&ld->mu);
		ng_fail(st, "%s", msg);
		if (hint[0])
			ng_hint("%s", hint);
		return st;
	}
	*batch = ld->ring[ld->head];
	ld->holding = true;
	ld->next = advance(ld, ld->ring_pos[ld->head]);
	pthread_mutex_unlock(&ld->mu);
	return NG_OK;
}

void ng_loader_tell(const struct ng_loader *ld, struct ng_loader_pos *pos) { *pos = ld->next; }

enum ng_status ng_loader_seek(struct ng_loader *ld, const struct ng_loader_pos *pos)
{
	if (pos->seed != ld->cfg.seed || pos->windows != ld->windows ||
	    pos->batch >= ld->batches_per_epoch) {
		ng_fail(NG_ERR_INPUT, "loader '%s': cannot resume at epoch %llu batch %llu (seed %llu, "
			"%llu windows): this loader has seed %llu, %llu windows, %llu batches per "
			"epoch", ld->cfg.pattern, (unsigned long long)pos->epoch,
			(unsigned long long)pos->batch, (unsigned long long)pos->seed,
			(unsigned long long)pos->windows, (unsigned long long)ld->cfg.seed,
			(unsigned long long)ld->windows, (unsigned long long)ld->batches_per_epoch);
		ng_hint("resume with the same --seed, shards, batch size and sequence length");
		return NG_ERR_INPUT;
	}
	pthread_mutex_lock(&ld->mu);
	ld->generation++;
	ld->filled = 0;
	ld->holding = false;
	ld->error = NG_OK;
	ld->error_msg[0] = ld->error_hint[0] = '\0';
	ld->fill = *pos;
	ld->next = *pos;
	pthread_cond_broadcast(&ld->cv);
	pthread_mutex_unlock(&ld->mu);
	return NG_OK;
}

enum ng_status ng_loader_rewind(struct ng_loader *ld)
{
	struct ng_loader_pos p = { .seed = ld->cfg.seed, .windows = ld->windows };
	return ng_loader_seek(ld, &p);
}

void ng_loader_close(struct ng_loader *ld)
{
	if (ld->thread_started) {
		pthread_mutex_lock(&ld->mu);
		ld->stop = true;
		pthread_cond_broadcast(&ld->cv);
		pthread_mutex_unlock(&ld->mu);
		pthread_join(ld->thread, NULL);
		pthread_mutex_destroy(&ld->mu);
		pthread_cond_destroy(&ld->cv);
	}
	if (ld->ring) {
		for (int i = 0; i < ld->cfg.prefetch; i++)
			if (ld->ring[i])
				ld->cfg.free(ld->ring[i], ld->cfg.alloc_ctx);
		free(ld->ring);
	}
	free(ld->ring_pos);
	for (int i = 0; ld->shards && i < ld->nshards; i++)
		free(ld->shards[i].path);
	free(ld->shards);
	memset(ld, 0, sizeof(*ld));
}
