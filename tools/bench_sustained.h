/*
 * tools/bench_sustained.h — one definition of "sustained" timing for the bench tools: a kernel
 * (or any launch sequence) timed with the GPU held busy, as the autotune ranks candidates.
 * On the H200 the step runs at the 700 W power cap, so a short burst at the idle clock ranks
 * kernels differently from the step (BENCHMARKS.md).
 *
 * ng_time_sustained(): ~150 ms of launches back to back to reach the power-limited clock, then
 * ~150 ms of launches between two events; *ms is the time a launch. est_ms sizes the batches
 * (<= 0: measured first from 20 launches). ng_time_energy(): longer batches, and the energy a
 * launch from the GPU's counter where the driver offers one.
 */
#ifndef NG_TOOLS_BENCH_SUSTAINED_H
#define NG_TOOLS_BENCH_SUSTAINED_H

#include <cuda_runtime.h>
#include <dlfcn.h>

#include "kernels/check.h"

/* The GPU's energy counter (NVML's nvmlDeviceGetTotalEnergyConsumption: millijoules since the
 * driver loaded, device 0), through dlopen so that no build links the driver's library. 0 and
 * *mj set when it can be read; -1 where there is no NVML or no counter (then every caller
 * prints times only). The step runs at the power cap, where its time is its energy: a kernel
 * that spends less energy is what shortens it (BENCHMARKS.md). */
static inline int ng_energy_mj(unsigned long long *mj)
{
	typedef int (*init_fn)(void);
	typedef int (*handle_fn)(unsigned, void **);
	typedef int (*energy_fn)(void *, unsigned long long *);
	static int state; /* 0 untried, 1 ready, -1 unavailable */
	static void *dev;
	static energy_fn energy;
	if (state == 0) {
		void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
		init_fn init = lib ? (init_fn)dlsym(lib, "nvmlInit_v2") : NULL;
		handle_fn handle = lib ? (handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2") : NULL;
		energy = lib ? (energy_fn)dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption") : NULL;
		unsigned long long probe;
		state = init && handle && energy && init() == 0 && handle(0, &dev) == 0 &&
				energy(dev, &probe) == 0
			? 1 : -1;
	}
	return state == 1 && energy(dev, mj) == 0 ? 0 : -1;
}

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

/* ng_time_sustained with the energy a launch too: *mj millijoules (-1 without a counter), over
 * a measured batch of ~600 ms (the counter moves in steps of tens of ms), after a heating batch
 * of ~300 ms; *ms from the same batch. */
static inline int ng_time_energy(ng_bench_launch_fn fn, const void *arg, cudaEvent_t *ev,
				 float *ms, double *mj)
{
	float est_ms;
	unsigned long long e0 = 0, e1 = 0;
	if (ng_bench_batch(fn, arg, ev, 20, &est_ms))
		return 1;
	int k = (int)(300.0f / est_ms);
	k = k < 20 ? 20 : k > 40000 ? 40000 : k;
	if (ng_bench_batch(fn, arg, ev, k, ms))
		return 1;
	const int have = ng_energy_mj(&e0) == 0;
	if (ng_bench_batch(fn, arg, ev, 2 * k, ms))
		return 1;
	*mj = have && ng_energy_mj(&e1) == 0 ? (double)(e1 - e0) / (2.0 * k) : -1.0;
	return 0;
}

#endif
