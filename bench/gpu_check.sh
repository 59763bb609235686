#!/usr/bin/env bash
# The one prepared device run (issue 27): on one GPU (sized for an H200, under 8 minutes) build the CUDA ops, run
# the GPU-marked tests and the device-agnostic kernel tests, then print the kernel, FP8 and end-to-end decode
# tables for docs/benchmarks.md. Everything here also runs on a CPU machine, where the GPU tests are collected and
# skipped with their reason; this run only confirms.
#
#   bash bench/gpu_check.sh            # from the repository root; PYTHON=... picks the interpreter
#
# Each step has its own time limit (together 520 s, so the run ends within 9 minutes); a failing step is reported and the rest still run; the exit code is the number
# of failed steps (0: all passed). Output: stdout, and a copy under ${OUT:-bench/out}/gpu_check.log.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
LOG_DIR=${OUT:-bench/out}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/gpu_check.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS=${MAX_JOBS:-16} OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
unset TRITON_INTERPRET QUANTKIT_KERNEL
failed=0
start=$(date +%s)

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s (total $(( $(date +%s) - start ))s)"
  [ $rc -eq 0 ] || failed=$((failed + 1))
}

{
  echo "gpu_check: $(date -u +%Y-%m-%dT%H:%MZ) $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | head -2
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: $PY has no CUDA torch (torch.cuda.is_available() is False); nothing to check here"
    exit 2
  fi
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
           'triton', triton.__version__, 'transformers', transformers.__version__)"
  step "build the quantkit CUDA ops" 120 "$PY" -c "
import time; t = time.time()
from quantkit.kernels.cuda_library import load_extension
load_extension(); print(f'built and registered in {time.time() - t:.0f} s')"
  # GPU-marked tests in a process of their own: other kernel test files switch Triton to its interpreter
  step "GPU tests (pytest -m gpu)" 80 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_gpu_kernels.py tests/test_gpu_runtime.py
  step "kernel tests, device-agnostic" 40 "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/test_kernels_cuda_ops.py tests/test_kernels_dispatch.py tests/test_kernels_cuda_bits.py \
    tests/test_runtime_device.py
  step "kernel table (bench/kernels_gpu.py)" 60 "$PY" bench/kernels_gpu.py --quick --launches 100
  step "FP8 table (bench/fp8_gpu.py)" 30 "$PY" bench/fp8_gpu.py --launches 100
  step "end-to-end decode (bench/decode_gpu.py)" 60 "$PY" bench/decode_gpu.py --tokens 64 --prompts 4
  step "SmolLM2: real-weight kernels, greedy and GPTQ against the CPU (bench/gpu_smollm.py)" 130 \
    "$PY" bench/gpu_smollm.py
  echo "gpu_check: $failed failed step(s) in $(( $(date +%s) - start ))s"
  exit $failed
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
