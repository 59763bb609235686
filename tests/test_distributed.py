"""`torchrun -m quantkit quantize`: data-parallel calibration, weight-parallel solving, rank 0 writes.

The reference is the same job in one process: pooling every rank's statistics must give what one process fed
every sample computes (the same held-out samples included), so the checkpoints agree code for code, up to the
float32 summation order of the Hessians. Two ranks with one thread each, on gloo; and two "nodes", two
torchrun launchers meeting at a rendezvous on 127.0.0.1.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit import distributed
from test_data_support import SAMPLE, tiny_tokenizer

from helpers import make_tiny_model

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    tok = tiny_tokenizer()
    folder = make_tiny_model(tmp_path_factory.mktemp("dist") / "src", "llama", vocab_size=len(tok))
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def src_outliers(src, tmp_path_factory):
    """The same model with a few input channels 30x larger (as real models have), so that AWQ and SmoothQuant
    choose scalings other than none and their searches decide something."""
    folder = tmp_path_factory.mktemp("dist") / "outliers"
    shutil.copytree(src, folder)
    tensors = load_file(folder / "model.safetensors")
    for k in tensors:
        if k.endswith("layernorm.weight"):
            tensors[k][:4] *= 30
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def src_moe(tmp_path_factory):
    from quantkit.testing.moe import save_tiny_moe

    folder = save_tiny_moe(tmp_path_factory.mktemp("dist") / "moe", "qwen3_moe")
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _args(src, out, scheme: str, method: str, *extra: str) -> list[str]:
    return ["quantize", str(src), "-o", str(out), "--scheme", scheme, "--method", method, "--calib", str(SAMPLE),
            "--num-samples", "8", "--seq-len", "32", "-q", *extra]


def _torchrun(args: list[str], nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "-m", "quantkit", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def _alone(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True, timeout=300,
                          env=ENV)


def _errors(stderr: str) -> list[str]:
    """The one-line errors the ranks printed; two processes writing at once can run them into one line."""
    return ["error: " + part.splitlines()[0] for part in stderr.split("error: ")[1:]]


def _same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    for k in ta:
        if ta[k].is_floating_point():
            assert torch.allclose(ta[k].float(), tb[k].float(), rtol=1e-3, atol=1e-6), k
        else:  # codes: a few flips where the summation order moved a rounding and GPTQ carried it along the row
            assert (_codes(k, ta[k]) == _codes(k, tb[k])).float().mean() > 0.99, k


def _codes(name: str, t: torch.Tensor) -> torch.Tensor:
    """4-bit codes unpacked from their int32 words (eight per word, lowest bits first); other tensors as they are."""
    if not name.endswith("weight_packed"):
        return t
    return torch.stack([(t >> (4 * i)) & 15 for i in range(8)], -1)


@pytest.mark.parametrize("model,scheme,method", [
    ("dense", "w4a16", "gptq"), ("dense", "w4a16", "rtn"), ("dense", "w8a8-static", "rtn"),
    ("dense", "fp8", "rtn"), ("moe", "w4a16", "gptq")])
def test_two_processes_write_what_one_writes(src, src_moe, tmp_path, model, scheme, method):
    """GPTQ pools Hessians and held-out Hessians; static INT8/FP8 input scales pool histograms and ranges; a
    MoE layer pools the tokens routed to each expert (the RTN fallback below quant.moe.min_tokens agrees) and
    solves in rank 0's order. (FP8 with GPTQ pools the same way, but a static input scale read after GPTQ'd
    Linears follows their float32 noise across bins: not compared bit for bit.)"""
    one, two = tmp_path / "one", tmp_path / "two"
    folder = src_moe if model == "moe" else src
    p = _alone(_args(folder, one, scheme, method))
    assert p.returncode == 0, p.stderr[-2000:]
    p = _torchrun(_args(folder, two, scheme, method))
    assert p.returncode == 0, p.stderr[-3000:]
    _same_checkpoint(one, two)
    meta_one, meta_two = (json.loads((d / "quantkit.json").read_text()) for d in (one, two))
    assert meta_two["processes"] == 2 and meta_one["processes"] == 1
    tokens = [(meta_one["layers"][n].get("tokens"), meta_two["layers"][n].get("tokens")) for n in meta_one["layers"]]
    assert all(a == b for a, b in tokens), tokens  # every rank's tokens counted once


@pytest.mark.parametrize("scheme,method,extra", [
    # a search budget of 3 of the 8 samples: the ranks keep the samples one process keeps
    ("w4a16", "awq", ["--set", "quant.awq.search_tokens=96", "--set", "quant.kv_cache=fp8"]),
    ("w8a8", "rtn", ["--set", "quant.smooth=true"]),
])
def test_searches_on_pooled_statistics_choose_what_one_process_chooses(src_outliers, tmp_path, scheme, method, extra):
    """AWQ's alpha and clip searches (block errors summed over ranks, channel statistics and Gram blocks pooled,
    the same held-out samples), SmoothQuant's migration search and the FP8 KV scales: the same checkpoint, bit
    for bit, as no GPTQ Hessian's summation order is involved."""
    one, two = tmp_path / "one", tmp_path / "two"
    p = _alone(_args(src_outliers, one, scheme, method, *extra))
    assert p.returncode == 0, p.stderr[-2000:]
    p = _torchrun(_args(src_outliers, two, scheme, method, *extra))
    assert p.returncode == 0, p.stderr[-3000:]
    ta, tb = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])][:5]
    layers = json.loads((one / "quantkit.json").read_text())["layers"]
    alphas = [v.get("awq_alpha", v.get("smooth_alpha")) for v in layers.values()]
    assert any(a not in (None, 0.0) for a in alphas), alphas  # the searches chose scalings: they were tested


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_meet_at_a_rendezvous(src, tmp_path):
    """Two launchers, as on two machines: --nnodes 2, each with one process, one rendezvous endpoint."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert _alone(_args(src, one, "w4a16", "gptq")).returncode == 0
    port = _free_port()
    nodes = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1",
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "quantkit",
                               *_args(src, two, "w4a16", "gptq")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for r in range(2)]
    outs = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    _same_checkpoint(one, two)


def test_learned_rounding_steps_on_gradients_pooled_over_ranks(src_outliers, tmp_path):
    """Each rank differentiates the step's samples it holds and the gradients are summed, so both ranks take one
    process's steps; sign descent follows the sign of each gradient, so a float32 summation-order difference
    can flip a rare near-zero component. The codes agree almost everywhere, and the guards judged the same
    held-out samples (the loss each rank pooled equals one process's to float precision)."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["--set", "quant.signround.iters=8"]
    p = _alone(_args(src_outliers, one, "w4a16", "signround", *extra))
    assert p.returncode == 0, p.stderr[-2000:]
    p = _torchrun(_args(src_outliers, two, "w4a16", "signround", *extra))
    assert p.returncode == 0, p.stderr[-3000:]
    _same_checkpoint(one, two)
    la, lb = (json.loads((d / "quantkit.json").read_text())["layers"] for d in (one, two))
    for n in la:
        a, b = la[n], lb[n]
        assert a["signround_heldout_samples"] == b["signround_heldout_samples"] > 0
        assert a["signround_fallback"] == b["signround_fallback"]
        for k in ("signround_initial_loss", "signround_heldout_rtn_loss"):  # before any step: the same inputs
            assert b[k] == pytest.approx(a[k], rel=1e-5), (n, k)
        for k in ("signround_final_loss", "signround_heldout_loss"):  # after 8 steps on pooled gradients
            assert b[k] == pytest.approx(a[k], rel=2e-3), (n, k)
    assert any(v["signround_final_loss"] < v["signround_initial_loss"] for v in la.values())  # it learned


def test_when_rank_0_cannot_claim_the_output_every_rank_stops(src, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("not quantkit's")
    p = _torchrun(_args(src, out, "w4a16", "gptq"))
    assert p.returncode != 0
    lines = _errors(p.stderr)
    assert len(lines) == 2, p.stderr[-2000:]
    assert any("rank 0 could not claim" in ln for ln in lines)
    assert (out / "mine.txt").read_text() == "not quantkit's" and len(list(out.iterdir())) == 1


def test_a_rank_that_dies_stops_the_others_and_leaves_the_output_as_it_was(src, tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(Path(__file__).with_name("dying_rank.py")),
                        *_args(src, out, "w4a16", "gptq")], capture_output=True, text=True, timeout=300,
                       env={**ENV, "TMPDIR": str(tmp_path)})  # the killed rank cannot remove its scratch folder
    assert p.returncode != 0
    assert "exitcode  : 9" in p.stderr, p.stderr[-3000:]  # torchrun names the rank that died
    survivor = [ln for ln in _errors(p.stderr) if ln.startswith("error: process 0 of 2")]
    assert len(survivor) == 1, p.stderr[-3000:]  # one line from rank 0, however it learnt of it
    assert "/quantkit/" not in p.stderr, p.stderr[-3000:]  # no traceback through our code (torchrun's own is kept)
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*")), list(tmp_path.iterdir())


def test_linears_are_dealt_so_no_rank_carries_more_than_its_share_plus_one_job():
    costs = [9.0, 7.0, 6.0, 5.0, 5.0, 4.0, 3.0, 1.0]
    for world in (1, 2, 3):
        ranks = _owners(costs, world)
        load = [sum(c for c, r in zip(costs, ranks) if r == rank) for rank in range(world)]
        assert sorted(set(ranks)) == list(range(world))
        assert max(load) <= sum(costs) / world + max(costs)


def _owners(costs, world):
    from unittest import mock

    with mock.patch.object(distributed, "world", return_value=world):
        return distributed.owners(costs)


@pytest.mark.parametrize("argv, code", [(["quantkit", "--help"], 0),
                                        (["quantkit", "quantize", "/nonexistent/model", "-o", "/tmp/x"], 2)])
def test_under_torchrun_the_command_ends_without_teardown_and_keeps_its_exit_code(monkeypatch, argv, code):
    """A rank whose run was over was seen to abort in C++ teardown at exit (SIGABRT), failing a run whose
    checkpoint was complete; under torchrun the command ends by os._exit with the code the run earned."""
    from quantkit import cli

    ended = []

    class Ended(Exception):
        pass

    def record(c):
        ended.append(c)
        raise Ended

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "exit_process", record)
    monkeypatch.setattr(distributed, "_EXITS_HARD", False)
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(Ended):
        cli.main()
    assert ended == [code] and distributed._EXITS_HARD
