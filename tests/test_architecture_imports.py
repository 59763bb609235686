"""docs/ARCHITECTURE.md's layering, kept true: no import runs upward and no import cycle exists.

Function-level imports count: an import hidden inside a function is still a dependency, and hiding one is how
cycles used to slip in. A short AST scan over quantkit/, no new dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "quantkit"

# Lowest first. A module may import its own layer or lower ones; a module belongs to the longest prefix that
# matches it. No exceptions: every package sits whole in one layer.
LAYERS = [
    ["quantkit.version", "quantkit.errors", "quantkit.e4m3", "quantkit.fp4", "quantkit.schemes", "quantkit.qweight",
     "quantkit.targets", "quantkit.shipped", "quantkit.distributed", "quantkit.dtypes", "quantkit.devices",
     "quantkit.heap", "quantkit.cache_dir"],
    ["quantkit.formats"],
    ["quantkit.kernels"],
    ["quantkit.linear", "quantkit.models", "quantkit.data", "quantkit.capture"],
    ["quantkit.solvers"],
    ["quantkit.recipe"],  # embeds each solver's own options model (solvers/*_options.py)
    ["quantkit.plan", "quantkit.auto_method", "quantkit.preflight"],
    ["quantkit.pipeline"],
    ["quantkit.job", "quantkit.gguf_job"],
    ["quantkit.runtime"],
    ["quantkit.drafts", "quantkit.open_model", "quantkit.evaluate", "quantkit.serve", "quantkit.inspect_ckpt",
     "quantkit.inspect_gguf", "quantkit.inspect_summary", "quantkit.verify_ckpt"],
    ["quantkit.recipe_run"],
    ["quantkit.cli", "quantkit.testing"],
    ["quantkit.__main__"],  # `python -m quantkit` (how torchrun starts it): the CLI, nothing else
]
RANK = {prefix: i for i, group in enumerate(LAYERS) for prefix in group}
# the package itself (quantkit/__init__.py) is the public facade, `quantkit.load`: above everything it offers
ROOT_RANK = len(LAYERS)
# the package never imports its test fixtures; only tests and bench/ do
FIXTURES = "quantkit.testing"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def rank(mod: str) -> int:
    if mod == "quantkit":
        return ROOT_RANK
    best = max((p for p in RANK if mod == p or mod.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{mod} is in no layer of LAYERS; add it (and to docs/ARCHITECTURE.md)")
    return RANK[best]


def _resolve(node: ast.ImportFrom, mod: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(mod: str) -> set[str]:
    """Every quantkit module MOD imports, anywhere in its body. A package's __init__ running first is not
    counted: it is the package's own business and would make every package a cycle with its members."""
    path = MODULES[mod]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(node, mod, path.name == "__init__.py")
            # 'from P import m' depends on the module P.m when m is one, else on P itself
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n in MODULES and n != mod)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def _upward(graph) -> list[str]:
    return [f"{m} (layer {rank(m)}) imports {t} (layer {rank(t)})"
            for m in sorted(graph) for t in sorted(graph[m]) if rank(t) > rank(m)]


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative enough for this size)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for m in MODULES:
        rank(m)


def test_no_package_is_split_across_layers():
    """An entry naming a module inside a package (as pipeline.capture once was) would put part of a folder in
    another layer than the rest: a folder's layer is what docs/ARCHITECTURE.md promises for all of it."""
    split = [p for p in RANK if p.count(".") > 1]
    assert not split, f"layer entries inside a package: {split}; move the module to a folder of its layer"


def test_no_import_runs_upward():
    bad = _upward({m: t for m, t in GRAPH.items() if not m.startswith(FIXTURES)})
    assert not bad, "imports against docs/ARCHITECTURE.md's layers:\n" + "\n".join(bad)


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_package_never_imports_its_fixtures():
    bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if not m.startswith(FIXTURES)
           for t in ts if t.startswith(FIXTURES)]
    assert not bad, bad


# the checks themselves must catch what they are for
def test_the_scan_sees_function_level_imports_and_relative_ones():
    assert "quantkit.formats.output" in GRAPH["quantkit.formats.writer"]
    assert "quantkit.solvers.gptq_solver" in GRAPH["quantkit.plan"]  # imported inside solver_for


@pytest.mark.parametrize("graph, want", [
    ({"quantkit.solvers.a": {"quantkit.runtime.b"}, "quantkit.runtime.b": set()}, "upward"),
    ({"quantkit.solvers.a": {"quantkit.solvers.b"}, "quantkit.solvers.b": {"quantkit.solvers.a"}}, "cycle"),
])
def test_the_checks_fail_on_a_bad_graph(graph, want):
    if want == "upward":
        assert _upward(graph) == ["quantkit.solvers.a (layer 4) imports quantkit.runtime.b (layer 9)"]
    else:
        assert _cycles(graph) == [["quantkit.solvers.a", "quantkit.solvers.b"]]
