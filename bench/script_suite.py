"""Suites whose rows are runs of an existing bench script: each row is a script and its options, and its
figures are the Markdown table the script prints (one JSON row per table row).

A script that cannot run here (no GPU, no peer library's venv) gives one row saying why instead of figures.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_tables(text: str) -> tuple[list[dict], list[str]]:
    """The rows of every Markdown table in text (cells as numbers where they are numbers), and the other lines."""
    rows, other, head = [], [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            head = None
            if line.strip():
                other.append(line.strip())
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if head is None:  # a repeated column name (e.g. two "CPU s") gets a number, so no cell is lost
            head = [h if h not in cells[:i] else f"{h} ({cells[:i].count(h) + 1})" for i, h in enumerate(cells)]
        elif not all(set(c) <= set("-: ") for c in cells):
            rows.append({h: number(c) for h, c in zip(head, cells)})
    return rows, other


def number(cell: str):
    try:
        return float(cell.replace(",", "")) if any(ch.isdigit() for ch in cell) else cell
    except ValueError:
        return cell


def run_script(row: dict, quick: bool, timeout: int = 3600) -> tuple[list[dict], list[str]]:
    """Run bench/SCRIPT with the row's args (plus its "quick" args); a skipped or failed run is one row."""
    need = row.get("needs")
    if need and (why := need()):
        return [{"name": row["name"], "skipped": why}], []
    cmd = [sys.executable, str(HERE / row["script"]), *row.get("args", []), *(row.get("quick", []) if quick else [])]
    env = {**os.environ, **row.get("env", {})}  # e.g. an instruction-set cap, to time another CPU kind here
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent, env=env)
    if proc.returncode:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[-300:]
        return [{"name": row["name"], "error": tail}], []
    table, other = parse_tables(proc.stdout)
    return [{"name": row["name"], **r} for r in table], other


def run_rows(rows: list[dict], quick: bool) -> dict:
    out, notes = [], []
    for row in rows:
        table, other = run_script(row, quick)
        out += table
        notes += [f"{row['name']}: {line}" for line in other]
    setup = {r["name"]: " ".join([*(f"{k}={v}" for k, v in r.get("env", {}).items()), "python", "bench/" + r["script"],
                                  *r.get("args", []), *(r.get("quick", []) if quick else [])]) for r in rows}
    return {"setup": setup, "rows": out, "note": "\n".join(notes)}


def no_gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def venv_missing(path: str):
    """A `needs` check: why a peer library's venv is missing (None when it is there)."""
    return lambda: None if (HERE.parent / path).exists() else f"{path} missing (bench/README.md says how to make it)"
