/*
 * alloc/planner.h — the static arena planner: intervals in (size, first op, last op), offsets
 * out, so that no two intervals alive at the same op overlap in memory and the arena is small.
 * Pure C (no CUDA, nothing of the project but util/). Why: docs/DESIGN.md "Memory" — one arena
 * for the whole run, every tensor placed once.
 *
 * Lifetimes are closed ranges of op indices [first, last]: two intervals conflict when their
 * ranges intersect. Sizes are rounded up to the alignment before placing; offsets are multiples
 * of it.
 *
 * Algorithm: greedy best-fit by size ("greedy by size" of Pisarchyk & Lee, "Efficient Memory
 * Management for Deep Neural Net Inference", 2020): intervals in decreasing size; each takes the
 * smallest gap between already-placed, time-conflicting intervals that fits it, or the top.
 * A second order (by decreasing size x duration) is also tried and the smaller arena kept.
 * The lower bound is the largest total of (aligned) live bytes at any op: no placement can do
 * better, so arena / lower bound measures the planner.
 */
#ifndef NG_ALLOC_PLANNER_H
#define NG_ALLOC_PLANNER_H

#include <stddef.h>

#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NG_ARENA_ALIGN 256 /* default alignment, bytes */

struct ng_interval {
	size_t size;   /* bytes (rounded up to the alignment when placed); 0 = needs no memory */
	int first;     /* first op index that uses it */
	int last;      /* last op index that uses it (>= first) */
	size_t offset; /* out: bytes from the start of the planned region */
};

/* Place every interval; *arena_bytes = the region size (a multiple of align). align 0 = 256;
 * it must be a power of two. NG_ERR_INPUT for a bad alignment or last < first (naming the
 * interval), NG_ERR_RUNTIME when memory for the work arrays runs out. */
enum ng_status ng_arena_plan(struct ng_interval *iv, int n, size_t align, size_t *arena_bytes);

/* The largest total of live aligned bytes at any op (0 for n = 0). */
size_t ng_arena_lower_bound(const struct ng_interval *iv, int n, size_t align);

/* Prove the placement: every offset aligned, every interval inside [0, arena_bytes), and no two
 * intervals whose lifetimes intersect overlap in memory. NG_ERR_RUNTIME naming the first bad
 * pair otherwise. O(n log n + conflicts). */
enum ng_status ng_arena_validate(const struct ng_interval *iv, int n, size_t align,
				 size_t arena_bytes);

#ifdef __cplusplus
}
#endif

#endif
