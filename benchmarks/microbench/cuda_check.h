// Host-side error check shared by the microbenchmarks in this folder: a failing CUDA runtime call prints where and
// why, then exits (a benchmark has nothing to recover).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                              \
    do {                                                                                         \
        cudaError_t err_ = (call);                                                               \
        if (err_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)
