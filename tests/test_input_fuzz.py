"""Issue 37.7: seeded mutation loops over a shipped recipe and a calibration file in each text format. Every
case must parse or be refused with a one-line UserError within a deadline: never another exception or a hang
(the alias bombs, deep nesting and huge numbers of the issue are among the mutations)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from quantkit.data.local import load_local
from quantkit.errors import UserError
from quantkit.recipe import parse_recipe

from helpers import deadline

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
CASES, PER_CASE_S = 300, 10


def _bomb(rng) -> str:
    n = rng.randrange(5, 12)
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, n)]
    return "\n".join(lines)


def _splice(text: str, rng, piece: str) -> str:
    lines = text.splitlines()
    at = rng.randrange(len(lines) + 1)
    return "\n".join(lines[:at] + [piece] + lines[at:]) + "\n"


def _mutate_text(text: str, rng) -> tuple[str, str]:
    """One damage to TEXT (a recipe, a JSONL or CSV file), and its name."""
    how = rng.choice(["truncate", "bytes", "bomb", "deep", "digits", "swap", "dup", "tab", "value"])
    if how == "truncate":
        return text[:rng.randrange(len(text))], how
    if how == "bytes":
        chars = list(text)
        for _ in range(rng.randrange(1, 8)):
            chars[rng.randrange(len(chars))] = rng.choice(["\x00", "\ufffd", ":", "[", "{", "'", '"', "&", "*", "\n"])
        return "".join(chars), how
    if how == "bomb":
        return _splice(text, rng, _bomb(rng)), how
    if how == "deep":
        n = rng.choice([99, 101, 1000, 5000, 20000])
        return _splice(text, rng, "deep: " + "[" * n + "]" * n), f"deep {n}"
    if how == "digits":
        return _splice(text, rng, "n: " + "9" * rng.choice([20, 31, 500, 5000])), how
    lines = text.splitlines()
    i = rng.randrange(len(lines))
    if how == "swap":
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif how == "dup":
        lines.insert(i, lines[i])
    elif how == "tab":
        lines[i] = "\t" + lines[i]
    else:
        key, sep, _ = lines[i].partition(":")
        lines[i] = key + (sep or ":") + " " + rng.choice(["-1", "0", "1e999", ".nan", "[]", "{}", "~", "'x'",
                                                          "9" * 40, "*nope", "&a", "!!python/object:os.system"])
    return "\n".join(lines) + "\n", how


def test_mutated_recipes_parse_or_refuse_in_one_line(tmp_path):
    rng = random.Random(37)
    texts = [p.read_text() for p in sorted(RECIPES.glob("*.yaml"))]
    outcomes = {"parsed": 0, "refused": 0}
    for i in range(CASES):
        text, how = _mutate_text(rng.choice(texts), rng)
        try:
            with deadline(PER_CASE_S):
                parse_recipe(text, "r.yaml", tmp_path)
            outcomes["parsed"] += 1
        except UserError as e:
            assert "\n" not in str(e) and str(e).startswith("r.yaml"), f"case {i} ({how}): {e}"
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001  (the point: name the case, whatever it raised)
            raise AssertionError(f"case {i} ({how}) raised {type(e).__name__}: {e}\n{text[:300]}") from e
    assert outcomes["refused"] > CASES // 3 and outcomes["parsed"] > 0, outcomes


def _calibration_texts() -> dict[str, str]:
    rows = [{"text": f"Document {i}: the quick brown fox jumps over the lazy dog {i} times."} for i in range(20)]
    return {".jsonl": "\n".join(json.dumps(r) for r in rows) + "\n",
            ".json": json.dumps(rows, indent=1),
            ".csv": "text\n" + "\n".join(f'"{r["text"]}"' for r in rows) + "\n"}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_mutated_calibration_files_load_or_refuse_in_one_line(tmp_path, suffix):
    rng = random.Random(f"calib{suffix}")
    base = _calibration_texts()[suffix]
    for i in range(CASES // 3):
        text, how = _mutate_text(base, rng)
        path = tmp_path / f"c{i}{suffix}"
        path.write_text(text, errors="surrogatepass")
        try:
            with deadline(PER_CASE_S):
                corpus = load_local(path, "text")
            assert all(isinstance(r, str) for r in corpus.rows[:50]), f"case {i} ({how})"
        except UserError as e:
            assert "\n" not in str(e), f"case {i} ({how}): {e}"
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"case {i} ({how}) raised {type(e).__name__}: {e}\n{text[:300]}") from e
