"""A non-editable install works: the wheel carries the recipes, calibration specs, CUDA sources and web files.

The wheel is built from a copy of the working tree (what a fresh clone holds), so the test never writes build/
or egg-info into the shared checkout, and the installed package is run from a folder outside the repository.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run inside the installed copy: everything it reports must come from there, not from the checkout.
PROBE = """
import json, sys
import quantkit
from quantkit.data.specs import get_spec
from quantkit.recipe import load_recipe, recipes_dir
from pathlib import Path
spec = get_spec("wikitext2")
smoke = load_recipe(recipes_dir() / "ci-smoke.yaml")
print(json.dumps({
    "file": quantkit.__file__, "recipes_dir": str(recipes_dir()),
    "wikitext2": spec and [spec.hub, spec.config], "smoke_eval": smoke.eval.data,
    "smoke_eval_exists": Path(smoke.eval.data).is_file()}))
"""


def _tree_copy(dest: Path) -> list[str]:
    """Copies the working tree's files that git would commit (tracked or new, not ignored) to DEST; their names."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    copied = []
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():  # a tracked file another change deleted is listed but gone
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
            copied.append(name)
    return copied


def _pip(*args: str, cwd: Path) -> None:
    # No build isolation: the test's environment already has setuptools, and it must not need the network.
    r = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "-q"],
                       cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def _wheel_from(src: Path, out: Path) -> Path:
    _pip("wheel", "-w", str(out), ".", cwd=src)
    (wheel,) = out.glob("quantkit-*.whl")
    return wheel


def _run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    names = _tree_copy(src)
    wheel = _wheel_from(src, tmp / "dist")
    site = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp / "elsewhere"
    run.mkdir()
    return {"tmp": tmp, "src": src, "names": names, "wheel": wheel, "site": site, "cwd": run}


def test_installed_cli_lists_every_shipped_recipe(built):
    cli = "import sys; from quantkit.cli import main; sys.argv[0] = 'quantkit'; main()"
    r = _run_installed(built["site"], built["cwd"], "-c", cli, "recipe", "list", "--json")
    assert r.returncode == 0, r.stderr
    listed = [row["name"] for row in json.loads(r.stdout)]
    shipped = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert shipped and listed == shipped


def test_installed_package_reads_its_own_copies(built):
    r = _run_installed(built["site"], built["cwd"], "-c", PROBE)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    site = built["site"].resolve()
    assert Path(got["file"]).resolve().is_relative_to(site), got["file"]
    assert Path(got["recipes_dir"]) == site / "quantkit" / "recipes"
    assert got["wikitext2"] == ["Salesforce/wikitext", "wikitext-2-raw-v1"]
    # {recipe_dir} in ci-smoke points at the eval text shipped beside the installed recipe
    assert Path(got["smoke_eval"]).resolve().is_relative_to(site) and got["smoke_eval_exists"]


def test_wheel_carries_every_data_file_of_the_package(built):
    """The web UI and the CUDA sources (compiled on first use) are read from beside the modules at run time."""
    data = {n for n in built["names"] if n.startswith("quantkit/") and not n.endswith(".py")}
    assert any(n.endswith(".cu") for n in data) and any(n.endswith("static/index.html") for n in data)
    missing = sorted(n for n in data if not (built["site"] / n).is_file())
    assert not missing, f"not in the wheel: {missing}; add them to package-data in pyproject.toml"


def test_wheel_from_the_sdist_has_the_same_files(built):
    """`python -m build` goes through the sdist: MANIFEST.in must bring recipes/ and calibration/ along."""
    tmp = built["tmp"]
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp / 'sdist')!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=built["src"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    with tarfile.open(tmp / "sdist" / r.stdout.split()[-1]) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    from_sdist = _wheel_from(unpacked, tmp / "dist-sdist")
    names = lambda w: {n for n in zipfile.ZipFile(w).namelist() if ".dist-info/" not in n}  # noqa: E731
    assert names(from_sdist) == names(built["wheel"])
    for folder in ("recipes", "calibration"):
        expected = {f"quantkit/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / folder).rglob("*") if p.is_file()}
        assert expected and expected <= names(from_sdist)
