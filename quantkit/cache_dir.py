"""quantkit's cache folder, the one rule for where anything cached on this machine goes (the embedded model, GGUF
files converted to float folders, the kernel choices, inductor's compiled kernels, the W4A8 op's library):
$QUANTKIT_CACHE, else $XDG_CACHE_HOME/quantkit, else ~/.cache/quantkit."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("QUANTKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "quantkit")
    return Path(root)
