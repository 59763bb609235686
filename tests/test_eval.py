"""`run_eval` end to end on tiny random models saved as folders: a copy of the baseline, two perturbed
copies and an RTN W4 checkpoint, scored on the same text windows and task prompts."""
import json
import math

import pytest
import torch

from quantkit.errors import UserError
from quantkit.evaluate import run_eval
from test_eval_support import TASKS, perturbed, save, task_file, text_file, tiny_model, tokenizer

SEQ, WINDOWS, NEW = 64, 4, 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The test machine's cores are shared; one intra-op thread avoids oversubscription stalls on tiny matmuls.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe, apply_overrides

    d = tmp_path_factory.mktemp("eval")
    model = tiny_model()
    base = save(model, d / "base")
    save(model, d / "same")
    save(perturbed(model, 0.05), d / "noisy")
    save(perturbed(model, 0.3), d / "noisier")
    quantize_to_checkpoint(apply_overrides(Recipe(), {"model": str(base), "output": str(d / "w4"),
                                                      "quant.group_size": 32, "dtype": "float32",
                                                      "quant.method": "rtn"}))
    report = run_eval(f"base={base}", [f"same={d / 'same'}", f"noisy={d / 'noisy'}", f"noisier={d / 'noisier'}",
                                       f"w4={d / 'w4'}"],
                      data=str(text_file(d)), tasks=str(task_file(d)), out_dir=d / "out", seq_len=SEQ,
                      max_windows=WINDOWS, max_new_tokens=NEW, gates={"max_kl_p99": 1e-6})
    return {"dir": d, "report": report, "rows": {r["label"]: r for r in report["variants"]}, "model": model}


def _kl_reference(base_model, other_folder, windows):
    """Per-token KL of every scored text position, from plain transformers forwards in float64."""
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(other_folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for w in windows:
            lp = base_model(w[None]).logits[0, :-1].double().log_softmax(-1)
            lq = other(w[None]).logits[0, :-1].double().log_softmax(-1)
            out.append((lp.exp() * (lp - lq)).sum(-1))
    return torch.cat(out)


def _windows():
    from quantkit.data import load_eval_windows
    from test_eval_support import SAMPLE

    return load_eval_windows(str(SAMPLE), tokenizer(), seq_len=SEQ, max_windows=WINDOWS)


def test_model_against_itself_has_zero_kl_and_full_agreement(run):
    same, base = run["rows"]["same"], run["rows"]["base"]
    assert same["kl"]["max"] == 0.0 and same["kl"]["n"] > 0
    assert same["ppl"] == base["ppl"]
    assert same["token_agreement"] == 1.0
    assert same["all"]["answer_agreement"] == 1.0
    assert same["all"]["exact_match"] == base["all"]["exact_match"]


def test_larger_perturbation_gives_larger_kl_and_less_agreement(run):
    r = run["rows"]
    assert 0 < r["noisy"]["kl"]["mean"] < r["noisier"]["kl"]["mean"]
    assert r["noisy"]["kl"]["p99"] < r["noisier"]["kl"]["p99"]
    assert r["noisy"]["token_agreement"] > r["noisier"]["token_agreement"]
    assert r["w4"]["kl"]["mean"] > 0


def test_perplexity_matches_direct_computation(run):
    windows = _windows()
    assert len(windows) == WINDOWS
    with torch.no_grad():
        nll = [torch.nn.functional.cross_entropy(run["model"](w[None]).logits[0, :-1].double(), w[1:],
                                                 reduction="sum") for w in windows]
    ref = math.exp(float(sum(nll)) / sum(len(w) - 1 for w in windows))
    # Our path computes log-softmax in float32 and sums in float64: 1e-5 relative covers float32 rounding.
    assert run["rows"]["base"]["ppl"] == pytest.approx(ref, rel=1e-5)
    assert run["rows"]["base"]["nll_tokens"] == WINDOWS * (SEQ - 1)


def test_text_kl_matches_float64_reference(run):
    ref = _kl_reference(run["model"], run["dir"] / "noisier", _windows())
    got = run["rows"]["noisier"]["kl_text"]
    assert got["n"] == len(ref)
    # float32 log-probs against float64: per-token error ~1e-6, far below the KL values (~0.1-1)
    assert got["mean"] == pytest.approx(float(ref.mean()), rel=1e-4)
    assert got["max"] == pytest.approx(float(ref.max()), rel=1e-4)


def test_per_task_counts_match_the_task_file(run):
    want = {}
    for t in TASKS:
        n, k = want.get(t["task"], (0, 0))
        want[t["task"]] = (n + 1, k + (t["answer"] is not None))
    for row in run["report"]["variants"]:
        got = {name: (d["n"], d["n_with_answer"]) for name, d in row["per_task"].items()}
        assert got == want
        assert row["all"]["n"] == len(TASKS)
        assert row["latency"]["requests"] == len(TASKS)
        assert row["latency"]["p50_s"] > 0 and row["latency"]["tokens_per_s"] > 0


def test_memory_figures(run):
    r = run["rows"]
    assert r["w4"]["weight_bytes"] < 0.6 * r["base"]["weight_bytes"]
    # 2 (K, V) x 2 layers x 2 KV heads x head dim 16 x 4 bytes (float32 compute)
    assert r["base"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert all(row["peak_memory_bytes"] > 0 for row in r.values())


def test_worst_samples_are_the_ten_largest_with_text(run):
    w = run["rows"]["noisier"]["worst"]
    assert len(w) == 10
    kls = [x["kl"] for x in w]
    assert kls == sorted(kls, reverse=True) and kls[0] == run["rows"]["noisier"]["kl"]["max"]
    assert all(isinstance(x["context"], str) and x["source"] in ("text window", "task") for x in w)
    assert run["rows"]["base"]["worst"] == []


def test_gate_failures_are_reported(run):
    fails = run["report"]["gate_failures"]
    assert sorted(f.split(":")[0] for f in fails) == ["noisier", "noisy", "w4"]


def test_report_files(run):
    out = run["dir"] / "out"
    data = json.loads((out / "report.json").read_text())
    assert [r["label"] for r in data["variants"]] == ["base", "same", "noisy", "noisier", "w4"]
    md = (out / "report.md").read_text()
    assert "| variant |" in md and "## Per task" in md and "Ten largest KL positions: noisier" in md
    for name in ("kl_distribution.png", "task_exact_match.png", "size_quality.png"):
        blob = (out / name).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 5000
    lines = [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]
    assert len(lines) == len(TASKS) and set(lines[0]["outputs"]) == {"base", "same", "noisy", "noisier", "w4"}


def test_exact_match_counts_references_equal_to_the_greedy_answer(tmp_path, one_thread):
    """Tasks whose reference is the model's own greedy first line (from transformers' generate) all match."""
    from quantkit.evaluate.agreement import answer_line

    model = tiny_model(seed=2)
    folder = save(model, tmp_path / "m")
    tok = tokenizer()
    lines, kept = [], 0
    for i, t in enumerate(TASKS):
        ids = tok(t["prompt"], return_tensors="pt")["input_ids"]
        out = model.generate(ids, do_sample=False, max_new_tokens=NEW, pad_token_id=0)
        ref = answer_line(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        if ref and "\n" not in ref:
            kept += 1
            lines.append(json.dumps({"id": str(i), "task": t["task"], "prompt": t["prompt"], "answer": ref}))
        wrong = json.dumps({"id": f"w{i}", "task": t["task"], "prompt": t["prompt"], "answer": "never said"})
        lines.append(wrong)
    assert kept >= 3
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    r = run_eval(str(folder), [f"again={folder}"], tasks=str(tmp_path / "t.jsonl"), max_new_tokens=NEW)
    for row in r["variants"]:
        assert row["all"]["exact_match"] == pytest.approx(kept / (kept + len(TASKS)))


def test_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="nothing to evaluate"):
        run_eval("a", ["b"])
    with pytest.raises(UserError, match="needs perplexity text"):
        run_eval("a", ["b"], tasks="t.jsonl", gates={"max_ppl_increase": 0.1})
    with pytest.raises(UserError, match="at least one VARIANT"):
        run_eval(str(tmp_path), [], tasks="t.jsonl")
