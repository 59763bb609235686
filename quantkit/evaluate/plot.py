"""PNG plots (headless): KL distribution per variant, exact match per task, size against quality."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    return plt


def kl_distribution(kls: dict[str, list[float]], path: Path) -> Path:
    """Complementary CDF on log axes: the tail (what share of tokens exceed a KL) is what matters."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, v in kls.items():
        v = sorted(x for x in v if x > 0)
        if not v:
            continue
        n = len(v)
        ax.step(v, [1 - i / n for i in range(n)], where="post", label=f"{label} (n={n})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-token KL(base || variant), nats")
    ax.set_ylabel("share of tokens with KL >= x")
    ax.set_title("KL from the baseline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def task_exact_match(per_task: dict[str, dict[str, float | None]], path: Path) -> Path:
    """Grouped bars: one group per task, one bar per model."""
    plt = _plt()
    labels = list(per_task)
    tasks = sorted({t for d in per_task.values() for t in d})
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(tasks) + 2), 4.5))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        ys = [(per_task[label].get(t) or 0.0) * 100 for t in tasks]
        ax.bar([j + i * width for j in range(len(tasks))], ys, width, label=label)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(tasks))])
    ax.set_xticklabels(tasks, rotation=20, ha="right")
    ax.set_ylabel("exact match, %")
    ax.set_ylim(0, 100)
    ax.set_title("Exact match per task")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def size_quality(points: list[tuple[str, float, float]], ylabel: str, path: Path) -> Path:
    """(label, weight bytes, quality) per model: smaller and lower-left is better."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, size, q in points:
        ax.scatter([size / 1e6], [q])
        ax.annotate(label, (size / 1e6, q), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("weight bytes, MB")
    ax.set_ylabel(ylabel)
    ax.set_title("Size against quality")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(report: dict, kls: dict[str, list[float]], out_dir: Path) -> list[str]:
    out = []
    variants = report["variants"]
    if any(kls.values()):
        out.append(kl_distribution({k: v for k, v in kls.items() if v}, out_dir / "kl_distribution.png"))
    if any(r.get("per_task") for r in variants):
        out.append(task_exact_match({r["label"]: {t: d.get("exact_match") for t, d in r["per_task"].items()}
                                     for r in variants}, out_dir / "task_exact_match.png"))
    if all(r.get("ppl") is not None for r in variants):
        pts = [(r["label"], r["weight_bytes"], r["ppl"]) for r in variants]
        out.append(size_quality(pts, "perplexity", out_dir / "size_quality.png"))
    elif all((r.get("all") or {}).get("answer_agreement") is not None for r in variants):
        pts = [(r["label"], r["weight_bytes"], 100 * r["all"]["answer_agreement"]) for r in variants]
        out.append(size_quality(pts, "answer agreement with the baseline, %", out_dir / "size_quality.png"))
    return [str(p) for p in out]
