/*
 * tools/bench_sustained.h — one definition of "sustained" timing for the bench tools: a kernel
 * (or any launch sequence) timed with the GPU held busy, as the autotune ranks candidates.
 * On the H200 the step runs at the 700 W power cap, so a short burst at the idle clock ranks
 * kernels differently from the step (BENCHMARKS.md, session 17).
 *
 * ng_time_sustained(): ~150 ms of launches back to back to reach the power-limited clock, then
 * ~150 ms of launches between two events; *ms is the time a launch. est_ms sizes the batches
 * (<= 0: measured first from 20 launches).
 */
#ifndef NG_TOOLS_BENCH_SUSTAINED_H
#define NG_TOOLS_BENCH_SUSTAINED_H

#include <cuda_runtime.h>

#include "kernels/check.h"

/* One launch on stream 0; nonzero on failure. */
typedef int (*ng_bench_launch_fn)(const void *arg);

/* k launches between two events: *ms a launch. */
static inline int ng_bench_batch(ng_bench_launch_fn fn, const void *arg, cudaEvent_t *ev, int k,
				 float *ms)
{
	cudaEventRecord(ev[0], 0);
	for (int r = 0; r < k; r++)
		if (fn(arg))
			return 1;
	cudaEventRecord(ev[1], 0);
	if (NG_CUDA_CHECK(cudaEventSynchronize(ev[1])))
		return 1;
	cudaEventElapsedTime(ms, ev[0], ev[1]);
	*ms /= (float)k;
	return 0;
}

static inline int ng_time_sustained(ng_bench_launch_fn fn, const void *arg, cudaEvent_t *ev,
				    float est_ms, float *ms)
{
	if (est_ms <= 0.0f && ng_bench_batch(fn, arg, ev, 20, &est_ms))
		return 1;
	int k = (int)(150.0f / est_ms);
	k = k < 20 ? 20 : k > 20000 ? 20000 : k;
	/* the first batch heats the GPU to its power-limited clock; the second is the figure */
	return ng_bench_batch(fn, arg, ev, k, ms) || ng_bench_batch(fn, arg, ev, k, ms);
}

#endif
