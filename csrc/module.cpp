// The Python module primerl._C. Each *_binding.cpp registers the CUDA kernels of its ops with
// TORCH_LIBRARY_IMPL(primerl, CUDA, m); the ops' schemas and fake kernels are defined in Python
// (primerl/kernels/_ext.py, which loads this module), so they exist without it. Called as
// torch.ops.primerl.<op> once primerl.kernels is imported.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "primerl CUDA kernels (ops live under torch.ops.primerl)";
}
