// FP8 quantization kernels: per-token-group / rowwise (one row kernel), per-block, tensorwise.
// Bitwise equal to primerl/kernels/fp8/reference.py: IEEE division and reciprocal (__fdiv_rn and
// __fmul_rn, which stay exact even under --use_fast_math), NaN-propagating maxima on the bits,
// ue8m0 rounding on the exponent bits, clamp, then the round-to-nearest-even satfinite conversion. Device code lives in quant_kernels.cuh.
#include "fp8/quant.h"
#include "fp8/quant_kernels.cuh"

#include <algorithm>
#include <type_traits>

namespace primerl {
namespace fp8 {
namespace {

using namespace kernels;

template <typename TIn, typename F>
cudaError_t dispatch_out(OutDType out_dtype, F&& f) {
  if (out_dtype == OutDType::kE4M3) return f(TIn{}, std::integral_constant<OutDType, OutDType::kE4M3>{});
  if (out_dtype == OutDType::kE5M2) return f(TIn{}, std::integral_constant<OutDType, OutDType::kE5M2>{});
  return cudaErrorInvalidValue;
}

// Calls f(TIn{}, integral_constant<OutDType, OUT>{}) for the runtime dtype pair.
template <typename F>
cudaError_t dispatch(InDType in_dtype, OutDType out_dtype, F&& f) {
  switch (in_dtype) {
    case InDType::kFloat32: return dispatch_out<float>(out_dtype, f);
    case InDType::kFloat16: return dispatch_out<__half>(out_dtype, f);
    case InDType::kBFloat16: return dispatch_out<__nv_bfloat16>(out_dtype, f);
  }
  return cudaErrorInvalidValue;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v && p < kThreads) p <<= 1;
  return p;
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifndef PRIMERL_FP8_HOST_EMULATION  // the host emulation (tests/kernels) brings its own launch()
template <typename Kernel, typename... Args>
void launch(Kernel kernel, int64_t grid, CUstream_st* stream, Args... args) {
  kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(args...);
}
#endif

}  // namespace

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

int quant_rows(const void* x, InDType in_dtype, void* q, OutDType out_dtype, float* sf, int64_t rows,
               int64_t row_len, bool ue8m0, bool reciprocal, CUstream_st* stream) {
  if (rows <= 0 || row_len <= 0) return cudaSuccess;
  return dispatch(in_dtype, out_dtype, [&](auto tin, auto tout) -> cudaError_t {
    using TIn = decltype(tin);
    constexpr OutDType OUT = decltype(tout)::value;
    constexpr int V = 16 / sizeof(TIn);
    const bool vec = row_len % V == 0 && aligned16(x) && aligned16(q);
    const int64_t n_vec = vec ? row_len / V : row_len;
    const int team = next_pow2(cdiv(n_vec, 2));  // about two loads per thread, at most a block
    const int64_t grid = cdiv(rows, kThreads / team);
    const auto* xp = static_cast<const TIn*>(x);
    auto* qp = static_cast<__nv_fp8_storage_t*>(q);
    if (vec) {
      launch(quant_rows_kernel<TIn, OUT, V>, grid, stream, xp, qp, sf, rows, row_len, team, ue8m0, reciprocal);
    } else {
      launch(quant_rows_kernel<TIn, OUT, 1>, grid, stream, xp, qp, sf, rows, row_len, team, ue8m0, reciprocal);
    }
    return cudaGetLastError();
  });
}

int quant_blocks(const void* w, InDType in_dtype, void* q, OutDType out_dtype, float* sf, int64_t batch,
                 int64_t n, int64_t k, int64_t bn, int64_t bk, bool ue8m0, bool reciprocal, CUstream_st* stream) {
  if (batch <= 0 || n <= 0 || k <= 0) return cudaSuccess;
  if (bn <= 0 || bk <= 0 || bn * bk > (int64_t{1} << 30)) return cudaErrorInvalidValue;
  const int64_t nb = cdiv(n, bn), kb = cdiv(k, bk);
  const int64_t grid = batch * nb * kb;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  return dispatch(in_dtype, out_dtype, [&](auto tin, auto tout) -> cudaError_t {
    using TIn = decltype(tin);
    constexpr OutDType OUT = decltype(tout)::value;
    constexpr int V = 16 / sizeof(TIn);
    const bool vec = bk % V == 0 && k % V == 0 && aligned16(w) && aligned16(q);
    const auto* wp = static_cast<const TIn*>(w);
    auto* qp = static_cast<__nv_fp8_storage_t*>(q);
    if (vec) {
      launch(quant_blocks_kernel<TIn, OUT, V>, grid, stream, wp, qp, sf, n, k, bn, bk, nb, kb, ue8m0, reciprocal);
    } else {
      launch(quant_blocks_kernel<TIn, OUT, 1>, grid, stream, wp, qp, sf, n, k, bn, bk, nb, kb, ue8m0, reciprocal);
    }
    return cudaGetLastError();
  });
}

int64_t quant_tensorwise_workspace(int64_t numel) {
  return std::max<int64_t>(1, std::min<int64_t>(cdiv(numel, kAmaxTileElems), kMaxPartials));
}

int quant_tensorwise(const void* x, InDType in_dtype, void* q, OutDType out_dtype, float* sf,
                     float* workspace, int64_t numel, bool reciprocal, CUstream_st* stream) {
  if (numel <= 0) return cudaSuccess;
  const int n_partials = static_cast<int>(quant_tensorwise_workspace(numel));
  return dispatch(in_dtype, out_dtype, [&](auto tin, auto tout) -> cudaError_t {
    using TIn = decltype(tin);
    constexpr OutDType OUT = decltype(tout)::value;
    constexpr int V = 16 / sizeof(TIn);
    const bool vec = numel % V == 0 && aligned16(x) && aligned16(q);
    const auto* xp = static_cast<const TIn*>(x);
    auto* qp = static_cast<__nv_fp8_storage_t*>(q);
    const int64_t n_vec = vec ? numel / V : numel;
    const int cast_grid = static_cast<int>(std::min<int64_t>(cdiv(n_vec, kThreads), kMaxCastBlocks));
    if (vec) {
      launch(amax_partials_kernel<TIn, V>, n_partials, stream, xp, workspace, numel);
      launch(cast_tensorwise_kernel<TIn, OUT, V>, cast_grid, stream, xp, qp, workspace, n_partials, sf, numel,
             reciprocal);
    } else {
      launch(amax_partials_kernel<TIn, 1>, n_partials, stream, xp, workspace, numel);
      launch(cast_tensorwise_kernel<TIn, OUT, 1>, cast_grid, stream, xp, qp, workspace, n_partials, sf, numel,
             reciprocal);
    }
    return cudaGetLastError();
  });
}

}  // namespace fp8
}  // namespace primerl
