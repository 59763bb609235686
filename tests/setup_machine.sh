#!/usr/bin/env bash
# What the test suite needs beyond the project's Python packages, on a fresh Debian machine:
#   - Debian's Chromium, for the playground's browser tests, where it is missing (about 0.5 GB);
#   - vLLM's CPU build in a venv of its own, .venv-vllm, for the acceptance tests (bench/vllm_env.sh, 3.5 GB);
#   - llama.cpp's tools built from llama-cpp-python's sdist, cached under ~/.cache/quantkit by CPU kind, for the
#     GGUF acceptance test (bench/llama_cpp_build.sh; about 3 minutes on 2 cores the first time).
# Idempotent: what is there already is kept. The README's test command runs it before pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# the suite writes checkpoints (about 8 GB over a run) under the temp folder and the venvs need about 7 GB: a disk
# that fills midway fails hundreds of tests with errors that do not name the cause, so say it here, once
need_gb=12
tmp="${TMPDIR:-/tmp}"
free_gb=$(df -Pk "$tmp" | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt "$need_gb" ]; then
  echo "only ${free_gb} GB free under $tmp; the test suite needs about ${need_gb} GB: free some space" \
       "(old /tmp/pytest-of-* folders are safe to remove) or point TMPDIR at a larger disk" >&2
  exit 2
fi

chromium="${QUANTKIT_CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$chromium" ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing Debian's chromium (the playground's browser tests need it)"
  if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium >/dev/null; }; then
    echo "could not install chromium with apt-get: install Debian's 'chromium' package, or point" \
         "QUANTKIT_CHROMIUM at a Chromium binary, then run this again" >&2
    exit 2
  fi
fi

if [ -z "${QUANTKIT_VLLM_PYTHON:-}" ]; then
  echo "making vLLM's venv (.venv-vllm) where it is missing"
  bash bench/vllm_env.sh >/dev/null
fi

echo "building llama.cpp's tools where the cache lacks them"
bash bench/llama_cpp_build.sh >/dev/null
