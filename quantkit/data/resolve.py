"""A spec string (named dataset, file, saved-dataset folder) to a Corpus."""
from __future__ import annotations

import difflib
from pathlib import Path

from ..errors import UserError
from .corpus import Corpus
from .hub import load_hub
from .local import SUFFIXES, load_local
from .specs import known_specs

SELF = "self"


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or "\\" in spec or spec.startswith((".", "~")) or Path(spec).suffix.lower() in SUFFIXES


def resolve_corpus(spec: str, text_field: str | None = "text", for_eval: bool = False) -> Corpus:
    flag = "--data" if for_eval else "--calib"
    named = known_specs()
    if spec in named:
        return load_hub(named[spec], for_eval, text_field)
    path = Path(spec).expanduser()
    if path.exists():
        return load_local(path, text_field, for_eval)
    if _looks_like_path(spec):
        raise UserError(f"{spec}: no such file or folder; pass an existing file with {flag} PATH")
    choices = ([] if for_eval else [SELF]) + sorted(named)
    close = difflib.get_close_matches(spec, choices, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise UserError(f"unknown dataset spec '{spec}'{hint}; known: {', '.join(choices)}; "
                    f"or pass a path to a {'/'.join(SUFFIXES)} file or a datasets.save_to_disk folder")
