#!/usr/bin/env bash
# CI: the package works when installed from a wheel, away from the source tree. Builds the wheel (no
# dependencies: they are the ones already installed), checks it holds the bundled configs/ and launch/,
# unpacks it into a scratch folder and, from another directory, runs the commands a user would:
# `hybridrl train --print-config` (default and by config name), `hybridrl submit --dry-run`, `hybridrl plan`,
# and `hybridrl bench` (which must say that benchmarks live in the source tree). ~30 s of CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# build from a copy of the tracked files: a stale build/ folder in the checkout would leak into the wheel
mkdir "$WORK/src"
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$WORK/src"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src" >/dev/null
WHEEL=$(ls "$WORK"/dist/hybridrl-*.whl)
"$PY" - "$WHEEL" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["hybridrl/_bundled/configs/remax_tiny.yaml", "hybridrl/_bundled/configs/ppo_tiny.yaml",
        "hybridrl/_bundled/configs/gpu/remax_llama2_7b_8gpu.yaml",
        "hybridrl/_bundled/configs/gpu/tools/grpo_qwen2_5_7b_python_8gpu.yaml",
        "hybridrl/_bundled/configs/gpu/moe/grpo_qwen3_30b_a3b_16gpu.yaml", "hybridrl/_bundled/configs/grpo_moe_tiny.yaml",
        "hybridrl/_bundled/configs/gpu/lora/grpo_llama3_70b_lora_8gpu.yaml",
        "hybridrl/_bundled/configs/gpu/judge/grpo_llama2_7b_judge_llama7b_16gpu.yaml",
        "hybridrl/_bundled/configs/remax_async_tiny.yaml", "hybridrl/_bundled/launch/slurm/hybridrl.sbatch",
        "hybridrl/_bundled/launch/ray/start_head.sh", "hybridrl/assets/tokenizer/tokenizer.json",
        "hybridrl/bundled.py", "hybridrl/cli/submit.py", "hybridrl/cli/__main__.py"]
missing = [n for n in need if n not in names]
assert not missing, f"the wheel lacks {missing}"
PY
"$PY" -m pip install --quiet --no-deps --target "$WORK/site" "$WHEEL" >/dev/null

cd "$WORK"  # no configs/, launch/ or benchmarks/ here
export PYTHONPATH="$WORK/site"
run() { "$PY" -m hybridrl.cli "$@"; }
"$PY" - "$WORK/site" <<'PY'
import sys
from pathlib import Path
import hybridrl
from hybridrl.bundled import bundled_dir, source_checkout
from hybridrl.launch.submit import DEFAULT_TEMPLATE
site = Path(sys.argv[1]).resolve()
assert Path(hybridrl.__file__).resolve().is_relative_to(site), hybridrl.__file__
assert bundled_dir("configs").is_relative_to(site) and DEFAULT_TEMPLATE.is_file() and DEFAULT_TEMPLATE.is_relative_to(site)
assert source_checkout() is None
PY
run train --print-config trainer.steps=3 | grep -q "steps: 3"
run train ppo_tiny.yaml --print-config | grep -q "name: ppo"
run train configs/grpo_tiny.yaml --print-config | grep -q "estimator: k3"
run submit remax_tiny.yaml --nodes 1 --gpus-per-node 2 --dry-run | grep -q "hybridrl.cli train"
run plan --model llama-7b --train-tp 8 --train-pp 1 --train-dp 1 --gen-tp 2 --gen-pp 1 >/dev/null
if run bench >"$WORK/bench.out" 2>&1; then echo "hybridrl bench should refuse outside the source tree" >&2; exit 1; fi
grep -q "source tree" "$WORK/bench.out"
echo "wheel install ok: $(basename "$WHEEL") runs from $WORK with its bundled configs and launch files"
