"""A checkpoint's sha256 manifest: every file the writer put in the folder, with its size and digest,
recorded in quantkit.json (which cannot list its own digest, so it is the one file left out).

It proves the files are the bytes quantkit wrote (a bad copy, a flipped bit, a hand edit), not that they are
safe: whoever can edit the files can rewrite quantkit.json too, so it is no signature. `quantkit verify`
hashes every file; loading compares every size and hashes only the small files (JSON, tokenizer), which are
what people edit on purpose, so a load of a large checkpoint does not read its weights twice.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from ..errors import UserError
from .json_files import read_json_object
from .output import MARKER

KEY = "manifest"
_CHUNK = 16 * 1024**2
HASH_AT_LOAD = 16 * 1024**2  # files up to this size are hashed at every load


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)


def build_manifest(folder: Path) -> dict:
    """{"algorithm": "sha256", "files": {relative name: {"bytes", "sha256"}}} of every file in FOLDER but
    quantkit.json."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in _files(folder)}
    return {"algorithm": "sha256", "files": files}


def _listed(manifest) -> dict | None:
    files = manifest.get("files") if isinstance(manifest, dict) else None
    ok = isinstance(files, dict) and all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                                         and isinstance(v.get("sha256"), str) for v in files.values())
    return files if ok else None


def manifest_problems(folder: Path, manifest, full: bool = True) -> list[str]:
    """What differs between FOLDER and MANIFEST, one phrase per file (empty: all match). full=False hashes only
    files up to HASH_AT_LOAD bytes and compares the sizes of the rest."""
    files = _listed(manifest)
    if files is None:
        return ["quantkit.json has no readable manifest"]
    problems = []
    for name, want in files.items():
        path = folder / name
        if ".." in Path(name).parts or not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, not {want['bytes']}")
        elif (full or want["bytes"] <= HASH_AT_LOAD) and sha256_file(path) != want["sha256"]:
            problems.append(f"{name} has changed (sha256 differs)")
    extra = [p.relative_to(folder).as_posix() for p in _files(folder) if p.relative_to(folder).as_posix() not in files]
    problems += [f"{name} was added" for name in extra if name.endswith((".safetensors", ".json"))]
    return problems


def source_identity(src: Path) -> dict:
    """What identifies the source model, where it is known cheaply: its Hugging Face revision when SRC is a hub
    snapshot (.../snapshots/<commit>), and the digest of its config.json. Its weights are not hashed: that
    would read the whole model once more."""
    out = {}
    if src.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", src.name):
        out["source_revision"] = src.name
    if (src / "config.json").is_file():
        out["source_config_sha256"] = sha256_file(src / "config.json")
    return out


def changed_since_written(folder: Path) -> str | None:
    """A load's quick look (sizes, and the digests of small files): what differs, in a phrase; None when the
    files match, or when there is no readable manifest to compare with (another tool's checkpoint, an older
    quantkit's, or a damaged quantkit.json, which inspect and verify report)."""
    try:
        manifest = read_json_object(folder / MARKER, "").get(KEY) if (folder / MARKER).is_file() else None
    except UserError:
        return None
    if _listed(manifest) is None:
        return None
    problems = manifest_problems(folder, manifest, full=False)
    more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
    return f"{problems[0]}{more}" if problems else None
