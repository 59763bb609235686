"""Suite `scaling`: the torchrun quantisation measured at 1 and 2 processes and modelled for 8 and 2 x 8
(bench/scaling.py, whose main() does the work; this adapts its rows to the harness's)."""
from __future__ import annotations

import tempfile
from pathlib import Path

ROWS = [{"name": "gptq w4a16, measured and modelled"}]


def run(rows: list[dict], quick: bool) -> dict:
    from . import scaling

    with tempfile.TemporaryDirectory() as tmp:  # the harness writes bench/results/scaling.json itself
        r = scaling.main(["--out", str(Path(tmp) / "scaling.json"), *(["--samples", "8"] if quick else [])])
    out = [{"name": x.get("name", x.get("row")), **{k: v for k, v in x.items() if k not in ("row", "name")}}
           for x in r["rows"]]
    return {"setup": r.get("setup", {}), "rows": out}
