/*
 * cuda_check.h: the CUDA runtime and qkeep call checks of the C GPU benchmarks (bench_forward,
 * bench_load): a failing call prints where and why, and the program exits 1. Header-only.
 */
#ifndef QKEEP_BENCH_CUDA_CHECK_H
#define QKEEP_BENCH_CUDA_CHECK_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#include "qkeep/qkeep.h"

#define CUDA_OK(call)                                                                                        \
  do {                                                                                                       \
    cudaError_t e_ = (call);                                                                                 \
    if (e_ != cudaSuccess) {                                                                                 \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));                 \
      exit(1);                                                                                               \
    }                                                                                                        \
  } while (0)
#define QKEEP_OK(call)                                                                                       \
  do {                                                                                                       \
    if ((call)) {                                                                                            \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, qkeep_errmsg());                         \
      exit(1);                                                                                               \
    }                                                                                                        \
  } while (0)

#endif
