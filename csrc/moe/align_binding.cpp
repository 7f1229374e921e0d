// torch.ops.primerl.moe_align / moe_scatter_rows: torch-facing wrappers of the launchers in align.cu.
// The Python entry points (primerl/kernels/moe/__init__.py) validate; these checks only guard
// direct callers. Only device-generic c10 APIs (see csrc/fp8/quant_binding.cpp for why).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "moe/align.h"

namespace primerl {
namespace moe {
namespace {

cudaStream_t current_stream(const at::Tensor& x) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return static_cast<cudaStream_t>(impl->getStream(x.device()).native_handle());
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> align_op(const at::Tensor& topk_ids,
                                                                                 int64_t num_experts, int64_t block) {
  const char* op = "moe_align";
  TORCH_CHECK(topk_ids.is_cuda(), op, ": topk_ids must be a CUDA tensor");
  TORCH_CHECK(num_experts > 0 && block > 0, op, ": num_experts and block must be positive");
  const c10::DeviceGuard guard(topk_ids.device());
  const auto ids = topk_ids.reshape({-1}).to(at::kInt).contiguous();
  const int64_t n = ids.numel();
  const int64_t bound = n + num_experts * (block - 1);
  const auto opts = ids.options().dtype(at::kInt);
  auto workspace = at::empty({align_workspace(n, static_cast<int32_t>(num_experts))}, opts);
  auto counts = at::empty({num_experts}, opts);
  auto ends = at::empty({num_experts}, opts);
  auto row_of_slot = at::empty({n}, opts);
  auto sorted_slots = at::empty({bound}, opts);
  auto block_expert = at::empty({(bound + block - 1) / block}, opts);
  check_launch(align(ids.data_ptr<int32_t>(), n, static_cast<int32_t>(num_experts), static_cast<int32_t>(block),
                     workspace.data_ptr<int32_t>(), counts.data_ptr<int32_t>(), ends.data_ptr<int32_t>(),
                     row_of_slot.data_ptr<int32_t>(), sorted_slots.data_ptr<int32_t>(),
                     block_expert.data_ptr<int32_t>(), current_stream(ids)),
               op);
  return {row_of_slot, sorted_slots, block_expert, ends.narrow(0, num_experts - 1, 1).clone(), ends};
}

at::Tensor scatter_rows_op(const at::Tensor& src, const at::Tensor& row_map, const std::optional<at::Tensor>& scale,
                           int64_t num_rows) {
  const char* op = "moe_scatter_rows";
  TORCH_CHECK(src.is_cuda() && src.dim() == 2 && src.is_contiguous(), op, ": src must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(row_map.dim() == 2 && row_map.size(0) == src.size(0) && row_map.scalar_type() == at::kInt, op,
              ": row_map must be int32 [T, k] with T = src rows");
  DType dtype;
  switch (src.scalar_type()) {
    case at::kFloat: dtype = DType::kFloat32; break;
    case at::kHalf: dtype = DType::kFloat16; break;
    case at::kBFloat16: dtype = DType::kBFloat16; break;
    default: TORCH_CHECK(false, op, ": src dtype must be float32, float16 or bfloat16, got ", src.scalar_type());
  }
  const c10::DeviceGuard guard(src.device());
  const auto rows = row_map.contiguous();
  at::Tensor scale_c;
  if (scale.has_value()) {
    scale_c = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(scale_c.numel() == rows.numel(), op, ": scale must have one value per slot");
  }
  auto out = at::zeros({num_rows, src.size(1)}, src.options());
  check_launch(scatter_rows(src.data_ptr(), dtype, rows.data_ptr<int32_t>(),
                            scale.has_value() ? scale_c.data_ptr<float>() : nullptr, out.data_ptr(), rows.numel(),
                            static_cast<int32_t>(rows.size(1)), src.size(1), current_stream(src)),
               op);
  return out;
}

}  // namespace
}  // namespace moe
}  // namespace primerl

// Schemas and fake kernels: primerl/kernels/_ext.py (see csrc/fp8/quant_binding.cpp).
TORCH_LIBRARY_IMPL(primerl, CUDA, m) {
  m.impl("moe_align", &primerl::moe::align_op);
  m.impl("moe_scatter_rows", &primerl::moe::scatter_rows_op);
}
