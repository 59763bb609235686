"""`quantkit eval --backend llama.cpp`: a GGUF file scored by llama.cpp's own CPU kernels on eval's token windows.

llama-perplexity tokenises its text itself and scores only the second half of each chunk, so it cannot score
the windows the other backends score. Our scorer (llama_cpp_score.cpp, linked against the static llama.cpp
libraries that bench/llama_cpp_build.sh builds) takes token ids on stdin and answers with each token's
negative log-likelihood and the greedy continuations. The build script is the one place that knows where the
build lives; its --find mode answers without building.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ..errors import UserError
from .backends import Scores

NAME = "llama.cpp"
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "llama_cpp_build.sh"
BUILD_HINT = "bash bench/llama_cpp_build.sh"
SCORER = "quantkit-llama-score"


def check_models(specs) -> None:
    """llama.cpp reads GGUF files only; a folder would have to be exported first."""
    folders = [s.label for s in specs if s.gguf is None]
    if folders:
        raise UserError(f"--backend llama.cpp scores GGUF files only, and {', '.join(folders)} is not one; export "
                        "it with `quantkit quantize MODEL -o OUT.gguf --format gguf` or drop --backend llama.cpp")


def scorer_path() -> Path:
    """QUANTKIT_LLAMA_CPP_SCORER, else the scorer in the build script's cache folder."""
    explicit = os.environ.get("QUANTKIT_LLAMA_CPP_SCORER")
    if explicit:
        if not Path(explicit).is_file():
            raise UserError(f"QUANTKIT_LLAMA_CPP_SCORER '{explicit}' does not exist; build it with `{BUILD_HINT}`")
        return Path(explicit)
    found = None
    if BUILD_SCRIPT.is_file():
        proc = subprocess.run(["bash", str(BUILD_SCRIPT), "--find"], capture_output=True, text=True, timeout=60)
        found = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None
    if not found or not (Path(found) / SCORER).is_file():
        raise UserError(f"the llama.cpp backend needs llama.cpp's libraries and our scorer; build them once with "
                        f"`{BUILD_HINT}` (a few minutes, cached), or set QUANTKIT_LLAMA_CPP_SCORER")
    return Path(found) / SCORER


def score_llama_cpp(gguf: str, windows, prompts, max_new: int, threads: int | None = None,
                    scorer: Path | None = None) -> Scores:
    """Every window and prompt in one scorer process; each starts from an empty KV cache."""
    import torch

    scorer = scorer or scorer_path()
    ctx = max([len(w) for w in windows] + [len(p) + max_new for p in prompts] + [8])
    requests = [f"score {' '.join(map(str, w))}" for w in windows]
    requests += [f"greedy {max_new} {' '.join(map(str, p))}" for p in prompts]
    cmd = [str(scorer), str(gguf), "--ctx", str(ctx), "--threads", str(threads or torch.get_num_threads())]
    proc = subprocess.run(cmd, input="\n".join(requests) + "\n", capture_output=True, text=True, timeout=3600)
    answers = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or len(answers) != len(requests):
        why = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return Scores(NAME, False, error=f"{SCORER} on {Path(gguf).name}: {why[0]}")
    scored, generated = answers[:len(windows)], answers[len(windows):]
    return Scores(NAME, True, [a["nll"] for a in scored], [g["greedy"] for g in generated],
                  margins=[g["margins"] for g in generated], top1=[a["top"] for a in scored])
