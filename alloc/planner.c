/*
 * alloc/planner.c — greedy best-fit arena planning, its lower bound and its validator
 * (see planner.h for the contract and the reference).
 *
 * Placement of one interval: collect the already-placed intervals whose lifetimes intersect
 * it, sort them by offset, walk the gaps between them and take the smallest gap that fits
 * (best fit); when none fits, go on top of the highest. Two visiting orders are tried (size,
 * then size x duration, both decreasing) and the smaller arena wins.
 */
#include "alloc/planner.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static size_t align_up(size_t x, size_t a)
{
	return (x + a - 1) / a * a;
}

/* Sorting helpers: qsort over indices with a file-scope key array (qsort has no context). */
static const struct ng_interval *sort_iv_;
static const size_t *sort_key_;

static int cmp_key_desc(const void *pa, const void *pb)
{
	int a = *(const int *)pa, b = *(const int *)pb;
	if (sort_key_[a] != sort_key_[b])
		return sort_key_[a] > sort_key_[b] ? -1 : 1;
	if (sort_iv_[a].first != sort_iv_[b].first)
		return sort_iv_[a].first < sort_iv_[b].first ? -1 : 1;
	return a < b ? -1 : a > b;
}

struct placed {
	size_t off; /* offset */
	size_t end; /* offset + aligned size */
};

static int cmp_placed(const void *pa, const void *pb)
{
	const struct placed *a = pa, *b = pb;
	if (a->off != b->off)
		return a->off < b->off ? -1 : 1;
	return a->end < b->end ? -1 : a->end > b->end;
}

/* Place the intervals in `order`; offsets into off[], returns the arena size. */
static size_t place_in_order(const struct ng_interval *iv, const int *order, int n, size_t align,
			     size_t *off, int *done_list, struct placed *buf)
{
	size_t arena = 0;
	int n_done = 0;
	for (int k = 0; k < n; k++) {
		int i = order[k];
		size_t sz = align_up(iv[i].size, align);
		if (sz == 0) {
			off[i] = 0;
			continue;
		}
		int m = 0;
		for (int d = 0; d < n_done; d++) {
			int j = done_list[d];
			if (iv[j].first <= iv[i].last && iv[i].first <= iv[j].last)
				buf[m++] = (struct placed){ off[j], off[j] + align_up(iv[j].size,
										       align) };
		}
		qsort(buf, (size_t)m, sizeof(*buf), cmp_placed);
		size_t best = SIZE_MAX, best_gap = SIZE_MAX, cursor = 0;
		for (int q = 0; q < m; q++) {
			if (buf[q].off > cursor) {
				size_t gap = buf[q].off - cursor;
				if (gap >= sz && gap < best_gap) {
					best_gap = gap;
					best = cursor;
				}
			}
			if (buf[q].end > cursor)
				cursor = buf[q].end;
		}
		if (best == SIZE_MAX)
			best = cursor; /* on top */
		off[i] = best;
		if (best + sz > arena)
			arena = best + sz;
		done_list[n_done++] = i;
	}
	return arena;
}

enum ng_status ng_arena_plan(struct ng_interval *iv, int n, size_t align, size_t *arena_bytes)
{
	if (align == 0)
		align = NG_ARENA_ALIGN;
	if (align & (align - 1))
		return ng_fail(NG_ERR_INPUT, "planner: alignment %zu is not a power of two", align);
	*arena_bytes = 0;
	for (int i = 0; i < n; i++)
		if (iv[i].first < 0 || iv[i].last < iv[i].first)
			return ng_fail(NG_ERR_INPUT, "planner: interval %d has lifetime [%d, %d]", i,
				       iv[i].first, iv[i].last);
	if (n <= 0)
		return NG_OK;
	size_t nn = (size_t)n;
	int *order = malloc(nn * sizeof(int));
	int *done = malloc(nn * sizeof(int));
	size_t *key = malloc(nn * sizeof(size_t));
	size_t *off_a = malloc(nn * sizeof(size_t));
	size_t *off_b = malloc(nn * sizeof(size_t));
	struct placed *buf = malloc(nn * sizeof(struct placed));
	enum ng_status st = NG_OK;
	if (!order || !done || !key || !off_a || !off_b || !buf) {
		st = ng_fail(NG_ERR_RUNTIME, "planner: out of host memory for %d intervals", n);
		goto out_free;
	}
	sort_iv_ = iv;
	sort_key_ = key;

	/* order A: decreasing size */
	for (int i = 0; i < n; i++) {
		order[i] = i;
		key[i] = align_up(iv[i].size, align);
	}
	qsort(order, nn, sizeof(int), cmp_key_desc);
	size_t arena_a = place_in_order(iv, order, n, align, off_a, done, buf);

	/* order B: decreasing size x duration (saturating) */
	for (int i = 0; i < n; i++) {
		order[i] = i;
		size_t dur = (size_t)(iv[i].last - iv[i].first + 1);
		size_t s = align_up(iv[i].size, align);
		key[i] = s > SIZE_MAX / dur ? SIZE_MAX : s * dur;
	}
	qsort(order, nn, sizeof(int), cmp_key_desc);
	size_t arena_b = place_in_order(iv, order, n, align, off_b, done, buf);

	const size_t *best = arena_b < arena_a ? off_b : off_a;
	for (int i = 0; i < n; i++)
		iv[i].offset = best[i];
	*arena_bytes = arena_b < arena_a ? arena_b : arena_a;
out_free:
	free(order);
	free(done);
	free(key);
	free(off_a);
	free(off_b);
	free(buf);
	return st;
}

size_t ng_arena_lower_bound(const struct ng_interval *iv, int n, size_t align)
{
	if (align == 0)
		align = NG_ARENA_ALIGN;
	int max_op = -1;
	for (int i = 0; i < n; i++)
		if (iv[i].last > max_op)
			max_op = iv[i].last;
	if (max_op < 0)
		return 0;
	/* difference array over op indices: +size at first, -size after last */
	long long *d = calloc((size_t)max_op + 2, sizeof(long long));
	if (!d)
		return 0;
	for (int i = 0; i < n; i++) {
		if (iv[i].first < 0 || iv[i].last < iv[i].first)
			continue;
		long long s = (long long)align_up(iv[i].size, align);
		d[iv[i].first] += s;
		d[iv[i].last + 1] -= s;
	}
	long long live = 0, peak = 0;
	for (int t = 0; t <= max_op; t++) {
		live += d[t];
		if (live > peak)
			peak = live;
	}
	free(d);
	return (size_t)peak;
}

static int cmp_first(const void *pa, const void *pb)
{
	int a = *(const int *)pa, b = *(const int *)pb;
	if (sort_iv_[a].first != sort_iv_[b].first)
		return sort_iv_[a].first < sort_iv_[b].first ? -1 : 1;
	return a < b ? -1 : a > b;
}

/* Validation sweeps op time: the intervals alive at one op form a set sorted by offset; an
 * interval starting is checked against its neighbours in that set only (if the set had no
 * overlap before, a new overlap must involve a neighbour). */
enum ng_status ng_arena_validate(const struct ng_interval *iv, int n, size_t align,
				 size_t arena_bytes)
{
	if (align == 0)
		align = NG_ARENA_ALIGN;
	for (int i = 0; i < n; i++) {
		size_t sz = align_up(iv[i].size, align);
		if (iv[i].offset % align)
			return ng_fail(NG_ERR_RUNTIME, "planner: interval %d offset %zu is not a "
				       "multiple of %zu", i, iv[i].offset, align);
		if (sz && iv[i].offset + sz > arena_bytes)
			return ng_fail(NG_ERR_RUNTIME, "planner: interval %d [%zu, +%zu) ends past "
				       "the arena (%zu bytes)", i, iv[i].offset, sz, arena_bytes);
	}
	if (n <= 0)
		return NG_OK;
	int *order = malloc((size_t)n * sizeof(int));
	int *act = malloc((size_t)n * sizeof(int));
	if (!order || !act) {
		free(order);
		free(act);
		return ng_fail(NG_ERR_RUNTIME, "planner: out of host memory validating");
	}
	int m = 0;
	for (int i = 0; i < n; i++)
		if (iv[i].size)
			order[m++] = i;
	sort_iv_ = iv;
	qsort(order, (size_t)m, sizeof(int), cmp_first);
	enum ng_status st = NG_OK;
	int n_act = 0;
	for (int k = 0; k < m && st == NG_OK; k++) {
		int i = order[k];
		/* retire intervals that ended before this one starts */
		int w = 0;
		for (int a = 0; a < n_act; a++)
			if (iv[act[a]].last >= iv[i].first)
				act[w++] = act[a];
		n_act = w;
		/* binary search by offset */
		int lo = 0, hi = n_act;
		while (lo < hi) {
			int mid = (lo + hi) / 2;
			if (iv[act[mid]].offset < iv[i].offset)
				lo = mid + 1;
			else
				hi = mid;
		}
		size_t end_i = iv[i].offset + align_up(iv[i].size, align);
		int bad = -1;
		if (lo > 0) {
			int p = act[lo - 1];
			if (iv[p].offset + align_up(iv[p].size, align) > iv[i].offset)
				bad = p;
		}
		if (bad < 0 && lo < n_act && iv[act[lo]].offset < end_i)
			bad = act[lo];
		if (bad >= 0) {
			st = ng_fail(NG_ERR_RUNTIME, "planner: intervals %d [%zu, +%zu) ops [%d, %d] "
				     "and %d [%zu, +%zu) ops [%d, %d] overlap", bad, iv[bad].offset,
				     iv[bad].size, iv[bad].first, iv[bad].last, i, iv[i].offset,
				     iv[i].size, iv[i].first, iv[i].last);
			break;
		}
		memmove(act + lo + 1, act + lo, (size_t)(n_act - lo) * sizeof(int));
		act[lo] = i;
		n_act++;
	}
	free(order);
	free(act);
	return st;
}
