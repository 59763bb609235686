"""Drafting with a trained EAGLE head: a chain of k tokens from the target's own features.

The features are the target's final-norm hidden states, read by a forward hook on its final norm as the
runtime's own forwards compute them (the prefill, each verify, each plain step), so drafting costs no target
work: only the one-layer head and the shared output head per drafted token. Rows a verify computed for drafts
the target refused are dropped at rollback. Whatever the head proposes, the runtime's exact acceptance rule
decides, so the output is the target's; a feature the hook attributes to the wrong position (several
sequences sharing one batched forward in the server) only costs acceptance.

A chain rather than a tree: the runtime verifies one row per drafted token with a causal mask, and on a CPU
each verify row costs a share of a step (docs/drafts.md), so the rows of a tree's other branches would be paid
on every step for the rare token they rescue.
"""
from __future__ import annotations

import weakref

import torch

from ..runtime import sampling
from .eagle_head import EagleHead, HeadCache


class EagleDrafter:
    deterministic = False

    def __init__(self, target, head: EagleHead, prompt_features: bool = True):
        """prompt_features: compute the prompt's features with one extra target forward at the first draft (the
        runtime's prefill normalises only its last row), so the head attends over the prompt as in training."""
        self.target, self.head = target, head
        self.prompt_features = prompt_features
        self.embed = target.get_input_embeddings()
        self.out_head = target.get_output_embeddings()
        self.kv = HeadCache()
        self.next_pos = 1  # the first head position not fed with a true feature (position 0 has no f_{-1})
        self.feat_start = 0  # position of self.feats' first row
        self.feats = None  # target features not yet consumed, contiguous from feat_start
        self._verify_from = None  # position of the first row of the verify forward after a propose
        self._tap: list[torch.Tensor] = []
        tap = self._tap  # the hook must not hold the drafter, so that dropping it removes the hook
        handle = target.model.norm.register_forward_hook(
            lambda mod, args, out: tap.append(out.detach().reshape(-1, out.shape[-1])))
        weakref.finalize(self, handle.remove)

    def _take(self, end: int | None = None, start: int | None = None) -> None:
        """Move the tapped rows into self.feats, placed to end at position `end` or to start at `start`."""
        if not self._tap:
            return
        rows = torch.cat(self._tap).to(self.head.fc.weight.dtype)
        self._tap.clear()
        if start is None:
            start = end - rows.shape[0] + 1
        if self.feats is not None and start == self.feat_start + self.feats.shape[0]:
            rows, start = torch.cat([self.feats, rows]), self.feat_start
        self.feats, self.feat_start = rows, start

    def rollback(self, valid_len: int) -> None:
        """After a verify: its rows start at the position fed first; those at valid_len and after were drafts the
        target refused."""
        if self._verify_from is not None:
            self._take(start=self._verify_from)
            self._verify_from = None
            if self.feats is not None:
                self.feats = self.feats[: max(0, valid_len - self.feat_start)]
        self.kv.keep_before(self.next_pos)

    def _feed(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Feed the head every position up to the last one (L-1) whose input feature is known; returns the
        predicted feature at L-1, or None when the feature before it is missing."""
        L = ids.shape[0]
        self._take(end=L - 2)
        if self.prompt_features and self.next_pos == 1 and self.feats is not None and self.feat_start > 0:
            with torch.inference_mode():
                hidden = self.target.model(input_ids=ids[None, : L - 1]).last_hidden_state[0]
            self._tap.clear()  # that forward ran the hooked norm too
            self.feats, self.feat_start = hidden.to(self.head.fc.weight.dtype), 0
        self.kv.keep_before(self.next_pos)
        if self.feats is None:
            return None
        first = max(self.next_pos, self.feat_start + 1)
        last = min(L - 1, self.feat_start + self.feats.shape[0])
        out = None
        if first <= last:
            pos = torch.arange(first, last + 1)
            f = self.feats[first - 1 - self.feat_start: last - self.feat_start]
            out = self.head(self._embed(ids[first: last + 1]), f[None], pos[None], self.kv)[0, -1]
            self.next_pos = last + 1
        keep = max(0, L - 1 - self.feat_start)  # f_{L-1} onward comes from the next forward
        self.feats, self.feat_start = self.feats[keep:], self.feat_start + keep
        return out if self.next_pos == L and last == L - 1 else None

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids.to(self.embed.weight.device))[None].to(self.head.fc.weight.dtype)

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        if self.head.out_w is not None:  # a reduced draft vocabulary: N gathered rows, zero mass elsewhere
            return self.head.draft_logits(g)
        return self.out_head(g[None].to(self.embed.weight.dtype))[0].float()

    def propose(self, ids: torch.Tensor, k: int, params, generator) -> tuple[list[int], torch.Tensor | None]:
        L = ids.shape[0]
        g = self._feed(ids)
        if g is None:
            return [], None
        draft, qs = [], []
        for i in range(k):
            logits = self._logits(g)
            t, q = sampling.draft_token(logits, params, generator)
            qs += [] if q is None else [q]
            draft.append(t)
            if i + 1 < k:  # the chain goes on from the head's own predicted feature
                g = self.head(self._embed(torch.tensor([t])), g.view(1, 1, -1), torch.tensor([[L + i]]),
                              self.kv)[0, -1]
        self._verify_from = L - 1
        return draft, (torch.stack(qs) if qs else None)
