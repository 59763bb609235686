"""A preallocated KV cache shared by every sequence of one model: one row ("slot") per sequence.

transformers' DynamicCache is one object per sequence that grows by concatenation and crops by copying, and
sequences at different lengths cannot share a forward through it. Here each layer's keys and values live in
one tensor [slots, kv_heads, capacity, head_dim]; a sequence owns a slot and a length. A forward writes its new
keys at each row's own positions, a rejected speculation rolls back by lowering the length, and a batched step
attends over its rows with a mask that hides every position past a row's length (llama_step.py).

Live slots stay packed at the front (a released slot takes the last live row), so a step over every live
sequence reads a plain slice. Every slot has the capacity of the longest sequence (a limitation: one long
request makes every row long while it lives); the storage shrinks again once it is four times what the live
sequences need. Storage grows by doubling (slots and positions), so the copies it costs are amortised. Slots
are assigned and compacted only under `lock` by the forwarding code; `release()` (or dropping the handle) may
happen on any thread and takes effect at the next forward.
"""
from __future__ import annotations

import threading
import weakref

import torch


class SlotHandle:
    """One sequence's place in a SlotPool. Quacks like the part of a transformers Cache the runtime uses."""

    def __init__(self, pool: "SlotPool"):
        self.pool = pool
        self.slot = -1  # assigned at the first forward
        self.length = 0
        self.released = False

    def get_seq_length(self) -> int:
        return self.length

    def crop_to(self, length: int) -> None:
        self.length = min(self.length, max(0, length))

    def release(self) -> None:
        """Give the slot back (a handle that is simply dropped gives it back too: the pool holds weak refs)."""
        self.released = True


class SlotPool:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, max_len: int):
        self.n_layers, self.kv_heads, self.head_dim, self.max_len = n_layers, kv_heads, head_dim, max_len
        # per layer [slots, kv_heads, capacity, head_dim], made at the first write. One tensor per layer rather
        # than one for all: a compiled step that writes into a slice of one big input copied all of it (22 ms).
        # Heads before positions: a step's slice of the rows is then [B, heads, positions, d] with every
        # (row, head) a plain [positions, d] matrix, which attention's batched products read in place; with
        # positions first each layer copied its keys and values into that shape (10 ms of a 55 ms 16-row step).
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.live: list[weakref.ref] = []  # live[i]() has slot i (or is dead / released, until the next sweep)
        self.lock = threading.RLock()

    def new(self) -> SlotHandle:
        return SlotHandle(self)

    @property
    def slots(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def n_live(self) -> int:
        with self.lock:
            self._sweep()
            return len(self.live)

    def prepare(self, handles: list[SlotHandle], need_len: int, dtype: torch.dtype, device) -> None:
        """Free the slots of released or dropped handles, give new handles a slot, and make room for `need_len`
        positions in every row. Call with `lock` held."""
        self._sweep()
        if not self.live:  # nothing cached: start again small rather than keep what one long request needed
            self.k, self.v = [], []
        for h in handles:
            if h.released:
                raise RuntimeError("this sequence's KV cache was released; start a new sequence")
            if h.slot < 0:
                h.slot = len(self.live)
                self.live.append(weakref.ref(h))
        self._grow(len(self.live), need_len, dtype, device)

    @torch.inference_mode()  # the storage is made under inference mode by the forward, and is moved here
    def _sweep(self) -> None:
        i = 0
        while i < len(self.live):
            h = self.live[i]()
            if h is not None and not h.released:
                i += 1
                continue
            if h is not None:
                h.slot = -1
            last_ref = self.live.pop()
            if i < len(self.live):  # the last row moves into the hole: one row copied, not every later one
                self.live[i] = last_ref
                last = last_ref()
                if last is not None and not last.released:
                    for t in self.k + self.v:
                        t[i, :, :last.length].copy_(t[last.slot, :, :last.length])
                    last.slot = i
                # index i is checked again: what moved in may itself be gone

    def _grow(self, rows: int, length: int, dtype: torch.dtype, device) -> None:
        """Fit the storage to `rows` live slots of `length` positions: grow by doubling, and shrink once it is
        four times what is needed (after a long or crowded moment has passed), so neither direction churns."""
        longest = max([length] + [h.length for h in (r() for r in self.live) if h is not None])
        slots, cap = 4, 64
        while slots < rows:
            slots *= 2
        # always one position more than the longest row: a step reading every stored position would slice the
        # whole length, and a compiled step specialised on "slice shorter than storage" recompiled (~12 s on
        # SmolLM2) the first time a sequence filled its storage exactly
        while cap <= longest:
            cap *= 2
        cap = max(longest + 1, min(cap, self.max_len))  # the context limit, plus a verify's padding past it
        if self.k and self.k[0].dtype == dtype:
            fit_s, fit_c = self.slots >= rows, self.capacity > longest
            over_s, over_c = self.slots >= 4 * slots, self.capacity >= 4 * cap
            if fit_s and fit_c:
                if not (over_s or over_c):
                    return
                # shrink only the dimension that is oversized
                slots, cap = (slots if over_s else self.slots), (cap if over_c else self.capacity)
            else:  # grow what does not fit, keep what does
                slots, cap = (max(slots, self.slots) if fit_s else slots), (max(cap, self.capacity) if fit_c else cap)
        shape = (slots, self.kv_heads, cap, self.head_dim)
        old = self.k, self.v
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
        for t in self.k + self.v:
            # a compiled step would otherwise specialise on the first sizes and recompile (~40 s) at each resize
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)
        if old[0]:
            s, c = min(old[0][0].shape[0], slots), min(old[0][0].shape[2], cap)
            for new, prev in zip(self.k + self.v, old[0] + old[1]):
                new[:s, :, :c].copy_(prev[:s, :, :c].to(dtype))
