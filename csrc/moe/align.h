// MoE layout launchers (implemented in align.cu). Raw pointers and a stream only: no torch.
//
// n = T * k routed slots (slot t*k + j), E experts. The layout is the one of
// primerl/kernels/moe/reference.py `align`: the slots of expert e occupy rows
// [ends[e] - padded[e], ...) in increasing slot order, each expert padded to a multiple of `block`.
// The rank of a slot within its expert is computed without atomics, so the layout is bitwise
// deterministic and equal to the reference.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace primerl {
namespace moe {

// Slots handled by one thread block of the layout kernels.
constexpr int kAlignSlots = 256;

// Number of int32 workspace elements moe_align needs: two [ceil(n / kAlignSlots), E] tables.
int64_t align_workspace(int64_t n, int32_t num_experts);

// ids [n] int32 in [0, E). Outputs: counts [E], ends [E] (cumulative padded ends), row_of_slot [n],
// sorted_slots [P] (slot per row, n on padding rows; P = n + E * (block - 1)),
// block_expert [ceil(P / block)] (expert per block, -1 past the padded total).
cudaError_t align(const int32_t* ids, int64_t n, int32_t num_experts, int32_t block, int32_t* workspace,
                  int32_t* counts, int32_t* ends, int32_t* row_of_slot, int32_t* sorted_slots,
                  int32_t* block_expert, cudaStream_t stream);

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// out [num_rows, D] must be zero-filled by the caller; out[row_map[s]] = src[s / k] (* scale[s],
// multiplied in float32 and rounded once) for every slot s < n. src [T, D], row_map [n], scale [n] or null.
cudaError_t scatter_rows(const void* src, DType dtype, const int32_t* row_map, const float* scale, void* out,
                         int64_t n, int32_t k, int64_t dim, cudaStream_t stream);

}  // namespace moe
}  // namespace primerl
