#!/usr/bin/env bash
# CI: build the wheel and the sdist, install the wheel WITHOUT -e into a clean venv and use it from
# outside the checkout: import every public module, `primerl rl --dry-run` of the SLURM and pool
# examples (the SLURM one renders the sbatch script from the installed template), `primerl plan`,
# one kernel call. The clean venv takes primerl with --no-deps and sees the main venv's pinned
# packages through a path file (so nothing is downloaded and no CUDA torch can be pulled).
# Usage: .ci/wheel_smoke.sh MAIN_PYTHON   (from the checkout root)
set -euo pipefail
ROOT="$PWD"
MAIN_PY="$1"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# --- build both from a copy of the tracked files (setuptools' PEP 517 backend, no network) ---
git ls-files -z | (mkdir -p "$WORK/src" && xargs -0 cp --parents -t "$WORK/src")
( cd "$WORK/src" && for hook in build_wheel build_sdist; do
    PRIMERL_BUILD_CUDA=0 "$MAIN_PY" -c "import sys; from setuptools import build_meta as b; b.$hook(sys.argv[1])" \
      "$WORK/dist" > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
  done )
WHEEL="$(ls "$WORK"/dist/primerl-*.whl)"
tar -tzf "$WORK"/dist/primerl-*.tar.gz > "$WORK/sdist.txt"
grep -q "/csrc/" "$WORK/sdist.txt" || { echo "sdist without csrc/"; exit 1; }

# --- a clean venv: the wheel with --no-deps, the main venv's packages behind it ---
python3 -m venv "$WORK/venv"
MAIN_SITE="$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
NEW_SITE="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$MAIN_SITE" > "$NEW_SITE/zz_main_venv.pth"  # after the venv's own site-packages: the wheel's primerl wins
"$WORK/venv/bin/pip" install -q --no-deps --no-index "$WHEEL"
PY="$WORK/venv/bin/python" PRIMERL="$WORK/venv/bin/primerl"

cd "$WORK"  # outside the checkout: nothing of it on sys.path
unset PYTHONPATH
"$PY" - "$WORK/venv" <<'PY'
import importlib, pkgutil, sys
import primerl
assert primerl.__file__.startswith(sys.argv[1]), f"primerl imported from {primerl.__file__}, not the installed wheel"
bad = []
for m in pkgutil.walk_packages(primerl.__path__, "primerl."):
    # vf_plugins are verifiers' environment plugins (imported in the verifiers venv only)
    if m.name.startswith("primerl.rl.envs.vf_plugins") or any(p.startswith("_") for p in m.name.split(".")[1:]):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as e:  # noqa: BLE001 - listed below
        bad.append(f"{m.name}: {e!r}")
assert not bad, "modules that do not import from the wheel:\n" + "\n".join(bad)
import torch
from primerl.kernels import dequant, quant_per_token_group
x = torch.randn(4, 256)
q, sf = quant_per_token_group(x, 128)
err = ((dequant(q, sf, group_shape=(1, 128), out_dtype=torch.float32) - x).norm() / x.norm()).item()
assert q.dtype == torch.float8_e4m3fn and err < 0.05, err  # e4m3: ~2-3% relative L2
print(f"wheel smoke: every public module imports; fp8 round trip rel. L2 {err:.4f}; primerl from {primerl.__file__}")
PY
"$PRIMERL" rl --config "$ROOT/examples/reverse_text_2node.toml" --deployment.kind slurm --deployment.hosts '[]' \
  --output_dir "$WORK/slurm" --dry-run > "$WORK/slurm.txt"
grep -q "^#SBATCH --nodes=2" "$WORK/slurm.txt" || { echo "no sbatch script rendered"; tail -20 "$WORK/slurm.txt"; exit 1; }
for pool in "$ROOT"/examples/*pool*.toml; do
  [ -e "$pool" ] && "$PRIMERL" rl --config "$pool" --output_dir "$WORK/pool" --dry-run > /dev/null
done
"$PRIMERL" rl --config "$ROOT/examples/reverse_text.toml" --inference.num_servers 3 --output_dir "$WORK/pool3" \
  --dry-run > /dev/null
"$PRIMERL" plan --config "$ROOT/examples/reverse_text.toml" > /dev/null
[ ! -e "$WORK/slurm" ] && [ ! -e "$WORK/pool3" ]  # --dry-run writes nothing
echo "wheel smoke: ok ($(basename "$WHEEL"), sdist with csrc/; slurm + pool dry-runs, plan)"
