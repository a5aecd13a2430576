/*
 * src/dist.h — bootstrap of data-parallel training: one process per GPU; find this process's
 * rank, the world size and the local rank (its GPU), exchange NCCL's unique id, and create the
 * communicator. Three launchers, one code path after the id exchange:
 *   (a) MPI  — `mpirun -np N nanograph train ...`: rank/world from MPI_COMM_WORLD, local rank
 *       from MPI_COMM_TYPE_SHARED, the id broadcast with MPI_Bcast (only in builds with MPI);
 *   (b) Slurm — `srun --ntasks N nanograph train ...`: SLURM_PROCID / SLURM_STEP_NUM_TASKS /
 *       SLURM_LOCALID, the id through a file on a shared file system (NG_DIST_FILE, default
 *       ./nanograph-nccl-<jobid>.<stepid>);
 *   (c) a file on one machine without MPI — `--world N --rank R --dist-file PATH` or the env
 *       NG_WORLD / NG_RANK / NG_DIST_FILE (NG_LOCAL_RANK, default = rank).
 * Precedence: flags, then NG_* env, then MPI's env (OMPI_COMM_WORLD_SIZE, PMI_SIZE,
 * PMIX_RANK), then Slurm's; none of them: a single process without NCCL. `--world 1` runs the
 * single GPU through the NCCL path (a one-rank communicator).
 *
 * File rendezvous: rank 0 writes a small record (magic, world size, the id) to PATH.tmp.<pid>
 * and renames it to PATH (atomic); other ranks poll for PATH, ignore records older than their
 * own start minus 60 s or of another world size, and read it. Rank 0 removes PATH once the
 * communicator exists (all ranks have read it by then).
 * NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set unless the environment sets it.
 */
#ifndef NG_SRC_DIST_H
#define NG_SRC_DIST_H

#include <stdbool.h>
#include <stddef.h>

#include "util/status.h"

struct ncclComm;

/* How the ranks were found. */
enum ng_dist_method {
	NG_DIST_METHOD_NONE,   /* one process, no NCCL */
	NG_DIST_METHOD_FILE,   /* flags or NG_* env, shared file */
	NG_DIST_METHOD_SLURM,  /* srun's env, shared file */
	NG_DIST_METHOD_MPI,    /* mpirun */
};

/* The command-line side (nanograph train --world --rank --dist-file). */
struct ng_dist_args {
	long long world;       /* 0: not given */
	long long rank;        /* -1: not given */
	const char *file;      /* NULL: not given */
};

/* The resolved plan (pure function of flags + environment). */
struct ng_dist_plan {
	enum ng_dist_method method;
	int rank;              /* 0 <= rank < world */
	int world;             /* processes */
	int local_rank;        /* this machine's process index: the GPU it uses */
	char file[4096];       /* rendezvous file (FILE, SLURM with world > 1); "" otherwise */
};

/* A live bootstrap. */
struct ng_dist {
	struct ng_dist_plan plan;
	struct ncclComm *comm; /* NULL for NG_DIST_METHOD_NONE */
	int device;            /* the CUDA device selected (local_rank) */
	bool mpi_inited;       /* this process called MPI_Init */
};

const char *ng_dist_method_name(enum ng_dist_method m);

/* Flags + environment -> plan. NG_ERR_INPUT for inconsistent or malformed values (named). */
enum ng_status ng_dist_resolve(struct ng_dist_plan *p, const struct ng_dist_args *a);

/* File rendezvous of an n-byte blob (n <= 1024): rank 0 publishes `blob` at `path`, every other
 * rank waits (up to timeout_s) and reads it into `blob`. */
enum ng_status ng_dist_file_publish(const char *path, int world, const void *blob, size_t n);
enum ng_status ng_dist_file_wait(const char *path, int world, void *blob, size_t n,
				 double timeout_s);

/* Resolve, select the GPU, exchange the NCCL id, create the communicator (blocks until every
 * rank joined). With method NONE: only fills d->plan (world 1) and leaves the device alone. */
enum ng_status ng_dist_init(struct ng_dist *d, const struct ng_dist_args *a);
void ng_dist_free(struct ng_dist *d);

#endif
