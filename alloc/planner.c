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

#include <limits.h>
#include <stdbool.h>
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

static bool placed_less(const struct placed *a, const struct placed *b)
{
	return a->off < b->off || (a->off == b->off && a->end < b->end);
}

static void placed_swap(struct placed *a, struct placed *b)
{
	struct placed t = *a;
	*a = *b;
	*b = t;
}

/* Sort by (offset, end): quicksort with a median-of-three pivot, insertion sort below 16
 * entries, recursing into the smaller side. Inlined compares: this is the planner's hot loop. */
static void sort_placed(struct placed *v, int n)
{
	while (n > 16) {
		int mid = n / 2;
		if (placed_less(&v[mid], &v[0]))
			placed_swap(&v[mid], &v[0]);
		if (placed_less(&v[n - 1], &v[0]))
			placed_swap(&v[n - 1], &v[0]);
		if (placed_less(&v[n - 1], &v[mid]))
			placed_swap(&v[n - 1], &v[mid]);
		struct placed pivot = v[mid];
		int i = 0, j = n - 1;
		while (i <= j) {
			while (placed_less(&v[i], &pivot))
				i++;
			while (placed_less(&pivot, &v[j]))
				j--;
			if (i <= j)
				placed_swap(&v[i++], &v[j--]);
		}
		/* [0, j] and [i, n) remain */
		if (j + 1 < n - i) {
			sort_placed(v, j + 1);
			v += i;
			n -= i;
		} else {
			sort_placed(v + i, n - i);
			n = j + 1;
		}
	}
	for (int i = 1; i < n; i++) {
		struct placed x = v[i];
		int j = i - 1;
		while (j >= 0 && placed_less(&x, &v[j])) {
			v[j + 1] = v[j];
			j--;
		}
		v[j + 1] = x;
	}
}

/* Finding the placed intervals alive at the same time as interval i = those alive at op
 * first_i (a stabbing query on a segment tree over op indices) plus those that start in
 * (first_i, last_i] (a range of the intervals sorted by first). Both sets are disjoint, so no
 * interval is seen twice, and the work is the size of the answer plus O(log ops). */
struct time_index {
	int size;      /* leaves: a power of two >= the op count */
	int *node_at;  /* 2*size + 1 entries: CSR start of each tree node's interval list */
	int *node_iv;  /* the lists */
	int *by_first; /* interval indices sorted by first */
	int *firsts;   /* firsts[k] = iv[by_first[k]].first */
};

/* The canonical nodes of op range [l, r] in a tree of `size` leaves (at most 2 per level, so
 * 64 fit any int range); returns how many were written to nodes[]. */
static int canonical_nodes(int size, int l, int r, int *nodes)
{
	int n = 0, lo = l + size, hi = r + size + 1;
	while (lo < hi) {
		if (lo & 1)
			nodes[n++] = lo++;
		if (hi & 1)
			nodes[n++] = --hi;
		lo >>= 1;
		hi >>= 1;
	}
	return n;
}

static int cmp_first(const void *pa, const void *pb);

static bool time_index_build(struct time_index *ti, const struct ng_interval *iv, int n)
{
	int max_op = 0;
	for (int i = 0; i < n; i++)
		if (iv[i].last > max_op)
			max_op = iv[i].last;
	ti->size = 1;
	while (ti->size < max_op + 1)
		ti->size *= 2;
	size_t nodes = 2 * (size_t)ti->size;
	ti->node_at = calloc(nodes + 1, sizeof(int));
	ti->by_first = malloc((size_t)n * sizeof(int));
	ti->firsts = malloc((size_t)n * sizeof(int));
	ti->node_iv = NULL;
	if (!ti->node_at || !ti->by_first || !ti->firsts)
		return false;
	size_t total = 0;
	for (int i = 0; i < n; i++) {
		int nodes[64], c = canonical_nodes(ti->size, iv[i].first, iv[i].last, nodes);
		for (int q = 0; q < c; q++)
			ti->node_at[nodes[q] + 1]++;
		total += (size_t)c;
	}
	if (total > INT_MAX)
		return false;
	for (size_t k = 0; k < nodes; k++)
		ti->node_at[k + 1] += ti->node_at[k];
	ti->node_iv = malloc((total ? total : 1) * sizeof(int));
	int *fill = malloc(nodes * sizeof(int));
	if (!ti->node_iv || !fill) {
		free(fill);
		return false;
	}
	memcpy(fill, ti->node_at, nodes * sizeof(int));
	for (int i = 0; i < n; i++) {
		int nodes[64], c = canonical_nodes(ti->size, iv[i].first, iv[i].last, nodes);
		for (int q = 0; q < c; q++)
			ti->node_iv[fill[nodes[q]]++] = i;
	}
	free(fill);
	for (int i = 0; i < n; i++)
		ti->by_first[i] = i;
	sort_iv_ = iv;
	qsort(ti->by_first, (size_t)n, sizeof(int), cmp_first);
	for (int k = 0; k < n; k++)
		ti->firsts[k] = iv[ti->by_first[k]].first;
	return true;
}

static void time_index_free(struct time_index *ti)
{
	free(ti->node_at);
	free(ti->node_iv);
	free(ti->by_first);
	free(ti->firsts);
}

/* Place the intervals in `order`; offsets into off[], returns the arena size. */
static size_t place_in_order(const struct ng_interval *iv, const int *order, int n, size_t align,
			     size_t *off, const struct time_index *ti, char *placed,
			     struct placed *buf)
{
	size_t arena = 0;
	memset(placed, 0, (size_t)n);
	for (int k = 0; k < n; k++) {
		int i = order[k];
		size_t sz = align_up(iv[i].size, align);
		if (sz == 0) {
			off[i] = 0;
			continue;
		}
		int m = 0;
		/* alive at first_i */
		for (int nd = iv[i].first + ti->size; nd >= 1; nd >>= 1)
			for (int q = ti->node_at[nd]; q < ti->node_at[nd + 1]; q++) {
				int j = ti->node_iv[q];
				if (placed[j])
					buf[m++] = (struct placed){ off[j], off[j] + align_up(iv[j].size,
											     align) };
			}
		/* starting in (first_i, last_i] */
		int lo = 0, hi = n;
		while (lo < hi) {
			int mid = (lo + hi) / 2;
			if (ti->firsts[mid] <= iv[i].first)
				lo = mid + 1;
			else
				hi = mid;
		}
		for (int q = lo; q < n && ti->firsts[q] <= iv[i].last; q++) {
			int j = ti->by_first[q];
			if (placed[j])
				buf[m++] = (struct placed){ off[j], off[j] + align_up(iv[j].size,
										     align) };
		}
		sort_placed(buf, m);
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
		placed[i] = 1;
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
	struct time_index ti;
	bool ti_ok = time_index_build(&ti, iv, n);
	int *order = malloc(nn * sizeof(int));
	size_t *key = malloc(nn * sizeof(size_t));
	size_t *off_a = malloc(nn * sizeof(size_t));
	size_t *off_b = malloc(nn * sizeof(size_t));
	struct placed *buf = malloc(nn * sizeof(struct placed));
	char *placed = malloc(nn);
	enum ng_status st = NG_OK;
	if (!ti_ok || !order || !key || !off_a || !off_b || !buf || !placed) {
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
	size_t arena_a = place_in_order(iv, order, n, align, off_a, &ti, placed, buf);

	if (arena_a == ng_arena_lower_bound(iv, n, align)) {
		for (int i = 0; i < n; i++)
			iv[i].offset = off_a[i];
		*arena_bytes = arena_a;
		goto out_free;
	}
	/* order B: decreasing size x duration (saturating) */
	for (int i = 0; i < n; i++) {
		order[i] = i;
		size_t dur = (size_t)(iv[i].last - iv[i].first + 1);
		size_t s = align_up(iv[i].size, align);
		key[i] = s > SIZE_MAX / dur ? SIZE_MAX : s * dur;
	}
	qsort(order, nn, sizeof(int), cmp_key_desc);
	size_t arena_b = place_in_order(iv, order, n, align, off_b, &ti, placed, buf);

	const size_t *best = arena_b < arena_a ? off_b : off_a;
	for (int i = 0; i < n; i++)
		iv[i].offset = best[i];
	*arena_bytes = arena_b < arena_a ? arena_b : arena_a;
out_free:
	time_index_free(&ti);
	free(placed);
	free(order);
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
