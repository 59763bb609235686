"""`--max-memory`: what quantkit may hold per device, written as accelerate writes it ("2GiB", "cpu=2GiB,cuda:0=70GiB").

Parsed strictly: a size is a number and one unit (B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers
of 1024) or a plain count of bytes, because a cap read wrongly (a "2G" taken as 2 bytes, or silently ignored) would
either refuse every model or cap nothing. Pure text handling: no torch, so the recipe schema can check it.
"""
from __future__ import annotations

import re

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")
_DEVICE = re.compile(r"cpu|cuda(?::\d+)?|\d+")
ALL = "*"  # a bare size: every device
EXAMPLE = "e.g. 2GiB, or cpu=2GiB,cuda:0=70GiB"


def parse_size(text: str) -> int:
    """Bytes in a size such as '70GiB', '1.5GB' or '4096'; ValueError naming the problem otherwise."""
    m = _SIZE.fullmatch(text.strip().lower())
    if m is None or m.group(2) not in UNITS and m.group(2) != "":
        raise ValueError(f"'{text}' is not a size; write a number and one of B, KB, MB, GB, TB, KiB, MiB, GiB, "
                         f"TiB ({EXAMPLE})")
    n = int(float(m.group(1)) * UNITS.get(m.group(2) or "b"))
    if n <= 0:
        raise ValueError(f"'{text}' caps memory at nothing; give a positive size ({EXAMPLE})")
    return n


def parse_max_memory(text: str) -> dict[str, int]:
    """{device: bytes}: 'cpu', 'cuda', 'cuda:N' (a bare N means cuda:N, as in accelerate), or '*' for a bare size."""
    text = text.strip()
    if "=" not in text and "," not in text:
        return {ALL: parse_size(text)}
    caps: dict[str, int] = {}
    for part in text.split(","):
        device, sep, size = (s.strip() for s in part.partition("="))
        device = device.lower()
        if not sep or not _DEVICE.fullmatch(device):
            raise ValueError(f"'{part.strip()}' is not DEVICE=SIZE with DEVICE cpu, cuda or cuda:N ({EXAMPLE})")
        device = f"cuda:{device}" if device.isdigit() else device
        if device in caps:
            raise ValueError(f"device '{device}' is capped twice")
        caps[device] = parse_size(size)
    return caps


def cap_for(caps: dict[str, int], device: str) -> int | None:
    """The cap on DEVICE ('cpu', 'cuda', 'cuda:N'): its own entry, else plain 'cuda' for any GPU, else a bare
    size; None when nothing caps it."""
    if device == "cuda":
        device = "cuda:0"
    for key in (device, "cuda" if device.startswith("cuda") else None, ALL):
        if key in caps:
            return caps[key]
    return None
