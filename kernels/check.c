/*
 * kernels/check.c — the generic checker behind NG_CUDA_CHECK and friends (see check.h).
 */
#include "kernels/check.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local const char *node_name;

void ng_check_set_node(const char *name) { node_name = name; }

static enum ng_status fail(const char *lib, const char *msg, const char *what, const char *file,
			   int line)
{
	return ng_fail(NG_ERR_RUNTIME, "%s failed at %s:%d: %s: %s%s%s%s", what, file, line, lib, msg,
		       node_name ? " (while running " : "", node_name ? node_name : "",
		       node_name ? ")" : "");
}

enum ng_status ng_check_cuda_(cudaError_t e, const char *what, const char *file, int line)
{
	if (e == cudaSuccess)
		return NG_OK;
	return fail("CUDA", cudaGetErrorString(e), what, file, line);
}

enum ng_status ng_check_cublas_(cublasStatus_t e, const char *what, const char *file, int line)
{
	if (e == CUBLAS_STATUS_SUCCESS)
		return NG_OK;
	char msg[64];
	snprintf(msg, sizeof(msg), "cublasStatus %d", (int)e);
	return fail("cuBLASLt", msg, what, file, line);
}

enum ng_status ng_check_cudnn_(cudnnStatus_t e, const char *what, const char *file, int line)
{
	if (e == CUDNN_STATUS_SUCCESS)
		return NG_OK;
	char msg[1200];
	char last[1024] = "";
	cudnnGetLastErrorString(last, sizeof(last));
	snprintf(msg, sizeof(msg), "%s (cuDNN %zu)%s%s", cudnnGetErrorString(e), cudnnGetVersion(),
		 last[0] ? ": " : "", last);
	return fail("cuDNN", msg, what, file, line);
}

enum ng_status ng_check_arg_fail(const char *launcher, const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	return ng_fail(NG_ERR_INPUT, "%s: %s", launcher, msg);
}

int ng_cuda_device_count(void)
{
	int n = 0;
	if (cudaGetDeviceCount(&n) != cudaSuccess) {
		cudaGetLastError(); /* clear the sticky "no device" error */
		return 0;
	}
	return n;
}
