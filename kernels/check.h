/*
 * kernels/check.h — one checker for every CUDA, cuBLASLt and cuDNN status (docs/CONTRIBUTING.md:
 * "one error macro family built on a single generic checker"). Each macro evaluates the call and
 * returns an enum ng_status; on failure it records "<statement> failed at file:line: <library
 * message> (while running <node>)" through ng_fail. No control flow is hidden: callers write
 *     if (NG_CUDA_CHECK(cudaMemsetAsync(p, 0, n, s))) return NG_ERR_RUNTIME;
 * The step executor names the node it is running with ng_check_set_node(), so an error inside a
 * 400-node step says which node failed.
 */
#ifndef NG_KERNELS_CHECK_H
#define NG_KERNELS_CHECK_H

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum ng_status ng_check_cuda_(cudaError_t e, const char *what, const char *file, int line);
enum ng_status ng_check_cublas_(cublasStatus_t e, const char *what, const char *file, int line);
enum ng_status ng_check_cudnn_(cudnnStatus_t e, const char *what, const char *file, int line);

#define NG_CUDA_CHECK(call) ng_check_cuda_((call), #call, __FILE__, __LINE__)
#define NG_CUBLAS_CHECK(call) ng_check_cublas_((call), #call, __FILE__, __LINE__)
#define NG_CUDNN_CHECK(call) ng_check_cudnn_((call), #call, __FILE__, __LINE__)
/* After a kernel launch: the launch error, if any (does not synchronise). */
#define NG_LAUNCH_CHECK(name) ng_check_cuda_(cudaGetLastError(), name, __FILE__, __LINE__)

/* The step node now running (a static string or NULL); shown in every failure message. */
void ng_check_set_node(const char *name);

/* A launcher's precondition failed: records "<launcher>: <message>" as an input error. */
enum ng_status ng_check_arg_fail(const char *launcher, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* Number of CUDA devices, 0 when there is no device or no driver (never fails). */
int ng_cuda_device_count(void);

#ifdef __cplusplus
}
#endif

#endif
