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

// Absolute maxima are taken on the bits: for non-negative floats (and a NaN with its sign cleared)
// the unsigned order is the float order with NaN above inf, so a NaN propagates as in torch.amax
// (fmaxf would drop it). `a` and `b` must be >= 0 or a positive NaN.
__device__ __forceinline__ float nan_max(float a, float b) {
  return __uint_as_float(max(__float_as_uint(a), __float_as_uint(b)));
}

__device__ __forceinline__ float abs_max(float amax, float v) {
  return nan_max(amax, __uint_as_float(__float_as_uint(v) & 0x7FFFFFFFu));
}

__device__ __forceinline__ float scale_from_amax(float amax, float fmax, bool ue8m0) {
  float sf = __fdiv_rn(amax < kAmaxFloor ? kAmaxFloor : amax, fmax);  // keeps NaN
  if (ue8m0) {
    // 2 ** ceil(log2(sf)): bump the exponent if any mantissa bit is set; clamp the biased exponent
    // to [1, 254] (inf / NaN -> 2**127), as DeepGEMM's ceil_to_ue8m0.
    const unsigned bits = __float_as_uint(sf) & 0x7FFFFFFFu;
    unsigned exponent = (bits >> 23) + ((bits & 0x7FFFFFu) != 0u ? 1u : 0u);
    exponent = exponent < 1u ? 1u : (exponent > 254u ? 254u : exponent);
    sf = __uint_as_float(exponent << 23);
  }
  return sf;
}

// The per-group operand of the cast: sf itself (x / sf), or, with reciprocal rounding, 1 / sf
// (x * (1 / sf), DeepGEMM's convention), computed once per group.
__device__ __forceinline__ float cast_operand(float sf, bool reciprocal) {
  return reciprocal ? __fdiv_rn(1.0f, sf) : sf;
}

template <OutDType OUT>
__device__ __forceinline__ __nv_fp8_storage_t quantize(float x, float operand, bool reciprocal) {
  constexpr float fmax = Fp8Traits<OUT>::kMax;
  float y = reciprocal ? __fmul_rn(x, operand) : __fdiv_rn(x, operand);
  if (y == y) y = fminf(fmaxf(y, -fmax), fmax);  // NaN stays NaN (the cvt keeps it)
  return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, Fp8Traits<OUT>::kKind);
}

// Max over aligned groups of `width` lanes (a power of two <= 32); every lane of the warp calls it.
__device__ __forceinline__ float warp_max(float v, int width) {
  for (int offset = width / 2; offset > 0; offset >>= 1) {
    v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
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
  for (int i = 1; i < kWarps; ++i) r = nan_max(r, smem[i]);
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
                      int64_t rows, int64_t row_len, int team, bool ue8m0, bool reciprocal) {
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
      for (int j = 0; j < VEC; ++j) amax = abs_max(amax, to_float(p.v[j]));
    }
  }
  amax = warp_max(amax, team < 32 ? team : 32);
  if (team > 32) {  // uniform over the block
    if (threadIdx.x % 32 == 0) smem[threadIdx.x / 32] = amax;
    __syncthreads();
    const int warps_per_team = team / 32;
    const int first = (threadIdx.x / team) * warps_per_team;
    amax = smem[first];
    for (int w = 1; w < warps_per_team; ++w) amax = nan_max(amax, smem[first + w]);
  }
  if (!active) return;
  const float s = scale_from_amax(amax, Fp8Traits<OUT>::kMax, ue8m0);
  const float op = cast_operand(s, reciprocal);
  if (lane == 0) sf[row] = s;
  const TIn* xr = x + row * row_len;
  __nv_fp8_storage_t* qr = q + row * row_len;
  for (int64_t i = lane; i < n_vec; i += team) {
    const Pack<TIn, VEC> p = load_pack<TIn, VEC>(xr + i * VEC);
    BytePack<VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = quantize<OUT>(to_float(p.v[j]), op, reciprocal);
    *reinterpret_cast<BytePack<VEC>*>(qr + i * VEC) = out;
  }
}

// One thread block per (batch, block row, block column); blockIdx.x enumerates sf's layout.
template <typename TIn, OutDType OUT, int VEC>
__global__ void __launch_bounds__(kThreads)
    quant_blocks_kernel(const TIn* __restrict__ w, __nv_fp8_storage_t* __restrict__ q, float* __restrict__ sf,
                        int64_t n, int64_t k, int64_t bn, int64_t bk, int64_t nb, int64_t kb, bool ue8m0,
                        bool reciprocal) {
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
    for (int j = 0; j < VEC; ++j) amax = abs_max(amax, to_float(p.v[j]));
  }
  amax = block_max(amax, smem);
  const float s = scale_from_amax(amax, Fp8Traits<OUT>::kMax, ue8m0);
  const float op = cast_operand(s, reciprocal);
  if (threadIdx.x == 0) sf[blk] = s;
  __nv_fp8_storage_t* qb = q + offset;
  for (int e = threadIdx.x; e < count; e += kThreads) {
    const int r = e / cols_vec, c = e - r * cols_vec;
    const Pack<TIn, VEC> p = load_pack<TIn, VEC>(wb + r * k + c * VEC);
    BytePack<VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = quantize<OUT>(to_float(p.v[j]), op, reciprocal);
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
    for (int j = 0; j < VEC; ++j) amax = abs_max(amax, to_float(p.v[j]));
  }
  amax = block_max(amax, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = amax;
}

// Every block reduces the few partial maxima itself (they sit in L2), so sf needs no extra launch.
template <typename TIn, OutDType OUT, int VEC>
__global__ void __launch_bounds__(kThreads)
    cast_tensorwise_kernel(const TIn* __restrict__ x, __nv_fp8_storage_t* __restrict__ q,
                           const float* __restrict__ partials, int n_partials, float* __restrict__ sf,
                           int64_t numel, bool reciprocal) {
  __shared__ float smem[kWarps];
  float amax = 0.0f;
  for (int i = threadIdx.x; i < n_partials; i += kThreads) amax = nan_max(amax, partials[i]);
  amax = block_max(amax, smem);
  const float s = scale_from_amax(amax, Fp8Traits<OUT>::kMax, false);
  const float op = cast_operand(s, reciprocal);
  if (blockIdx.x == 0 && threadIdx.x == 0) *sf = s;
  const int64_t n_vec = numel / VEC;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n_vec;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const Pack<TIn, VEC> p = load_pack<TIn, VEC>(x + i * VEC);
    BytePack<VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = quantize<OUT>(to_float(p.v[j]), op, reciprocal);
    *reinterpret_cast<BytePack<VEC>*>(q + i * VEC) = out;
  }
}

}  // namespace kernels
}  // namespace fp8
}  // namespace primerl
