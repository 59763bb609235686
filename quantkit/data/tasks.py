"""Task sets for evaluation: JSONL, one prompt per line, grouped by `task` for per-task breakdowns."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError


@dataclass(frozen=True)
class Task:
    """One line of a task set: a prompt, and the answer when the set has references."""

    id: str
    task: str
    prompt: str
    answer: str | None = None
    extra: dict = field(default_factory=dict)  # any other fields on the line, untouched


def load_tasks(path) -> list[Task]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such task file; pass a JSONL file with id, task, prompt[, answer] per line")
    data = path.read_bytes()
    if b"\x00" in data[:65536]:
        raise UserError(f"{path} looks like a binary file; a task file is JSONL text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path} looks like a binary file; a task file is JSONL text") from None
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {n} is not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise UserError(f"{path} line {n} is not a JSON object")
        missing = [k for k in ("task", "prompt") if not isinstance(rec.get(k), str) or not rec.get(k)]
        if missing:
            raise UserError(f"{path} line {n} lacks text field(s) {', '.join(missing)}; "
                            f"fields present: {', '.join(rec) or '(none)'}")
        # Ids are optional in hand-written files; the line number is stable and unique.
        tid = str(rec.get("id", f"line-{n}"))
        if tid in seen:
            raise UserError(f"{path} line {n}: id '{tid}' already used on line {seen[tid]}; ids must be unique")
        seen[tid] = n
        answer = rec.get("answer")
        extra = {k: v for k, v in rec.items() if k not in ("id", "task", "prompt", "answer")}
        tasks.append(Task(id=tid, task=rec["task"], prompt=rec["prompt"],
                          answer=None if answer is None else str(answer), extra=extra))
    if not tasks:
        raise UserError(f"{path} is empty; a task file needs at least one JSONL line")
    return tasks
