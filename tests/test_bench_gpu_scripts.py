"""The GPU bench scripts and bench/gpu_check.sh are ready for the device run: each script's --help works, and
without a GPU each exits 2 with one line saying so (torch.cuda.is_available is patched, so this holds on GPU
machines too); the check script parses and names only test files and scripts that exist."""
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = ["kernels_gpu", "fp8_gpu", "decode_gpu", "gpu_smollm"]


def _script(name):
    """Load bench/NAME.py from its file: by bare module name, `kernels` could resolve to another module already
    imported in this worker (a CI run did), and the test would check the wrong file."""
    spec = importlib.util.spec_from_file_location(f"bench_gpu_script_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        _script(name).main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_without_a_gpu_one_line_and_exit_2(name, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        _script(name).main([])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"bench/{name}.py needs a CUDA GPU" in err[0]


def test_gpu_check_script_parses_and_names_real_files():
    script = BENCH / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    named = set(re.findall(r"(?:tests|bench)/[\w/]+\.py", text))
    assert {"tests/test_gpu_kernels.py", "tests/test_gpu_runtime.py", "bench/kernels_gpu.py"} <= named
    for path in named:
        assert (BENCH.parent / path).is_file(), path
    limits = [int(n) for n in re.findall(r'^\s*step "[^"]+" (\d+)', text, flags=re.M)]
    assert len(limits) == 7 and sum(limits) <= 520  # the run ends within 9 minutes whatever happens
