"""The CPU kernel path chosen by measurement (kernels/path_choice.py, linear/path_candidates.py): the choice logic
with injected timings and a cache in a temporary folder, and every candidate against the float64 truth under each
instruction-set cap torch honours (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), each in its own process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from quantkit.kernels import path_choice
from quantkit.kernels.path_choice import Cache, Candidate, Chooser
from quantkit.linear import dispatch
from quantkit.linear.quant import QuantLinear
from quantkit.testing.packed import make_packed

ROOT = Path(__file__).resolve().parent.parent
W = torch.randn(24, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
X = [torch.randn(r, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64) for r in (1, 3)]


def truth(x):
    return x.double() @ W.t()


def cand(name, scale=1.0, fail=False):
    def build():
        if fail:
            raise RuntimeError("no kernel for this shape\nsecond line")
        return lambda x: (x @ W.t()) * scale

    return Candidate(name, build, 1e-6)


def timer_from(times):
    calls = []

    def timer(name, fn):
        fn()
        calls.append(name)
        return times[name]

    return timer, calls


FIELDS = {"cpu": "Test CPU", "isa": ["avx2"], "torch": "t", "capability": "AVX2", "caps": {}, "threads": 1}


def chooser(tmp_path, times, fields=FIELDS):
    timer, calls = timer_from(times)
    return Chooser(Cache(tmp_path / "choice.json", fields), timer, "measure"), calls


def test_the_fastest_correct_candidate_wins_and_a_wrong_one_never(tmp_path):
    c, calls = chooser(tmp_path, {"slow": 50.0, "fast": 20.0, "wrong": 1.0, "broken": 0.5})
    cands = [cand("slow"), cand("fast"), cand("wrong", scale=1.001), cand("broken", fail=True)]
    choice = c.pick("k", "layers.0.q_proj", cands, X, truth)
    assert choice.path == "fast" and choice.source == "measured"
    assert set(choice.rejected) == {"wrong", "broken"} and "tolerance" in choice.rejected["wrong"]
    assert "no kernel for this shape" in choice.rejected["broken"]
    assert sorted(set(calls)) == ["fast", "slow"]  # wrong candidates are not even timed
    again = c.pick("k", "layers.1.q_proj", cands, X, truth)  # same key: decided once, both modules recorded
    assert again is choice and choice.modules == ["layers.0.q_proj", "layers.1.q_proj"]
    assert len(calls) == 2 * path_choice.TIMING_ROUNDS


def test_ties_go_to_the_preferred_candidate_and_no_correct_one_is_an_error(tmp_path):
    c, _ = chooser(tmp_path, {"a": 10.4, "b": 10.0})
    assert c.pick("k", "m", [cand("a"), cand("b")], X, truth).path == "a"  # within the 5% margin
    c, _ = chooser(tmp_path, {"a": 11.0, "b": 10.0})
    assert c.pick("k2", "m", [cand("a"), cand("b")], X, truth).path == "b"
    with pytest.raises(RuntimeError, match="no candidate kernel"):
        c.pick("k3", "m", [cand("a", scale=2.0)], X, truth)


def test_a_burst_of_other_work_during_one_candidates_timing_does_not_decide(tmp_path):
    """The machine was busy while 'fast' was first timed (1000x its time): rounds interleave the candidates and
    keep each one's fastest, so the burst is outvoted; timed in one go, 'fast' would have lost for good."""
    seen = []

    def timer(name, fn):
        fn()
        seen.append(name)
        return {"fast": 20.0, "slow": 50.0}[name] * (1000 if seen.count(name) == 1 and name == "fast" else 1)

    c = Chooser(Cache(tmp_path / "choice.json", FIELDS), timer, "measure")
    choice = c.pick("k", "m", [cand("slow"), cand("fast")], X, truth)
    assert choice.path == "fast" and choice.times_us == {"slow": 50.0, "fast": 20.0}
    assert seen[:4] == ["slow", "fast", "slow", "fast"]  # interleaved, not one candidate's calls in a row


def test_cache_hit_miss_and_keys(tmp_path):
    c, calls = chooser(tmp_path, {"a": 30.0, "b": 10.0})
    c.pick("w4 64x64", "m", [cand("a"), cand("b")], X, truth)
    c.save()
    c2, calls2 = chooser(tmp_path, {"a": 1.0, "b": 10.0})  # timings now favour a: a hit must not re-time
    hit = c2.pick("w4 64x64", "m", [cand("a"), cand("b")], X, truth)
    assert (hit.path, hit.source, calls2) == ("b", "cached", []) and hit.times_us == {"a": 30.0, "b": 10.0}
    miss = c2.pick("w4 64x128", "m", [cand("a"), cand("b")], X, truth)  # another shape: measured
    assert (miss.path, miss.source) == ("a", "measured")
    for change in ({"caps": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}, {"threads": 2}, {"torch": "u"}, {"cpu": "Other"},
                   {"isa": ["avx2", "avx512f"]}, {"capability": "AVX512"}):
        c3, calls3 = chooser(tmp_path, {"a": 1.0, "b": 10.0}, {**FIELDS, **change})
        assert c3.pick("w4 64x64", "m", [cand("a"), cand("b")], X, truth).source == "measured", change
    # a choice made among fewer candidates (a path unavailable then) is measured again when more are offered
    c5, calls5 = chooser(tmp_path, {"a": 30.0, "b": 10.0, "c": 5.0})
    more = c5.pick("w4 64x64", "m", [cand("a"), cand("b"), cand("c")], X, truth)
    assert (more.path, more.source) == ("c", "measured") and "c" in calls5
    # a cached path that now gives wrong numbers is measured again and refused
    c4, _ = chooser(tmp_path, {"a": 30.0, "b": 10.0})
    redo = c4.pick("w4 64x64", "m", [cand("a"), cand("b", scale=1.1)], X, truth)
    assert (redo.path, redo.source) == ("a", "measured") and "b" in redo.rejected


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00", b"[]", b'{"version": 1, "machines": []}',
                                     b'{"version": 1, "machines": {"%s": {"choices": {"k": 7}}}}'])
def test_a_corrupt_cache_is_measured_again_and_rewritten(tmp_path, content):
    path = tmp_path / "choice.json"
    path.write_bytes(content.replace(b"%s", path_choice.machine_key(FIELDS).encode()))
    c, calls = chooser(tmp_path, {"a": 30.0, "b": 10.0})
    assert c.pick("k", "m", [cand("a"), cand("b")], X, truth).path == "b" and calls
    c.save()
    saved = json.loads(path.read_text())
    assert saved["machines"][path_choice.machine_key(FIELDS)]["choices"]["k"]["path"] == "b"


def test_machine_fields_and_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert path_choice.cache_path() == tmp_path / "quantkit" / "kernel_choice.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert path_choice.cache_path() == Path.home() / ".cache" / "quantkit" / "kernel_choice.json"
    for cap in path_choice.ENV_CAPS:  # the suite may itself run under a cap (ATEN_CPU_CAPABILITY=avx2 ...)
        monkeypatch.delenv(cap, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    f = path_choice.machine()
    assert f["caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"} and f["torch"] == torch.__version__
    assert f["capability"] == torch.backends.cpu.get_cpu_capability() and f["threads"] == torch.get_num_threads()
    monkeypatch.setenv("QUANTKIT_KERNEL_CHOICE", "fastest")
    from quantkit.errors import UserError

    with pytest.raises(UserError, match="QUANTKIT_KERNEL_CHOICE"):
        path_choice.mode()


def _tiny_w4_model():
    from quantkit.testing.models import tiny_llama

    model = tiny_llama(hidden=64, layers=2)
    for name, lin in list(model.named_modules()):
        if isinstance(lin, nn.Linear) and name != "lm_head":
            p = make_packed(lin.out_features, lin.in_features, 4, 32, symmetric=True, scale_dtype=torch.float32)
            q = QuantLinear(lin.in_features, lin.out_features, 4, 32, dtype=torch.float32)
            q.weight_packed, q.weight_scale = p.weight_packed, p.weight_scale
            model.set_submodule(name, q)
    return model


def test_each_timed_call_runs_its_own_candidates_path(tmp_path):
    """The W4 candidates share one module: every candidate is built before the rounds time them, so a build
    that set the path would have timed the last-built path under every name (seen: both at 470 us, a tie)."""
    model = _tiny_w4_model()
    q = model.model.layers[0].self_attn.q_proj
    ran = []

    def timer(name, fn):
        fn()
        ran.append((name, q._cpu_path))
        return 1.0

    with torch.inference_mode():
        dispatch.choose(q, dispatch.schemes(model), cpu_fast=True, name="q_proj",
                        chooser=Chooser(Cache(tmp_path / "c.json", FIELDS), timer, "measure"))
    assert len({n for n, _ in ran}) >= 2 and all(name == path for name, path in ran), ran


def test_a_load_records_its_choices_caches_them_and_explains_them(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTKIT_KERNEL_CHOICE", "measure")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = _tiny_w4_model()
    x = torch.randint(0, 256, (1, 5))
    with torch.inference_mode():
        exact = model(x).logits.double()
    dispatch.apply(model, cpu_fast=True)
    lines = dispatch.kernel_paths(model)
    assert lines[0].startswith("kernel paths on ") and "threads" in lines[0]
    # q/o 64x64, k/v 32x64, gate/up 128x64, down 64x128 and the head: five keys, each with its times
    assert len(lines) == 6 and all(" us" in line for line in lines[1:]), lines
    q = model.model.layers[0].self_attn.q_proj
    assert q._cpu_path in ("cpu-int4pack", "cpu-w4a8", "torch-dequant-matmul") and any(
        "q_proj" in line and q._cpu_path in line for line in lines)
    cached = json.loads((tmp_path / "quantkit" / "kernel_choice.json").read_text())
    (entry,) = cached["machines"].values()
    assert {v["path"] for v in entry["choices"].values()} <= {"cpu-int4pack", "cpu-w4a8", "torch-dequant-matmul",
                                                              "float16-copy", "plain"}
    with torch.inference_mode():
        fast = model(x).logits.double()
    # bf16 activations in every layer of a random model compound to a few percent (0.018 of 0.48 seen); a wrong
    # kernel anywhere is of the logits' own size
    assert (fast - exact).abs().max() <= 0.1 * exact.abs().max()


def test_generate_explain_prints_the_paths(monkeypatch, tmp_path, cli):
    from transformers import AutoTokenizer

    from quantkit.models.embedded import embedded_model_dir
    from quantkit.testing.models import tiny_llama

    monkeypatch.setenv("QUANTKIT_KERNEL_CHOICE", "measure")
    # not XDG_CACHE_HOME: the embedded model's tokenizer is cached there too, and would be rebuilt
    monkeypatch.setattr(path_choice, "cache_path", lambda: tmp_path / "choice.json")
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    tiny_llama(vocab_size=len(tok), seed=9).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    code, out, err = cli("generate", tmp_path / "m", "--prompt", "one two", "--max-tokens", "2", "--threads", "1",
                         "--explain", "--json")
    assert code == 0, err[-2000:]
    paths = json.loads(out)["kernel_paths"]
    assert paths[0].startswith("kernel paths on ") and any("q_proj" in p and "fastest at 1 row" in p for p in paths)
    code, out, err = cli("generate", tmp_path / "m", "--prompt", "one two", "--max-tokens", "2", "--threads", "1",
                         "--explain")
    assert code == 0 and "kernel paths on " in err and "[cached]" in err  # the first run's choices, from the cache


# Run in a fresh process per cap: torch reads both variables once, when it loads.
CHECK = r"""
import json, os, torch
from torch import nn
torch.set_num_threads(1)
from quantkit.kernels import dispatch as kd
from quantkit.kernels.path_choice import Choice, relative_error
from quantkit.linear import half_weight, path_candidates as pc
from quantkit.linear.quant import QuantLinear
from quantkit.testing.packed import make_packed

truths, found = {}, {}

class Check:  # every candidate checked against our own float64 truth; nothing chosen
    def pick(self, key, name, cands, inputs, _their_truth, batch_rows=None):
        w64, b = truths[name]
        ys = [x.double() @ w64.t() + (0 if b is None else b.double()) for x in inputs]
        found[key] = {c.name: [max(relative_error(c.build()(x), y) for x, y in zip(inputs, ys)), c.tolerance]
                      for c in cands}
        return Choice(key, cands[0].name)

g = torch.Generator().manual_seed(0)
for name, (n, k, bits, gs, sym, gi) in {"w4s": (96, 256, 4, 64, True, None), "w4a": (64, 256, 4, 32, False, "actorder"),
                                        "w8": (48, 128, 8, -1, False, None)}.items():
    p = make_packed(n, k, bits, gs, sym, gi, seed=3, scale_dtype=torch.float32)
    m = QuantLinear(k, n, bits, gs, symmetric=sym, has_g_idx=gi is not None, bias=True, dtype=torch.float32)
    m.weight_packed, m.weight_scale, m.weight_zero_point, m.weight_g_idx = p.args[:4]
    m.bias = nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
    m.cpu_bf16_activations = True
    kd.prepare(m)
    truths[name] = (p.w64, m.bias)
    pc.choose_quant(m, Check(), name)
for name, n, dtype, exact16 in (("f16exact", 80, torch.float32, True), ("f32", 72, torch.float32, False),
                                ("bf16", 80, torch.bfloat16, False)):
    lin = nn.Linear(192, n, dtype=dtype).requires_grad_(False)
    if exact16:
        lin.weight.copy_(lin.weight.half().float())
    truths[name] = (lin.weight.double(), lin.bias)
    pc.float_layout(lin, Check(), name)
head = nn.Linear(128, 512, bias=False).requires_grad_(False)
truths["head"] = (head.weight.double(), None)
pc.head_layout(head, Check(), "head")
print("RESULT " + json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "found": found}))
"""

ATEN = ("default", "avx2")
ONEDNN = ("default", "AVX512_CORE_BF16", "AVX2")
# what each oneDNN cap leaves out, as oneDNN's verbose `isa:` line words the ISA it runs
ABOVE = {"AVX512_CORE_BF16": ("AMX", "AVX10"), "AVX2": ("AVX-512", "AMX", "AVX10")}


@pytest.mark.parametrize("onednn", ONEDNN)
@pytest.mark.parametrize("aten", ATEN)
def test_every_candidate_is_correct_under_each_isa_cap(aten, onednn):
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    if aten != "default":
        env["ATEN_CPU_CAPABILITY"] = aten
    if onednn != "default":
        env["ONEDNN_MAX_CPU_ISA"] = onednn
    env["ONEDNN_VERBOSE"] = "1"  # oneDNN prints the ISA it runs at its first primitive: proof the cap held
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(line[7:] for line in r.stdout.splitlines() if line.startswith("RESULT ")))
    if aten == "avx2":
        assert out["capability"] == "AVX2"  # ATen honours the cap: its vectorised kernels are AVX2 ones
    isa = [line for line in r.stdout.splitlines() if ",isa:" in line]
    if onednn != "default":
        assert isa, "oneDNN ran no primitive: the cap cannot be shown to hold"
        assert not any(word in isa[0] for word in ABOVE[onednn]), isa[0]
    found = out["found"]
    q4 = next(v for k, v in found.items() if k.startswith("w4 g64"))
    q8 = next(v for k, v in found.items() if k.startswith("w8"))
    # the packed ops, quantkit's W4A8 op (every cap here leaves AVX2) and the dequantising fallback are all
    # checked, under every cap, the act-order W4 too
    assert {"cpu-int4pack", "cpu-w4a8", "torch-dequant-matmul"} <= set(q4) and "cpu-int8pack" in q8
    assert "cpu-w4a8" in next(v for k, v in found.items() if k.startswith("w4 g32 asym act-order"))
    assert "fbgemm-fp16" in found["float 80x192 float32"] and "float16-copy" in found["head 512x128 float32"]
    bad = {(key, path): e for key, paths in found.items() for path, e in paths.items() if not e[0] <= e[1]}
    assert not bad, bad


def test_a_path_that_sinks_a_batch_is_refused_even_when_fastest_at_one_row(tmp_path):
    """Timed on 16 rows as well, a candidate more than BATCH_SLACK times the fastest there is refused."""
    rows_seen = []

    def counted(name):
        def build():
            def run(x):
                rows_seen.append(x.shape[0])
                return x @ W.t()
            return run
        return Candidate(name, build, 1e-6)

    us = {("one-row champion", 1): 10.0, ("batch-friendly", 1): 12.0,
          ("one-row champion", 16): 300.0, ("batch-friendly", 16): 100.0}

    def timer(name, fn):
        fn()
        return us[name, rows_seen[-1]]

    cands = [counted("batch-friendly"), counted("one-row champion")]
    choice = Chooser(Cache(tmp_path / "c.json", FIELDS), timer, "measure").pick("k", "m", cands, X, truth,
                                                                                batch_rows=16)
    assert choice.path == "batch-friendly" and 16 in rows_seen
    assert choice.rejected["one-row champion"] == "3.0x the fastest at 16 rows" and "refused" in choice.why()
    # within the slack (or without a batch) the one-row champion wins, as before
    us["one-row champion", 16] = 140.0
    assert Chooser(Cache(tmp_path / "c2.json", FIELDS), timer, "measure").pick(
        "k", "m", cands, X, truth, batch_rows=16).path == "one-row champion"
