// CPU emulation of the CUDA C subset that middleware's generated kernels use.
//
// Compile a generated .cu as C++ with `g++ -x c++ -include emulate.h -DMW_EMULATE`: the
// CUDA qualifiers become nothing, blockIdx/threadIdx/blockDim/gridDim become globals, and
// mw_run_grid() runs a launch's grid block by block and thread by thread. That is exact
// for kernels whose threads never wait for each other: __syncthreads and __shared__ are
// refused at compile time here. Tiled kernels (shared memory and barriers) spell them
// MW_SHARED, MW_SYNC and MW_THREADS, which under MW_EMULATE run each phase between two
// barriers as a loop over the block's threads (mw_run_blocks): exact as well.
#pragma once
#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstdint>

#ifdef __CUDACC__
#error "emulate.h is for compiling generated kernels on the CPU, not with nvcc"
#endif

struct mw_dim3 {
  unsigned x = 1, y = 1, z = 1;
};
static mw_dim3 threadIdx, blockIdx, blockDim, gridDim;
static const int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
// Threads run one after the other: a barrier cannot be emulated, so using one is an error.
#define __syncthreads() static_assert(sizeof(int) == 0, "emulated kernels must not synchronise")
#define __shared__ static_assert(sizeof(int) == 0, "emulated kernels must not use shared memory");

using std::max;
using std::min;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <typename T> inline T __ldg(const T* p) { return *p; }
struct alignas(16) float4 {
  float x, y, z, w;
};

// Tiled kernels (kernel_tiled.cu.j2) loop over their block's threads themselves, one loop
// per phase between barriers (MW_THREADS): the grid runs block by block, each block once.
template <typename F> inline void mw_run_blocks(unsigned grid, unsigned block, F&& body) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    threadIdx.x = 0;
    body();
  }
}

template <typename F> inline void mw_run_grid(unsigned grid, unsigned block, F&& body) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned t = 0; t < block; ++t) {
      threadIdx.x = t;
      body();
    }
  }
}
