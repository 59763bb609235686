"""Calibration sets: num_samples token sequences from a spec, cut by chunking or by document."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from .corpus import Corpus
from .resolve import SELF, resolve_corpus
from .selfgen import DEFAULTS as SELF_DEFAULTS
from .selfgen import sample_from_model
from .tokens import Encoder, sha256_of

CUTS = ("chunk", "document")
_BATCH = 64  # rows tokenised per call: big enough for the fast tokenizer's batching, small enough to stop early
CHARS_PER_TOKEN_MAX = 32  # byte-level BPE vocabularies average 3-5 characters a token on prose and code
# a continuous text up to 64 characters per needed token (16x the tokens at ~4 a token) is tokenised whole, so
# chunks are picked among all of its tokens; past that, from windows (`_windows`), so time does not grow with it
WHOLE_TEXT_CHARS_PER_TOKEN = 64


@dataclass
class CalibrationSet:
    samples: list[torch.Tensor]  # 1-D int64 token ids; all seq_len long when cut == "chunk"
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.samples)

    def stacked(self) -> torch.Tensor:
        """[num_samples, seq_len]; only for equal-length samples (chunk cut, or self-generated)."""
        if len({s.numel() for s in self.samples}) != 1:
            raise ValueError("samples differ in length (document cut); iterate over .samples instead")
        return torch.stack(self.samples)


def _too_little(corpus: Corpus, found: int, need: int, what: str, fix: str) -> UserError:
    src = corpus.source.get("path") or corpus.source.get("name") or "the data"
    return UserError(f"too little text in {src}: found {found} tokens, need {need} ({what}); {fix}")


def _shuffled(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def _rendered_batches(corpus: Corpus, enc: Encoder, order):
    """Yields (row, text) in `order`, rendering in batches; empty rows are skipped."""
    for b in range(0, len(order), _BATCH):
        rows = [corpus.rows[i] for i in order[b:b + _BATCH]]
        yield [(r, t) for r in rows if (t := enc.render(r))]


def _capped(text: str, tokens: int) -> str:
    """TEXT cut where it can no longer add to its first TOKENS tokens, so a 50 MB one-line document costs what
    its used part costs. No vocabulary averages CHARS_PER_TOKEN_MAX characters a token, so the cut text still
    holds TOKENS tokens whenever the whole did."""
    return text[:tokens * CHARS_PER_TOKEN_MAX]


def _windows(text: str, enc: Encoder, body: int, num_samples: int, seed: int) -> list[list[int]] | None:
    """num_samples chunks of BODY tokens from windows at random places of a text too long to tokenise whole
    (the seed still picks from all of it); None when a window held too few tokens."""
    width = (body + 1) * CHARS_PER_TOKEN_MAX
    if len(text) <= width:
        return None
    starts = sorted(random.Random(seed).sample(range(len(text) - width), num_samples))
    ids = [w[1:body + 1] for w in enc.encode([text[s:s + width] for s in starts])]  # w[0] may be half a word
    return ids if all(len(w) == body for w in ids) else None


def chunk_continuous(corpus: Corpus, enc: Encoder, body: int, num_samples: int, seed: int) -> list[list[int]]:
    texts = [t for batch in _rendered_batches(corpus, enc, range(len(corpus.rows))) for _, t in batch]
    text = corpus.separator.join(texts)
    if len(text) > num_samples * body * WHOLE_TEXT_CHARS_PER_TOKEN:  # tokenising all of it would take minutes
        picked = _windows(text, enc, body, num_samples, seed)
        if picked is not None:
            return picked
    ids = enc.encode([text])[0] if texts else []
    n_chunks = len(ids) // body
    if n_chunks < num_samples:
        raise _too_little(corpus, len(ids), num_samples * body, f"{num_samples} samples of {body} text tokens",
                          "lower --num-samples or --seq-len, or pass more text")
    # Chunks come from the whole text, not just its start, so the seed picks which parts are used.
    picks = sorted(random.Random(seed).sample(range(n_chunks), num_samples))
    return [ids[k * body:(k + 1) * body] for k in picks]


def chunk_documents(corpus: Corpus, enc: Encoder, body: int, num_samples: int, seed: int) -> list[list[int]]:
    need = num_samples * body
    stream: list[int] = []
    for batch in _rendered_batches(corpus, enc, _shuffled(len(corpus.rows), seed)):
        for ids in enc.encode([_capped(t, need) for _, t in batch]):
            stream += ids + enc.doc_separator
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise _too_little(corpus, len(stream), need, f"{num_samples} samples of {body} text tokens",
                          "lower --num-samples or --seq-len, or pass more text")
    return [stream[k * body:(k + 1) * body] for k in range(num_samples)]


def by_document(corpus: Corpus, enc: Encoder, seq_len: int, num_samples: int, min_tokens: int,
                seed: int) -> list[list[int]]:
    kept: list[list[int]] = []
    found = 0
    for batch in _rendered_batches(corpus, enc, _shuffled(len(corpus.rows), seed)):
        for (row, _), ids in zip(batch, enc.encode([_capped(t, seq_len) for _, t in batch])):
            ids = ids if isinstance(row, list) else enc.prefix + ids
            if len(ids) >= min_tokens:
                kept.append(ids[:seq_len])
                found += len(kept[-1])
            if len(kept) == num_samples:
                return kept
    raise _too_little(corpus, found, num_samples * min_tokens,
                      f"{num_samples} documents of at least {min_tokens} tokens; only {len(kept)} qualify",
                      "lower --num-samples or --min-tokens, use --calib-cut chunk, or pass more text")


def _check_args(tokenizer, num_samples, seq_len, cut, min_tokens, prefix_len):
    if tokenizer is None:
        raise UserError("calibration needs the model's tokenizer")
    if cut not in CUTS:
        raise UserError(f"unknown calibration cut '{cut}'; choose one of: {', '.join(CUTS)}")
    if num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {num_samples}")
    if seq_len <= prefix_len + 1:
        raise UserError(f"--seq-len must be at least {prefix_len + 2}, got {seq_len}")
    if cut == "document" and not 1 <= min_tokens <= seq_len:
        raise UserError(f"--min-tokens must be between 1 and --seq-len ({seq_len}), got {min_tokens}")


def load_calibration(spec: str | None = SELF, tokenizer=None, num_samples: int = 128, seq_len: int = 512,
                     seed: int = 0, cut: str = "chunk", text_field: str | None = "text", min_tokens: int = 32,
                     model=None, **self_options) -> CalibrationSet:
    """Token sequences for calibration from a named spec, a local file/folder, or `self` (needs model).

    self_options (temperature, top_p, batch_size) tune the self-generated path only.
    """
    spec = spec or SELF
    enc = Encoder(tokenizer) if tokenizer is not None else None
    _check_args(tokenizer, num_samples, seq_len, cut, min_tokens, len(enc.prefix) if enc else 0)
    meta = {"spec": spec, "cut": cut, "seed": seed, "seq_len": seq_len, "num_samples": num_samples}
    if spec == SELF:
        if model is None:
            raise UserError("calibration spec 'self' samples text from the model, but no model was given")
        opts = {**SELF_DEFAULTS, **self_options}
        samples, source = sample_from_model(model, tokenizer, num_samples, seq_len, seed, **opts)
    else:
        if self_options:
            raise TypeError(f"options {sorted(self_options)} apply only to spec 'self'")
        corpus = resolve_corpus(spec, text_field, for_eval=False)
        source = corpus.source
        body = seq_len - len(enc.prefix)
        if cut == "document":
            meta["min_tokens"] = min_tokens
            ids = by_document(corpus, enc, seq_len, num_samples, min_tokens, seed)
        elif corpus.continuous:
            ids = [enc.prefix + c for c in chunk_continuous(corpus, enc, body, num_samples, seed)]
        else:
            ids = [enc.prefix + c for c in chunk_documents(corpus, enc, body, num_samples, seed)]
        samples = [torch.tensor(x, dtype=torch.long) for x in ids]
        meta["text_field"] = text_field
    meta.update(source=source, num_tokens=sum(int(s.numel()) for s in samples), sha256=sha256_of(samples),
                tokenizer=enc.describe())
    return CalibrationSet(samples=samples, meta=meta)
