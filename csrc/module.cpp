// The Python module primerl._C. Ops register themselves into the `primerl` torch library with
// TORCH_LIBRARY_FRAGMENT in their own *_binding.cpp files and are called as torch.ops.primerl.<op>.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "primerl CUDA kernels (ops live under torch.ops.primerl)";
}
