"""The one resolver of device names users type (--device, `quantkit.load(device=...)`) to a torch device."""
from __future__ import annotations

import torch

from .errors import UserError


def resolve_device(name: str | None) -> str:
    """auto is CUDA when this torch sees a GPU, else the CPU; a GPU that is not there is one line, before any
    loading starts."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise UserError(f"unknown --device '{name}'; choose auto, cpu or cuda (cuda:N for one GPU)")
    if not torch.cuda.is_available():
        raise UserError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA GPU; "
                        "use --device cpu or --device auto")
    if ":" in name and int(name[5:]) >= torch.cuda.device_count():
        raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) visible; pick a lower index")
    return name


def proc_kib(path: str, key: str) -> int | None:
    """KEY's value from a Linux /proc status-style file (\"VmHWM:  1234 kB\") in bytes; None where there is
    none (another OS, or the key absent)."""
    from pathlib import Path

    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
