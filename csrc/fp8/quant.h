// FP8 quantization launchers (implemented in quant.cu). Raw pointers and a stream only: no torch.
//
// Convention (DeepGEMM's): sf is the dequantization factor, x ~= q * sf. Per group:
// amax = max(|x|) (NaN propagates) clamped to >= 1e-4, sf = amax / fmax (IEEE division; 448 for
// e4m3, 57344 for e5m2), optionally rounded up to a power of two (ue8m0, exponent clamped to
// [1, 254]), q = clamp(x * (1 / sf)) (reciprocal = true, DeepGEMM's) or clamp(x / sf) to +-fmax,
// NaN kept, cast with round-to-nearest-even. Bitwise equal to primerl/kernels/fp8/reference.py.
#pragma once

#include <cstddef>
#include <cstdint>

// cudaStream_t is `CUstream_st*`; declaring the struct keeps CUDA headers out of the bindings, which
// CI syntax-checks against a CPU torch.
struct CUstream_st;

namespace primerl {
namespace fp8 {

enum class InDType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum class OutDType : int { kE4M3 = 0, kE5M2 = 1 };

// Every launcher returns a cudaError_t value (0 = cudaSuccess); error_string names it.
const char* error_string(int err);

// x, q: [rows, row_len] contiguous; sf: [rows]. Serves per-token-group (row_len = group size on the
// [numel / group, group] view) and rowwise (row_len = K).
int quant_rows(const void* x, InDType in_dtype, void* q, OutDType out_dtype, float* sf,
                       int64_t rows, int64_t row_len, bool ue8m0, bool reciprocal, CUstream_st* stream);

// w, q: [batch, n, k] contiguous; sf: [batch, ceil(n / bn), ceil(k / bk)]; edge blocks may be ragged.
int quant_blocks(const void* w, InDType in_dtype, void* q, OutDType out_dtype, float* sf,
                         int64_t batch, int64_t n, int64_t k, int64_t bn, int64_t bk, bool ue8m0,
                         bool reciprocal, CUstream_st* stream);

// Number of floats of workspace quant_tensorwise needs for numel elements.
int64_t quant_tensorwise_workspace(int64_t numel);

// x, q: numel contiguous elements; sf: one float; workspace: quant_tensorwise_workspace(numel) floats.
int quant_tensorwise(const void* x, InDType in_dtype, void* q, OutDType out_dtype, float* sf,
                             float* workspace, int64_t numel, bool reciprocal, CUstream_st* stream);

}  // namespace fp8
}  // namespace primerl
