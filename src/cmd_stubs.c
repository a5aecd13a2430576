/*
 * src/cmd_stubs.c — commands whose issue has not landed yet. Each says so plainly and exits 1;
 * remove an entry here when its real file lands.
 */
#include "src/commands.h"

#define NOT_YET(fn, what)                                                                  \
	enum ng_status fn(int argc, char **argv)                                           \
	{                                                                                  \
		(void)argc;                                                                \
		(void)argv;                                                                \
		return ng_fail(NG_ERR_RUNTIME, "%s is not implemented in this version", what); \
	}

NOT_YET(ng_cmd_bench_kernels, "bench-kernels")

