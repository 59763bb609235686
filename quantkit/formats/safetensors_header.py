"""A safetensors file's header, read without loading the file, and the check that the file is whole.

The format is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
[begin, end) byte range in the data that follows, then the data. A copy cut short keeps a valid header, so
only comparing those ranges with the file's length tells that it is truncated; safetensors itself would
only fail later with a traceback, and a reader of headers alone (inspect) would not notice at all.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

_MAX_HEADER = 100 * 1024**2  # the largest header safetensors itself accepts
REDO = "copy or download it again, or re-run quantkit quantize"


def _data_end(head: dict) -> int:
    """The end of the last tensor's bytes, relative to the start of the data section."""
    ends = [entry["data_offsets"][1] for name, entry in head.items() if name != "__metadata__"]
    if not all(isinstance(e, int) and e >= 0 for e in ends):
        raise ValueError("a data offset is not a non-negative integer")
    return max(ends, default=0)


def read_header(path: str | Path) -> dict:
    """{tensor name: {dtype, shape, data_offsets}} (plus '__metadata__' when stored) of safetensors file PATH.

    UserError when the file is missing, is not safetensors, or is shorter or longer than its header says.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is missing; {REDO}")
    size = path.stat().st_size
    with path.open("rb") as fh:
        prefix = fh.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        if not 0 < n <= _MAX_HEADER:
            raise UserError(f"{path} is not a safetensors file (bad header length); {REDO}")
        if 8 + n > size:
            raise UserError(f"{path} is truncated or corrupt: it ends inside its {n}-byte header ({size} bytes); "
                            f"{REDO}")
        raw = fh.read(n)
    try:
        head = json.loads(raw)
        end = _data_end(head)
    except (ValueError, AttributeError, KeyError, IndexError, TypeError) as e:
        raise UserError(f"{path} has a corrupt safetensors header ({e}); {REDO}") from None
    need = 8 + n + end
    if need > size:
        raise UserError(f"{path} is truncated: its header places tensor data up to byte {need} but the file "
                        f"has {size} bytes; {REDO}")
    if need < size:
        raise UserError(f"{path} has {size - need} bytes after its last tensor, so it is corrupt; {REDO}")
    return head
