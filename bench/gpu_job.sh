#!/usr/bin/env bash
# The GPU example for about a minute: steps/s, trainer tokens/s, engine tokens/s, peak GPU memory
# of trainer and engine, and the reward (bench/job.py). For bench/gpu_check.sh to call.
#   bash bench/gpu_job.sh            # PRIMERL_JOB_SECONDS=60 by default here
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PRIMERL_JOB_SECONDS=${PRIMERL_JOB_SECONDS:-60}
exec timeout $((PRIMERL_JOB_SECONDS + 60)) ${PYTHON:-python} -m bench job --device cuda
