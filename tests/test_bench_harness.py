"""`python -m bench`: a tiny suite runs through the harness on a tiny seeded checkpoint; its JSON has the schema
the report reads, its perplexities equal a float64 recomputation by hand (the model's own forward, no cache
path) of the same quantised weights, and the report renders every JSON file, the same way each time."""
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import registry, report  # noqa: E402
from bench.__main__ import main  # noqa: E402

W4 = {"quant.scheme": "w4a16", "quant.group_size": 32, "quant.symmetric": True, "quant.method": "rtn"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from quantkit.testing.models import tiny_llama

    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def windows():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (48,), generator=g) for _ in range(3)]


@pytest.fixture
def tiny_suite(checkpoint, windows, monkeypatch):
    from bench.quality import measure

    mod = types.ModuleType("tiny_bench_suite")
    mod.ROWS = [{"name": "float", "set": {}}, {"name": "w4 g32 rtn", "set": W4}]
    mod.run = lambda rows, quick: {"setup": {"windows": len(windows)}, "rows": measure(str(checkpoint), rows, None, windows)}
    monkeypatch.setitem(sys.modules, "tiny_bench_suite", mod)
    monkeypatch.setitem(registry.SUITES, "tiny", "tiny_bench_suite")


def float64_ppl(model, windows) -> float:
    """exp(mean NLL) of every next token, the model in float64, one plain forward per window."""
    from quantkit.evaluate.perplexity import perplexity

    model = model.double()
    total, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(input_ids=w[None], use_cache=False).logits[0, :-1].double(), -1)
            total -= float(logp.gather(-1, w[1:, None]).sum())
            n += len(w) - 1
    return perplexity(total, n)


def test_suite_json_schema_and_perplexity_against_float64(tiny_suite, checkpoint, windows, tmp_path):
    import quantkit
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides

    assert main(["tiny", "--results", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "tiny.json").read_text())
    assert doc["suite"] == "tiny" and doc["command"] == f"python -m bench tiny --results {tmp_path}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", doc["date"])
    assert doc["machine"]["cpu"] and doc["machine"]["cores"] >= 1 and set(doc["machine"]["isa"]) <= set(registry.ISA_FLAGS)
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == ["float", "w4 g32 rtn"]

    ref = quantkit.load(checkpoint, exact=True, dtype=torch.float32)
    assert rows["float"]["ppl"] == pytest.approx(float64_ppl(ref, windows), rel=1e-5)
    quant = quantkit.load(checkpoint, exact=True, dtype=torch.float32)
    quantize_model(quant, build_plan(quant, apply_overrides(Recipe(), W4)))
    expect = float64_ppl(quant, windows)
    assert rows["w4 g32 rtn"]["ppl"] == pytest.approx(expect, rel=1e-5)
    assert rows["w4 g32 rtn"]["ppl"] != pytest.approx(rows["float"]["ppl"], rel=1e-4)  # the rows differ
    assert 0 < rows["w4 g32 rtn"]["agreement"] < 1


def test_only_selects_rows_and_a_bad_pattern_is_one_line(tiny_suite, tmp_path, capsys):
    assert main(["tiny", "--only", "W4", "--results", str(tmp_path)]) == 0
    assert [r["name"] for r in json.loads((tmp_path / "tiny.json").read_text())["rows"]] == ["w4 g32 rtn"]
    capsys.readouterr()
    assert main(["tiny", "--only", "w9", "--results", str(tmp_path)]) == 2
    assert main(["nosuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "matches no row" in err[0] and "no bench suite 'nosuch'" in err[1]


def test_report_renders_every_json_and_is_deterministic(tmp_path):
    docs = report.render(registry.RESULTS)
    assert docs == report.render(registry.RESULTS)
    paths = sorted(registry.RESULTS.glob("*.json"))
    assert paths, "bench/results holds the committed figures"
    for path in paths:
        doc = json.loads(path.read_text())
        section = docs.split(f"## {doc.get('suite', path.stem)}\n", 1)[1].split("\n## ", 1)[0]
        assert f"`{doc['command']}`" in section and doc["date"] in section
        for row in doc["rows"]:
            assert f"| {report.cell(next(iter(row.values())))} |" in section
        assert ("Carried over" in section) == bool(doc.get("carried_over"))
    # the committed page is exactly what the report makes of the committed JSON
    assert (ROOT / "docs" / "benchmarks.md").read_text() == docs, "run `python -m bench report`"
