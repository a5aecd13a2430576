/*
 * tests/test_dist.c — data-parallel bootstrap and collectives.
 * CPU: rank discovery from flags and each launcher's environment (file, mpirun, srun) with the
 * precedence of src/dist.h and the named errors; the file rendezvous between two forked
 * processes (publisher late, stale and wrong-world records ignored, timeout); shard lengths.
 * GPU (2 GPUs, else skipped): two forked ranks bootstrap through a file and check the NCCL
 * all-reduce mean, the in-place reduce-scatter and the fp32/bf16 all-gather against host sums;
 * one GPU: a one-rank communicator (the --world 1 path). Fresh random data per run, the seed is
 * printed in failures.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "kernels/check.h"
#include "kernels/collective.h"
#include "src/dist.h"
#include "util/rng.h"

static const char *env_names[] = {
	"NG_WORLD", "NG_RANK", "NG_LOCAL_RANK", "NG_DIST_FILE", "OMPI_COMM_WORLD_SIZE",
	"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
	"SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID",
};

static void clean_env(void)
{
	for (size_t i = 0; i < sizeof(env_names) / sizeof(env_names[0]); i++)
		unsetenv(env_names[i]);
}

static const struct ng_dist_args no_flags = { 0, -1, NULL };

Test(dist, no_launcher_is_one_process, .init = clean_env)
{
	struct ng_dist_plan p;
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_OK, "%s", ng_error_message());
	cr_assert_eq(p.method, NG_DIST_METHOD_NONE);
	cr_assert(p.world == 1 && p.rank == 0);
}

Test(dist, flags_and_env, .init = clean_env)
{
	struct ng_dist_plan p;
	struct ng_dist_args a = { 4, 3, "/tmp/x" };
	cr_assert_eq(ng_dist_resolve(&p, &a), NG_OK, "%s", ng_error_message());
	cr_assert(p.method == NG_DIST_METHOD_FILE && p.world == 4 && p.rank == 3 &&
		  p.local_rank == 3 && strcmp(p.file, "/tmp/x") == 0);
	/* env alone, with a local rank; flags beat env */
	setenv("NG_WORLD", "8", 1);
	setenv("NG_RANK", "5", 1);
	setenv("NG_LOCAL_RANK", "1", 1);
	setenv("NG_DIST_FILE", "/tmp/y", 1);
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_OK, "%s", ng_error_message());
	cr_assert(p.world == 8 && p.rank == 5 && p.local_rank == 1 && !strcmp(p.file, "/tmp/y"));
	struct ng_dist_args b = { 0, 2, NULL };
	cr_assert_eq(ng_dist_resolve(&p, &b), NG_OK, "%s", ng_error_message());
	cr_assert(p.world == 8 && p.rank == 2);
	/* NG_* beats mpirun's env */
	setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_OK);
	cr_assert_eq(p.method, NG_DIST_METHOD_FILE);
}

Test(dist, world_one_needs_no_file, .init = clean_env)
{
	struct ng_dist_plan p;
	struct ng_dist_args a = { 1, -1, NULL };
	cr_assert_eq(ng_dist_resolve(&p, &a), NG_OK, "%s", ng_error_message());
	cr_assert(p.method == NG_DIST_METHOD_FILE && p.world == 1 && p.rank == 0);
}

Test(dist, bad_setups_are_named, .init = clean_env)
{
	struct ng_dist_plan p;
	struct ng_dist_args a = { 2, 2, "/tmp/x" };
	cr_assert_eq(ng_dist_resolve(&p, &a), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "rank 2"), "%s", ng_error_message());
	ng_clear_error();
	struct ng_dist_args b = { 2, 0, NULL };
	cr_assert_eq(ng_dist_resolve(&p, &b), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "rendezvous"), "%s", ng_error_message());
	struct ng_dist_args c = { 2, -1, "/tmp/x" };
	cr_assert_eq(ng_dist_resolve(&p, &c), NG_ERR_INPUT);
	ng_clear_error();
	struct ng_dist_args d = { 0, 1, "/tmp/x" };
	cr_assert_eq(ng_dist_resolve(&p, &d), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "world size"), "%s", ng_error_message());
	ng_clear_error();
	setenv("NG_WORLD", "two", 1);
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_ERR_INPUT);
	cr_assert(strstr(ng_error_message(), "NG_WORLD"), "%s", ng_error_message());
}

Test(dist, mpirun_env, .init = clean_env)
{
	struct ng_dist_plan p;
	setenv("OMPI_COMM_WORLD_SIZE", "16", 1);
	setenv("OMPI_COMM_WORLD_RANK", "9", 1);
	setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
	setenv("SLURM_STEP_NUM_TASKS", "4", 1); /* mpirun inside an allocation: MPI wins */
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_OK, "%s", ng_error_message());
	cr_assert(p.method == NG_DIST_METHOD_MPI && p.world == 16 && p.rank == 9 &&
		  p.local_rank == 1);
	clean_env();
	setenv("PMI_SIZE", "3", 1);
	setenv("PMI_RANK", "2", 1);
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_OK, "%s", ng_error_message());
	cr_assert(p.method == NG_DIST_METHOD_MPI && p.world == 3 && p.rank == 2);
}

Test(dist, srun_env, .init = clean_env)
{
	struct ng_dist_plan p;
	setenv("SLURM_STEP_NUM_TASKS", "8", 1);
	setenv("SLURM_PROCID", "6", 1);
	setenv("SLURM_LOCALID", "2", 1);
	setenv("SLURM_JOB_ID", "77", 1);
	setenv("SLURM_STEP_ID", "3", 1);
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_OK, "%s", ng_error_message());
	cr_assert(p.method == NG_DIST_METHOD_SLURM && p.world == 8 && p.rank == 6 &&
		  p.local_rank == 2);
	cr_assert_str_eq(p.file, "nanograph-nccl-77.3");
	setenv("NG_DIST_FILE", "/shared/id", 1); /* NG_DIST_FILE alone means the file method */
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_ERR_INPUT);
	unsetenv("NG_DIST_FILE");
	/* a batch script (no job step) with one task is not a launch */
	clean_env();
	setenv("SLURM_PROCID", "0", 1);
	setenv("SLURM_NTASKS", "4", 1);
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_OK);
	cr_assert_eq(p.method, NG_DIST_METHOD_NONE);
	unsetenv("SLURM_NTASKS");
	setenv("SLURM_STEP_NUM_TASKS", "2", 1); /* a step without SLURM_PROCID/LOCALID */
	unsetenv("SLURM_PROCID");
	cr_assert_eq(ng_dist_resolve(&p, &no_flags), NG_ERR_INPUT);
}

Test(dist, shard_len)
{
	cr_assert_eq(ng_collective_shard_len(10, 1), 10);
	cr_assert_eq(ng_collective_shard_len(10, 2), 8); /* ceil(total / world), up to 4k */
	cr_assert_eq(ng_collective_shard_len(11, 2), 8);
	cr_assert_eq(ng_collective_shard_len(124475904, 8), 15559488);
	cr_assert_eq(ng_collective_shard_len(124475904, 3), 41491968);
	cr_assert_eq(ng_collective_shard_len(124475905, 3), 41491972);
	cr_assert_eq(ng_collective_shard_len(7, 8), 4);
}

static char rdv_dir[64];

static void make_dir(void)
{
	snprintf(rdv_dir, sizeof(rdv_dir), "/tmp/ng_dist_XXXXXX");
	cr_assert(mkdtemp(rdv_dir));
}

Test(dist, file_rendezvous_two_processes, .init = make_dir)
{
	char path[128];
	snprintf(path, sizeof(path), "%s/id", rdv_dir);
	uint64_t seed = (uint64_t)time(NULL) ^ (uint64_t)getpid();
	unsigned char blob[128], got[128];
	struct ng_rng r;
	ng_rng_seed(&r, seed);
	for (int i = 0; i < 128; i++)
		blob[i] = (unsigned char)ng_rng_below(&r, 256);
	/* a stale record of another world size is there first: the waiter must skip it */
	cr_assert_eq(ng_dist_file_publish(path, 3, blob + 1, 127), NG_OK, "%s",
		     ng_error_message());
	pid_t pid = fork();
	cr_assert(pid >= 0);
	if (pid == 0) {
		unsigned char b[128];
		int rc = ng_dist_file_wait(path, 2, b, 128, 20) != NG_OK ||
			 memcmp(b, blob, 128) != 0;
		_exit(rc);
	}
	usleep(200000); /* the publisher comes late */
	cr_assert_eq(ng_dist_file_publish(path, 2, blob, 128), NG_OK, "%s", ng_error_message());
	int status;
	waitpid(pid, &status, 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "the waiting rank did not read the published blob (seed %llu)",
		  (unsigned long long)seed);
	cr_assert_eq(ng_dist_file_wait(path, 2, got, 128, 1), NG_OK);
	cr_assert_eq(memcmp(got, blob, 128), 0, "seed %llu", (unsigned long long)seed);
	/* nothing for world 4: a named timeout */
	ng_clear_error();
	cr_assert_eq(ng_dist_file_wait(path, 4, got, 128, 0.2), NG_ERR_RUNTIME);
	cr_assert(strstr(ng_error_message(), path), "%s", ng_error_message());
	unlink(path);
	rmdir(rdv_dir);
}

/* ---- GPU: real communicators between forked ranks ---- */

/* The CUDA device count, asked in a child so this process never initialises CUDA (a forked
 * child of a process that did could not use the GPU). */
static int gpus(void)
{
	pid_t pid = fork();
	if (pid == 0)
		_exit(ng_cuda_device_count() > 100 ? 100 : ng_cuda_device_count());
	int status;
	waitpid(pid, &status, 0);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
}

static void rank_data(uint64_t seed, int rank, float *x, size_t n)
{
	struct ng_rng r;
	ng_rng_seed(&r, seed + (uint64_t)rank);
	for (size_t i = 0; i < n; i++)
		x[i] = (float)ng_rng_normal(&r);
}

static uint16_t to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

#define FAIL(...) do { fprintf(stderr, __VA_ARGS__); return 1; } while (0)

/* One rank of `world`: all-reduce mean, reduce-scatter mean, fp32 and bf16 all-gather. */
static int rank_main(int rank, int world, const char *path, uint64_t seed)
{
	struct ng_dist_args a = { world, rank, path };
	struct ng_dist d;
	if (ng_dist_init(&d, &a))
		FAIL("rank %d: %s\n", rank, ng_error_message());
	size_t n = 1000003, len = ng_collective_shard_len(n, world), np = len * world;
	float *h = calloc(np, 4), *want = calloc(np, 4), *got = calloc(np, 4), *tmp = calloc(np, 4);
	for (int r = 0; r < world; r++) {
		rank_data(seed, r, tmp, n);
		for (size_t i = 0; i < n; i++)
			want[i] += tmp[i] / (float)world;
	}
	rank_data(seed, rank, h, n);
	float *dbuf;
	uint16_t *d16;
	cudaStream_t s;
	if (cudaMalloc((void **)&dbuf, np * 4) || cudaMalloc((void **)&d16, np * 2) ||
	    cudaStreamCreate(&s))
		FAIL("rank %d: cuda setup failed\n", rank);
	double worst = 0;
	size_t wi = 0;
	/* all-reduce mean */
	cudaMemcpy(dbuf, h, np * 4, cudaMemcpyHostToDevice);
	if (ng_collective_allreduce_mean_f32(d.comm, dbuf, n, s) || cudaStreamSynchronize(s))
		FAIL("rank %d: all-reduce: %s\n", rank, ng_error_message());
	cudaMemcpy(got, dbuf, np * 4, cudaMemcpyDeviceToHost);
	for (size_t i = 0; i < n; i++) {
		double e = fabs((double)got[i] - want[i]) / (fabs(want[i]) + 1e-6);
		if (e > worst)
			worst = e, wi = i;
	}
	if (worst > 1e-5)
		FAIL("rank %d: all-reduce mean: max rel err %.3g at %zu (got %g want %g) seed "
		     "%llu\n", rank, worst, wi, got[wi], want[wi], (unsigned long long)seed);
	/* reduce-scatter mean: this rank's shard */
	cudaMemcpy(dbuf, h, np * 4, cudaMemcpyHostToDevice);
	if (ng_collective_reduce_scatter_mean_f32(d.comm, dbuf, len, rank, s) ||
	    cudaStreamSynchronize(s))
		FAIL("rank %d: reduce-scatter: %s\n", rank, ng_error_message());
	cudaMemcpy(got, dbuf, np * 4, cudaMemcpyDeviceToHost);
	worst = 0;
	for (size_t i = rank * len; i < (rank + 1) * len && i < n; i++) {
		double e = fabs((double)got[i] - want[i]) / (fabs(want[i]) + 1e-6);
		if (e > worst)
			worst = e, wi = i;
	}
	if (worst > 1e-5)
		FAIL("rank %d: reduce-scatter: max rel err %.3g at %zu seed %llu\n", rank, worst, wi,
		     (unsigned long long)seed);
	/* all-gather: shard r of every rank's buffer holds rank r's data; fp32 exact, bf16 exact */
	rank_data(seed, rank, h, np);
	cudaMemcpy(dbuf, h, np * 4, cudaMemcpyHostToDevice);
	uint16_t *h16 = calloc(np, 2), *g16 = calloc(np, 2);
	for (size_t i = 0; i < np; i++)
		h16[i] = to_bf16(h[i]);
	cudaMemcpy(d16, h16, np * 2, cudaMemcpyHostToDevice);
	if (ng_collective_group_begin() ||
	    ng_collective_allgather(d.comm, dbuf, len, 4, rank, s) ||
	    ng_collective_allgather(d.comm, d16, len, 2, rank, s) || ng_collective_group_end() ||
	    cudaStreamSynchronize(s))
		FAIL("rank %d: all-gather: %s\n", rank, ng_error_message());
	cudaMemcpy(got, dbuf, np * 4, cudaMemcpyDeviceToHost);
	cudaMemcpy(g16, d16, np * 2, cudaMemcpyDeviceToHost);
	for (int r = 0; r < world; r++) {
		rank_data(seed, r, tmp, np);
		for (size_t i = r * len; i < (r + 1) * len; i++)
			if (got[i] != tmp[i] || g16[i] != to_bf16(tmp[i]))
				FAIL("rank %d: all-gather differs at %zu (shard of rank %d): %g vs "
				     "%g, seed %llu\n", rank, i, r, got[i], tmp[i],
				     (unsigned long long)seed);
	}
	/* max over ranks of 32-bit words (the --fp8 maxima as float bits): each rank's words are
	 * its data's bits, one of them NaN's 0x7fc00000 on the last rank */
	enum { NW = 1001 };
	unsigned hw[NW], gw[NW];
	for (size_t i = 0; i < NW; i++) {
		float v = fabsf(h[i]);
		memcpy(&hw[i], &v, 4);
	}
	if (rank == world - 1)
		hw[NW / 2] = 0x7fc00000u;
	cudaMemcpy(dbuf, hw, sizeof(hw), cudaMemcpyHostToDevice);
	if (ng_collective_allreduce_max_u32(d.comm, (unsigned *)dbuf, NW, s) ||
	    cudaStreamSynchronize(s))
		FAIL("rank %d: all-reduce max: %s\n", rank, ng_error_message());
	cudaMemcpy(gw, dbuf, sizeof(gw), cudaMemcpyDeviceToHost);
	for (size_t i = 0; i < NW; i++) {
		unsigned w = 0;
		for (int r = 0; r < world; r++) {
			rank_data(seed, r, tmp, np);
			float v = fabsf(tmp[i]);
			unsigned b;
			memcpy(&b, &v, 4);
			if (r == world - 1 && i == NW / 2)
				b = 0x7fc00000u;
			w = b > w ? b : w;
		}
		if (gw[i] != w)
			FAIL("rank %d: all-reduce max differs at %zu: %08x vs %08x, seed %llu\n",
			     rank, i, gw[i], w, (unsigned long long)seed);
	}
	cudaFree(dbuf);
	cudaFree(d16);
	ng_dist_free(&d);
	free(h), free(want), free(got), free(tmp), free(h16), free(g16);
	return 0;
}

static void run_ranks(int world)
{
	char path[128];
	snprintf(path, sizeof(path), "%s/nccl-id", rdv_dir);
	uint64_t seed = (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)getpid();
	pid_t pid[8];
	for (int r = 0; r < world; r++) {
		pid[r] = fork();
		cr_assert(pid[r] >= 0);
		if (pid[r] == 0)
			_exit(rank_main(r, world, path, seed));
	}
	for (int r = 0; r < world; r++) {
		int status;
		waitpid(pid[r], &status, 0);
		cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0,
			  "rank %d of %d failed (its message is on stderr; seed %llu)", r, world,
			  (unsigned long long)seed);
	}
	rmdir(rdv_dir);
}

Test(dist_gpu, one_rank_communicator, .init = make_dir, .timeout = 300)
{
	if (gpus() < 1)
		cr_skip_test("no CUDA device");
	run_ranks(1);
}

Test(dist_gpu, two_ranks_collectives, .init = make_dir, .timeout = 300)
{
	if (gpus() < 2)
		cr_skip_test("needs 2 GPUs");
	run_ranks(2);
}
