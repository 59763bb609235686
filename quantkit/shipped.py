"""Where the shipped recipes/ and calibration/ folders are, for a wheel install and for a source checkout.

The repository's top-level recipes/ and calibration/ folders are the only copies kept in git (users read and
copy them there). setup.py's build_py copies them into the package when a wheel is built, so an installed
wheel finds them inside the package; an editable install has no such copy and reads the checkout's folders.
"""
from __future__ import annotations

from pathlib import Path

# setup.py keeps the same tuple: it cannot import the package at build time (torch may not be installed yet).
SHIPPED = ("recipes", "calibration")


def shipped_dir(name: str) -> Path:
    """The folder NAME ('recipes' or 'calibration'): inside the installed package, else in the source checkout."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped folder {name!r}; one of {SHIPPED}")
    # A plain path next to the package, not importlib.resources: callers glob and open files, and the package
    # is never imported from a zip (torch and the CUDA kernels need real files anyway).
    package = Path(__file__).resolve().parent
    packaged = package / name
    if packaged.is_dir():
        return packaged
    checkout = package.parent
    # Only a quantkit source checkout may supply the folder: beside a wheel install the parent is
    # site-packages, whose 'recipes' or 'calibration' would belong to some other distribution.
    if (checkout / "pyproject.toml").is_file() and (checkout / name).is_dir():
        return checkout / name
    return packaged
