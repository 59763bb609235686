"""The server's shape (the architecture issue): quantkit.serve builds on quantkit.runtime, never the reverse,
and every endpoint is a module-level function one can read alone."""
import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import quantkit.runtime
import quantkit.serve
from quantkit.serve.app import create_app
from quantkit.serve.playground import CompareModel, mount

from serve_helpers import random_model, real_tokenizer

SERVE = Path(quantkit.serve.__file__).parent


def test_the_runtime_never_imports_the_server():
    modules = [m.name for m in pkgutil.iter_modules(quantkit.runtime.__path__, "quantkit.runtime.")]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('quantkit.serve')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert len(modules) > 10 and out.strip() == "[]"


def _routes(routes):
    for r in routes:  # FastAPI keeps an included router's routes behind one entry
        yield from _routes(r.original_router.routes) if hasattr(r, "original_router") else [r]


def test_every_endpoint_is_a_module_level_function():
    from quantkit.runtime.engine import Engine

    tok = real_tokenizer()
    engine, base = Engine(random_model(tok), tok), Engine(random_model(tok, seed=6), tok)
    try:
        app = mount(create_app(engine, "m"), compare=CompareModel(base, "b"))
        routes = [r for r in _routes(app.routes) if hasattr(r, "endpoint")]
        assert {r.path for r in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                            "/metrics", "/v1/details/{rid}", "/", "/v1/playground",
                                            "/v1/playground/kl"}
        for r in routes:
            if r.endpoint.__module__.startswith("quantkit."):
                assert "<locals>" not in r.endpoint.__qualname__, r.path
    finally:
        engine.close()
        base.close()


def test_files_and_functions_stay_short():
    for path in sorted(SERVE.glob("*.py")) + sorted(SERVE.glob("static/*")):
        text = path.read_text()
        assert text.count("\n") <= 300, path.name
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert node.end_lineno - node.lineno < 60, f"{path.name}: {node.name}"
