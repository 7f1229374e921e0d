#!/usr/bin/env bash
# One GPU check for a machine with no network (torch + triton + pytest preinstalled; the repo is
# copied, not pip-installed): build primerl._C in place (in the background), run the `gpu` tests,
# run the speed benches the open issues ask for, and print their tables, a summary and the open
# issues' done-when targets (PASS / MISS / NOT RUN, from bench/targets.py) last.
# Everything is time-boxed so that the whole script stays under 8 minutes: no step starts after
# GPU_CHECK_TOTAL_S, and a bench's limit ends at GPU_CHECK_END_S at the latest (a bench stopped at
# its limit still writes the rows it finished).
#
#   bash bench/gpu_check.sh                      # logs in ${OUT:-/tmp/gpu_check}
#   GPU_CHECK_QUICK=1 bash bench/gpu_check.sh    # benches with --quick
#   GPU_CHECK_SKIP_BUILD=1 ...                   # use an existing in-place build
#   GPU_CHECK_BENCHES="gemm moe" ...             # choose the bench modules (default below)
#
# Optional wheels (pure-Python baselines such as liger-kernel for `bench logprobs`) are installed
# from ./.whl when that folder exists (carried to the machine: nothing is fetched).
# Logs: env.txt, build.log, pytest.log, bench.log, summary.txt, targets.txt; data: bench_rows.jsonl
# (every bench row, `python -m bench --json`, and every step's status), junit/*.xml (the gpu tests).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUILD_LIMIT=${GPU_CHECK_BUILD_S:-150}
TEST_LIMIT=${GPU_CHECK_TEST_S:-150}
BENCH_LIMIT=${GPU_CHECK_BENCH_S:-90}
GEMM_LIMIT=${GPU_CHECK_GEMM_S:-150}  # bench gemm: ~12 Triton compiles before its 110 s own budget ends
TOTAL_LIMIT=${GPU_CHECK_TOTAL_S:-420}  # no step starts after this many seconds
END_LIMIT=${GPU_CHECK_END_S:-460}  # every step's time limit ends here at the latest: the script stays under 8 min
BENCHES=${GPU_CHECK_BENCHES:-"gemm moe attention logprobs job runtime pd lora_kernels"}  # attention includes mla_attention's rows; pd: P/D vs colocated on one GPU; lora_kernels: grouped_lora vs the per-expert loop
NPROC_TESTS=${GPU_CHECK_TEST_WORKERS:-8}
# torch finds CUDA_HOME from `which nvcc`, which a wrapper script on the PATH can defeat
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
START=$(date +%s)
SUMMARY="$OUT_DIR/summary.txt"
ROWS="$OUT_DIR/bench_rows.jsonl"
JUNIT="$OUT_DIR/junit"
: >"$SUMMARY"
: >"$ROWS"
rm -rf "$JUNIT" && mkdir -p "$JUNIT"

elapsed() { echo $(($(date +%s) - START)); }
json_str() {  # a bash string as a JSON string
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//[$'\t\n\r']/ }
  printf '"%s"' "$s"
}
record() {  # step status seconds detail (a summary line, and a status record for bench/targets.py)
  printf '%-34s | %-8s | %5ss | %s\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"
  printf '{"kind": "status", "step": %s, "status": %s, "seconds": %s, "detail": %s}\n' \
    "$(json_str "$1")" "$(json_str "$2")" "${3:-0}" "$(json_str "$4")" >>"$ROWS"
}
status_of() {  # exit code -> word
  case "$1" in 0) echo ok ;; 124|137) echo TIMEOUT ;; *) echo "FAIL($1)" ;; esac
}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT_DIR/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  record "carried wheels" "$( [ $? -eq 0 ] && echo ok || echo FAIL)" 0 "$(ls .whl | tr '\n' ' ')"
fi

{
  echo "# $(date -u +%FT%TZ)  $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None, 'gpus', torch.cuda.device_count())" 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -1
  $PY -c "import liger_kernel; print('liger_kernel', getattr(liger_kernel, '__version__', 'present'))" 2>&1 | tail -1
} | tee "$OUT_DIR/env.txt"

# 1. The CUDA extension, in place, in the background while the tests that do not need it run.
BUILD_PID=""
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  record "build primerl._C" skipped 0 "GPU_CHECK_SKIP_BUILD=1"
else
  BUILD_T0=$(date +%s)
  ( MAX_JOBS=${MAX_JOBS:-$(nproc)} PRIMERL_BUILD_CUDA=1 timeout "$BUILD_LIMIT" \
      $PY setup.py build_ext --inplace >"$OUT_DIR/build.log" 2>&1; echo $? >"$OUT_DIR/build.rc" ) &
  BUILD_PID=$!
fi
wait_build() {
  [ -z "$BUILD_PID" ] && return
  wait "$BUILD_PID"; BUILD_PID=""
  rc=$(cat "$OUT_DIR/build.rc" 2>/dev/null || echo 1)
  record "build primerl._C" "$(status_of "$rc")" $(($(date +%s) - BUILD_T0)) "log: build.log$([ "$rc" -ne 0 ] && echo '; cuda backend tests will skip')"
  ext=$($PY -c "from primerl.kernels import HAS_CUDA_EXT, _ext; print('loaded' if HAS_CUDA_EXT else 'missing: ' + str(_ext.CUDA_EXT_ERROR)[:80])" 2>&1 | tail -1)
  record "import primerl._C" "-" 0 "$ext"
}

# 2. The gpu-marked tests, one pytest per test folder (same-named test files in two folders cannot
#    share one pytest process under the default import mode); kernels last, after the build.
#    A folder without gpu-marked tests is not started (a pytest with 8 xdist workers costs ~10-20 s
#    to select nothing). rc 5 = nothing selected there. JUnit XML per folder for bench/targets.py.
xdist=""
$PY -c "import xdist" 2>/dev/null && xdist="-n $NPROC_TESTS"
: >"$OUT_DIR/pytest.log"
run_tests() {  # folder
  local dir=$1
  if ! grep -rqE --include='*.py' 'mark\.gpu|mark\("gpu"\)' "$dir"; then
    record "pytest -m gpu $dir" "-" 0 "no gpu-marked tests there"; return
  fi
  local limit=$(( END_LIMIT - $(elapsed) < TEST_LIMIT ? END_LIMIT - $(elapsed) : TEST_LIMIT ))
  if [ "$(elapsed)" -ge "$TOTAL_LIMIT" ] || [ "$limit" -lt 15 ]; then
    record "pytest -m gpu $dir" skipped 0 "time budget (${TOTAL_LIMIT}s to start, ${END_LIMIT}s to end) spent"; return
  fi
  local t0=$(date +%s)
  echo "===== pytest -m gpu $dir" >>"$OUT_DIR/pytest.log"
  timeout "$limit" $PY -m pytest -m gpu "$dir" -q -rfE -p no:cacheprovider $xdist \
    --junitxml="$JUNIT/$(basename "$dir").xml" >"$OUT_DIR/pytest_part.log" 2>&1
  local rc=$?
  cat "$OUT_DIR/pytest_part.log" >>"$OUT_DIR/pytest.log"
  local tail_line=$(grep -E "[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran" "$OUT_DIR/pytest_part.log" | tail -1)
  [ $rc -eq 5 ] && rc=0
  record "pytest -m gpu $dir" "$(status_of $rc)" $(($(date +%s) - t0)) "${tail_line:-see pytest.log}"
}
for dir in tests/*/; do
  dir=${dir%/}
  [ "$dir" = tests/kernels ] && continue
  run_tests "$dir"
done
wait_build
run_tests tests/kernels
rm -f "$OUT_DIR/pytest_part.log"

# 2b. vLLM on the GPU (only with PRIMERL_VLLM_PYTHON naming a CUDA build of vLLM with primerl
#     installed --no-deps; the image has none and no network, so it is recorded as skipped).
if [ -n "${PRIMERL_VLLM_PYTHON:-}" ] && [ "$(elapsed)" -lt "$TOTAL_LIMIT" ]; then
  t0=$(date +%s)
  echo "===== pytest -m vllm tests/runtime" >>"$OUT_DIR/pytest.log"
  timeout "$TEST_LIMIT" $PY -m pytest -m vllm tests/runtime -q -rfEs -p no:cacheprovider >>"$OUT_DIR/pytest.log" 2>&1
  rc=$?
  record "pytest -m vllm tests/runtime" "$(status_of $rc)" $(($(date +%s) - t0)) "log: pytest.log"
else
  record "pytest -m vllm tests/runtime" skipped 0 "PRIMERL_VLLM_PYTHON not set (no vLLM on this machine)"
fi

# 3. The benches the open issues measure (each prints its baseline and ratios, and appends its rows
#    to $ROWS for the targets table).
: >"$OUT_DIR/bench.log"
known=" $($PY -c "from bench.__main__ import available_ops; print(' '.join(available_ops()))" 2>>"$OUT_DIR/bench.log") "
quick=""
[ "${GPU_CHECK_QUICK:-0}" = 1 ] && quick="--quick"
for op in $BENCHES; do
  if [[ "$known" != *" $op "* ]]; then
    record "bench $op" skipped 0 "no module bench/$op.py"; continue
  fi
  own=$BENCH_LIMIT
  [ "$op" = gemm ] && own=$GEMM_LIMIT
  [ "$op" = attention ] && own=${GPU_CHECK_ATTENTION_S:-150}  # its own rows, then mla_attention's
  limit=$(( END_LIMIT - $(elapsed) < own ? END_LIMIT - $(elapsed) : own ))
  if [ "$(elapsed)" -ge "$TOTAL_LIMIT" ] || [ "$limit" -lt 15 ]; then
    record "bench $op" skipped 0 "time budget (${TOTAL_LIMIT}s to start, ${END_LIMIT}s to end) spent"; continue
  fi
  t0=$(date +%s)
  echo "===== bench $op $quick" >>"$OUT_DIR/bench.log"
  # SIGTERM at the limit: the module writes the rows it finished (bench job stops its job, <= 10 s);
  # SIGKILL 12 s later if it cannot
  timeout -k 12 "$limit" $PY -m bench "$op" --device cuda $quick --json "$ROWS" >>"$OUT_DIR/bench.log" 2>&1
  rc=$?
  record "bench $op" "$(status_of $rc)" $(($(date +%s) - t0)) "limit ${limit}s; log: bench.log"
done

echo
echo "===== bench output"
grep -v -E "^\s*$|Warning|warn\(" "$OUT_DIR/bench.log"
echo
echo "===== failures (pytest)"
grep -E "^(FAILED|ERROR)" "$OUT_DIR/pytest.log" | cut -c1-220 | head -30
echo
echo "===== summary ($(elapsed)s total; logs in $OUT_DIR)"
printf '%-34s | %-8s | %6s | %s\n' step status time detail
cat "$SUMMARY"
# 4. The done-when targets of the open issues, from the rows, the step records and the JUnit files.
printf '{"kind": "status", "step": "total", "status": "-", "seconds": %s, "detail": ""}\n' "$(elapsed)" >>"$ROWS"
echo
echo "===== targets (issues 22-24; data: $ROWS, $JUNIT)"
$PY -m bench.targets "$ROWS" --junit "$JUNIT" 2>&1 | tee "$OUT_DIR/targets.txt"
