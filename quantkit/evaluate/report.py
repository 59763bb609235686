"""The report in three forms: a rich table for the terminal, report.md for people, report.json for tools."""
from __future__ import annotations

import json
from pathlib import Path


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _ms(s) -> str:
    return "-" if s is None else f"{1000 * s:.0f} ms"


def summary_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    base = next(r for r in report["variants"] if r["is_base"])
    head = ["variant", "weights", "exact match", "agreement", "token agr", "ppl", "KL mean", "KL p99", "KL max",
            "p50 latency", "tok/s", "peak mem", "KV/token"]
    rows = []
    for r in report["variants"]:
        allt = r.get("all") or {}
        lat = r.get("latency") or {}
        ppl = _num(r.get("ppl"))
        if r.get("ppl") is not None and not r["is_base"] and base.get("ppl"):
            ppl += f" ({100 * (r['ppl'] / base['ppl'] - 1):+.1f}%)"
        kl = r.get("kl") or {}
        rows.append([r["label"] + (" (base)" if r["is_base"] else ""), _bytes(r.get("weight_bytes")),
                     _pct(allt.get("exact_match")), _pct(allt.get("answer_agreement")),
                     _pct(r.get("token_agreement")), ppl, _num(kl.get("mean"), "{:.4f}"),
                     _num(kl.get("p99"), "{:.4f}"), _num(kl.get("max"), "{:.3f}"), _ms(lat.get("p50_s")),
                     _num(lat.get("tokens_per_s"), "{:.1f}"), _bytes(r.get("peak_memory_bytes")),
                     _bytes(r.get("kv_bytes_per_token"))])
    return head, rows


def task_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    variants = report["variants"]
    names = sorted({t for r in variants for t in (r.get("per_task") or {})})
    head = ["task", "n"] + [f"{r['label']} EM" for r in variants] + [
        f"{r['label']} agr / KL p99" for r in variants if not r["is_base"]]
    rows = []
    for t in names:
        cells = [t, str((variants[0].get("per_task") or {}).get(t, {}).get("n", "-"))]
        cells += [_pct((r.get("per_task") or {}).get(t, {}).get("exact_match")) for r in variants]
        for r in variants:
            if not r["is_base"]:
                pt = (r.get("per_task") or {}).get(t, {})
                cells.append(f"{_pct(pt.get('answer_agreement'))} / {_num(pt.get('kl_p99'), '{:.3f}')}")
        rows.append(cells)
    return head, rows


def print_tables(report: dict, console) -> None:
    from rich.table import Table

    for title, (head, rows) in (("quantkit eval", summary_rows(report)), ("per task", task_rows(report))):
        if not rows:
            continue
        t = Table(title=title)
        for i, h in enumerate(head):
            t.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            t.add_row(*r)
        console.print(t)
    if report.get("backends"):
        from .backend_report import markdown as backends_markdown

        console.print(backends_markdown(report["backends"]))
    for line in report.get("gate_failures") or []:
        console.print(f"[red]gate failed[/] {line}")


def _md_table(head, rows) -> str:
    esc = [[c.replace("|", "\\|").replace("\n", "\\n") for c in r] for r in [head, *rows]]
    out = ["| " + " | ".join(esc[0]) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(out)


def markdown(report: dict, plots: list[str]) -> str:
    s = report["settings"]
    parts = ["# quantkit eval report", "",
             f"Baseline `{report['base']}`; data `{s.get('data')}` ({s.get('windows', 0)} windows of {s['seq_len']} "
             f"tokens); tasks `{s.get('tasks')}` ({s.get('num_tasks', 0)} prompts, greedy, up to "
             f"{s['max_new_tokens']} new tokens); device {s['device']}.", "",
             _md_table(*summary_rows(report)), ""]
    head, rows = task_rows(report)
    if rows:
        parts += ["## Per task (exact match; answer agreement / KL p99 against the baseline)", "",
                  _md_table(head, rows), ""]
    if report.get("gates"):
        fails = report.get("gate_failures") or []
        parts += ["## Gates", "", ", ".join(f"`{k}={v:g}`" for k, v in report["gates"].items()) + ": " +
                  ("all passed" if not fails else "FAILED"), ""] + [f"- {f}" for f in fails] + [""]
    for r in report["variants"]:
        if r["is_base"] or not r.get("worst"):
            continue
        parts += [f"## Ten largest KL positions: {r['label']}", "",
                  _md_table(["KL", "where", "context (last 80 chars)", "next", "base top", "variant top"],
                            [[f"{w['kl']:.3f}", f"{w['source']} {w['where']}:{w['position']}",
                              repr(w["context"]), repr(w["next_token"]), repr(w["base_top"]),
                              repr(w["variant_top"])] for w in r["worst"]]), ""]
    if report.get("backends"):
        from .backend_report import markdown as backends_markdown

        parts += [backends_markdown(report["backends"])]
    for p in plots:
        parts += [f"![{Path(p).stem}]({Path(p).name})", ""]
    parts += ["Metrics: KL is KL(base || variant) per token in nats at every scored text position and every "
              "baseline answer token (teacher-forced); token agreement is the top-1 match rate at those "
              "positions; agreement is the share of task answers (first line) identical to the baseline's; "
              "exact match compares the first line with the reference. Latency is per request on quantkit's "
              "decode loop; peak memory is " + (report["variants"][0].get("peak_memory_kind") or "") + ".", ""]
    return "\n".join(parts)


def write_reports(report: dict, items: dict, out_dir: Path, plots: list[str]) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(markdown(report, plots))
    if items:
        with open(out_dir / "answers.jsonl", "w") as fh:
            for item in items.values():
                fh.write(json.dumps(item, ensure_ascii=False) + "\n")
    return {"json": str(out_dir / "report.json"), "markdown": str(out_dir / "report.md"),
            "answers": str(out_dir / "answers.jsonl") if items else None, "plots": plots}
