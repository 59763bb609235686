"""Which CPU path a Linear runs, chosen by timing the candidates on this machine rather than by CPU vendor.

Which product is fastest for a batch-1 decode step depends on the instructions torch may use here: torch's int4
op is fast where oneDNN/ATen have AMX or AVX-512 kernels and can trail a float16 product elsewhere, and the
instruction set can be capped (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) below what the CPU has. So at load the
runtime hands `Chooser.pick` each distinct Linear kind and shape with its candidate paths (linear/path_candidates.py).
A candidate must first equal the float64 reference within its tolerance on this machine (a path that gives wrong
numbers is never chosen, however fast); the correct ones are timed on one row and the fastest is kept.
Choices are cached once per machine in the user's cache folder, under a key naming everything that changes which
path wins (CPU model, ISA flags, torch version and capability, the env caps, torch's thread count); an unreadable
cache file is ignored and rewritten.
QUANTKIT_KERNEL_CHOICE=preferred skips the timing: the first candidate (the order each kind lists them in) is
taken, as before choices were measured; the test suite runs this way, so a test's layout never depends on how
busy the machine is.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..cache_dir import cache_root
from ..errors import UserError

log = logging.getLogger("quantkit.kernels")

MODE_ENV = "QUANTKIT_KERNEL_CHOICE"
MODES = ("measure", "preferred")
CACHE_FILE = "kernel_choice.json"
TIE_MARGIN = 0.05  # times this close to the fastest count as equal (one row's timing noise on a quiet machine)
CACHE_VERSION = 3  # 2 timed one row only; 1 timed each candidate in one go: a burst of other work could decide a choice, then cached
# Candidates are timed in this many interleaved rounds and each keeps its fastest: a burst of other work on a
# shared machine then slows one round of every candidate instead of all of one candidate's calls (one such
# burst, cached, halved W4 decode: cpu-int4pack timed at 52 ms for a 29 us product)
TIMING_ROUNDS = 3
# Where a kind is also timed on a batch (Chooser.pick's batch_rows), a candidate more than this many times the
# fastest there is refused even when it wins at one row: on an AVX-512 BF16 CPU quantkit's W4A8 op ties torch's
# int4 op at one row and takes 2.1x its time at 16 (each row redoes the byte products), which took 16 concurrent
# requests from 267 to 195 tok/s (2-core AMD EPYC, 2026-12-05); capped to AVX2 the two tie at 16 rows.
BATCH_SLACK = 1.5
# The env caps that change which kernels torch runs (ATen's vectorised code; oneDNN's ISA, old and new name)
ENV_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# The CPU flags the candidate kernels branch on (x86 and Arm): anything else leaves the choice alone
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")


@dataclass(frozen=True)
class Candidate:
    """One way to compute a Linear. build() returns fn(x) -> y, made only when the candidate is checked or
    timed (building may repack a weight). tolerance: the largest max|y - truth| / max|truth| accepted."""
    name: str
    build: Callable[[], Callable[[torch.Tensor], torch.Tensor]]
    tolerance: float


@dataclass
class Choice:
    key: str
    path: str
    times_us: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # path -> why it could not be chosen
    source: str = "measured"  # measured | cached | preferred
    modules: list[str] = field(default_factory=list)

    def why(self) -> str:
        if self.source == "preferred":
            return f"first candidate ({MODE_ENV}=preferred: neither checked nor timed)"
        times = ", ".join(f"{p} {t:.1f} us" for p, t in sorted(self.times_us.items(), key=lambda kv: kv[1]))
        wrong = "".join(f"; {p} refused: {r}" for p, r in self.rejected.items())
        return f"fastest at 1 row, ties within {TIE_MARGIN:.0%} to the earlier ({times}){wrong}" + (" [cached]" if self.source == "cached" else "")


def mode() -> str:
    value = os.environ.get(MODE_ENV, "").strip().lower() or "measure"
    if value not in MODES:
        raise UserError(f"{MODE_ENV}={value!r} is not a mode; use one of {', '.join(MODES)} or unset it")
    return value


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        info.setdefault(k.strip(), v.strip())  # the first processor's entries
    return info


def machine() -> dict:
    """Everything that decides which candidate is fastest here, as the cache keys it."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "isa": sorted(flags.intersection(ISA_FLAGS)), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "caps": {k: os.environ[k] for k in ENV_CAPS if k in os.environ}, "threads": torch.get_num_threads()}


def machine_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def cache_path() -> Path:
    return cache_root() / CACHE_FILE


class Cache:
    """The cache file's choices for this machine. A file that cannot be read as this version's JSON is
    treated as empty (logged) and replaced on save: a stale cache costs a measurement, never a crash."""

    def __init__(self, path: Path, fields: dict):
        self.path, self.fields, self.key = path, fields, machine_key(fields)
        self.entries = self._read()
        self.dirty = False

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            entries = data["machines"][self.key]["choices"] if data.get("version") == CACHE_VERSION else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if not isinstance(e, KeyError):
                log.warning("kernel choice cache %s unreadable (%s); measuring again and rewriting it", self.path, e)
            return {}
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        return entry if isinstance(entry, dict) and isinstance(entry.get("path"), str) else None

    def put(self, key: str, choice: Choice) -> None:
        self.entries[key] = {"path": choice.path, "times_us": choice.times_us, "rejected": choice.rejected}
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(
                    data.get("machines"), dict):
                raise ValueError
        except (OSError, ValueError):
            data = {"version": CACHE_VERSION, "machines": {}}
        data["machines"][self.key] = {"machine": self.fields, "choices": self.entries}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)  # whole or not at all: a reader never sees half a file
            self.dirty = False
        except OSError as e:  # a read-only home must not stop a model loading
            log.warning("kernel choice cache %s not written: %s", self.path, e)


def relative_error(y: torch.Tensor, truth: torch.Tensor) -> float:
    """max|y - truth| / max|truth|: one number a kernel's documented tolerance bounds (inf for a wrong shape
    or a non-finite output)."""
    if y.shape != truth.shape:
        return float("inf")
    err = float((y.double() - truth).abs().max())
    return err / max(float(truth.abs().max()), 1e-30) if err == err else float("inf")


def best_us(fn: Callable[[], object], *, warmup: int = 3, reps: int = 25, budget_s: float = 0.01) -> float:
    """Microseconds of the fastest of up to `reps` timed calls after `warmup`, stopping once `budget_s` is
    spent (a slow candidate costs the load little). The fastest, not the mean: on a shared machine the slower
    calls measure the other jobs."""
    for _ in range(warmup):
        fn()
    best, spent = float("inf"), 0.0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
        if spent > budget_s:
            break
    return best * 1e6


Timer = Callable[[str, Callable[[], object]], float]


class Chooser:
    """One model load's choices: each distinct key is decided once (cache, else check and time), and every
    module given that key is recorded under it for --explain."""

    def __init__(self, cache: Cache | None = None, timer: Timer | None = None, how: str | None = None):
        self.how = how or mode()
        self.cache = cache  # the user's cache file, read when the first key is decided by measuring
        self.timer = timer or (lambda name, fn: best_us(fn))
        self.choices: dict[str, Choice] = {}

    def pick(self, key: str, module_name: str, candidates: list[Candidate], inputs: list[torch.Tensor],
             truth: Callable[[torch.Tensor], torch.Tensor], batch_rows: int | None = None) -> Choice:
        """The path for `key`. inputs: activations to check on (the first, one row, is also the one timed);
        truth(x): the float64 reference output. Candidates in order of preference. batch_rows: also time each
        correct candidate on that many rows, and refuse one more than BATCH_SLACK times the fastest there (a
        path that wins one sequence's decode must not sink a batch of them, or a prefill)."""
        choice = self.choices.get(key)
        if choice is None:
            choice = self._decide(key, candidates, inputs, truth, batch_rows)
            self.choices[key] = choice
        choice.modules.append(module_name)
        return choice

    def _decide(self, key, candidates, inputs, truth, batch_rows=None) -> Choice:
        if self.how == "preferred":  # the layouts chosen before measuring, each already probed by its module
            return Choice(key, candidates[0].name, source="preferred")
        if self.cache is None:
            self.cache = Cache(cache_path(), machine())
        truths = [truth(x) for x in inputs]
        cached = self.cache.get(key)
        by_name = {c.name: c for c in candidates}
        # a choice holds for the candidates it was measured among: one made while a path was unavailable (float16
        # weights turned off, say) must not keep that path from being timed once it is offered
        among = set(cached.get("times_us") or {}) | set(cached.get("rejected") or {}) if cached else set()
        if cached and among == set(by_name) and self._wrong(by_name[cached["path"]], inputs, truths) is None:
            return Choice(key, cached["path"], dict(cached.get("times_us") or {}), dict(cached.get("rejected") or {}),
                          "cached")
        rejected, fns = {}, {}
        for c in candidates:
            why = self._wrong(c, inputs, truths)
            if why is not None:
                rejected[c.name] = why
                continue
            fns[c.name] = c.build()
        times = self._times(fns, inputs[0])
        if batch_rows and len(fns) > 1:
            batch = self._times(fns, inputs[0].expand(batch_rows, -1).contiguous())
            fastest = min(batch.values())
            for name, t in batch.items():
                if t > BATCH_SLACK * fastest:
                    rejected[name] = f"{t / fastest:.1f}x the fastest at {batch_rows} rows"
                    del times[name]
        if not times:
            raise RuntimeError(f"no candidate kernel gives correct results for {key}: {rejected}")
        fastest = min(times.values())
        # within timing noise of the fastest, the earlier (preferred) candidate: it is what neighbouring
        # modules of the same kind get, and like layouts fuse (linear/fused.py)
        path = next(p for p in times if times[p] <= fastest * (1 + TIE_MARGIN))
        choice = Choice(key, path, times, rejected)
        self.cache.put(key, choice)
        return choice

    def _times(self, fns: dict, x: torch.Tensor) -> dict[str, float]:
        """Each candidate's best time on x, over TIMING_ROUNDS interleaved rounds."""
        times: dict[str, float] = {}
        for _ in range(TIMING_ROUNDS):
            for name, fn in fns.items():
                t = self.timer(name, lambda fn=fn: fn(x))
                times[name] = min(times.get(name, float("inf")), t)
        return times

    @staticmethod
    def _wrong(c: Candidate, inputs, truths) -> str | None:
        """Why candidate c may not be chosen (an error, or an output off the reference), or None."""
        try:
            fn = c.build()
            with torch.inference_mode():
                errs = [relative_error(fn(x), t) for x, t in zip(inputs, truths)]
        except (RuntimeError, NotImplementedError, ValueError) as e:
            return f"failed: {str(e).splitlines()[0][:120]}"
        worst = max(errs)
        return None if worst <= c.tolerance else f"relative error {worst:.2g} > tolerance {c.tolerance:.2g}"

    def save(self) -> None:
        if self.cache is not None:
            self.cache.save()


def describe(choices: list[Choice]) -> list[str]:
    """One line per decided key: the path, which modules run it and why."""
    lines = []
    for c in choices:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in c.modules})
        lines.append(f"{c.key} [{', '.join(kinds)}; {len(c.modules)} modules]: {c.path} - {c.why()}")
    return lines


def header(fields: dict | None = None) -> str:
    """The machine line printed above the choices: what they were measured on."""
    f = fields or machine()
    caps = ", ".join(f"{k}={v}" for k, v in f["caps"].items()) or "none"
    return (f"kernel paths on {f['cpu']} (ISA: {' '.join(f['isa']) or '-'}; torch {f['torch']} capability "
            f"{f['capability']}; caps: {caps}; {f['threads']} threads)")
