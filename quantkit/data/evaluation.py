"""Perplexity text as fixed-length token windows, from the same sources as calibration.

The text is read in source order (never shuffled) and each window is the tokenizer's prefix specials
(BOS where the model expects one) followed by seq_len - len(prefix) text tokens. By default windows do not
overlap. With a stride below that length, window i starts stride*i text tokens in; a scorer should then
count only each window's last `stride` tokens after the first window, so no token is scored twice.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from .resolve import SELF, resolve_corpus
from .tokens import Encoder, sha256_of

_BATCH = 64


class EvalWindows(list):
    """A plain list of 1-D LongTensors that also carries where they came from (.meta)."""

    meta: dict


def _stream(corpus, enc: Encoder, enough: int | None) -> list[int]:
    rows = corpus.rows
    if corpus.continuous:
        texts = [t for i in range(len(rows)) if (t := enc.render(rows[i]))]
        return enc.encode([corpus.separator.join(texts)])[0] if texts else []
    stream: list[int] = []
    for b in range(0, len(rows), _BATCH):
        texts = [t for i in range(b, min(b + _BATCH, len(rows))) if (t := enc.render(rows[i]))]
        for ids in enc.encode(texts):
            stream += ids + enc.doc_separator
        if enough is not None and len(stream) >= enough:
            break  # a big hub split need not be tokenised past the windows asked for
    return stream


def load_eval_windows(spec: str, tokenizer, seq_len: int = 512, stride: int | None = None,
                      max_windows: int | None = None, text_field: str | None = "text") -> EvalWindows:
    if spec == SELF:
        raise UserError("'self' is for calibration only; evaluate on held-out text: pass --data with a file or "
                        "a named dataset")
    enc = Encoder(tokenizer)
    body = seq_len - len(enc.prefix)
    if body < 2:
        raise UserError(f"--seq-len must be at least {len(enc.prefix) + 2}, got {seq_len}")
    stride = body if stride is None else stride
    if not 1 <= stride <= body:
        raise UserError(f"--stride must be between 1 and {body} (the text tokens per window), got {stride}")
    if max_windows is not None and max_windows < 1:
        raise UserError(f"--max-windows must be at least 1, got {max_windows}")
    corpus = resolve_corpus(spec, text_field, for_eval=True)
    enough = None if max_windows is None else body + stride * (max_windows - 1)
    ids = _stream(corpus, enc, enough)
    starts = list(range(0, len(ids) - body + 1, stride))[:max_windows]
    if not starts:
        src = corpus.source.get("path") or corpus.source.get("name")
        raise UserError(f"too little text in {src}: found {len(ids)} tokens, need {body} for one window of "
                        f"{seq_len}; lower --seq-len or pass more text")
    windows = EvalWindows(torch.tensor(enc.prefix + ids[s:s + body], dtype=torch.long) for s in starts)
    windows.meta = {"spec": spec, "source": corpus.source, "seq_len": seq_len, "stride": stride,
                    "num_windows": len(windows), "text_tokens": len(ids), "sha256": sha256_of(windows),
                    "tokenizer": enc.describe()}
    return windows
