"""Continuous batching: one loop steps every active sequence, requests join and leave between steps.

The loop runs on a worker thread, or on the calling thread (`Engine(..., worker=False)` then `run()`): `quantkit
serve` runs it on the main thread and HTTP beside it, because torch's OpenMP (GNU libgomp) counts the main thread
among its threads, so a worker thread's team of as many threads as cores oversubscribes them, and libgomp then
cuts its spin-wait to a hundred turns: every parallel region wakes its threads through the kernel. Batch-1 decode
of SmolLM2 W4 ran 1.8x slower on a worker thread than on the main thread (0.72 against 1.39 s for 64 tokens,
2-core AMD EPYC; bench serve_split).

A step runs the new requests' prefills (those of similar length share a forward: prefill_groups), then one batched
forward for every request past its prefill (llama_step.py over the shared slot cache; models it does not cover
fall back to one forward per request).
Rows do not see each other, so a request's tokens do not depend on what else is running, up to float
summation order: greedy answers under load equal the answers alone (tests/test_server.py). The bounded
waiting queue makes overload visible (QueueFull -> HTTP 429) instead of letting latency grow without end.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Callable

import torch

from . import sequence as decode_state
from .forward import forward_many
from .kv_cache import crop_to
from .sequence import Sequence
from .metrics import ServerMetrics


PREFILL_TOKENS = 2048  # most prompt positions (padding included) one shared prefill forward holds
PREFILL_PAD = 1.25  # most padded positions per prompt token in a shared prefill


class QueueFull(Exception):
    pass


def prefill_groups(lengths: list[int], max_tokens: int = PREFILL_TOKENS,
                   max_pad: float = PREFILL_PAD) -> list[list[int]]:
    """Indices of prompts, grouped into shared prefill forwards. Rows are padded to the group's longest prompt,
    so a group keeps its padding within max_pad of its real tokens and its padded size within max_tokens (a
    longer prompt goes alone). Sorting by length keeps similar prompts together."""
    groups: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]  # ascending: the newest member is the group's longest
        padded = (len(cur) + 1) * n
        if cur and (padded > max_pad * (real + n) or padded > max_tokens):
            groups.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += n
    if cur:
        groups.append(cur)
    return groups


class Request:
    _ids = itertools.count()

    def __init__(self, seq: Sequence, on_event: Callable[[str, object], None]):
        self.id = f"{int(time.time())}-{next(self._ids)}"
        self.seq = seq
        self.on_event = on_event  # ("tokens", [TokenInfo]) per step, then ("done", None) or ("error", msg)
        self.cancelled = False  # set by any thread when the client goes away; the worker drops it next step
        self.failed = False


def default_spec_max_batch(model) -> int:
    """Up to how many active requests speculation pays, by how the model's products run (bench/spec_batch.py,
    prompt lookup on code edits, one CPU thread, docs/benchmarks.md). Float models in oneDNN's float32 layout: up
    to about 8, since its products cost nearly the same for 1 to 5 rows. Float16-held weights (FBGEMM, a float16
    checkpoint): up to 3 (1.28x at 2, 1.08x at 3, 0.97-1.02x at 4), since one row reads half the bytes while each
    extra row costs about as much as in float32. int4/int8 checkpoints on a CPU: up to 2 (0.89-0.96x from 3),
    where torch's packed int4 products cost more per extra row."""
    from ..linear.half_weight import HalfWeightLinear
    from ..linear.quant import QuantLinear
    from ..linear.relayout import layer_layouts

    if any(isinstance(m, QuantLinear) and m.weight_packed.device.type == "cpu" for m in model.modules()):
        return 2
    return 3 if HalfWeightLinear in layer_layouts(model) else 8


class Engine:
    def __init__(self, model, tokenizer, *, drafter_factory=None, num_speculative_tokens: int = 4,
                 max_active: int = 64, max_queue: int = 256, spec_max_batch: int | None = None,
                 keep_details: int = 256, kv_cache: str = "auto", cost_aware: bool = True, worker: bool = True):
        """worker=False: no thread is started; the caller runs `run()` itself (module docstring says why)."""
        self.model = model
        self.tokenizer = tokenizer
        self.drafter_factory = drafter_factory
        self.k = num_speculative_tokens
        self.kv_cache = kv_cache
        self.cost_aware = cost_aware  # Sequence(cost_aware=...): the governor also times steps
        self.max_active = max_active
        self.max_queue = max_queue
        self.spec_max_batch = default_spec_max_batch(model) if spec_max_batch is None else spec_max_batch
        self.metrics = ServerMetrics()
        self.details: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.keep_details = keep_details
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self.run, name="quantkit-decode", daemon=True) if worker else None
        if self._thread is not None:
            self._thread.start()

    def new_sequence(self, prompt_ids: list[int], params, *, prompt_logprobs: bool = False) -> Sequence:
        """prompt_logprobs: record the prompt tokens' logprobs too (processed.ProcessedSequence)."""
        if params.adjusts_logits or params.logprobs is not None or prompt_logprobs:
            from .processed import ProcessedSequence

            # without a drafter: these follow each single step's distribution (processed.py says why)
            return ProcessedSequence(self.model, prompt_ids, params, prompt_logprobs=prompt_logprobs,
                                     tokenizer=self.tokenizer, kv_cache=self.kv_cache, cost_aware=self.cost_aware)
        drafter = self.drafter_factory() if self.drafter_factory else None
        return Sequence(self.model, prompt_ids, params, drafter=drafter, num_speculative_tokens=self.k,
                        tokenizer=self.tokenizer, kv_cache=self.kv_cache, cost_aware=self.cost_aware)

    def submit(self, seq: Sequence, on_event) -> Request:
        req = Request(seq, on_event)
        with self._cv:
            if len(self._waiting) >= self.max_queue:
                self.metrics.rejected += 1
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are already waiting")
            self._waiting.append(req)
            self.metrics.queued = len(self._waiting)
            self._cv.notify()
        return req

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _admit(self) -> None:
        with self._cv:
            while not self._stop and not self._waiting and not self._active:
                self._cv.wait()
            while self._waiting and len(self._active) < self.max_active:
                req = self._waiting.popleft()
                if req.cancelled:  # gone while it waited: it never takes a slot
                    self._drop(req)
                else:
                    req.seq.metrics.t_admitted = time.perf_counter()
                    self._active.append(req)
            self.metrics.queued = len(self._waiting)
            self.metrics.active = len(self._active)

    @torch.inference_mode()
    def run(self) -> None:
        """Step the requests until close(): the worker thread's whole life, or the caller's (worker=False)."""
        while True:
            self._admit()
            if self._stop:
                return
            # With one batched forward, a drafting request's k+1 verify rows pad every other row to k+1 as well;
            # past spec_max_batch requests that costs more than drafts save (default_spec_max_batch)
            speculate = len(self._active) <= self.spec_max_batch
            live = []
            for req in self._active:
                if req.cancelled:
                    self._drop(req)
                else:
                    live.append(req)
            # Prefills never share a forward with decode rows: padding one-token rows to a prompt's length
            # would waste the batch. Prompts of similar length share one (16 prompts of 128 tokens: one call
            # per product instead of 16). A sequence with its own step (prompt logprobs) prefills alone.
            batch, fresh = [], []
            for req in live:
                if req.seq.prefilled:
                    batch.append(req)
                elif type(req.seq).step is Sequence.step:
                    fresh.append(req)
                else:
                    self._deliver(req, lambda r=req: r.seq.step(speculate=speculate))
            for group in prefill_groups([r.seq.ids.shape[0] for r in fresh]):
                self._forward([fresh[i] for i in group], speculate, last_only=True)
            self._forward(batch, speculate, last_only=False)
            self._active = [r for r in live if not r.seq.done and not r.failed]
            self.metrics.active = len(self._active)  # else the gauge stays stale until new work arrives

    def _forward(self, batch: list[Request], speculate: bool, last_only: bool) -> None:
        """One forward for these requests: a decode step for every request past its prefill (requests join and
        leave between these steps), or a group of prefills (last_only: only each prompt's last row is needed)."""
        fed = []
        for req in batch:
            try:
                fed.append((req, req.seq.cache.get_seq_length(), req.seq.next_feed(speculate)))
            except Exception as e:  # a drafter failing for one request must not take the others down
                self._fail(req, e)
        if not fed:
            return
        t = decode_state.clock()
        try:
            logits = forward_many(self.model, [(r.seq.cache, ids) for r, _, ids in fed], last_only)
            forward_s = decode_state.clock() - t
        except Exception:
            # find who it was: each request alone (a request whose forward ran before the failure has its
            # cache one step ahead, so roll every cache back to where this step began)
            logits, forward_s = [], None
            for req, before, ids in fed:
                crop_to(req.seq.cache, before)
                try:
                    logits.append(forward_many(self.model, [(req.seq.cache, ids)], last_only)[0])
                except Exception as e:
                    self._fail(req, e)
                    logits.append(None)
        for (req, _, _), lg in zip(fed, logits):
            if lg is not None:
                self._deliver(req, lambda r=req, x=lg: r.seq.finish(x, forward_s))

    def _deliver(self, req: Request, run) -> None:
        try:
            toks = run()
        except Exception as e:  # one bad request must not take the worker down
            self._fail(req, e)
            return
        if toks:
            req.on_event("tokens", toks)
        if req.seq.done:
            self._finish(req)

    def _drop(self, req: Request) -> None:
        """A request whose client went away (Request.cancelled): free its slot, count it, say nothing more."""
        req.seq.release()
        self.metrics.count("cancelled")

    def _fail(self, req: Request, e: Exception) -> None:
        req.failed = True
        req.seq.release()
        self.metrics.count("failed")
        req.on_event("error", f"{type(e).__name__}: {e}")

    def _finish(self, req: Request) -> None:
        seq = req.seq
        self.metrics.finish(seq.metrics)
        self.details[req.id] = {
            "id": req.id, "finish_reason": seq.finish_reason, "metrics": seq.metrics.to_dict(),
            "tokens": [{"id": t.id, "text": t.text, "logprob": t.logprob, "drafted": t.drafted} for t in seq.tokens],
        }
        while len(self.details) > self.keep_details:
            self.details.popitem(last=False)
        req.on_event("done", None)
