// FP8 quantization device code: constants, conversions and the __global__ kernels.
// Included by quant.cu (which adds the host launchers) and, on machines without a GPU, by the host
// emulation in tests/kernels/fp8_cuda_emulation.cpp, which runs these same kernels on CPU threads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "fp8/quant.h"

namespace primerl {
namespace fp8 {
namespace kernels {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPartials = 1024;
constexpr int kAmaxTileElems = kThreads * 16;  // elements per amax block per sweep
constexpr int kMaxCastBlocks = 1024;
constexpr float kAmaxFloor = 1e-4f;  // same float32 value as torch's clamp_min(1e-4)

template <OutDType OUT>
struct Fp8Traits;
template <>
struct Fp8Traits<OutDType::kE4M3> {
  static constexpr float kMax = 448.0f;
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E4M3;
};
template <>
struct Fp8Traits<OutDType::kE5M2> {
  static constexpr float kMax = 57344.0f;
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E5M2;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N>
struct alignas(N) BytePack {
  __nv_fp8_storage_t v[N];
};

__device__ __forceinline__ float scale_from_amax(float amax, float fmax, bool ue8m0) {
  float sf = __fdiv_rn(fmaxf(amax, kAmaxFloor), fmax);
  if (ue8m0) {
    // 2 ** ceil(log2(sf)) for a positive normal sf: bump the exponent if any mantissa bit is set.
    const unsigned bits = __float_as_uint(sf);
    const unsigned exponent = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u ? 1u : 0u);
    sf = __uint_as_float(exponent << 23);
  }
  return sf;
}

template <OutDType OUT>
__device__ __forceinline__ __nv_fp8_storage_t quantize(float x, float sf) {
  constexpr float fmax = Fp8Traits<OUT>::kMax;
  const float y = fminf(fmaxf(__fdiv_rn(x, sf), -fmax), fmax);
  return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, Fp8Traits<OUT>::kKind);
}

// Max over aligned groups of `width` lanes (a power of two <= 32); every lane of the warp calls it.
__device__ __forceinline__ float warp_max(float v, int width) {
  for (int offset = width / 2; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Max over the whole block; call once per kernel (smem is not reused).
__device__ __forceinline__ float block_max(float v, float* smem) {
  v = warp_max(v, 32);
  if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = v;
  __syncthreads();
  float r = smem[0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i) r = fmaxf(r, smem[i]);
  return r;
}

template <typename TIn, int VEC>
__device__ __forceinline__ Pack<TIn, VEC> load_pack(const TIn* p) {
  return *reinterpret_cast<const Pack<TIn, VEC>*>(p);
}

// One team of `team` threads (a power of two, <= kThreads) per row.
template <typename TIn, OutDType OUT, int VEC>
__global__ void __launch_bounds__(kThreads)
    quant_rows_kernel(const TIn* __restrict__ x, __nv_fp8_storage_t* __restrict__ q, float* __restrict__ sf,
                      int64_t rows, int64_t row_len, int team, bool ue8m0) {
  __shared__ float smem[kWarps];
  const int teams_per_block = kThreads / team;
  const int lane = threadIdx.x % team;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * teams_per_block + threadIdx.x / team;
  const bool active = row < rows;
  const int64_t n_vec = row_len / VEC;
  float amax = 0.0f;
  if (active) {
    const TIn* xr = x + row * row_len;
    for (int64_t i = lane; i < n_vec; i += team) {
      const Pack<TIn, VEC> p = load_pack<TIn, VEC>(xr + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_float(p.v[j])));
    }
  }
  amax = warp_max(amax, team < 32 ? team : 32);
  if (team > 32) {  // uniform over the block
    if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = amax;
    __syncthreads();
    const int warps_per_team = team / 32;
    const int first = (threadIdx.x / team) * warps_per_team;
    amax = smem[first];
    for (int w = 1; w < warps_per_team; ++w) amax = fmaxf(amax, smem[first + w]);
  }
  if (!active) return;
  const float s = scale_from_amax(amax, Fp8Traits<OUT>::kMax, ue8m0);
  if (lane == 0) sf[row] = s;
  const TIn* xr = x + row * row_len;
  __nv_fp8_storage_t* qr = q + row * row_len;
  for (int64_t i = lane; i < n_vec; i += team) {
    const Pack<TIn, VEC> p = load_pack<TIn, VEC>(xr + i * VEC);
    BytePack<VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = quantize<OUT>(to_float(p.v[j]), s);
    *reinterpret_cast<BytePack<VEC>*>(qr + i * VEC) = out;
  }
}

// One thread block per (batch, block row, block column); blockIdx.x enumerates sf's layout.
template <typename TIn, OutDType OUT, int VEC>
__global__ void __launch_bounds__(kThreads)
    quant_blocks_kernel(const TIn* __restrict__ w, __nv_fp8_storage_t* __restrict__ q, float* __restrict__ sf,
                        int64_t n, int64_t k, int64_t bn, int64_t bk, int64_t nb, int64_t kb, bool ue8m0) {
  __shared__ float smem[kWarps];
  const int64_t blk = blockIdx.x;
  const int64_t bj = blk % kb;
  const int64_t bi = (blk / kb) % nb;
  const int64_t g = blk / (kb * nb);
  const int64_t n0 = bi * bn, k0 = bj * bk;
  const int rows = static_cast<int>(min(bn, n - n0));
  const int cols_vec = static_cast<int>(min(bk, k - k0) / VEC);
  const int count = rows * cols_vec;
  const int64_t offset = g * n * k + n0 * k + k0;
  const TIn* wb = w + offset;
  float amax = 0.0f;
  for (int e = threadIdx.x; e < count; e += kThreads) {
    const int r = e / cols_vec, c = e - r * cols_vec;
    const Pack<TIn, VEC> p = load_pack<TIn, VEC>(wb + r * k + c * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_float(p.v[j])));
  }
  amax = block_max(amax, smem);
  const float s = scale_from_amax(amax, Fp8Traits<OUT>::kMax, ue8m0);
  if (threadIdx.x == 0) sf[blk] = s;
  __nv_fp8_storage_t* qb = q + offset;
  for (int e = threadIdx.x; e < count; e += kThreads) {
    const int r = e / cols_vec, c = e - r * cols_vec;
    const Pack<TIn, VEC> p = load_pack<TIn, VEC>(wb + r * k + c * VEC);
    BytePack<VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = quantize<OUT>(to_float(p.v[j]), s);
    *reinterpret_cast<BytePack<VEC>*>(qb + r * k + c * VEC) = out;
  }
}

template <typename TIn, int VEC>
__global__ void __launch_bounds__(kThreads)
    amax_partials_kernel(const TIn* __restrict__ x, float* __restrict__ partials, int64_t numel) {
  __shared__ float smem[kWarps];
  const int64_t n_vec = numel / VEC;
  float amax = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n_vec;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const Pack<TIn, VEC> p = load_pack<TIn, VEC>(x + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_float(p.v[j])));
  }
  amax = block_max(amax, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = amax;
}

// Every block reduces the few partial maxima itself (they sit in L2), so sf needs no extra launch.
template <typename TIn, OutDType OUT, int VEC>
__global__ void __launch_bounds__(kThreads)
    cast_tensorwise_kernel(const TIn* __restrict__ x, __nv_fp8_storage_t* __restrict__ q,
                           const float* __restrict__ partials, int n_partials, float* __restrict__ sf,
                           int64_t numel) {
  __shared__ float smem[kWarps];
  float amax = 0.0f;
  for (int i = threadIdx.x; i < n_partials; i += kThreads) amax = fmaxf(amax, partials[i]);
  amax = block_max(amax, smem);
  const float s = scale_from_amax(amax, Fp8Traits<OUT>::kMax, false);
  if (blockIdx.x == 0 && threadIdx.x == 0) *sf = s;
  const int64_t n_vec = numel / VEC;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n_vec;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const Pack<TIn, VEC> p = load_pack<TIn, VEC>(x + i * VEC);
    BytePack<VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = quantize<OUT>(to_float(p.v[j]), s);
    *reinterpret_cast<BytePack<VEC>*>(q + i * VEC) = out;
  }
}

}  // namespace kernels
}  // namespace fp8
}  // namespace primerl
