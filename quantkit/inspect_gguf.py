"""`quantkit inspect FILE.gguf`: what a GGUF file holds, per tensor kind: llama.cpp's block types, bits per
weight (block scales included, from the gguf package's block sizes) and bytes; the header's architecture, name
and file type. GGUF keeps no solver record, so there are no error columns."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from .errors import UserError

_LAYER = re.compile(r"^blk\.\d+\.")


def kind_of(name: str) -> str:
    """The tensor's kind without its layer number: 'blk.3.attn_q.weight' -> 'attn_q.weight'."""
    return _LAYER.sub("", name)


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    return f.contents()


def types_text(counts: dict[str, int]) -> str:
    """'Q4_K x169, Q6_K x30, F32': each type and how many tensors have it."""
    return ", ".join(f"{t} x{n}" if n > 1 else t for t, n in counts.items())


def gguf_types(path) -> dict[str, int]:
    """Tensors of each llama.cpp type in the GGUF file at PATH."""
    return inspect_gguf(path)["types"]


def describe(path) -> str:
    """One line for a report: the file type and its tensor types, e.g. 'gguf MOSTLY_Q4_K_M (Q4_K x169, ...)'."""
    info = inspect_gguf(path)
    return f"gguf {info['file_type'] or '?'} ({types_text(info['types'])})"


def inspect_gguf(path) -> dict:
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise UserError(f"{path} is not a readable GGUF file ({str(e).splitlines()[0][:200]}); "
                        "export one with quantkit quantize --format gguf") from None
    tensors = []
    for t in reader.tensors:
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        tensors.append({"name": t.name, "kind": kind_of(t.name), "type": t.tensor_type.name,
                        "shape": [int(d) for d in reversed(t.shape.tolist())], "parameters": int(t.n_elements),
                        "bytes": int(t.n_bytes), "bits_per_weight": 8 * size / block})
    kinds: dict[str, list[dict]] = {}
    for t in tensors:
        kinds.setdefault(t["kind"], []).append(t)
    rows = [{"kind": k, "count": len(ts), "types": dict(Counter(t["type"] for t in ts)),
             "parameters": sum(t["parameters"] for t in ts), "bytes": sum(t["bytes"] for t in ts),
             "bits_per_weight": 8 * sum(t["bytes"] for t in ts) / sum(t["parameters"] for t in ts)}
            for k, ts in kinds.items()]
    params, data = sum(t["parameters"] for t in tensors), sum(t["bytes"] for t in tensors)
    file_type = _field(reader, "general.file_type")
    return {"checkpoint": str(path), "format": "gguf", "architecture": _field(reader, "general.architecture"),
            "name": _field(reader, "general.name"),
            "file_type": gguf.LlamaFileType(file_type).name if file_type is not None else None,
            "file_bytes": path.stat().st_size, "tensor_bytes": data, "parameters": params,
            "bits_per_weight": 8 * data / params if params else None,
            "types": dict(Counter(t["type"] for t in tensors)), "kinds": rows, "tensors": tensors}
