/*
 * mxfp4.hip: the HIP build of the shared MXFP4 kernels (plugins/gpu/mxfp4_kernel.h) for
 * gfx942 (MI300), wave 64, MFMA 16x16x16 bf16/f16. Compiled device-only by clang-19 into
 * a code object that the plugin embeds and loads by name (plugins/rocm/launch.c); no HIP
 * header and no host code.
 */
#include "mxfp4_kernel.h"

MXFP4_GEMM_KERNELS(16, 1, 8)
MXFP4_GEMM_KERNELS(32, 2, 4)
MXFP4_GEMM_KERNELS(64, 4, 4)
MXFP4_OTHER_KERNELS
