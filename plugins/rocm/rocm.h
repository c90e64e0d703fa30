/*
 * rocm.h: private declarations of the rocm-mxfp4 backend. The plugin has no
 * link-time dependency on the HIP runtime: hip.c dlopens libamdhip64.so.6, then
 * .so.5, and looks up the entry points below (their types from ROCm's own
 * hip_runtime_api.h, whose C ABI for these calls is the same in ROCm 5 and 6), so
 * one build loads on ROCm 5 and ROCm 6 hosts and, without either or without an AMD
 * GPU, still loads and says why in its probe. The gfx942 code object
 * (mxfp4.hip, built by clang-19) is linked into the plugin as bytes and loaded
 * with hipModuleLoadData; its kernels are found by name.
 */
#ifndef QKEEP_ROCM_H
#define QKEEP_ROCM_H

#include <hip/hip_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>

/* The HIP entry points the backend uses. Optional ones (NULL when absent) are marked. */
struct hip_api {
  __typeof__(hipGetDeviceCount) *GetDeviceCount;
  __typeof__(hipGetDevice) *GetDevice;
  __typeof__(hipSetDevice) *SetDevice;
  __typeof__(hipDeviceGetAttribute) *DeviceGetAttribute;
  __typeof__(hipMalloc) *Malloc;
  __typeof__(hipFree) *Free;
  __typeof__(hipMemcpy) *Memcpy;
  __typeof__(hipMemset) *Memset;
  __typeof__(hipDeviceSynchronize) *DeviceSynchronize;
  __typeof__(hipStreamSynchronize) *StreamSynchronize;
  __typeof__(hipGetErrorString) *GetErrorString;
  __typeof__(hipGetErrorName) *GetErrorName;
  __typeof__(hipGetLastError) *GetLastError;
  __typeof__(hipModuleLoadData) *ModuleLoadData;
  __typeof__(hipModuleGetFunction) *ModuleGetFunction;
  __typeof__(hipModuleLaunchKernel) *ModuleLaunchKernel;
  __typeof__(hipModuleUnload) *ModuleUnload;
  __typeof__(hipHostMalloc) *HostMalloc; /* pinned staging and copy fences (ABI 1.2 and 1.3 memory ops) */
  __typeof__(hipHostFree) *HostFree;
  __typeof__(hipMemcpyAsync) *MemcpyAsync;
  __typeof__(hipEventCreateWithFlags) *EventCreateWithFlags;
  __typeof__(hipEventRecord) *EventRecord;
  __typeof__(hipEventQuery) *EventQuery;
  __typeof__(hipEventSynchronize) *EventSynchronize;
  __typeof__(hipEventDestroy) *EventDestroy;
  __typeof__(hipMallocAsync) *MallocAsync; /* optional (ROCm 5.1 and later) */
  __typeof__(hipFreeAsync) *FreeAsync;     /* optional */
};

/* Token blocks of the gemm kernels: 16, 32 and 64 tokens (wave 64). */
#define ROCM_GEMM_SIZES 3

/* The kernels of the code object, per device (hipModuleLoadData loads for the current one). */
struct rocm_kernels {
  hipModule_t module;
  hipFunction_t gemm[2][ROCM_GEMM_SIZES]; /* [f16][16, 32, 64 tokens] */
  hipFunction_t reduce, combine, convert, tile_codes, tile_scales;
  int compute_units;
};

/* The runtime, loaded once per process (hip.c); NULL with *why set when it cannot be. The handle
 * is never closed: the HIP runtime does not support being unloaded. */
const struct hip_api *rocm_hip(const char **why);

/* Loads the code object on the current device into *k (the first time; later calls return the
 * same). Returns hipSuccess or the error of the step that failed, with *what naming it. */
hipError_t rocm_kernels_load(struct rocm_kernels *k, const char **what);

/* The kernels of the device current on this thread, as loaded by the backend (launch.c reads them). */
const struct rocm_kernels *rocm_current_kernels(void);
void rocm_set_current_kernels(const struct rocm_kernels *k);

/* The gfx942 code object (codeobj.c, generated from mxfp4-gfx942.hsaco at build time). */
extern const unsigned char rocm_mxfp4_code_object[];
extern const size_t rocm_mxfp4_code_object_size;

#endif
