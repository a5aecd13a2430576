/*
 * graph/dump.h — the design's graph-dump tool: a planned step as Graphviz DOT and its arena as
 * SVG, for people to look at (nanograph dump) and for CI to check (dot -Tsvg renders it,
 * xmllint accepts the SVG, the sizes drawn equal the planner's).
 *
 * step.dot: ops are nodes (label: op name, its outputs as dtype[shape], the parameters it
 * reads, its workspace); tensors are edges from the op that last wrote them to each op that
 * reads them (xlabel and tooltip: the tensor's name), coloured by role; persistent tensors are
 * nodes with edges to the optimizer ops only (parameter reads are named in the op labels:
 * hundreds of edges from one node make dot's layout impractically slow); ops are grouped in
 * clusters per micro-batch and phase (input, forward, loss, backward, optimizer).
 *
 * arena.svg: the planned region over time. x is the op index, y the offset from the start of
 * the planned region (0 at the bottom); one <rect> per planned tensor with a <title> tooltip
 * ("name dtype[shape] role: N bytes (X MiB) at offset O, ops A..B") and data-name, data-bytes
 * (the tensor's bytes), data-offset (from the arena start, as ng_tensor.offset), data-first,
 * data-last attributes; the root <svg> carries data-arena-bytes, data-lower-bound-bytes and
 * data-persistent-bytes; the rectangles' group carries data-y0 (the pixel y of offset 0) and
 * data-px-per-byte, so rect height = bytes x px-per-byte and y = y0 - (offset - persistent
 * + bytes) x px-per-byte (heights under 0.2 px are drawn 0.2 px); the lower bound is a dashed
 * horizontal line (class "lower-bound").
 */
#ifndef NG_GRAPH_DUMP_H
#define NG_GRAPH_DUMP_H

#include "graph/ir.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Write the DOT of a planned graph to `path`. NG_ERR_INPUT when the file cannot be written. */
enum ng_status ng_dump_write_dot(const struct ng_graph *g, const char *path);
/* Write the arena SVG of a planned graph to `path`. */
enum ng_status ng_dump_write_arena_svg(const struct ng_graph *g, const char *path);
/* Create `dir` if needed (one level) and write dir/step.dot and dir/arena.svg. */
enum ng_status ng_dump_write_all(const struct ng_graph *g, const char *dir);

/* "bf16[64,1024,2304]" into buf (always NUL-terminated). */
void ng_dump_format_tensor(const struct ng_tensor *t, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
