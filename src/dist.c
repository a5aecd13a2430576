/*
 * src/dist.c — rank discovery and the NCCL communicator (see dist.h). MPI is optional: the code
 * under NG_HAVE_MPI is compiled only when meson found an MPI (src/meson.build defines it).
 */
#include "src/dist.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "kernels/check.h"
#include "ng_config.h"

#if NG_HAVE_NCCL
#include <nccl.h>
#endif
#ifdef NG_HAVE_MPI
#include <mpi.h>
#endif

#define DIST_MAGIC 0x4e47444953543031ull /* "NGDIST01" */
#define DIST_MAX_BLOB 1024

const char *ng_dist_method_name(enum ng_dist_method m)
{
	switch (m) {
	case NG_DIST_METHOD_FILE: return "file";
	case NG_DIST_METHOD_SLURM: return "slurm";
	case NG_DIST_METHOD_MPI: return "mpi";
	default: return "none";
	}
}

/* Parse a non-negative decimal int from env `name` into *v; 0 if unset, 1 if set, -1 if bad. */
static int env_int(const char *name, int *v)
{
	const char *s = getenv(name);
	if (!s || !*s)
		return 0;
	char *end;
	errno = 0;
	long x = strtol(s, &end, 10);
	if (errno || *end || x < 0 || x > 1 << 20)
		return -1;
	*v = (int)x;
	return 1;
}

static enum ng_status bad_env(const char *name)
{
	return ng_fail(NG_ERR_INPUT, "environment %s='%s' is not a non-negative integer", name,
		       getenv(name));
}

static enum ng_status check_ranks(const struct ng_dist_plan *p, const char *from)
{
	if (p->world < 1)
		return ng_fail(NG_ERR_INPUT, "%s: world size %d must be at least 1", from, p->world);
	if (p->rank < 0 || p->rank >= p->world)
		return ng_fail(NG_ERR_INPUT, "%s: rank %d is outside [0, %d)", from, p->rank,
			       p->world);
	if (p->local_rank < 0)
		return ng_fail(NG_ERR_INPUT, "%s: local rank %d is negative", from, p->local_rank);
	return NG_OK;
}

static enum ng_status resolve_file(struct ng_dist_plan *p, const struct ng_dist_args *a)
{
	int w = 0, r = -1, lr = -1;
	int hw = env_int("NG_WORLD", &w), hr = env_int("NG_RANK", &r);
	int hl = env_int("NG_LOCAL_RANK", &lr);
	if (hw < 0)
		return bad_env("NG_WORLD");
	if (hr < 0)
		return bad_env("NG_RANK");
	if (hl < 0)
		return bad_env("NG_LOCAL_RANK");
	if (a->world > 0)
		w = (int)a->world;
	if (a->rank >= 0)
		r = (int)a->rank;
	const char *file = a->file ? a->file : getenv("NG_DIST_FILE");
	p->method = NG_DIST_METHOD_FILE;
	p->world = w;
	p->rank = r < 0 ? 0 : r;
	p->local_rank = lr >= 0 ? lr : p->rank;
	if (w == 0)
		return ng_fail(NG_ERR_INPUT, "train: --rank/--dist-file (or NG_RANK/NG_DIST_FILE) "
			       "given without a world size (--world N or NG_WORLD)");
	if (w > 1 && r < 0)
		return ng_fail(NG_ERR_INPUT, "train: --world %d needs this process's --rank (or "
			       "NG_RANK)", w);
	if (w > 1 && (!file || !*file)) {
		ng_fail(NG_ERR_INPUT, "train: --world %d needs a rendezvous file (--dist-file PATH "
			"or NG_DIST_FILE) that every rank can read", w);
		ng_hint("or launch with mpirun -np %d (a build with MPI) or srun", w);
		return NG_ERR_INPUT;
	}
	if (file && strlen(file) >= sizeof(p->file))
		return ng_fail(NG_ERR_INPUT, "train: --dist-file path is longer than %zu bytes",
			       sizeof(p->file) - 1);
	snprintf(p->file, sizeof(p->file), "%s", file ? file : "");
	return check_ranks(p, "--world/--rank");
}

enum ng_status ng_dist_resolve(struct ng_dist_plan *p, const struct ng_dist_args *a)
{
	memset(p, 0, sizeof(*p));
	p->world = 1;
	if (a->world > 0 || a->rank >= 0 || a->file || getenv("NG_WORLD") || getenv("NG_RANK") ||
	    getenv("NG_DIST_FILE"))
		return resolve_file(p, a);
	/* mpirun (OpenMPI, or a PMI launcher such as MPICH's hydra) */
	const char *mw = getenv("OMPI_COMM_WORLD_SIZE") ? "OMPI_COMM_WORLD_SIZE"
			 : getenv("PMI_SIZE")          ? "PMI_SIZE"
							 : NULL;
	if (mw || getenv("PMIX_RANK")) {
		p->method = NG_DIST_METHOD_MPI;
		int h;
		if (mw && env_int(mw, &p->world) < 0)
			return bad_env(mw);
		const char *rn = getenv("OMPI_COMM_WORLD_RANK") ? "OMPI_COMM_WORLD_RANK"
				 : getenv("PMI_RANK")          ? "PMI_RANK"
								 : "PMIX_RANK";
		if ((h = env_int(rn, &p->rank)) < 0)
			return bad_env(rn);
		p->local_rank = p->rank;
		if ((h = env_int("OMPI_COMM_WORLD_LOCAL_RANK", &p->local_rank)) < 0)
			return bad_env("OMPI_COMM_WORLD_LOCAL_RANK");
		if (!mw) /* PMIx without a size in the env: MPI tells at init */
			p->world = p->rank + 1;
		return check_ranks(p, "mpirun environment");
	}
	/* srun: SLURM_STEP_NUM_TASKS exists only inside a job step (not in the batch script) */
	int w;
	int hw = env_int("SLURM_STEP_NUM_TASKS", &w);
	if (hw < 0)
		return bad_env("SLURM_STEP_NUM_TASKS");
	if (hw > 0 && w > 1) {
		p->method = NG_DIST_METHOD_SLURM;
		p->world = w;
		if (env_int("SLURM_PROCID", &p->rank) <= 0)
			return ng_fail(NG_ERR_INPUT, "srun environment without a valid SLURM_PROCID");
		if (env_int("SLURM_LOCALID", &p->local_rank) <= 0)
			return ng_fail(NG_ERR_INPUT, "srun environment without a valid SLURM_LOCALID");
		const char *f = getenv("NG_DIST_FILE");
		const char *job = getenv("SLURM_JOB_ID"), *stp = getenv("SLURM_STEP_ID");
		if (f && *f)
			snprintf(p->file, sizeof(p->file), "%s", f);
		else
			snprintf(p->file, sizeof(p->file), "nanograph-nccl-%s.%s", job ? job : "0",
				 stp ? stp : "0");
		return check_ranks(p, "srun environment");
	}
	return NG_OK;
}

/* ---- file rendezvous ---- */

struct record_head {
	uint64_t magic;        /* DIST_MAGIC */
	int32_t world;         /* the world size it was written for */
	int32_t bytes;         /* blob bytes that follow */
};

enum ng_status ng_dist_file_publish(const char *path, int world, const void *blob, size_t n)
{
	if (n > DIST_MAX_BLOB)
		return ng_fail(NG_ERR_RUNTIME, "rendezvous blob of %zu bytes is too large", n);
	char tmp[4200];
	snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
	FILE *f = fopen(tmp, "wb");
	if (!f)
		return ng_fail(NG_ERR_INPUT, "cannot write the rendezvous file %s: %s", tmp,
			       strerror(errno));
	struct record_head h = { DIST_MAGIC, world, (int32_t)n };
	bool ok = fwrite(&h, sizeof(h), 1, f) == 1 && fwrite(blob, 1, n, f) == n;
	ok = fflush(f) == 0 && fsync(fileno(f)) == 0 && ok;
	ok = fclose(f) == 0 && ok;
	if (!ok || rename(tmp, path) != 0) {
		int err = errno;
		unlink(tmp);
		return ng_fail(NG_ERR_INPUT, "cannot publish the rendezvous file %s: %s", path,
			       strerror(err));
	}
	return NG_OK;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* 1: a fresh record of this world size was read; 0: not (yet) there or stale. */
static int try_read(const char *path, int world, void *blob, size_t n, double not_before)
{
	struct stat sb;
	if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode) || (double)sb.st_mtime < not_before)
		return 0; /* not a regular file (a FIFO would block fopen): never a record */
	FILE *f = fopen(path, "rb");
	if (!f)
		return 0;
	struct record_head h;
	int ok = fread(&h, sizeof(h), 1, f) == 1 && h.magic == DIST_MAGIC && h.world == world &&
		 h.bytes == (int32_t)n && fread(blob, 1, n, f) == n;
	fclose(f);
	return ok;
}

enum ng_status ng_dist_file_wait(const char *path, int world, void *blob, size_t n,
				 double timeout_s)
{
	double t0 = now_s(), not_before = t0 - 60.0;
	while (!try_read(path, world, blob, n, not_before)) {
		if (now_s() - t0 > timeout_s) {
			ng_fail(NG_ERR_RUNTIME, "no rendezvous record for world size %d appeared at "
				"%s within %.0f s", world, path, timeout_s);
			ng_hint("start rank 0 with the same --dist-file and --world; the path must be "
				"on a file system every rank sees");
			return NG_ERR_RUNTIME;
		}
		usleep(20000);
	}
	return NG_OK;
}

/* ---- communicator ---- */

#if NG_HAVE_NCCL
static enum ng_status nccl_fail(ncclResult_t r, const char *what)
{
	ng_fail(NG_ERR_RUNTIME, "NCCL %s: %s", what, ncclGetErrorString(r));
	ng_hint("run with NCCL_DEBUG=WARN for NCCL's own account");
	return NG_ERR_RUNTIME;
}
#endif

#ifdef NG_HAVE_MPI
static enum ng_status mpi_ranks(struct ng_dist *d)
{
	int inited = 0;
	MPI_Initialized(&inited);
	if (!inited) {
		if (MPI_Init(NULL, NULL) != MPI_SUCCESS)
			return ng_fail(NG_ERR_RUNTIME, "MPI_Init failed");
		d->mpi_inited = true;
	}
	MPI_Comm_rank(MPI_COMM_WORLD, &d->plan.rank);
	MPI_Comm_size(MPI_COMM_WORLD, &d->plan.world);
	MPI_Comm local;
	MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, d->plan.rank, MPI_INFO_NULL,
			    &local);
	MPI_Comm_rank(local, &d->plan.local_rank);
	MPI_Comm_free(&local);
	return NG_OK;
}
#endif

enum ng_status ng_dist_init(struct ng_dist *d, const struct ng_dist_args *a)
{
	memset(d, 0, sizeof(*d));
	enum ng_status st = ng_dist_resolve(&d->plan, a);
	if (st || d->plan.method == NG_DIST_METHOD_NONE)
		return st;
#if !NG_HAVE_NCCL
	ng_fail(NG_ERR_RUNTIME, "train: multi-process training (%s) needs NCCL, and this build "
		"has none", ng_dist_method_name(d->plan.method));
	ng_hint("install NCCL and reconfigure with meson -Dnccl=enabled");
	return NG_ERR_RUNTIME;
#else
	setenv("NCCL_NVLS_ENABLE", "0", 0); /* NVLink multicast off unless the user says */
	if (d->plan.method == NG_DIST_METHOD_MPI) {
#ifdef NG_HAVE_MPI
		if ((st = mpi_ranks(d)))
			return st;
#else
		ng_fail(NG_ERR_RUNTIME, "train: launched by mpirun but this build has no MPI");
		ng_hint("install libopenmpi-dev and reconfigure, or use --world/--rank/--dist-file");
		return NG_ERR_RUNTIME;
#endif
	}
	int ndev = ng_cuda_device_count();
	if (d->plan.local_rank >= ndev) {
		ng_fail(NG_ERR_INPUT, "train: local rank %d needs GPU %d but this machine shows %d",
			d->plan.local_rank, d->plan.local_rank, ndev);
		ng_hint("run at most one process per GPU on each machine");
		return NG_ERR_INPUT;
	}
	d->device = d->plan.local_rank;
	if (NG_CUDA_CHECK(cudaSetDevice(d->device)))
		return NG_ERR_RUNTIME;
	ncclUniqueId id;
	ncclResult_t r;
	if (d->plan.rank == 0 && (r = ncclGetUniqueId(&id)) != ncclSuccess)
		return nccl_fail(r, "get unique id");
	if (d->plan.method == NG_DIST_METHOD_MPI) {
#ifdef NG_HAVE_MPI
		if (MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
			return ng_fail(NG_ERR_RUNTIME, "MPI_Bcast of the NCCL id failed");
#endif
	} else if (d->plan.world > 1) {
		st = d->plan.rank == 0
			     ? ng_dist_file_publish(d->plan.file, d->plan.world, &id, sizeof(id))
			     : ng_dist_file_wait(d->plan.file, d->plan.world, &id, sizeof(id), 300);
		if (st)
			return st;
	}
	ncclComm_t comm;
	if ((r = ncclCommInitRank(&comm, d->plan.world, id, d->plan.rank)) != ncclSuccess)
		return nccl_fail(r, "communicator init");
	d->comm = comm;
	if (d->plan.rank == 0 && d->plan.world > 1 && d->plan.method != NG_DIST_METHOD_MPI)
		unlink(d->plan.file); /* every rank has joined, so every rank has read it */
	return NG_OK;
#endif
}

void ng_dist_free(struct ng_dist *d)
{
#if NG_HAVE_NCCL
	if (d->comm)
		ncclCommDestroy(d->comm);
#endif
	d->comm = NULL;
#ifdef NG_HAVE_MPI
	if (d->mpi_inited)
		MPI_Finalize();
#endif
	d->mpi_inited = false;
}
