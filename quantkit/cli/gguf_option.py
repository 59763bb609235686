"""`quantkit quantize --format gguf`: the options a GGUF export reads, handed to gguf_job."""
from __future__ import annotations

from .common import console, emit_json

# what --format gguf reads; any other option given is refused rather than silently ignored
GGUF_READS = ("model", "output", "overwrite", "scheme", "method", "calib", "num_samples", "seq_len")


def run_gguf(fmt: str, opts: dict, as_json: bool) -> None:
    from ..errors import UserError
    from ..gguf_job import quantize_to_gguf

    if fmt != "gguf":
        raise UserError(f"--format {fmt} is unknown; use compressed-tensors (the default) or gguf")
    extra = sorted(k for k, v in opts.items() if k not in GGUF_READS and v not in (None, [], False))
    if extra:
        names = ", ".join("--" + k.rstrip("_").replace("_", "-") for k in extra)
        raise UserError(f"--format gguf does not read {names} yet; drop them (it reads MODEL, -o, --scheme, "
                        "--method auto|rtn|gptq, --calib, --num-samples, --seq-len and --overwrite)")
    summary = quantize_to_gguf(opts.get("model"), opts.get("output"), opts.get("scheme"), opts.get("method"),
                               bool(opts.get("overwrite")), calib=opts.get("calib"),
                               num_samples=opts.get("num_samples"), seq_len=opts.get("seq_len"))
    if as_json:
        emit_json(summary)
    else:
        types = ", ".join(f"{n} {k}" for k, n in sorted(summary["types"].items()))
        console.print(f"[green]wrote[/] {summary['output']}: {summary['scheme']} ({types}), "
                      f"{summary['bytes'] / 2**20:.1f} MiB, {summary['seconds']} s")
