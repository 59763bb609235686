"""`quantkit eval --backend`: the same checkpoints scored by several engines side by side, differences flagged.

vLLM's own run is in tests/test_vllm_interop.py (it needs its venv); here quantkit's runtime and transformers
score a float and an RTN W4 checkpoint of a tiny model, and the flagging rule is checked on scores built to
differ.
"""
import json

import pytest
import torch

from quantkit.errors import UserError
from quantkit.evaluate import run_eval
from quantkit.evaluate.backend_report import _row, check_backends, markdown
from quantkit.evaluate.backends import NEAR_TIE, Scores
from test_eval_support import save, text_file, tiny_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe, apply_overrides

    d = tmp_path_factory.mktemp("backends")
    base = save(tiny_model(), d / "base")
    quantize_to_checkpoint(apply_overrides(Recipe(), {"model": str(base), "output": str(d / "w4"),
                                                      "quant.group_size": 32, "dtype": "float32",
                                                      "quant.method": "rtn"}))
    return d


def test_quantkit_and_transformers_side_by_side(folders, cli):
    d = folders
    code, out, err = cli("eval", f"base={d / 'base'}", f"w4={d / 'w4'}", "--data", text_file(d), "--seq-len", "64",
                         "--max-windows", "3", "--dtype", "float32", "--backend", "quantkit", "--backend",
                         "transformers", "--backend-windows", "2", "--no-plots", "--json", "-o", d / "report")
    assert code == 0, err
    section = json.loads(out)["backends"]
    assert section["dtype"] == "float32" and section["backends"] == ["quantkit", "transformers"]
    rows = {(r["model"], r["backend"]): r for r in section["rows"]}
    assert set(rows) == {(m, b) for m in ("base", "w4") for b in ("quantkit", "transformers")}
    a, b = rows[("base", "quantkit")], rows[("base", "transformers")]
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6) and not a["flagged"] and not b["flagged"]
    assert b["greedy_agree"] == [16, 16]  # the first backend is the reference; 16 tokens each
    # W4 layers run as `quantkit serve` runs them on a CPU (torch's int4 op, bfloat16 activations), which
    # transformers' float32 dequantised weights do not: close, and flagged exactly when the rule says so
    qa, qb = rows[("w4", "quantkit")], rows[("w4", "transformers")]
    assert qa["ppl"] != a["ppl"] and qa["ppl"] == pytest.approx(qb["ppl"], rel=0.01)
    for r in (qa, qb):
        early = [m for n, m in zip(r["greedy_agree"], r["parting_margin"]) if n < 16]
        assert r["flagged"] == (abs(r["vs_median"]) > 0.005 or any(m is None or m >= NEAR_TIE for m in early))
    assert "## Backends (float32" in (d / "report" / "report.md").read_text()


def test_a_backend_that_departs_is_flagged():
    ref = Scores("quantkit", True, [[2.0, 2.0]], [[1, 2, 3, 4]])
    close = Scores("transformers", True, [[2.001, 2.0]], [[1, 2, 3, 4]])
    far = Scores("vllm", True, [[2.2, 2.2]], [[1, 2, 3, 4]])
    parts = Scores("vllm", True, [[2.0, 2.0]], [[1, 2, 9, 9]])
    median = torch.tensor([2.0, 2.0005, 2.2]).exp().median().item()
    assert not _row("m", "transformers", close, ref, median, 0.005, 4)["flagged"]
    flagged = _row("m", "vllm", far, ref, median, 0.005, 4)
    assert flagged["flagged"] and flagged["vs_median"] > 0.1
    assert _row("m", "vllm", parts, ref, median, 0.005, 4)["greedy_agree"] == [2]
    assert _row("m", "vllm", parts, ref, median, 0.005, 4)["flagged"]  # parted before min_agree tokens
    # ... unless the reference's top two were a near-tie where they parted: rounding may flip that choice
    ref.margins = [[1.0, 1.0, NEAR_TIE / 2, 1.0]]
    coin = _row("m", "vllm", parts, ref, median, 0.005, 4)
    assert not coin["flagged"] and coin["parting_margin"] == [NEAR_TIE / 2]
    ref.margins = [[1.0, 1.0, 2 * NEAR_TIE, 1.0]]
    assert _row("m", "vllm", parts, ref, median, 0.005, 4)["flagged"]
    broken = _row("m", "vllm", Scores("vllm", False, error="ValueError: no kernel"), ref, median, 0.005, 4)
    assert broken["flagged"] and "does not load: ValueError: no kernel" in markdown(
        {"dtype": "float16", "tolerance": 0.005, "min_agree": 4, "backends": ["quantkit", "vllm"], "rows": [broken]})


def test_bad_backend_choices_fail_before_any_scoring(folders, monkeypatch):
    with pytest.raises(UserError, match="unknown backend vlm"):
        check_backends(["quantkit", "vlm"])
    with pytest.raises(UserError, match="at least two"):
        check_backends(["vllm"])
    monkeypatch.delenv("QUANTKIT_VLLM_PYTHON", raising=False)
    with pytest.raises(UserError, match="bench/vllm_env.sh"):
        run_eval(folders / "base", [folders / "w4"], data=str(text_file(folders)), seq_len=64, max_windows=2,
                 backends=["quantkit", "vllm"], plots=False)


VLLM_LOG = """\
(EngineCore pid=11) WARNING 12-01 20:02:44 [vllm.py:725] Model Runner V2 requires Triton
(Worker pid=12) ERROR 12-01 20:02:44 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=12) ERROR 12-01 20:02:44 [multiproc_executor.py:953]   File "x.py", line 1, in f
(Worker pid=12) ERROR 12-01 20:02:44 [multiproc_executor.py:953] ValueError: Failed to find a kernel. Reasons:
(Worker pid=12) ERROR 12-01 20:02:44 [multiproc_executor.py:953]  CPUWNA16 cannot: uint8b128 not supported
(Worker pid=12) ERROR 12-01 20:02:44 [multiproc_executor.py:953]
(EngineCore pid=11) ERROR 12-01 20:02:46 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_root_cause_is_the_engines_own_reason_not_its_wrappers():
    from quantkit.evaluate.backends import root_cause

    assert root_cause(VLLM_LOG) == ("ValueError: Failed to find a kernel. Reasons: CPUWNA16 cannot: uint8b128 not "
                                    "supported")
    assert root_cause(VLLM_LOG.replace("ValueError: Failed", "Failed")) is None  # only wrappers left


def test_a_hung_engine_is_reported_and_its_processes_killed(tmp_path):
    """vLLM's worker processes can outlive a failed start and keep the output open; the whole process group
    goes, and the job comes back as not ok with a reason instead of blocking the caller."""
    import os
    import time

    from quantkit.evaluate.backends import score_vllm

    fake = tmp_path / "python"
    pid_file = tmp_path / "child.pid"
    fake.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {pid_file}\n"
                    "echo 'ValueError: no kernel for this scheme'\nwait\n")
    fake.chmod(0o755)
    t0 = time.time()
    [res] = score_vllm([{"model": "m", "dtype": "float16", "windows": [], "prompts": [], "max_new": 0}],
                       str(fake), timeout=3)
    assert time.time() - t0 < 30
    assert not res.ok and res.error.startswith("no answer within 3 s") and "no kernel for this scheme" in res.error
    child = int(pid_file.read_text())
    time.sleep(0.2)
    status = f"/proc/{child}/status"
    # gone, or a zombie nobody has reaped yet (its parent was killed too): either way it runs no more
    assert not os.path.exists(status) or "State:\tZ" in open(status).read()


def test_greedy_may_part_only_at_a_near_tie():
    from quantkit.evaluate.backends import NEAR_TIE, compare

    ref = Scores("transformers", True, [[1.0]], [[5, 6, 7, 8]], margins=[[2.0, NEAR_TIE / 2, 2.0, 2.0]])
    tie = Scores("vllm", True, [[1.0]], [[5, 9, 9, 9]])  # parts at step 1, where ref's top two were close
    real = Scores("vllm", True, [[1.0]], [[9, 9, 9, 9]])  # parts at step 0, a clear choice
    assert compare(ref, tie, n_greedy=4)["greedy_ok"] and compare(ref, tie, n_greedy=4)["parting_margin"] == [0.025]
    assert not compare(ref, real, n_greedy=4)["greedy_ok"]
    assert compare(ref, ref, n_greedy=4)["greedy_ok"] and compare(ref, ref, n_greedy=4)["parting_margin"] == [None]


def test_one_model_scored_by_two_engines_and_nothing_to_compare_is_one_line(folders, cli):
    d = folders
    code, out, err = cli("eval", d / "base", "--data", text_file(d), "--seq-len", "64", "--max-windows", "2",
                         "--backend", "quantkit", "--backend", "transformers", "--backend-windows", "2",
                         "--no-plots", "--json")
    assert code == 0, err
    section = json.loads(out)["backends"]
    assert section["dtype"] == "float32"  # float16 is the default only where vLLM's CPU W4 kernels need it
    rows = section["rows"]
    assert [(r["model"], r["backend"]) for r in rows] == [("base", "quantkit"), ("base", "transformers")]
    assert rows[0]["ppl"] == pytest.approx(rows[1]["ppl"], rel=1e-6)
    code, out, err = cli("eval", d / "base", "--data", text_file(d))
    assert code == 2 and "VARIANT" in err and len(err.strip().splitlines()) == 1, err
