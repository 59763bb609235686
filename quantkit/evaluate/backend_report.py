"""`quantkit eval --backend`: the same checkpoints scored by several engines, side by side, in one dtype.

Users report that one W4 checkpoint scores differently in vLLM and in transformers; this section of the report
shows it directly. Every backend scores the same windows and greedy prompts; a backend whose perplexity departs
from the median of the backends by more than the tolerance is flagged, and so is one whose greedy answers part
from the first backend's before `min_agree` tokens where its top two choices were not a near-tie.
"""
from __future__ import annotations

import statistics

from ..errors import UserError
from .backends import BACKENDS, NEAR_TIE, Scores, greedy_agreement, score_quantkit, score_transformers, score_vllm, vllm_python


def check_backends(backends: list[str]) -> list[str]:
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise UserError(f"unknown backend {', '.join(bad)}; choose from {', '.join(BACKENDS)}")
    if len(set(backends)) < 2:
        raise UserError("--backend compares engines: give at least two, e.g. --backend quantkit --backend vllm")
    return list(dict.fromkeys(backends))


def _scores(backend: str, specs, windows, prompts, max_new: int, dtype: str, python) -> list[Scores]:
    paths = [str(s.path) for s in specs]
    if backend == "llama.cpp":  # the GGUF file itself, in the types it stores; dtype does not apply
        from .llama_cpp_backend import check_models, score_llama_cpp, scorer_path

        check_models(specs)
        scorer = scorer_path()  # once: finding it runs the build script's --find
        return [score_llama_cpp(str(s.gguf), windows, prompts, max_new, scorer=scorer) for s in specs]
    if backend == "vllm":
        jobs = [{"model": p, "dtype": dtype, "windows": windows, "prompts": prompts, "max_new": max_new}
                for p in paths]
        return score_vllm(jobs, python)
    fn = score_quantkit if backend == "quantkit" else score_transformers
    return [fn(p, windows, prompts, max_new, dtype) for p in paths]


def compare_backends(specs, windows, prompts, backends: list[str], *, dtype: str = "float16", max_new: int = 16,
                     tolerance: float = 0.005, min_agree: int = 16, vllm_python_path: str | None = None,
                     log=lambda msg: None) -> dict:
    """{"dtype", "tolerance", "rows": [{model, backend, ppl, vs_median, greedy_agree, flagged, error}]}."""
    backends = check_backends(backends)
    python = vllm_python(vllm_python_path) if "vllm" in backends else None
    win = [w.tolist() if hasattr(w, "tolist") else list(w) for w in windows]
    by_backend = {}
    for b in backends:
        log(f"scoring {len(specs)} models with {b} in " + ("their GGUF types" if b == "llama.cpp" else dtype))
        by_backend[b] = _scores(b, specs, win, prompts, max_new, dtype, python)
    rows = []
    for i, spec in enumerate(specs):
        scores = {b: by_backend[b][i] for b in backends}
        ppls = [s.perplexity for s in scores.values() if s.ok and s.perplexity]
        median = statistics.median(ppls) if ppls else None
        first = scores[backends[0]]
        for b, s in scores.items():
            rows.append(_row(spec.label, b, s, first, median, tolerance, min_agree))
    return {"dtype": dtype, "tolerance": tolerance, "min_agree": min_agree, "backends": backends, "rows": rows}


def _row(label, backend, s: Scores, first: Scores, median, tolerance, min_agree) -> dict:
    if not s.ok:
        return {"model": label, "backend": backend, "ppl": None, "vs_median": None, "greedy_agree": None,
                "flagged": True, "error": s.error}
    rel = s.perplexity / median - 1 if median else None
    agree = greedy_agreement(first, s) if first.ok else []
    margins = first.margins or [[]] * len(agree)
    # the first backend's top-1 minus top-2 where each answer parted early (None: it did not, or no margins)
    parting = [m[a] if a < min(min_agree, len(g)) and a < len(m) else None
               for a, g, m in zip(agree, first.greedy, margins)]
    # an early parting at a near-tie is rounding flipping a coin, not a wrong engine (backends.NEAR_TIE)
    short = [a for a, g, p in zip(agree, first.greedy, parting)
             if a < min(min_agree, len(g)) and (p is None or p >= NEAR_TIE)]
    return {"model": label, "backend": backend, "ppl": s.perplexity, "vs_median": rel, "greedy_agree": agree,
            "parting_margin": parting, "flagged": (rel is not None and abs(rel) > tolerance) or bool(short),
            "error": None}


def markdown(section: dict) -> str:
    lines = [f"## Backends ({section['dtype']}; flagged: perplexity more than {100 * section['tolerance']:.2g}% "
             f"from the backends' median, or greedy tokens parting from {section['backends'][0]}'s before "
             f"{section['min_agree']} where its top two were more than {NEAR_TIE} nats apart)", "",
             "| model | backend | perplexity | vs median | greedy tokens equal | flag |", "|---|---|---:|---:|---|---|"]
    for r in section["rows"]:
        if r["error"]:
            lines.append(f"| {r['model']} | {r['backend']} | - | - | - | does not load: {r['error'][:120]} |")
            continue
        rel = "-" if r["vs_median"] is None else f"{100 * r['vs_median']:+.3f}%"
        agree = ", ".join(map(str, r["greedy_agree"])) or "-"
        lines.append(f"| {r['model']} | {r['backend']} | {r['ppl']:.4f} | {rel} | {agree} | "
                     f"{'**differs**' if r['flagged'] else ''} |")
    return "\n".join(lines) + "\n"
