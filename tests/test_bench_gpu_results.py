"""bench/gpu_results.py turns a device run's log into the JSON the docs are generated from: every kernel row,
check and pytest summary in the log is kept with its numbers, and a step stopped at its limit is a failure."""
import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"

LOG = """=== GPU tests (pytest -m gpu) (limit 80s)
3 failed, 68 passed in 21.61s
=== GPU tests (pytest -m gpu): rc=1 in 27s (total 55s)
copy bandwidth: 2769 GB/s (1 GiB device-to-device, read + write)
| 4096x4096 | 1 | cuda gemv | 13.2 | 657 | 24% | 0.96x | graph |
| 4096x4096 | 2 | cuda gemv | 15.4 | 563 | 20% | 0.83x | graph |
| 4096x14336 | 64 | triton fused | 53.7 | 608 | 22% | 0.60x | graph |
=== end-to-end decode (bench/decode_gpu.py) (limit 60s)
| float16 | cuda | 29.8 | 33.54 | 100% |
=== end-to-end decode (bench/decode_gpu.py): rc=124 in 60s (total 114s)
PASS cuda gemv on real SmolLM2 weights: max error 1.02e-03 of max abs(y) (tolerance 0.003)
FAIL GPTQ SmolLM2 quantised on cuda vs cpu: perplexity 36.0 vs 35.3 (2.0% apart, limit 0.1%)
"""


def _module():
    spec = importlib.util.spec_from_file_location("bench_gpu_results", BENCH / "gpu_results.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_a_log_becomes_kernel_rows_and_checks(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    assert _module().main([str(log), "--date", "d", "--gpu", "g", "--out", str(tmp_path)]) == 0
    kernels = json.loads((tmp_path / "gpu_kernels.json").read_text())
    # rows 2 is not among the rows shown; the others keep their numbers
    assert [(r["in x out"], r["rows"], r["kernel"], r["us"], r["GB/s"]) for r in kernels["rows"]] == [
        ("4096x4096", 1, "cuda gemv", 13.2, 657.0), ("4096x14336", 64, "triton fused", 53.7, 608.0)]
    assert "2769 GB/s" in kernels["note"]
    checks = {r["check"]: r["result"] for r in json.loads((tmp_path / "gpu_checks.json").read_text())["rows"]}
    assert checks["pytest: GPU tests (pytest -m gpu)"].startswith("FAIL: 3 failed, 68 passed")
    assert checks["decode SmolLM2-135M batch 1: float16 on cuda"].startswith("29.8 tok/s")
    assert checks["step: end-to-end decode (bench/decode_gpu.py)"].startswith("FAIL: stopped at its time limit")
    assert checks["cuda gemv on real SmolLM2 weights"].startswith("PASS: max error 1.02e-03")
    assert checks["GPTQ SmolLM2 quantised on cuda vs cpu"].startswith("FAIL: perplexity 36.0")


def test_a_log_without_gpu_output_is_refused(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("gpu_check: .venv/bin/python has no CUDA torch; nothing to check here\n")
    assert _module().main([str(log), "--date", "d", "--gpu", "g", "--out", str(tmp_path)]) == 2
    assert "no gpu_check output" in capsys.readouterr().err
