"""Expected time and peak memory of a quantisation run (one process or several under torchrun), from a model's
config and per-layer costs that bench/scaling.py measures.

Per decoder layer, the pipeline (pipeline/sequential.py) does, on each of R processes:
  calibration  its share of the samples through the layer: forward ~ tokens/R x layer parameters, and for GPTQ
               the Hessian of each Linear's input ~ tokens/R x in^2 (one x^T x per batch)
  all-reduce   the Hessians (and the held-out ones) summed across processes: 4 in^2 bytes each, 2(R-1)/R of it
               over the slowest link (a ring)
  solve        each Linear once, on the process distributed.owners deals it to by cost: GPTQ ~ in^2 x out
               (plus a step per input column); the pipeline deals one stage at a time (q/k/v, o, gate/up,
               down), so each stage waits for its most loaded process (the LPT makespan) and a stage of one
               Linear runs on one process whatever the rank count
  broadcast    every solved Linear sent from its owner to the others (codes + scales)
The layer loop is sequential (layer i+1's inputs are layer i's quantised outputs), so the run is layers x that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import distributed
from ..errors import UserError
from .estimate import Shape, param_counts

# Per-layer cost constants measured by `python bench/scaling.py --layers 3` (SmolLM2-135M's first 3 layers, GPTQ
# w4a16, 16 x 256 tokens), fitted to the 2-process torchrun run: one process with one thread (a torchrun rank on a
# CPU). The machine was shared (load average 13 to 19 on 2 cores), so these are slower than an idle machine's.
# GPU constants are not measured here: on a GPU device estimate gives the memory, not a time.
MEASURED = {
    "cpu": {
        "machine": "Intel(R) Xeon(R) Processor (AVX-512, AMX), 2 cores, shared; bench/results/scaling.json",
        "date": "2026-12-03",
        "forward_s": 8.83e-10,  # seconds per token per decoder-layer parameter in one forward pass
        "hessian_s": 5.78e-10,  # seconds per token per in^2, summed over a layer's calibrated Linears
        "solve_s": 8.67e-09,  # GPTQ seconds per in^2 x out of one Linear (the held-out guard's solves included)
        "column_s": 4.15e-03,  # GPTQ seconds per input column (its column loop's steps, whatever the rows)
        "rtn_s": 3.45e-07,  # round-to-nearest seconds per weight
        "load_s": 7.78e-08,  # seconds per decoder-layer parameter to read a layer from disk
        "gloo_bytes_per_s": 3.05e6,  # two processes' gloo on this host: the slower of all-reduce and broadcast
    },
}

# Link bandwidths the time model is asked about, bytes/s each way: NVLink-class bus bandwidth an all-reduce
# reaches inside one 8-GPU node (NVLink 4 is 450 GB/s a direction per GPU; NCCL reaches ~300 of it), and one
# 100 Gb/s-class network link per node between nodes.
LINKS = {"nvlink": 300e9, "ib100": 12.5e9}
LATENCY_S = 20e-6  # per collective call, of the order NCCL reports on one node
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
TIMED_METHODS = ("gptq", "rtn")


@dataclass(frozen=True)
class Linear:
    out: int
    inp: int
    stage: int  # Linears of one stage read one tensor and are fed (and hold their Hessians) together


def layer_linears(s: Shape) -> list[Linear]:
    """One decoder layer's Linears in the pipeline's stages: q/k/v, o, every expert's gate/up, every down."""
    stage = {0: 0, 1: 0, 2: 0, 3: 1}
    out = []
    for i, (o, n) in enumerate(s.linear_shapes()):
        out.append(Linear(o, n, stage.get(i, 2 if (i - 4) % 3 < 2 else 3)))
    return out


def layer_params(s: Shape) -> int:
    return sum(o * n for o, n in s.linear_shapes()) + s.other_params_per_layer()


def forward_passes(s: Shape) -> float:
    """Layer forwards per calibration token: each stage's feeding runs the layer up to that stage's Linears (the
    parameters of the stages before it), then the quantised layer runs whole to make the next layer's inputs."""
    lins, total = layer_linears(s), layer_params(s)
    before = [sum(lin.out * lin.inp for lin in lins if lin.stage < k) for k in sorted({lin.stage for lin in lins})]
    return 1 + sum(before) / total


def stages(lins: list[Linear]) -> list[list[Linear]]:
    return [[lin for lin in lins if lin.stage == k] for k in sorted({lin.stage for lin in lins})]


def solve_costs(s: Shape, method: str, lins: list[Linear] | None = None) -> list[float]:
    """Relative solve time of each Linear (of the layer, or LINS): the cost the pipeline deals Linears by."""
    return [float(lin.inp * lin.inp * lin.out if method == "gptq" else lin.inp * lin.out)
            for lin in (layer_linears(s) if lins is None else lins)]


def solve_seconds(lin: Linear, method: str, c: dict) -> float:
    if method == "gptq":
        return c["solve_s"] * lin.inp ** 2 * lin.out + c["column_s"] * lin.inp
    return c["rtn_s"] * lin.inp * lin.out


def makespan(costs: list[float], ranks: int, seconds: list[float] | None = None) -> float:
    """The most loaded process's time when distributed.owners deals the jobs by COSTS to RANKS processes; each
    job takes SECONDS (default: its cost)."""
    load = [0.0] * ranks
    for t, r in zip(seconds or costs, distributed.owners(costs, ranks)):
        load[r] += t
    return max(load)


def _ring(nbytes: float, ranks: int, calls: int, bandwidth: float) -> float:
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + calls * LATENCY_S


def result_bytes(lin: Linear, group_size: int = 128) -> float:
    """A solved Linear as broadcast: int8 codes, float32 group scales, int32 act-order group index."""
    return lin.out * lin.inp + 4 * lin.out * math.ceil(lin.inp / group_size) + 4 * lin.inp


def layer_time(s: Shape, method: str, samples: int, seq_len: int, ranks: int, c: dict, bandwidth: float,
               holdout: bool = True) -> dict:
    """Seconds per decoder layer by phase, for RANKS processes joined by BANDWIDTH bytes/s (the slowest link)."""
    lins = layer_linears(s)
    tokens = math.ceil(samples / ranks) * seq_len  # each process feeds every ranks-th sample
    t = {"load": c["load_s"] * layer_params(s), "allreduce": 0.0, "broadcast": 0.0}
    if method == "gptq":
        in2 = sum(lin.inp ** 2 for lin in lins)
        t["calibration"] = tokens * (c["forward_s"] * layer_params(s) * forward_passes(s) + c["hessian_s"] * in2)
        copies = 2 if holdout else 1
        # the Hessians are summed in float64 (solvers/gptq_solver.py), so each travels as 8 in^2 bytes
        t["allreduce"] = _ring(8 * in2 * copies, ranks, len(lins) * copies, bandwidth)
    else:  # round-to-nearest reads no activations
        t["calibration"] = 0.0
    t["solve"] = sum(makespan(solve_costs(s, method, st), ranks, [solve_seconds(lin, method, c) for lin in st])
                     for st in stages(lins))
    if ranks > 1:
        t["broadcast"] = sum(result_bytes(lin) for lin in lins) / bandwidth + len(lins) * LATENCY_S
    t["total"] = sum(t.values())
    return t


def peak_bytes(s: Shape, method: str, samples: int, seq_len: int, ranks: int = 1, dtype_bytes: int = 2,
               holdout: bool = True, group_size: int = 128, cap: int | None = None) -> dict:
    """Peak host (or device) bytes one process holds, by part: the layers stream from disk one at a time.
    CAP: what --max-memory gives each process; activations that would take more than the run lets them
    (capture/spill.py) are counted as the run holds them then, one sample at a time, and the rest as on disk."""
    from ..capture.spill import SHARE

    lins = layer_linears(s)
    tokens = math.ceil(samples / ranks) * seq_len
    on_disk = cap is not None and 2 * tokens * s.hidden * dtype_bytes > SHARE * cap
    parts = {
        "outside_layers": param_counts(s)["other"] * dtype_bytes - s.layers * s.other_params_per_layer() * dtype_bytes,
        # the layer as loaded plus its solvers' float32 copies of the weights
        "one_layer": layer_params(s) * (dtype_bytes + 4),
        # a layer's inputs and the outputs it is producing for the next layer, in the model's dtype
        "activations": 2 * (seq_len if on_disk else tokens) * s.hidden * dtype_bytes,
        "hessians": 0,
        # every solved Linear's codes and scales are kept until the checkpoint is written, then packed
        "output": s.layers * sum(result_bytes(lin, group_size) + lin.out * lin.inp // 2 for lin in lins),
    }
    # the writer streams one tensor at a time (formats/safetensors_stream.py): beside what is held, one tensor in
    # its stored dtype, at most the embedding (or head) converted from the compute dtype
    parts["writing"] = s.vocab * s.hidden * dtype_bytes
    if method == "gptq":
        per_stage: dict[int, int] = {}
        for lin in lins:
            # float64 sums while calibrating (solvers/gptq_solver.py), and the Hessians and held-out ones
            per_stage[lin.stage] = per_stage.get(lin.stage, 0) + 8 * lin.inp ** 2 * (2 if holdout else 1)
        # the solve's own float32 work: inverse Cholesky factor and a copy of the weight and its errors
        work = max(4 * (2 * lin.inp ** 2 + 3 * lin.out * lin.inp) for lin in lins)
        parts["hessians"] = max(per_stage.values()) + work
    parts["total"] = sum(parts.values())
    parts["activations_on_disk"] = 2 * tokens * s.hidden * dtype_bytes if on_disk else 0
    return parts


def quantize_estimate(cfg: dict, method: str, samples: int, seq_len: int, ranks: int = 1, nodes: int = 1,
                      device: str = "cpu", cap: int | None = None) -> dict:
    """Time (where constants are measured for DEVICE) and peak memory of a whole run, for `quantkit estimate`."""
    from .estimate import GPUS, shape_from_config

    if device not in MEASURED and device not in GPUS:
        raise UserError(f"unknown device '{device}'; use {', '.join(MEASURED)} or a GPU name ({', '.join(GPUS)})")
    text = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
    return run_estimate(shape_from_config(cfg), method, samples, seq_len, ranks, nodes, device,
                        DTYPE_BYTES.get(dtype, 2), cap)


def run_estimate(s: Shape, method: str, samples: int, seq_len: int, ranks: int = 1, nodes: int = 1,
                 device: str = "cpu", dtype_bytes: int = 2, cap: int | None = None) -> dict:
    """Time (where constants are measured for DEVICE) and peak memory of a run of model shape S."""
    if method not in TIMED_METHODS:
        raise UserError(f"run time is modelled for --method {' or '.join(TIMED_METHODS)}; '{method}' is not "
                        "measured yet")
    if ranks < 1 or nodes < 1 or ranks % nodes:
        raise UserError(f"--ranks {ranks} over --nodes {nodes}: pass a positive number of processes that the "
                        "nodes share evenly (ranks is the total)")
    if samples < ranks or seq_len < 1:
        raise UserError(f"{samples} samples cannot be shared by {ranks} processes; pass --num-samples {ranks} "
                        "or more and a positive --seq-len")
    c = MEASURED.get(device)
    link = "ib100" if nodes > 1 else "nvlink"
    bandwidth = c.get("gloo_bytes_per_s", LINKS[link]) if c and nodes == 1 else LINKS[link]
    out = {"method": method, "samples": samples, "seq_len": seq_len, "ranks": ranks, "nodes": nodes,
           "device": device, "link": "gloo (measured)" if c and nodes == 1 else link, "link_bytes_per_s": bandwidth,
           "memory": peak_bytes(s, method, samples, seq_len, ranks, dtype_bytes, cap=cap)}
    if c is None:
        out.update(seconds=None, note=f"no time constants measured for '{device}' (only {', '.join(MEASURED)})")
        return out
    per_layer = layer_time(s, method, samples, seq_len, ranks, c, bandwidth)
    out.update(seconds=s.layers * per_layer["total"], per_layer=per_layer,
               constants={k: c[k] for k in ("machine", "date")})
    return out


def fit_constants(phases: dict, ranks: list[dict], s: Shape, tokens: int) -> dict:
    """The constants above from a run bench/scaling.py timed: PHASES (per-layer seconds, slowest rank) and the
    per-Linear solve times every rank recorded; TOKENS one process fed."""
    n = len(phases["calibration"])
    in2 = sum(lin.inp ** 2 for lin in layer_linears(s))
    fwd = sum(phases["calibration"]) - sum(phases["hessian"])
    solve_s, column_s = fit_solve([(x["out"], x["in"], x["seconds"]) for r in ranks for x in r["linears"]])
    return {"forward_s": fwd / (n * tokens * layer_params(s) * forward_passes(s)),
            "hessian_s": sum(phases["hessian"]) / (n * tokens * in2), "solve_s": solve_s, "column_s": column_s,
            "load_s": sum(phases["load"]) / (n * layer_params(s)), "rtn_s": 0.0}


def fit_solve(timed: list[tuple[int, int, float]]) -> tuple[float, float]:
    """solve_s and column_s by least squares over (out, in, seconds) of solved Linears, neither below zero."""
    import torch

    a = torch.tensor([[float(i * i * o), float(i)] for o, i, _ in timed], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in timed], dtype=torch.float64)
    scale = a.abs().max(0).values
    x = torch.linalg.lstsq(a / scale, y[:, None]).solution[:, 0] / scale
    if (x < 0).any():  # one term alone explains it: keep the one that fits better
        fits = [(float((y * a[:, k]).sum() / (a[:, k] ** 2).sum()), k) for k in (0, 1)]
        err = [float(((a[:, k] * f - y) ** 2).sum()) for f, k in fits]
        f, k = fits[err.index(min(err))]
        x = torch.zeros(2, dtype=torch.float64)
        x[k] = f
    return float(x[0]), float(x[1])
