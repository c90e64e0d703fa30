/*
 * hip.c: the HIP runtime and the code object, found at run time. libamdhip64.so.6 is
 * tried first, then .so.5 (ROCm 5 hosts), with RTLD_LOCAL so that nothing of it leaks
 * into the process's symbol namespace. The handle is never closed: the runtime's
 * threads and static state do not survive an unload.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "rocm.h"

static struct hip_api api;
static const char *api_error; /* why the runtime is unusable; NULL once loaded */
static pthread_once_t api_once = PTHREAD_ONCE_INIT;
static char api_message[512];

#define REQUIRE(field, symbol)                                                                               \
  do {                                                                                                       \
    *(void **)&api.field = dlsym(handle, symbol);                                                            \
    if (!api.field) {                                                                                        \
      snprintf(api_message, sizeof api_message, "%s has no %s", library, symbol);                            \
      api_error = api_message;                                                                               \
      return;                                                                                                \
    }                                                                                                        \
  } while (0)

static void load_api(void) {
  static const char *const libraries[] = {"libamdhip64.so.6", "libamdhip64.so.5"};
  void *handle = NULL;
  const char *library = NULL;
  for (size_t i = 0; !handle && i < sizeof libraries / sizeof libraries[0]; i++)
    if ((handle = dlopen(libraries[i], RTLD_NOW | RTLD_LOCAL)))
      library = libraries[i];
  if (!handle) {
    snprintf(api_message, sizeof api_message, "no HIP runtime (libamdhip64.so.6 or .so.5): %s", dlerror());
    api_error = api_message;
    return;
  }
  REQUIRE(GetDeviceCount, "hipGetDeviceCount");
  REQUIRE(GetDevice, "hipGetDevice");
  REQUIRE(SetDevice, "hipSetDevice");
  REQUIRE(DeviceGetAttribute, "hipDeviceGetAttribute");
  REQUIRE(Malloc, "hipMalloc");
  REQUIRE(Free, "hipFree");
  REQUIRE(Memcpy, "hipMemcpy");
  REQUIRE(Memset, "hipMemset");
  REQUIRE(DeviceSynchronize, "hipDeviceSynchronize");
  REQUIRE(StreamSynchronize, "hipStreamSynchronize");
  REQUIRE(GetErrorString, "hipGetErrorString");
  REQUIRE(GetErrorName, "hipGetErrorName");
  REQUIRE(GetLastError, "hipGetLastError");
  REQUIRE(ModuleLoadData, "hipModuleLoadData");
  REQUIRE(ModuleGetFunction, "hipModuleGetFunction");
  REQUIRE(ModuleUnload, "hipModuleUnload");
  REQUIRE(ModuleLaunchKernel, "hipModuleLaunchKernel");
  REQUIRE(HostMalloc, "hipHostMalloc");
  REQUIRE(HostFree, "hipHostFree");
  REQUIRE(MemcpyAsync, "hipMemcpyAsync");
  REQUIRE(EventCreateWithFlags, "hipEventCreateWithFlags");
  REQUIRE(EventRecord, "hipEventRecord");
  REQUIRE(EventQuery, "hipEventQuery");
  REQUIRE(EventSynchronize, "hipEventSynchronize");
  REQUIRE(EventDestroy, "hipEventDestroy");
  *(void **)&api.MallocAsync = dlsym(handle, "hipMallocAsync");
  *(void **)&api.FreeAsync = dlsym(handle, "hipFreeAsync");
  if (!api.MallocAsync || !api.FreeAsync)
    api.MallocAsync = NULL, api.FreeAsync = NULL;
  api_error = NULL;
}

const struct hip_api *rocm_hip(const char **why) {
  pthread_once(&api_once, load_api);
  if (api_error) {
    *why = api_error;
    return NULL;
  }
  return &api;
}

hipError_t rocm_kernels_load(struct rocm_kernels *k, const char **what) {
  static const char *const gemm_names[2][ROCM_GEMM_SIZES] = {
      {"mxfp4_k_gemm_bf16_t16", "mxfp4_k_gemm_bf16_t32", "mxfp4_k_gemm_bf16_t64"},
      {"mxfp4_k_gemm_f16_t16", "mxfp4_k_gemm_f16_t32", "mxfp4_k_gemm_f16_t64"}};
  if (k->module)
    return hipSuccess;
  *what = "hipModuleLoadData (the gfx942 code object)";
  k->module = NULL;
  hipError_t err = api.ModuleLoadData(&k->module, rocm_mxfp4_code_object);
  for (int f = 0; err == hipSuccess && f < 2; f++)
    for (int t = 0; err == hipSuccess && t < ROCM_GEMM_SIZES; t++) {
      *what = gemm_names[f][t];
      err = api.ModuleGetFunction(&k->gemm[f][t], k->module, gemm_names[f][t]);
    }
  struct {
    hipFunction_t *fn;
    const char *name;
  } others[] = {{&k->reduce, "mxfp4_k_reduce"},
                {&k->combine, "mxfp4_k_combine"},
                {&k->convert, "mxfp4_k_convert"},
                {&k->tile_codes, "mxfp4_k_tile_codes"},
                {&k->tile_scales, "mxfp4_k_tile_scales"}};
  for (size_t i = 0; err == hipSuccess && i < sizeof others / sizeof others[0]; i++) {
    *what = others[i].name;
    err = api.ModuleGetFunction(others[i].fn, k->module, others[i].name);
  }
  int device = 0, units = 0;
  if (err == hipSuccess && api.GetDevice(&device) == hipSuccess &&
      api.DeviceGetAttribute(&units, hipDeviceAttributeMultiprocessorCount, device) == hipSuccess &&
      units > 0 && units <= 4096)
    k->compute_units = units;
  else
    k->compute_units = 304; /* MI300X */
  if (err != hipSuccess && k->module) {
    (void)api.ModuleUnload(k->module);
    k->module = NULL;
  }
  return err;
}

static _Thread_local const struct rocm_kernels *current;

const struct rocm_kernels *rocm_current_kernels(void) { return current; }
void rocm_set_current_kernels(const struct rocm_kernels *k) { current = k; }
