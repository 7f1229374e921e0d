// Runs csrc/fp8/quant.cu — its launchers and its kernels, unmodified — on CPU threads, so the CUDA
// backend's indexing, reductions and vector paths are tested on machines without a GPU.
// Built with g++ by tests/kernels/test_fp8.py:
//   g++ -std=c++20 -shared -fPIC -pthread -I<cuda>/include -Icsrc tests/kernels/fp8_cuda_emulation.cpp
//
// Model: a block is kThreads std::threads; __syncthreads is a barrier; a warp shuffle writes to a
// shared buffer between two barriers (every kernel calls its shuffles from all threads of the block);
// __shared__ becomes a function-local static (blocks run one after another); __fdiv_rn / __fmul_rn are
// the host's IEEE division / multiplication (no FMA contraction in ISO C++ mode); the fp8 conversion
// is cuda_fp8.h's host path (round to nearest even, satfinite).
// What it cannot show: races between blocks, memory-model and alignment faults, the hardware cvt.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <math.h>

#include <barrier>
#include <cstring>
#include <thread>
#include <vector>

struct EmuDim {
  unsigned x = 0, y = 0, z = 0;
};
thread_local EmuDim threadIdx, blockIdx;
EmuDim gridDim;

namespace emu {
std::barrier<>* block_barrier = nullptr;
float shuffle_buffer[1024];
}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  emu::shuffle_buffer[threadIdx.x] = v;
  __syncthreads();
  const float r = emu::shuffle_buffer[threadIdx.x ^ lane_mask];
  __syncthreads();
  return r;
}
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
using std::max;
using std::min;

#undef __global__
#define __global__
#undef __launch_bounds__
#define __launch_bounds__(n)
#undef __shared__
#define __shared__ static
#define PRIMERL_FP8_HOST_EMULATION 1

template <typename Kernel, typename... Args>
void launch(Kernel kernel, long grid, CUstream_st*, Args... args);

extern "C" cudaError_t cudaGetLastError() { return cudaSuccess; }
extern "C" const char* cudaGetErrorString(cudaError_t) { return "emulated"; }

#include "fp8/quant.cu"

template <typename Kernel, typename... Args>
void launch(Kernel kernel, long grid, CUstream_st*, Args... args) {
  constexpr int threads = primerl::fp8::kernels::kThreads;
  gridDim.x = static_cast<unsigned>(grid);
  for (long b = 0; b < grid; ++b) {
    std::barrier<> barrier(threads);
    emu::block_barrier = &barrier;
    std::vector<std::thread> team;
    team.reserve(threads);
    for (int t = 0; t < threads; ++t) {
      team.emplace_back([=] {
        threadIdx.x = static_cast<unsigned>(t);
        blockIdx.x = static_cast<unsigned>(b);
        kernel(args...);
      });
    }
    for (auto& th : team) th.join();
  }
}

extern "C" {
int emu_quant_rows(const void* x, int in_dtype, void* q, int out_dtype, float* sf, long rows, long row_len,
                   int ue8m0, int reciprocal) {
  using namespace primerl::fp8;
  return quant_rows(x, InDType(in_dtype), q, OutDType(out_dtype), sf, rows, row_len, ue8m0 != 0, reciprocal != 0,
                    nullptr);
}

int emu_quant_blocks(const void* w, int in_dtype, void* q, int out_dtype, float* sf, long batch, long n, long k,
                     long bn, long bk, int ue8m0, int reciprocal) {
  using namespace primerl::fp8;
  return quant_blocks(w, InDType(in_dtype), q, OutDType(out_dtype), sf, batch, n, k, bn, bk, ue8m0 != 0,
                      reciprocal != 0, nullptr);
}

long emu_quant_tensorwise_workspace(long numel) { return primerl::fp8::quant_tensorwise_workspace(numel); }

int emu_quant_tensorwise(const void* x, int in_dtype, void* q, int out_dtype, float* sf, float* workspace,
                         long numel, int reciprocal) {
  using namespace primerl::fp8;
  return quant_tensorwise(x, InDType(in_dtype), q, OutDType(out_dtype), sf, workspace, numel, reciprocal != 0,
                          nullptr);
}
}
