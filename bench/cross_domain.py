"""Cross-domain quality: calibrate on one source, evaluate on texts none of the sources contain.

    python bench/cross_domain.py                                   # every source x method, three eval texts
    python bench/cross_domain.py --methods awq --sources prose --tag guard --set quant.awq.clip=false

Embedded SmolLM2-135M, W4 g64 symmetric. Calibration sources: text the model samples itself ('self'),
calibration/texts/prose_calib.txt, calibration/texts/code_calib.txt; the same budget for each (10 x 256
tokens: the local files hold ~3k tokens); and 'stdlib', more Python (STDLIB_CALIB) for larger code budgets.
Evaluation texts, disjoint from every source: bench/data/eval_prose.txt, calibration/texts/prose_eval.txt,
and Python source from the interpreter's own standard library (modules neither code source quotes), 8 windows
x 256 tokens each. For each (method, source, eval text):
perplexity and the share of the RTN-to-float gap it closes, (rtn - q) / (rtn - float). Results are appended
as JSON lines to bench/out/cross_domain.jsonl so runs can be merged into one table.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from quality_common import load_model, perplexity  # noqa: E402

STDLIB_MODULES = ("textwrap.py", "fractions.py", "shlex.py", "bisect.py", "heapq.py")
# the 'stdlib' calibration source: more Python than the local file holds (for the 32 x 256 budget),
# from standard-library modules disjoint from STDLIB_MODULES
STDLIB_CALIB = ("calendar.py", "difflib.py", "csv.py", "dataclasses.py", "statistics.py", "argparse.py")
# a calibration spec, or (stdlib) the modules whose text is written out as one
SOURCES = {"self": "self", "prose": str(ROOT / "calibration/texts/prose_calib.txt"),
           "code": str(ROOT / "calibration/texts/code_calib.txt"), "stdlib": STDLIB_CALIB}
W4G64 = {"quant.scheme": "w4a16", "quant.group_size": 64, "quant.symmetric": True}


def stdlib_text(out_dir: Path, name: str, modules) -> Path:
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = out_dir / name
    out.write_text("\n\n".join((lib / m).read_text() for m in modules if (lib / m).is_file()))
    return out


def eval_texts(out_dir: Path) -> dict[str, Path]:
    code = stdlib_text(out_dir, "eval_stdlib_code.txt", STDLIB_MODULES)
    return {"prose A": HERE / "data/eval_prose.txt", "prose B": ROOT / "calibration/texts/prose_eval.txt",
            "code": code}


def table(sink: Path) -> str:
    """The markdown table of every row in SINK: perplexity and (share of the RTN-to-float gap closed) per text;
    the latest row wins for a repeated (tag, method, source, eval); the gap is the first stored RTN row's."""
    rows = {}
    for line in sink.read_text().splitlines():
        r = json.loads(line)
        rows[(r["tag"], r["method"], r["source"], r["eval"])] = r
    evals = list(dict.fromkeys(k[3] for k in rows))
    ref: dict = {}  # the first float and RTN rows stored: the gap is plain RTN's, whatever later rows change
    for (t, m, src, e), r in rows.items():
        if m in ("float", "rtn"):
            ref.setdefault((m, e), r["ppl"])
    out = ["| tag | method | calibration | " + " | ".join(evals) + " | quantise s |",
           "|---|---|---|" + "---:|" * (len(evals) + 1)]
    for key in dict.fromkeys(k[:3] for k in rows):
        cells = []
        for e in evals:
            r = rows.get((*key, e))
            if r is None:
                cells.append("-")
                continue
            gap = ref[("rtn", e)] - ref[("float", e)]
            share = "" if key[1] in ("float", "rtn") else f" ({(ref[('rtn', e)] - r['ppl']) / gap:.0%})"
            cells.append(f"{r['ppl']:.2f}{share}")
        secs = rows[(*key, evals[0])].get("seconds", 0)
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {secs} |")
    return "\n".join(out)


def _calibration(source: str, samples: int, seq_len: int, tok, model, out_dir: Path) -> list:
    """SOURCE's calibration samples. Self-generated sets are kept on disk (bench/out/self_calib_*.pt): sampling
    128 x 512 tokens takes ~15 minutes on this CPU. A smaller set is the first SAMPLES of a larger stored one
    with the same length, which is a sample of the same distribution."""
    import torch

    from quantkit.data import load_calibration

    if source != "self":
        spec = SOURCES[source]
        if isinstance(spec, tuple):
            spec = str(stdlib_text(out_dir, f"calib_{source}_code.txt", spec))
        return load_calibration(spec=spec, tokenizer=tok, num_samples=samples, seq_len=seq_len, seed=0).samples
    stored = sorted((int(p.stem.split("_")[2].split("x")[0]), p) for p in out_dir.glob(f"self_calib_*x{seq_len}.pt"))
    for n, p in stored:
        if n >= samples:
            return torch.load(p)[:samples]
    got = load_calibration(spec="self", tokenizer=tok, num_samples=samples, seq_len=seq_len, seed=0,
                           model=model).samples
    torch.save(got, out_dir / f"self_calib_{samples}x{seq_len}.pt")
    return got


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="gptq,awq,awq+gptq")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--tag", default="default", help="label of this configuration in the JSON lines")
    ap.add_argument("--set", action="append", default=[], help="recipe override FIELD=VALUE (repeatable)")
    ap.add_argument("--baselines", action="store_true", help="also score float and RTN")
    ap.add_argument("--table", action="store_true", help="print the table of every stored row and stop")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = _args(argv)
    if a.table:
        print(table(HERE / "out" / "cross_domain.jsonl"))
        return

    from transformers import AutoTokenizer

    from quantkit.data import load_eval_windows
    from quantkit.models.embedded import embedded_model_dir
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides
    from quantkit.cli.set_option import parse_set

    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    path = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(path)
    base = load_model(path)
    evals = {n: load_eval_windows(str(p), tok, seq_len=256, max_windows=a.windows)
             for n, p in eval_texts(out_dir).items()}
    sink = out_dir / "cross_domain.jsonl"

    def record(method, source, model, secs, stats=None):
        for name, windows in evals.items():
            row = {"tag": a.tag, "method": method, "source": source, "eval": name, "calib_tokens": a.samples * a.seq_len,
                   "ppl": perplexity(model, windows), "seconds": secs, **(stats or {})}
            print(json.dumps(row), flush=True)
            with sink.open("a") as f:
                f.write(json.dumps(row) + "\n")

    if a.baselines:
        record("float", "-", base, 0)
        rows = [("rtn", None)]
    else:
        rows = []
    rows += [(m, s) for m in a.methods.split(",") for s in a.sources.split(",")]
    calibs = {}  # per source, made once: self-generated text costs minutes
    for method, source in rows:
        if source is not None and source not in calibs:
            calibs[source] = _calibration(source, a.samples, a.seq_len, tok, base, out_dir)
        calib = calibs.get(source)
        model = copy.deepcopy(base)
        recipe = apply_overrides(Recipe(), {**W4G64, "quant.method": method, **parse_set(a.set)})
        t = time.perf_counter()
        res = quantize_model(model, build_plan(model, recipe), calib)
        guards = sum(1 for s in res.stats.values() if s.get("awq_guard"))
        gptq = [s["gptq_guard"].split(":")[0] for s in res.stats.values() if s.get("gptq_guard")]
        record(method, source or "-", model, round(time.perf_counter() - t, 1),
               {"guard_fallbacks": guards, "gptq_guard": {k: gptq.count(k) for k in set(gptq)}})


if __name__ == "__main__":
    main()
