// torch.ops.primerl.fp8_quant_* : torch-facing wrappers of the launchers in quant.cu.
// The Python entry points (primerl/kernels/fp8/__init__.py) validate; these checks only guard
// direct callers of the ops.
//
// Only device-generic c10 APIs here (DeviceGuard, the guard impl's current stream): the c10/cuda
// headers need a generated header that CPU builds of torch lack, and CI syntax-checks this file
// against a CPU torch.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "fp8/quant.h"

namespace primerl {
namespace fp8 {
namespace {

InDType in_dtype_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return InDType::kFloat32;
    case at::kHalf: return InDType::kFloat16;
    case at::kBFloat16: return InDType::kBFloat16;
    default: TORCH_CHECK(false, "fp8 quant: input dtype must be float32, float16 or bfloat16, got ", x.scalar_type());
  }
}

OutDType out_dtype_of(at::ScalarType dtype) {
  if (dtype == at::kFloat8_e4m3fn) return OutDType::kE4M3;
  if (dtype == at::kFloat8_e5m2) return OutDType::kE5M2;
  TORCH_CHECK(false, "fp8 quant: dtype must be float8_e4m3fn or float8_e5m2, got ", dtype);
}

void check_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda(), op, ": input must be a CUDA tensor");
  TORCH_CHECK(x.is_contiguous(), op, ": input must be contiguous");
  TORCH_CHECK(x.numel() > 0, op, ": input is empty");
}

CUstream_st* current_stream(const at::Tensor& x) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return static_cast<CUstream_st*>(impl->getStream(x.device()).native_handle());
}

void check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, op, ": kernel launch failed: ", error_string(err));
}

std::tuple<at::Tensor, at::Tensor> quant_rows_op(const at::Tensor& x, int64_t row_len, at::ScalarType dtype,
                                                 bool ue8m0, bool reciprocal, std::vector<int64_t> sf_shape,
                                                 const char* op) {
  const c10::DeviceGuard guard(x.device());
  auto q = at::empty(x.sizes(), x.options().dtype(dtype));
  auto sf = at::empty(sf_shape, x.options().dtype(at::kFloat));
  check_launch(quant_rows(x.data_ptr(), in_dtype_of(x), q.data_ptr(), out_dtype_of(dtype), sf.data_ptr<float>(),
                          x.numel() / row_len, row_len, ue8m0, reciprocal, current_stream(x)),
               op);
  return {q, sf};
}

std::tuple<at::Tensor, at::Tensor> quant_per_token_group_op(const at::Tensor& x, int64_t group_size,
                                                            at::ScalarType dtype, bool ue8m0, bool reciprocal) {
  const char* op = "fp8_quant_per_token_group";
  check_input(x, op);
  TORCH_CHECK(x.dim() >= 1, op, ": input must have at least 1 dim");
  TORCH_CHECK(group_size > 0 && x.size(-1) % group_size == 0, op, ": K=", x.size(-1),
              " must be divisible by group_size=", group_size);
  auto sf_shape = x.sizes().vec();
  sf_shape.back() /= group_size;
  return quant_rows_op(x, group_size, dtype, ue8m0, reciprocal, sf_shape, op);
}

std::tuple<at::Tensor, at::Tensor> quant_rowwise_op(const at::Tensor& x, at::ScalarType dtype, bool reciprocal) {
  const char* op = "fp8_quant_rowwise";
  check_input(x, op);
  TORCH_CHECK(x.dim() >= 1, op, ": input must have at least 1 dim");
  auto sf_shape = x.sizes().vec();
  sf_shape.back() = 1;
  return quant_rows_op(x, x.size(-1), dtype, false, reciprocal, sf_shape, op);
}

std::tuple<at::Tensor, at::Tensor> quant_per_block_op(const at::Tensor& w, int64_t block_n, int64_t block_k,
                                                   at::ScalarType dtype, bool ue8m0, bool reciprocal) {
  const char* op = "fp8_quant_per_block";
  check_input(w, op);
  TORCH_CHECK(w.dim() == 2 || w.dim() == 3, op, ": w must be [N, K] or [G, N, K], got ", w.sizes());
  TORCH_CHECK(block_n > 0 && block_k > 0, op, ": block sizes must be positive");
  const int64_t n = w.size(-2), k = w.size(-1);
  const int64_t batch = w.dim() == 3 ? w.size(0) : 1;
  std::vector<int64_t> sf_shape;
  if (w.dim() == 3) sf_shape.push_back(batch);
  sf_shape.push_back((n + block_n - 1) / block_n);
  sf_shape.push_back((k + block_k - 1) / block_k);
  const c10::DeviceGuard guard(w.device());
  auto q = at::empty(w.sizes(), w.options().dtype(dtype));
  auto sf = at::empty(sf_shape, w.options().dtype(at::kFloat));
  check_launch(quant_blocks(w.data_ptr(), in_dtype_of(w), q.data_ptr(), out_dtype_of(dtype), sf.data_ptr<float>(),
                            batch, n, k, block_n, block_k, ue8m0, reciprocal, current_stream(w)),
               op);
  return {q, sf};
}

std::tuple<at::Tensor, at::Tensor> quant_tensorwise_op(const at::Tensor& x, at::ScalarType dtype, bool reciprocal) {
  const char* op = "fp8_quant_tensorwise";
  check_input(x, op);
  const c10::DeviceGuard guard(x.device());
  auto q = at::empty(x.sizes(), x.options().dtype(dtype));
  auto sf = at::empty({}, x.options().dtype(at::kFloat));
  auto workspace = at::empty({quant_tensorwise_workspace(x.numel())}, x.options().dtype(at::kFloat));
  check_launch(quant_tensorwise(x.data_ptr(), in_dtype_of(x), q.data_ptr(), out_dtype_of(dtype), sf.data_ptr<float>(),
                                workspace.data_ptr<float>(), x.numel(), reciprocal, current_stream(x)),
               op);
  return {q, sf};
}

}  // namespace
}  // namespace fp8
}  // namespace primerl

// The schemas (and the fake kernels torch.compile / FakeTensorMode use) are defined in Python, in
// primerl/kernels/_ext.py, so that they exist without this extension; here only the CUDA kernels.
TORCH_LIBRARY_IMPL(primerl, CUDA, m) {
  m.impl("fp8_quant_per_token_group", &primerl::fp8::quant_per_token_group_op);
  m.impl("fp8_quant_per_block", &primerl::fp8::quant_per_block_op);
  m.impl("fp8_quant_rowwise", &primerl::fp8::quant_rowwise_op);
  m.impl("fp8_quant_tensorwise", &primerl::fp8::quant_tensorwise_op);
}
