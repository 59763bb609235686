"""Scaling of a torchrun quantisation: calibration and solve time per decoder layer, measured for 1 process
(2 threads) and 2 processes (torchrun, 1 thread each, gloo) on SmolLM2-135M with GPTQ, then modelled for 8
processes on one node and 2 x 8 across nodes from the measured per-layer costs and the bytes each collective
moves.

    python bench/scaling.py                 # both runs (a few minutes), the table, bench/results/scaling.json
    python bench/scaling.py --samples 8     # smaller calibration set

The same file is the worker torchrun starts (`--worker DIR -- quantize ...`): it runs quantkit's own CLI in
process with timers wrapped around the pipeline's steps, and each rank writes what it timed to DIR/rank{r}.json.
The model's terms and constants live in quantkit/evaluate/run_cost.py (what `quantkit estimate` prints); this
file measures them and prints the comparison.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "scaling.json"


# ---------------------------------------------------------------- worker: timers around quantkit's own pipeline

class _Timer:
    def __init__(self):
        self.layer = -1
        self.rows: dict[int, dict] = {}
        self.linears: list[dict] = []

    def add(self, key: str, seconds: float, nbytes: int = 0) -> None:
        row = self.rows.setdefault(self.layer, {})
        row[key] = row.get(key, 0.0) + seconds
        if nbytes:
            row[key + "_bytes"] = row.get(key + "_bytes", 0) + nbytes


def _wrap(owner, attr: str, key: str, timer: _Timer, nbytes=None) -> None:
    fn = getattr(owner, attr)

    def timed(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        timer.add(key, time.perf_counter() - t, nbytes(a, out) if nbytes else 0)
        return out

    setattr(owner, attr, timed)


def _saved_bytes(obj) -> int:
    if obj is None:
        return 0
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer().nbytes


def _instrument(timer: _Timer) -> None:
    from quantkit import distributed
    from quantkit.pipeline import sequential, stream

    capture = sequential.capture  # whichever module the pipeline feeds layers through
    from quantkit.solvers.gptq_solver import GPTQSolver

    load = stream.LayerStream.load

    def load_layer(self, i):
        timer.layer = i
        t = time.perf_counter()
        load(self, i)
        timer.add("load", time.perf_counter() - t)

    stream.LayerStream.load = load_layer
    _wrap(capture, "first_layer_inputs", "embed", timer)
    _wrap(capture, "linear_groups", "forward", timer)
    _wrap(capture, "run_layer", "forward", timer)
    _wrap(capture, "feed_group", "feed", timer)  # the layer's forward with the Hessians' accumulation inside
    _wrap(GPTQSolver, "add_batch", "hessian", timer)
    _wrap(GPTQSolver, "add_holdout", "hessian", timer)
    _wrap(GPTQSolver, "reduce", "allreduce", timer,
          lambda a, out: 4 * a[0].H.numel() * (2 if a[0].H_hold is not None else 1))
    # the broadcast's time includes waiting for the owner's solve: the solve phase is solve + broadcast
    _wrap(distributed, "broadcast", "broadcast", timer, lambda a, out: _saved_bytes(out) if a[1] == 0 else 0)
    solved_by = sequential._Solve.solved_by

    def solve(self, name, solver):
        t = time.perf_counter()
        qw = solved_by(self, name, solver)
        dt = time.perf_counter() - t
        timer.add("solve", dt)
        out_f, in_f = solver.weight.shape
        timer.linears.append({"name": name, "out": out_f, "in": in_f, "seconds": dt, "layer": timer.layer})
        return qw

    sequential._Solve.solved_by = solve


def worker(out_dir: str, argv: list[str]) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    timer = _Timer()
    _instrument(timer)
    from quantkit.cli import main as cli

    sys.argv = ["quantkit", *argv]
    t = time.perf_counter()
    code = 0
    try:
        cli()
    except SystemExit as e:
        code = e.code or 0
    rank = int(os.environ.get("RANK", "0"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "exit": code, "wall": time.perf_counter() - t, "threads": torch.get_num_threads(),
        "layers": {str(k): v for k, v in timer.rows.items()}, "linears": timer.linears}))


def gloo_worker(out_dir: str, nbytes: int = 32 << 20, reps: int = 3) -> None:
    """The link the two processes share here, without a solve to wait for: a Hessian-sized all-reduce and a
    result-sized broadcast as the pipeline sends them (broadcast_object_list), best of REPS after a barrier."""
    import torch
    import torch.distributed as dist

    from quantkit import distributed

    dist.init_process_group("gloo")
    t = torch.ones(nbytes // 4)
    times = {"allreduce": float("inf"), "broadcast": float("inf")}
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times["allreduce"] = min(times["allreduce"], time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        distributed.broadcast(t[: nbytes // 16] if dist.get_rank() == 0 else None, 0)
        times["broadcast"] = min(times["broadcast"], time.perf_counter() - t0)
    if dist.get_rank() == 0:  # a ring all-reduce over 2 processes moves its bytes once each way
        Path(out_dir, "gloo.json").write_text(json.dumps({"allreduce_bytes_per_s": nbytes / times["allreduce"],
                                                          "broadcast_bytes_per_s": nbytes / 4 / times["broadcast"],
                                                          "bytes": nbytes}))
    dist.destroy_process_group()


def _gloo(tmp: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="gloo-", dir=tmp))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--gloo", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"the gloo measurement failed:\n{p.stderr[-3000:]}")
    return json.loads((out / "gloo.json").read_text())


# ---------------------------------------------------------------- driver: the two runs, the fit, the model

def _smollm2(tmp: Path, layers: int) -> Path:
    """SmolLM2-135M cut to its first LAYERS decoder layers: every layer has the same shapes, so the per-layer
    costs are the full model's and a run takes minutes on two shared cores."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quantkit.models.embedded import embedded_model_dir

    src, dst = embedded_model_dir(), tmp / f"smollm2-{layers}-layers"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = min(layers, cfg["num_hidden_layers"])
    (dst / "config.json").write_text(json.dumps(cfg))
    keep = {k: v for k, v in load_file(src / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _calib_file(tmp: Path) -> Path:
    """Prose and code from the shipped calibration texts: enough tokens for 16 x 256 without a download."""
    texts = sorted((ROOT / "calibration" / "texts").glob("*_calib.txt"))
    path = tmp / "calib.txt"
    path.write_text("\n\n".join(p.read_text() for p in texts))
    return path


def _run(nproc: int, threads: int, model: Path, calib: Path, samples: int, seq_len: int, tmp: Path) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix=f"scaling{nproc}-", dir=tmp))
    args = ["quantize", str(model), "-o", str(out_dir / "ckpt"), "--method", "gptq", "--scheme", "w4a16",
            "--calib", str(calib), "--num-samples", str(samples), "--seq-len", str(seq_len), "-q"]
    me = [str(Path(__file__).resolve()), "--worker", str(out_dir), "--", *args]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *me]
              if nproc > 1 else [sys.executable, *me])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    p = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"the {nproc}-process run failed:\n{p.stderr[-3000:]}")
    ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(nproc)]
    return {"processes": nproc, "threads_per_process": threads, "wall": wall, "command": " ".join(launch),
            "ranks": ranks}


def _phases(run: dict) -> dict:
    """Per-layer seconds of the slowest rank for each phase (a phase ends when the last rank is done)."""
    layers = sorted({int(k) for r in run["ranks"] for k in r["layers"]} - {-1})
    out = {}
    for key in ("load", "feed", "hessian", "forward", "allreduce", "solve", "broadcast"):
        out[key] = [max(r["layers"].get(str(i), {}).get(key, 0.0) for r in run["ranks"]) for i in layers]
    out["calibration"] = [f + g for f, g in zip(out["feed"], out["forward"])]
    out["solve_phase"] = [max(r["layers"].get(str(i), {}).get("solve", 0.0)
                              + r["layers"].get(str(i), {}).get("broadcast", 0.0) for r in run["ranks"])
                          for i in layers]
    r0 = run["ranks"][0]["layers"]
    out["allreduce_bytes"] = [r0.get(str(i), {}).get("allreduce_bytes", 0) for i in layers]
    out["broadcast_bytes"] = [r0.get(str(i), {}).get("broadcast_bytes", 0) for i in layers]
    return out


def machine() -> dict:
    model, flags = platform.processor(), []
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in info.splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "Model name":
                model = v.strip()
            if k.strip() == "Flags":
                flags = [f for f in v.split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    except OSError:
        pass
    return {"cpu": model, "isa": sorted(flags), "cores": os.cpu_count()}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _measured_row(label: str, run: dict, ph: dict) -> dict:
    return {"row": label, "kind": "measured", "processes": run["processes"],
            "threads_per_process": run["threads_per_process"], "wall_s": round(run["wall"], 2),
            "calibration_s_per_layer": round(_mean(ph["calibration"]), 4),
            "hessian_s_per_layer": round(_mean(ph["hessian"]), 4),
            "allreduce_s_per_layer": round(_mean(ph["allreduce"]), 4),
            "solve_s_per_layer": round(_mean(ph["solve_phase"]), 4),
            "layers_s": round(sum(ph["calibration"]) + sum(ph["solve_phase"]) + sum(ph["allreduce"]), 2)}


def _modelled_rows(shape, samples: int, seq_len: int, consts: dict, links: dict) -> list[dict]:
    """Per-layer seconds and the whole model's layer loop, from run_cost's model with the fitted constants."""
    from quantkit.evaluate import run_cost

    rows = []
    for label, ranks, link in [("1 process", 1, "none"), ("2 processes, gloo as measured here", 2, "gloo-here"),
                               ("8 ranks, 1 node, NVLink-class", 8, "nvlink"),
                               ("8 ranks, 1 node, gloo as measured here", 8, "gloo-here"),
                               ("2 x 8 ranks, 100 Gb/s between nodes", 16, "ib100"),
                               ("2 x 8 ranks, gloo as measured here", 16, "gloo-here")]:
        t = run_cost.layer_time(shape, "gptq", samples, seq_len, ranks, consts, links[link])
        rows.append({"row": f"{label} ({shape.layers} layers)", "kind": "modelled", "processes": ranks, "link": link,
                     "link_bytes_per_s": links[link],
                     "calibration_s_per_layer": round(t["calibration"], 4),
                     "allreduce_s_per_layer": round(t["allreduce"], 4),
                     "solve_s_per_layer": round(t["solve"] + t["broadcast"], 4),
                     "layers_s": round(shape.layers * (t["total"] - t["load"]), 2)})
    return rows


def _rtn_seconds_per_weight(shape, reps: int = 3) -> float:
    """Round-to-nearest (w4a16, group 128) of one layer's Linears on one thread, best of REPS."""
    import torch

    from quantkit.evaluate.run_cost import layer_linears
    from quantkit.schemes import get_scheme
    from quantkit.solvers.gptq import round_to_nearest

    torch.set_num_threads(1)
    ws = [torch.randn(lin.out, lin.inp) for lin in layer_linears(shape)]
    scheme = replace(get_scheme("w4a16"), group_size=64)  # SmolLM2's 576 inputs take groups of 64, not 128
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for w in ws:
            round_to_nearest(w, scheme, False, torch.float32)
        best = min(best, time.perf_counter() - t)
    return best / sum(w.numel() for w in ws)


def _fit(one: dict, two: dict, link: dict, shape, tokens: int) -> tuple[dict, dict]:
    """Per-rank compute constants from the 2-process run (1 thread each, the rank the model multiplies), the
    2-thread ones from the 1-process run, and the gloo bandwidth the 2-process collectives reached here."""
    from quantkit.evaluate import run_cost

    per_thread = run_cost.fit_constants(_phases(two), two["ranks"], shape, tokens // 2)
    two_threads = run_cost.fit_constants(_phases(one), one["ranks"], shape, tokens)
    per_thread["rtn_s"] = _rtn_seconds_per_weight(shape)
    ph = _phases(two)
    moved = sum(ph["allreduce_bytes"]) + sum(ph["broadcast_bytes"])
    # in the run, a collective's time holds the wait for the slower rank's calibration or solve; the link itself
    # is what gloo_worker timed after a barrier (the slower of its all-reduce and broadcast rates)
    gloo = min(link["allreduce_bytes_per_s"], link["broadcast_bytes_per_s"])
    return {"per_rank_1_thread": per_thread, "one_process_2_threads": two_threads, "gloo": link,
            "bytes_moved_2_processes_per_layer": moved / len(ph["allreduce"])}, {"gloo-here": gloo}


def print_table(rows: list[dict]) -> None:
    cols = ("row", "processes", "calibration_s_per_layer", "allreduce_s_per_layer", "solve_s_per_layer", "layers_s")
    heads = ("run", "procs", "calib s/layer", "all-reduce s/layer", "solve+bcast s/layer", "all layers s")
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


def report(result: dict) -> dict:
    """Fit the per-layer constants to the two timed runs and model the larger runs (the rows of the table)."""
    from quantkit.evaluate import run_cost
    from quantkit.evaluate.estimate import shape_from_config

    one, two = result["runs"]["one"], result["runs"]["two"]
    shape = shape_from_config(result["config"])
    full = shape_from_config({**result["config"], "num_hidden_layers": 30})
    fitted, links = _fit(one, two, result["gloo"], shape, result["samples"] * result["seq_len"])
    links = {**run_cost.LINKS, **links, "none": float("inf")}
    rows = [_measured_row(f"1 process, 2 threads ({shape.layers} layers)", one, _phases(one)),
            _measured_row(f"2 processes (torchrun, gloo), 1 thread each ({shape.layers} layers)", two, _phases(two))]
    rows += _modelled_rows(full, result["samples"], result["seq_len"], fitted["per_rank_1_thread"], links)
    return {**result, "fitted": fitted, "links_bytes_per_s": links, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3, help="SmolLM2's first N decoder layers (of 30)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--refit", type=Path, help="redo the fit and the table from the runs saved in this result")
    a = ap.parse_args(argv)
    if a.refit:
        result = json.loads(a.refit.read_text())
        if "gloo" not in result:  # a result saved before the link was timed on its own
            with tempfile.TemporaryDirectory() as tmp:
                result["gloo"] = _gloo(Path(tmp))
        result = report(result)
    else:
        load_before = _uptime()
        with tempfile.TemporaryDirectory() as tmp:
            model = _smollm2(Path(tmp), a.layers)
            calib = _calib_file(Path(tmp))
            one = _run(1, 2, model, calib, a.samples, a.seq_len, Path(tmp))
            two = _run(2, 1, model, calib, a.samples, a.seq_len, Path(tmp))
            gloo = _gloo(Path(tmp))
            config = json.loads((model / "config.json").read_text())
        result = {"machine": machine(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "command": "python bench/scaling.py " + " ".join(argv or []), "uptime_before": load_before,
                  "uptime_after": _uptime(), "model": f"SmolLM2-135M-Instruct (embedded), first {a.layers} of 30 "
                  "layers", "method": "gptq w4a16", "samples": a.samples, "seq_len": a.seq_len, "config": config,
                  "gloo": gloo, "runs": {"one": one, "two": two}}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))  # the runs are kept even if the fit below fails
        result = report(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print_table(result["rows"])
    print(f"machine: {result['machine']['cpu']}; {result['date']}; load {result['uptime_before']} -> "
          f"{result['uptime_after']}")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--gloo":
        gloo_worker(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[4:] if sys.argv[3] == "--" else sys.argv[3:])
    else:
        main(sys.argv[1:])
