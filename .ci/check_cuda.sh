#!/usr/bin/env bash
# Compile-only check of csrc/: every .cu with nvcc for sm_90a, every .cpp binding against torch's headers.
# ptxas reports each kernel's registers and spills (-Xptxas -v): a kernel that spills fails the check.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s globstar nullglob
cu_files=(csrc/**/*.cu)
cpp_files=(csrc/**/*.cpp)
if [ $# -gt 0 ]; then cu_files=("$@"); cpp_files=(); fi  # given .cu files instead (tests of this check)
if [ ${#cu_files[@]} -eq 0 ] && [ ${#cpp_files[@]} -eq 0 ]; then echo "check_cuda: no sources"; exit 0; fi
command -v nvcc >/dev/null || { echo "check_cuda: nvcc not found but csrc/ has CUDA sources" >&2; exit 1; }
TORCH_INC=$(python -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))")
PY_INC=$(python -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])")
# /usr/local/bin/nvcc may be a wrapper script, so do not derive the toolkit root from its path.
CUDA_ROOT=${CUDA_HOME:-/usr/local/cuda}
CUDA_INC="-I$CUDA_ROOT/include"
tmp=$(mktemp -d)
fail=0
# ptxas -v log on stdin -> one line per kernel that spills ("<kernel>: N bytes spill stores, M bytes spill loads")
spilling_kernels() {
  awk '/Function properties for/ {fn = $NF}
       /bytes spill stores/ {if ($5 + 0 > 0 || $9 + 0 > 0) print fn ": " $5 " bytes spill stores, " $9 " bytes spill loads"}'
}
for f in "${cu_files[@]}"; do
  if nvcc -std=c++17 -O2 -gencode arch=compute_90a,code=sm_90a -Xptxas -v -Icsrc $TORCH_INC $PY_INC -c "$f" -o "$tmp/$(basename "$f").o" 2>"$tmp/err"; then
    spills=$(spilling_kernels <"$tmp/err")
    kernels=$(grep -c "Function properties for" "$tmp/err" || true)
    regs=$(grep -o "Used [0-9]* registers" "$tmp/err" | awk '{if ($2 > m) m = $2} END {print m + 0}')
    if [ -n "$spills" ]; then
      echo "check_cuda: FAIL $f spills registers (ptxas -v, sm_90a):"; echo "$spills"; fail=1
    else
      echo "check_cuda: ok   $f ($kernels functions, at most $regs registers, no spills)"
    fi
  else
    echo "check_cuda: FAIL $f"; cat "$tmp/err"; fail=1
  fi
done
for f in "${cpp_files[@]}"; do
  if g++ -std=c++17 -fsyntax-only -DTORCH_EXTENSION_NAME=_C -Icsrc $TORCH_INC $PY_INC $CUDA_INC "$f" 2>"$tmp/err"; then
    echo "check_cuda: ok   $f"
  else
    echo "check_cuda: FAIL $f"; cat "$tmp/err"; fail=1
  fi
done
rm -rf "$tmp"
exit $fail
