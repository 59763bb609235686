"""Module-name matching shared by recipes, the writer and the reader (compressed-tensors target rules)."""
from __future__ import annotations

import fnmatch
import re


def matches(pattern: str, name: str, module=None) -> bool:
    """'re:<regex>' (re.match on the full name), a module class name such as 'Linear', or a glob.

    A glob also matches as a suffix, so 'lm_head' or 'mlp.*' work without a leading '*.'.
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if module is not None and type(module).__name__ == pattern:
        return True
    return name == pattern or fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")
