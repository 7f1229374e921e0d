// MoE layout (counts, padded expert-sorted rows) and row scatter. See align.h for the contract.
#include "moe/align.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace primerl {
namespace moe {
namespace {

constexpr int kThreads = 256;
static_assert(kAlignSlots == kThreads, "one slot per thread in the layout kernels");

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// block_counts[b][e] = number of slots of block b routed to expert e (shared-memory histogram).
__global__ void block_counts_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t num_experts,
                                    int32_t* __restrict__ block_counts) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kAlignSlots + threadIdx.x;
  if (s < n) atomicAdd(&hist[ids[s]], 1);  // integer counts: order does not matter
  __syncthreads();
  int32_t* row = block_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) row[e] = hist[e];
}

// One thread block. counts/ends per expert, then block_base[b][e] = first row of block b's
// slots of expert e (exclusive scan over blocks, offset by the expert's start).
__global__ void block_bases_kernel(const int32_t* __restrict__ block_counts, int32_t* __restrict__ block_base,
                                   int64_t num_blocks, int32_t num_experts, int32_t align,
                                   int32_t* __restrict__ counts, int32_t* __restrict__ ends) {
  extern __shared__ int32_t padded[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t c = 0;
    for (int64_t b = 0; b < num_blocks; ++b) c += block_counts[b * num_experts + e];
    counts[e] = c;
    padded[e] = (c + align - 1) / align * align;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int e = 0; e < num_experts; ++e) {
      run += padded[e];
      ends[e] = run;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t run = ends[e] - padded[e];
    for (int64_t b = 0; b < num_blocks; ++b) {
      block_base[b * num_experts + e] = run;
      run += block_counts[b * num_experts + e];
    }
  }
}

// Each slot's rank among the earlier slots of its block with the same expert (stable order).
__global__ void place_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t num_experts,
                             const int32_t* __restrict__ block_base, int32_t* __restrict__ row_of_slot,
                             int32_t* __restrict__ sorted_slots) {
  __shared__ int32_t tile[kAlignSlots];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kAlignSlots;
  const int64_t s = first + threadIdx.x;
  tile[threadIdx.x] = s < n ? ids[s] : -1;
  __syncthreads();
  if (s >= n) return;
  const int32_t e = tile[threadIdx.x];
  int32_t rank = 0;
  for (int i = 0; i < static_cast<int>(threadIdx.x); ++i) rank += tile[i] == e;
  const int32_t row = block_base[static_cast<int64_t>(blockIdx.x) * num_experts + e] + rank;
  row_of_slot[s] = row;
  sorted_slots[row] = static_cast<int32_t>(s);
}

__global__ void fill_kernel(int32_t* __restrict__ out, int64_t len, int32_t value) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < len) out[i] = value;
}

// block_expert[b] = number of experts whose padded group ends at or before row b*block.
__global__ void block_expert_kernel(const int32_t* __restrict__ ends, int32_t num_experts, int32_t block,
                                    int64_t num_blocks, int32_t* __restrict__ block_expert) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= num_blocks) return;
  const int64_t start = b * block;
  const int32_t total = num_experts > 0 ? ends[num_experts - 1] : 0;
  if (start >= total) {
    block_expert[b] = -1;
    return;
  }
  int lo = 0, hi = num_experts;  // first e with ends[e] > start
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (ends[mid] <= start) lo = mid + 1; else hi = mid;
  }
  block_expert[b] = lo;
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// One thread block per slot; threads stride over the row.
template <typename T>
__global__ void scatter_rows_kernel(const T* __restrict__ src, const int32_t* __restrict__ row_map,
                                    const float* __restrict__ scale, T* __restrict__ out, int32_t k, int64_t dim) {
  const int64_t s = blockIdx.x;
  const T* in_row = src + (s / k) * dim;
  T* out_row = out + static_cast<int64_t>(row_map[s]) * dim;
  if (scale == nullptr) {
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) out_row[c] = in_row[c];
  } else {
    const float w = scale[s];
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) out_row[c] = from_float<T>(__fmul_rn(to_float(in_row[c]), w));
  }
}

}  // namespace

int64_t align_workspace(int64_t n, int32_t num_experts) {
  return 2 * (cdiv(n, kAlignSlots) > 0 ? cdiv(n, kAlignSlots) : 1) * static_cast<int64_t>(num_experts);
}

cudaError_t align(const int32_t* ids, int64_t n, int32_t num_experts, int32_t block, int32_t* workspace,
                  int32_t* counts, int32_t* ends, int32_t* row_of_slot, int32_t* sorted_slots,
                  int32_t* block_expert, cudaStream_t stream) {
  const int64_t num_slot_blocks = cdiv(n, kAlignSlots);
  int32_t* block_counts = workspace;
  int32_t* block_base = workspace + (num_slot_blocks > 0 ? num_slot_blocks : 1) * num_experts;
  const size_t hist_bytes = sizeof(int32_t) * num_experts;
  if (num_slot_blocks > 0) {
    block_counts_kernel<<<num_slot_blocks, kThreads, hist_bytes, stream>>>(ids, n, num_experts, block_counts);
  }
  block_bases_kernel<<<1, kThreads, hist_bytes, stream>>>(block_counts, block_base, num_slot_blocks, num_experts,
                                                          block, counts, ends);
  const int64_t padded_bound = n + static_cast<int64_t>(num_experts) * (block - 1);
  if (padded_bound > 0) {
    fill_kernel<<<cdiv(padded_bound, kThreads), kThreads, 0, stream>>>(sorted_slots, padded_bound, static_cast<int32_t>(n));
  }
  if (num_slot_blocks > 0) {
    place_kernel<<<num_slot_blocks, kThreads, 0, stream>>>(ids, n, num_experts, block_base, row_of_slot, sorted_slots);
  }
  const int64_t num_blocks = cdiv(padded_bound, block);
  if (num_blocks > 0) {
    block_expert_kernel<<<cdiv(num_blocks, kThreads), kThreads, 0, stream>>>(ends, num_experts, block, num_blocks,
                                                                             block_expert);
  }
  return cudaGetLastError();
}

cudaError_t scatter_rows(const void* src, DType dtype, const int32_t* row_map, const float* scale, void* out,
                         int64_t n, int32_t k, int64_t dim, cudaStream_t stream) {
  if (n == 0 || dim == 0) return cudaSuccess;
  const int threads = dim >= 256 ? 256 : 64;
  switch (dtype) {
    case DType::kFloat32:
      scatter_rows_kernel<float><<<n, threads, 0, stream>>>(static_cast<const float*>(src), row_map, scale,
                                                            static_cast<float*>(out), k, dim);
      break;
    case DType::kFloat16:
      scatter_rows_kernel<__half><<<n, threads, 0, stream>>>(static_cast<const __half*>(src), row_map, scale,
                                                             static_cast<__half*>(out), k, dim);
      break;
    case DType::kBFloat16:
      scatter_rows_kernel<__nv_bfloat16><<<n, threads, 0, stream>>>(static_cast<const __nv_bfloat16*>(src), row_map,
                                                                    scale, static_cast<__nv_bfloat16*>(out), k, dim);
      break;
  }
  return cudaGetLastError();
}

}  // namespace moe
}  // namespace primerl
