"""`quantkit verify`: are a checkpoint's files the bytes quantkit wrote, and does it pass every check a load
makes? The manifest in quantkit.json is compared file by file (every file hashed), then the checkpoint is
loaded on the CPU through the one loader, which checks headers, config, every tensor's layout and values.
"""
from __future__ import annotations

from pathlib import Path

from .errors import UserError
from .formats.json_files import read_json_object
from .formats.manifest import KEY, manifest_problems
from .formats.output import MARKER

OK, CHANGED, DAMAGED = 0, 1, 2  # exit codes: all good; files differ from the manifest; the checks of a load fail


def _manifest(folder: Path) -> tuple[int, list[str]]:
    """(files listed, problems) of FOLDER against its manifest."""
    if not (folder / MARKER).is_file():
        return 0, [f"no {MARKER}: not a checkpoint quantkit wrote, so there is no manifest to check"]
    try:
        meta = read_json_object(folder / MARKER, "")
    except UserError as e:
        return 0, [str(e).rstrip("; ")]
    if KEY not in meta:
        return 0, [f"{MARKER} has no manifest (written by an older quantkit); re-run quantkit quantize to get one"]
    files = meta[KEY].get("files") if isinstance(meta[KEY], dict) else None
    return len(files) if isinstance(files, dict) else 0, manifest_problems(folder, meta[KEY], full=True)


def verify_checkpoint(path) -> dict:
    """The report: manifest (files checked, problems), integrity (None, or the load's one-line error), and the
    exit code `quantkit verify` gives."""
    from .runtime.loader import read_model

    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"'{folder}' is not a folder; pass a checkpoint folder written by quantkit quantize")
    checked, problems = _manifest(folder)
    try:
        read_model(folder, device="cpu", check_manifest=False)
        error = None
    except UserError as e:
        error = str(e)
    code = DAMAGED if error else (CHANGED if problems else OK)
    return {"checkpoint": str(folder), "ok": code == OK, "exit_code": code,
            "manifest": {"files_checked": checked, "problems": problems}, "integrity": {"error": error}}
