"""Shared fixtures: tiny random models built in-process, the real embedded model, and an in-process CLI runner."""
from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton kernels run on the CPU through the interpreter; it must be chosen before triton is first imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each kind's preferred CPU layout, not timed: a test's layout must not depend on how busy the machine is, and
# loads must not write the user's kernel-choice cache (tests/test_kernel_choice.py measures on purpose)
os.environ.setdefault("QUANTKIT_KERNEL_CHOICE", "preferred")

import pytest  # noqa: E402

# Tiny models are per-op overhead: a second intra-op thread only adds OpenMP synchronisation, which made them
# 20-75x slower whenever the two cores were shared. Tests that time nothing lose nothing by using one.
torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(__file__))
from helpers import TINY_ARCHS, make_tiny_model  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """The vLLM acceptance tests first: their two files are the longest (minutes of one vLLM worker each). Under
    the README's `-n 2 --dist loadfile` xdist hands out the files with the most tests first whatever this order
    says (its default --loadscope-reorder); the vLLM matrix file has the most. Handing out the long files first
    (--no-loadscope-reorder, with this sort and the real-model files after the vLLM ones) did not shorten the
    suite, which is CPU-bound: 14:19 against 14:00-14:13 (2-core AMD EPYC, 2026-12-05)."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)


@pytest.fixture(scope="session")
def embedded_dir():
    from quantkit.models.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture
def tiny_llama(tmp_path):
    return make_tiny_model(tmp_path / "tiny-llama", "llama")


@pytest.fixture
def cli(capsys):
    """Run `quantkit ARGS` in-process; returns (exit code, stdout, stderr)."""
    from quantkit.cli import main

    def run(*args):
        old = sys.argv
        sys.argv = ["quantkit", *map(str, args)]
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = old
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """vLLM's Python: QUANTKIT_VLLM_PYTHON, else the venv bench/vllm_env.sh makes (or finds)."""
    import subprocess

    explicit = os.environ.get("QUANTKIT_VLLM_PYTHON")
    if explicit:
        return explicit
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "bench" / "vllm_env.sh")], capture_output=True, text=True,
                          timeout=1800, cwd=root)
    assert proc.returncode == 0, f"bench/vllm_env.sh failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_tokens():
    """Windows and prompts held out from every calibration set the vLLM cases use."""
    from quantkit.evaluate import interop

    return interop.eval_tokens(Path(__file__).resolve().parents[1] / "bench" / "data" / "eval_prose.txt")
