"""Continuous batching: one worker thread steps every active sequence, requests join and leave between steps.

Each request keeps its own KV caches, so a step runs one forward per active request; a request's tokens do
not depend on what else is running (greedy answers under load equal the answers alone). The bounded
waiting queue makes overload visible (QueueFull -> HTTP 429) instead of letting latency grow without end.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Callable

import torch

from .generate import Sequence
from .metrics import ServerMetrics


class QueueFull(Exception):
    pass


class Request:
    _ids = itertools.count()

    def __init__(self, seq: Sequence, on_event: Callable[[str, object], None]):
        self.id = f"{int(time.time())}-{next(self._ids)}"
        self.seq = seq
        self.on_event = on_event  # ("tokens", [TokenInfo]) per step, then ("done", None) or ("error", msg)
        self.cancelled = False


class Engine:
    def __init__(self, model, tokenizer, *, drafter_factory=None, num_speculative_tokens: int = 4,
                 max_active: int = 64, max_queue: int = 256, spec_max_batch: int = 64, keep_details: int = 256,
                 kv_cache: str = "auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.drafter_factory = drafter_factory
        self.k = num_speculative_tokens
        self.kv_cache = kv_cache
        self.max_active = max_active
        self.max_queue = max_queue
        self.spec_max_batch = spec_max_batch
        self.metrics = ServerMetrics()
        self.details: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.keep_details = keep_details
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="quantkit-decode", daemon=True)
        self._thread.start()

    def new_sequence(self, prompt_ids: list[int], params) -> Sequence:
        drafter = self.drafter_factory() if self.drafter_factory else None
        return Sequence(self.model, prompt_ids, params, drafter=drafter, num_speculative_tokens=self.k,
                        tokenizer=self.tokenizer, kv_cache=self.kv_cache)

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
        self._thread.join(timeout=10)

    def _admit(self) -> None:
        with self._cv:
            while not self._stop and not self._waiting and not self._active:
                self._cv.wait()
            while self._waiting and len(self._active) < self.max_active:
                self._active.append(self._waiting.popleft())
            self.metrics.queued = len(self._waiting)
            self.metrics.active = len(self._active)

    @torch.inference_mode()
    def _loop(self) -> None:
        while True:
            self._admit()
            if self._stop:
                return
            # Each request runs its own forward here, so a draft costs the same at any batch size and kept
            # paying up to 16 concurrent requests (bench/spec_batch.py, docs/benchmarks.md): the limit defaults
            # to the batch size. A batched forward would make verify rows compete and want a lower one.
            speculate = len(self._active) <= self.spec_max_batch
            still = []
            for req in self._active:
                if req.cancelled:
                    continue
                try:
                    toks = req.seq.step(speculate=speculate)
                except Exception as e:  # one bad request must not take the worker down
                    req.on_event("error", f"{type(e).__name__}: {e}")
                    continue
                if toks:
                    req.on_event("tokens", toks)
                if req.seq.done:
                    self._finish(req)
                else:
                    still.append(req)
            self._active = still
            self.metrics.active = len(still)  # else the gauge stays stale until new work arrives

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
