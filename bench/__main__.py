"""python -m bench SUITE [--only PATTERN] [--quick] | python -m bench report | python -m bench list

Runs a suite's rows (bench/registry.py), writes bench/results/SUITE.json; `report` regenerates
docs/benchmarks.md from every JSON file there.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import registry


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("suite", help=f"one of {', '.join(registry.SUITES)}, 'report' or 'list'")
    ap.add_argument("--only", help="rows whose name contains this (case-insensitive)")
    ap.add_argument("--quick", action="store_true", help="the suite's smaller set-up (fewer samples, windows)")
    ap.add_argument("--results", type=Path, default=registry.RESULTS, help="folder of the JSON files")
    ap.add_argument("--docs", type=Path, default=None, help="report: the Markdown file to write")
    a = ap.parse_args(argv)
    from quantkit.errors import UserError

    try:
        if a.suite == "report":
            from .report import write_report

            print(write_report(a.results, a.docs))
            return 0
        if a.suite == "list":
            for name in registry.SUITES:
                print(name, *(r["name"] for r in registry.suite(name).ROWS), sep="\n  ")
            return 0
        mod = registry.suite(a.suite)
        result = mod.run(registry.select(mod.ROWS, a.only), a.quick)
        print(registry.write(a.suite, result, argv, a.results))
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
