"""safetensors files written one tensor at a time.

safetensors' own `save_file` serialises every tensor of a file into one buffer before writing, so a checkpoint
was held twice in memory at the end of a run (the tensors, then their bytes): for a 70B W4 model, twice ~40 GB.
Here the header is laid out first from each tensor's dtype and shape (the format: an 8-byte little-endian header
length, a JSON header padded with spaces, then the data, offsets relative to the data's start), and each tensor's
bytes go to their place in their file as the tensor is produced, so the writer holds one tensor at a time.
Tensors are placed by decreasing element size, then name, so every tensor starts aligned to its element size.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class Spec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> "Spec":
        return cls(t.dtype, tuple(t.shape))

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _header(entries: dict[str, dict], metadata: dict[str, str]) -> bytes:
    text = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)  # the data then starts 8-aligned
    return struct.pack("<Q", len(text)) + text


class StreamWriter:
    """Files for `specs` under `folder`; `write(name, tensor)` once per name, in any order; `close()` checks that
    every tensor came and writes the index when there are several files. Used as a context manager, an error
    leaves the files for the caller to remove (the checkpoint writer removes its whole temporary folder)."""

    def __init__(self, folder: Path, specs: dict[str, Spec], shard_bytes: int, metadata: dict[str, str]):
        order = sorted(specs, key=lambda n: (-specs[n].dtype.itemsize, n))
        shards: list[list[str]] = [[]]
        size = 0
        for name in order:
            if shards[-1] and size + specs[name].nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += specs[name].nbytes
        self.folder, self.specs = Path(folder), specs
        self.files = shard_names(len(shards))
        self._where: dict[str, tuple[int, int]] = {}  # name -> (file index, absolute offset)
        self._handles = []
        for i, names in enumerate(shards):
            entries, offset = {}, 0
            for name in names:
                s = specs[name]
                entries[name] = {"dtype": DTYPES[s.dtype], "shape": list(s.shape),
                                 "data_offsets": [offset, offset + s.nbytes]}
                offset += s.nbytes
            head = _header(entries, metadata)
            f = open(self.folder / self.files[i], "wb")
            self._handles.append(f)
            f.write(head)
            f.truncate(len(head) + offset)  # sized now: a file-size limit fails here, before any tensor is made
            for name in names:
                self._where[name] = (i, len(head) + entries[name]["data_offsets"][0])
        self._shards = shards
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None or name in self._written:
            raise ValueError(f"tensor {name!r} was {'written twice' if spec else 'not announced'}")
        if Spec.of(tensor) != spec:
            raise ValueError(f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, announced as "
                             f"{spec.dtype} {spec.shape}")
        i, at = self._where[name]
        if spec.nbytes:
            raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            f = self._handles[i]
            f.seek(at)
            f.write(raw.data)
        self._written.add(name)

    def _close_files(self) -> None:
        for f in self._handles:
            f.close()
        self._handles = []

    def close(self) -> list[str]:
        self._close_files()
        missing = sorted(set(self.specs) - self._written)
        if missing:
            raise ValueError(f"{len(missing)} announced tensors were never written, e.g. {missing[0]!r}")
        if len(self.files) > 1:
            weight_map = {name: self.files[i] for i, names in enumerate(self._shards) for name in names}
            total = sum(s.nbytes for s in self.specs.values())
            (self.folder / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        return self.files

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, kind, err, tb) -> None:
        if kind is None:
            self.close()
        else:
            self._close_files()
