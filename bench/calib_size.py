"""Suite `calib_size` (issue 43): which method is best at each calibration size, in-domain and across domains,
with a 95% paired bootstrap interval over evaluation windows for every comparison.

    python -m bench calib_size [--only "code 2048"] [--quick]

Three text domains that no other suite or default was tuned on, each split into a calibration part and a
disjoint evaluation part (64 windows x 256 tokens, 16,320 scored tokens):
  code     Python's own standard library: calibration from four modules, evaluation from five others;
  quotes   Debian's `fortunes` collections (apt-get install fortunes): calibration from five files,
           evaluation from four others;
  manuals  man pages rendered by man(1): calibration from bash(1), evaluation from find, tar, dpkg, apt-get,
           grep and sed.
Each row quantises the embedded SmolLM2-135M (W4 g64 symmetric) with one method on N tokens (N / 256 samples) of
one domain's calibration part and scores it on all three evaluation parts; "awq+gptq, no prior" is AWQ+GPTQ with
GPTQ's Hessian as measured (quant.gptq.prior_tokens=0), as it was before issue 43; "awq+gptq, no hold-out" fits
every sample and judges nothing (calibration.holdout=0: no GPTQ, AWQ or clip guard). A row takes 3-5 minutes on a
2-core CPU (three 16k-token evaluations are ~2.5 of them), the whole suite about three hours.

Per (calibration domain, tokens), the table gives each method's in-domain perplexity against the best method's
there, and its perplexity on the two other domains against plain RTN's (full range, no data), each as a ratio
with its interval. The default's rule (quantkit/auto_method.py) must be within 1% of the best in-domain and
never worse than RTN across domains at every size (issue 43, requirement 1).

Every quantised model's per-window NLLs are kept in bench/out/calib_size.jsonl, keyed by the quantkit commit
that made them, so a run of some rows (--only) adds to what earlier runs measured with the same code.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sysconfig
import time
from pathlib import Path

import torch

from .quality import W4G64
from .score import paired_ratio, score

HERE = Path(__file__).resolve().parent
SINK = HERE / "out" / "calib_size.jsonl"
TEXTS = HERE / "out" / "calib_size_texts"
SEQ_LEN, WINDOWS = 256, 64
FORTUNES = Path("/usr/share/games/fortunes")
DOMAINS = {
    "code": {"calib": ("argparse.py", "difflib.py", "inspect.py", "configparser.py"),
             "eval": ("textwrap.py", "fractions.py", "shlex.py", "heapq.py", "tarfile.py")},
    "quotes": {"calib": ("people", "politics", "science", "work", "men-women"),
               "eval": ("literature", "wisdom", "humorists", "songs-poems")},
    "manuals": {"calib": ("bash",), "eval": ("find", "tar", "dpkg", "apt-get", "grep", "sed")},
}
TOKENS = (2048, 8192, 32768)
# each method as a user asks for it, AWQ+GPTQ as it was before GPTQ's decorrelation prior, and AWQ+GPTQ without
# the hold-out guards (every sample fitted; the guards' cost is a quarter of GPTQ's time)
METHODS = {"awq": {"quant.method": "awq"}, "gptq": {"quant.method": "gptq"},
           "awq+gptq": {"quant.method": "awq+gptq"},
           "awq+gptq, no prior": {"quant.method": "awq+gptq", "quant.gptq.prior_tokens": 0},
           "awq+gptq, no hold-out": {"quant.method": "awq+gptq", "calibration.holdout": 0}}
ROWS = [{"name": f"{d} {n} {m}", "domain": d, "tokens": n, "method": m}
        for n in TOKENS for d in DOMAINS for m in METHODS]
QUICK = {"windows": 4, "tokens": 512}


def _man(page: str) -> str:
    env = {**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8", "MAN_KEEP_FORMATTING": ""}
    text = subprocess.run(["man", "-P", "cat", page], capture_output=True, text=True, env=env, check=True).stdout
    # overstrike bold and underline (x\bx, _\bx) where man formats for a terminal anyway
    return subprocess.run(["col", "-bx"], input=text, capture_output=True, text=True, check=True).stdout


def _part(domain: str, names: tuple[str, ...]) -> str:
    from quantkit.errors import UserError

    if domain == "code":
        lib = Path(sysconfig.get_paths()["stdlib"])
        return "\n\n".join((lib / n).read_text() for n in names)
    if domain == "quotes":
        if not FORTUNES.is_dir():
            raise UserError(f"no {FORTUNES}: the quotes domain reads Debian's fortunes; apt-get install fortunes")
        # '%' lines separate the quotes; a blank line reads as the same break to a tokenizer
        return "\n".join("" if line == "%" else line
                         for n in names for line in (FORTUNES / n).read_text(errors="replace").splitlines())
    try:
        return "\n\n".join(_man(n) for n in names)
    except (OSError, subprocess.CalledProcessError) as e:
        raise UserError(f"could not render man pages ({e}); apt-get install man-db") from e


def texts() -> dict[str, dict[str, Path]]:
    """Every domain's calibration and evaluation parts as files under bench/out (made once, then reused)."""
    TEXTS.mkdir(parents=True, exist_ok=True)
    out = {}
    for domain, parts in DOMAINS.items():
        out[domain] = {}
        for part, names in parts.items():
            path = TEXTS / f"{domain}_{part}.txt"
            if not path.is_file():
                path.write_text(_part(domain, names))
            out[domain][part] = path
    return out


def _commit() -> str:
    root = HERE.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "quantkit"], cwd=root, capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _stored(commit: str) -> dict:
    rows = {}
    if SINK.is_file():
        for line in SINK.read_text().splitlines():
            r = json.loads(line)
            if r["commit"] == commit:
                rows[(r["method"], r["domain"], r["tokens"])] = r
    return rows


def _measure(key, model_path, calib, evals, commit, windows) -> dict:
    import quantkit
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides

    method, domain, tokens = key
    model = quantkit.load(model_path, exact=True, dtype=torch.float32)
    row = {"commit": commit, "method": method, "domain": domain, "tokens": tokens, "windows": windows}
    if method != "float":
        recipe = apply_overrides(Recipe(), {**W4G64, **METHODS.get(method, {"quant.method": method})})
        t = time.perf_counter()
        quantize_model(model, build_plan(model, recipe), calib)
        row["seconds"] = round(time.perf_counter() - t, 1)
    row["window_nll"] = {name: score(model, w)["window_nll"] for name, w in evals.items()}
    with SINK.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def _ratio(a: list[float], b: list[float]) -> str:
    r, lo, hi = ((x - 1) * 100 for x in paired_ratio(a, b))
    return f"{r:+.2f}% [{lo:+.2f}, {hi:+.2f}]"


def _ppl(nll: list[float]) -> float:
    return float(torch.tensor(nll, dtype=torch.float64).mean().exp())


def table(measured: dict, config) -> list[dict]:
    """One row per (tokens, calibration domain, method): in-domain perplexity against the best method's there,
    and each other domain's against RTN's."""
    from quantkit.auto_method import choose_method

    out = []
    rtn = measured[("rtn", "-", 0)]["window_nll"]
    cells = sorted({(k[2], k[1]) for k in measured if k[0] not in ("float", "rtn")})
    for tokens, domain in cells:
        here = {k[0]: measured[k]["window_nll"] for k in measured if k[1:] == (domain, tokens)}
        best = min(here, key=lambda m: sum(here[m][domain]))
        auto = choose_method(config, "w4a16", [])[0]  # a method as users name it, so never a variant
        for method, nll in here.items():
            # one column whichever method is best in the cell, so the table keeps one shape; the best is named
            row = {"calibration": domain, "tokens": tokens, "method": method + (" (auto)" if method == auto else ""),
                   "in-domain ppl": round(_ppl(nll[domain]), 3), "best in-domain": best,
                   "vs best in-domain, 95%": _ratio(nll[domain], here[best][domain])}
            row["other domains vs rtn, 95%"] = "; ".join(f"{o} {_ratio(nll[o], rtn[o])}" for o in DOMAINS
                                                          if o != domain)
            out.append(row)
    return out


def run(rows: list[dict], quick: bool) -> dict:
    from transformers import AutoTokenizer

    from quantkit.data import load_calibration, load_eval_windows
    from quantkit.models.embedded import embedded_model_dir

    torch.set_num_threads(2)
    windows = QUICK["windows"] if quick else WINDOWS
    path = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(path)
    parts = texts()
    evals = {d: list(load_eval_windows(str(p["eval"]), tok, seq_len=SEQ_LEN, max_windows=windows))
             for d, p in parts.items()}
    commit = _commit() + ("+quick" if quick else "")
    measured = _stored(commit)
    for key in [("float", "-", 0), ("rtn", "-", 0)] + [(r["method"], r["domain"], r["tokens"]) for r in rows]:
        if quick:
            key = (*key[:2], min(key[2], QUICK["tokens"]))
        if key not in measured:
            calib = None
            if key[2]:
                calib = list(load_calibration(spec=str(parts[key[1]]["calib"]), tokenizer=tok,
                                              num_samples=key[2] // SEQ_LEN, seq_len=SEQ_LEN, seed=0).samples)
            measured[key] = _measure(key, path, calib, evals, commit, windows)
            print(f"{key}: {measured[key].get('seconds')} s", flush=True)
    sha = {f"{d} {p}": hashlib.sha256(f.read_bytes()).hexdigest()[:12]
           for d, ps in parts.items() for p, f in ps.items()}
    float_ppl = {d: round(_ppl(measured[("float", "-", 0)]["window_nll"][d]), 3) for d in DOMAINS}
    rtn_ppl = {d: round(_ppl(measured[("rtn", "-", 0)]["window_nll"][d]), 3) for d in DOMAINS}
    setup = {"model": "embedded SmolLM2-135M", "scheme": "w4a16 g64 symmetric", "quantkit": commit,
             "eval": f"{windows} x {SEQ_LEN} tokens per domain", "float ppl": float_ppl, "rtn ppl": rtn_ppl,
             "texts sha256": sha}
    from transformers import AutoConfig

    return {"setup": setup, "rows": table(measured, AutoConfig.from_pretrained(path)),
            "note": "Intervals: 95% paired bootstrap over evaluation windows (2,000 resamples). '(auto)' marks the "
                    "method `--method auto` picks at that token count. Domains and texts: bench/calib_size.py."}
