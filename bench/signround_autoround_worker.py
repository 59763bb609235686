"""Worker for bench/signround_vs_autoround.py, run by AutoRound's own venv (.venv-autoround): quantise a model
with the `auto-round` package on the calibration tokens the bench wrote, save the checkpoint, print a JSON line.

    .venv-autoround/bin/python bench/signround_autoround_worker.py MODEL TOKENS.pt OUT --iters 200

Imports nothing from quantkit. The checkpoint is written in AutoRound's llm_compressor format (compressed-tensors
pack-quantized, which transformers loads with compressed-tensors installed), or as dequantised float weights
("fake") when that export fails; the JSON says which.
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("tokens", help="torch.save'd int64 tensor [samples, seq_len]")
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    ids = torch.load(a.tokens)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    t0, c0 = time.perf_counter(), time.process_time()
    ar = AutoRound(model, tok, bits=4, group_size=a.group_size, sym=True, iters=a.iters, nsamples=ids.shape[0],
                   seqlen=ids.shape[1], batch_size=a.batch, dataset=[row.unsqueeze(0) for row in ids], device="cpu")
    ar.quantize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    fmt = "llm_compressor"
    try:
        ar.save_quantized(a.out, format=fmt)
    except Exception as e:  # noqa: BLE001 - report and fall back to the float export
        print(f"llm_compressor export failed ({e}); saving fake-quantised float weights")
        fmt = "fake"
        ar.save_quantized(a.out, format=fmt)
    print(json.dumps({"format": fmt, "quantise_wall_s": wall, "quantise_cpu_s": cpu, "iters": a.iters,
                      "samples": int(ids.shape[0]), "seq_len": int(ids.shape[1])}))


if __name__ == "__main__":
    main()
