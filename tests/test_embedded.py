"""The embedded default model end to end: `quantkit demo` does real work with nothing downloaded."""
import json

import pytest
import torch

import quantkit

TEXT = ("The river rises in the hills north of the town and runs south through farmland before it reaches the "
        "sea. In spring the water is high and fast, and the old stone bridge near the market has been closed "
        "twice in the last ten years because of flooding. Most people in the town remember the year the mill "
        "was swept away, and the council still argues about whether to build a new wall along the bank.")


def _ppl(model, ids):
    with torch.no_grad():
        return torch.exp(model(ids, labels=ids).loss).item()


@pytest.mark.slow
def test_quantize_without_model_uses_embedded(tmp_path, cli, embedded_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smollm2-w4"
    code, stdout, err = cli("quantize", "--method", "rtn", "-o", out, "--json")  # no MODEL: the embedded SmolLM2
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["layers"] == 30 * 7 and summary["group_size"] == 64
    tok = AutoTokenizer.from_pretrained(out)  # the tokenizer travels with the checkpoint
    ids = tok(TEXT, return_tensors="pt").input_ids
    base = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    q = quantkit.load(out, dtype=torch.float32, exact=True)
    p_base, p_q = _ppl(base, ids), _ppl(q, ids)
    # W4 g64 RTN on a 135M model costs a few percent of perplexity; a broken layout costs orders of magnitude
    assert p_base < 40 and p_q < p_base * 1.5, (p_base, p_q)
    code, stdout, _ = cli("inspect", out, "--json")
    info = json.loads(stdout)
    assert info["compression"] > 2.0


def test_demo_runs_the_embedded_recipe(tmp_path, cli, monkeypatch):
    import quantkit.job as qz

    seen = {}
    monkeypatch.setattr(qz, "quantize_to_checkpoint", lambda recipe, progress=None: seen.setdefault("r", recipe)
                        and {"output": recipe.output, "layers": 0, "scheme": "w4a16", "method": "rtn",
                             "group_size": 64, "mean_weight_rel_error": None, "seconds": 0})
    code, _, err = cli("demo", "-o", tmp_path / "d", "--json")
    assert code == 0, err
    r = seen["r"]
    assert r.model is None and r.quant.scheme == "w4a16" and r.quant.group_size == 64 and r.quant.method == "rtn"
