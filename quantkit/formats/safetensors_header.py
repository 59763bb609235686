"""A safetensors file's header, read without loading the file, and the check that the file is whole.

The format is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
[begin, end) byte range in the data that follows, then the data. Every entry is checked here, before any reader
trusts it: a known dtype, a shape of non-negative integers, a byte range exactly as long as shape x dtype says,
and ranges that tile the data section with no overlap and no gap (as the format requires), ending at the end of
the file. A copy cut short keeps a valid header, so only that last comparison tells it is truncated; an edited
header with overlapping or mis-sized ranges would otherwise load as garbage or report absurd sizes (inspect).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import UserError

_MAX_HEADER = 100 * 1024**2  # the largest header safetensors itself accepts
REDO = "copy or download it again, or re-run quantkit quantize"
# bytes per element of every dtype safetensors names
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def nbytes(entry: dict) -> int:
    """The bytes a checked header entry's tensor takes."""
    return DTYPE_BYTES[entry["dtype"]] * math.prod(entry["shape"])


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry_problem(name: str, entry) -> str | None:
    """What is wrong with one tensor's header entry, in words; None when it is well formed."""
    if not isinstance(entry, dict):
        return f"tensor '{name}' has a {type(entry).__name__} entry, not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        return f"tensor '{name}' has unknown dtype {dtype!r} (expected one of {', '.join(DTYPE_BYTES)})"
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"tensor '{name}' has shape {shape!r}; expected a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        return f"tensor '{name}' has data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end"
    if offsets[1] - offsets[0] != nbytes(entry):
        return (f"tensor '{name}' is {dtype} {shape}, which needs {nbytes(entry)} bytes, but its data_offsets "
                f"{offsets} span {offsets[1] - offsets[0]}")
    return None


def _layout_problem(head: dict) -> str | None:
    """Overlapping or gapped byte ranges, in words; None when the ranges tile [0, end) exactly."""
    ranges = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in head.items() if k != "__metadata__")
    end, last = 0, None
    for begin, stop, name in ranges:
        if begin < end:
            return f"tensors '{last}' and '{name}' overlap (bytes {begin}-{end})"
        if begin > end:
            return f"there are {begin - end} unused bytes before tensor '{name}'"
        end, last = stop, name
    return None


def _check_entries(path: Path, head) -> int:
    """The end of the data section the header describes; UserError for the first malformed entry."""
    if not isinstance(head, dict):
        raise UserError(f"{path} has a corrupt safetensors header (a JSON {type(head).__name__}, not an object); "
                        f"{REDO}")
    meta = head.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise UserError(f"{path} has a corrupt safetensors header (__metadata__ is not a map of strings); {REDO}")
    for name, entry in head.items():
        problem = None if name == "__metadata__" else _entry_problem(name, entry)
        if problem:
            raise UserError(f"{path} has a corrupt safetensors header: {problem}; {REDO}")
    problem = _layout_problem(head)
    if problem:
        raise UserError(f"{path} has a corrupt safetensors header: {problem}; {REDO}")
    return max((e["data_offsets"][1] for k, e in head.items() if k != "__metadata__"), default=0)


def read_header(path: str | Path) -> dict:
    """{tensor name: {dtype, shape, data_offsets}} (plus '__metadata__' when stored) of safetensors file PATH.

    UserError when the file is missing, is not safetensors, has a malformed entry, or is shorter or longer than
    its header says.
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
    except (ValueError, RecursionError) as e:
        raise UserError(f"{path} has a corrupt safetensors header ({e}); {REDO}") from None
    need = 8 + n + _check_entries(path, head)
    if need > size:
        raise UserError(f"{path} is truncated: its header places tensor data up to byte {need} but the file "
                        f"has {size} bytes; {REDO}")
    if need < size:
        raise UserError(f"{path} has {size - need} bytes after its last tensor, so it is corrupt; {REDO}")
    return head
