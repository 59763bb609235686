"""Quantising with several processes: torch.distributed, as torchrun starts it.

`torchrun --nproc-per-node N -m quantkit quantize MODEL -o OUT ...` (and --nnodes with a rendezvous for several
machines) runs N copies of the same job. Calibration is data-parallel: each rank feeds its share of the samples
through the layer, and the statistics a solver reads are pooled across ranks (sums of Hessians and histograms,
maxima of ranges). Solving is weight-parallel: the Linears of a stage are dealt to ranks by cost, each is solved
once, and the results are broadcast so every rank feeds the next layer the same quantised output. Only rank 0
writes. Nothing here is a process pool or a protocol of its own: torchrun launches, torch.distributed carries.

A single process (no WORLD_SIZE, or 1) never touches torch.distributed: every helper is then the identity.
"""
from __future__ import annotations

import io
import os
import signal
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import UserError


# Set by the `quantkit` command: the process ends with os._exit once its run is over (see exit_process), so a
# successful run need not tear the process group down at all.
_EXITS_HARD = False


def init_from_env(device: str) -> None:
    """Join the process group torchrun describes; NCCL for GPUs, gloo for CPUs."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # a rank waits for the others' solves of a layer; a 400B layer's GPTQ takes minutes, not hours
    dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(minutes=60))
    # torchrun stops the survivors of a failed rank with SIGTERM: as an exception, rank 0's output claim still
    # removes its temporary folder on the way out
    signal.signal(signal.SIGTERM, _stopped)


def _stopped(signum, frame):
    raise SystemExit(f"error: process {rank()} of {world()} was stopped by torchrun (another process failed); "
                     "nothing was written to the output folder")


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def shard(items: list) -> list:
    """This rank's share of the calibration samples (every world()-th one, from its rank on)."""
    if not active():
        return items
    if len(items) < world():
        raise UserError(f"{len(items)} calibration samples cannot be shared by {world()} processes; pass "
                        f"--num-samples {world()} or more, or start fewer processes")
    return items[rank()::world()]


def _device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def global_index(local: int) -> int:
    """The position in the whole calibration set of this rank's LOCAL-th sample (see shard)."""
    return local * world() + rank()


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=op)
    return t


class Pool:
    """The reductions a solver's statistics need, in place, across every rank."""

    @staticmethod
    def sum(t: torch.Tensor) -> torch.Tensor:
        return _all_reduce(t, dist.ReduceOp.SUM)

    @staticmethod
    def max(t: torch.Tensor) -> torch.Tensor:
        return _all_reduce(t, dist.ReduceOp.MAX)

    @staticmethod
    def total(x: float) -> float:
        """A number summed over every rank (an error or a count measured on each rank's own samples)."""
        if not active():
            return x
        return float(Pool.sum(torch.tensor([x], dtype=torch.float64, device=_device())).item())

    @staticmethod
    def count(n: int) -> int:
        return int(Pool.total(n))

    @staticmethod
    def active() -> bool:
        return active()

    @staticmethod
    def index(local: int) -> int:
        return global_index(local)


def owners(costs: list[float], ranks: int | None = None) -> list[int]:
    """A rank for each job: the costliest first, each to the least loaded rank (the same answer on every rank).
    ranks: how many to deal to (this run's, unless a cost estimate asks about another)."""
    load = [0.0] * (ranks or world())
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += costs[i]
    return out


def broadcast(obj, src: int):
    """OBJ from rank SRC on every rank (pickled; tensors travel on the CPU)."""
    if not active():
        return obj
    payload = None
    if rank() == src:  # torch.save's format: plain pickling of float8 tensors does not load back (torch 2.13)
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = buf.getvalue()
    box = [payload]
    dist.broadcast_object_list(box, src=src)
    return torch.load(io.BytesIO(box[0]), weights_only=False)


def least(n: int) -> int:
    """The smallest N any rank holds (what every rank can afford, when each measured its own memory)."""
    if not active():
        return n
    return -int(Pool.max(torch.tensor([-float(n)], dtype=torch.float64, device=_device())).item())


def agree(ok: bool) -> bool:
    """True when every rank says ok: a rank that fails before the first collective must not leave the others
    waiting in it."""
    if not active():
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


@contextmanager
def peer_failures():
    """A collective that fails because another rank stopped becomes one line (torchrun names that rank); on a
    failure the process group is left before the line is printed, so no transport thread outlives it and aborts
    the process first. A success leaves it too, unless the process ends by exit_process."""
    try:
        try:
            yield
        except RuntimeError as e:
            if not active() or not (isinstance(e, dist.DistError) or "closed by peer" in str(e)
                                    or "Connection reset" in str(e)):
                raise
            raise UserError(f"process {rank()} of {world()}: another process of this run stopped "
                            f"({str(e).splitlines()[0][:200]}); nothing was written to the output folder") from None
    except BaseException:
        _leave(destroy=True)
        raise
    _leave(destroy=not _EXITS_HARD)


def _leave(destroy: bool) -> None:
    if destroy and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if signal.getsignal(signal.SIGTERM) is _stopped:
        # the run is over (its temporary folder already removed): a SIGTERM torchrun sends while this process
        # prints its line and exits must not raise again inside the interpreter's shutdown (a traceback)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def exit_hard_when_launched() -> bool:
    """Called by the `quantkit` command before it runs: under torchrun, True, and the process will end by
    exit_process. CI saw a rank abort with SIGABRT ("terminate called without an active exception", the mark of
    a joinable C++ thread destroyed at exit, as in gloo's or the store's teardown), failing the run; nothing
    after the last barrier needs that teardown, so it is skipped."""
    global _EXITS_HARD
    _EXITS_HARD = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return _EXITS_HARD


def exit_process(code: int) -> None:
    """End this process now, without the interpreter's and the C++ libraries' shutdown (see
    exit_hard_when_launched); what it printed is flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def barrier() -> None:
    if active():
        dist.barrier()
