"""Limits a recipe's YAML must keep before anything builds it, checked on the parser's event stream.

The event stream is produced without recursion and without expanding aliases, so it is safe to walk whatever
the text holds. Built, the same text could be 501 bytes of nested aliases ("billion laughs") that expand to
billions of values and run until killed, or 5000 nested brackets whose construction overflows Python's
stack, or a 5000-digit integer that int() refuses with a ValueError. Each is refused as FILE:LINE here.
"""
from __future__ import annotations

import re

import yaml

MAX_DEPTH = 100  # a recipe nests four levels; this leaves room for any hand-written data in it
MAX_VALUES = 100_000  # values after alias expansion: a recipe holds a few hundred
MAX_DIGITS = 30  # no recipe field takes an integer near 10^30
_INT = re.compile(r"[-+]?(0b[01_]+|0x[0-9a-fA-F_]+|0o?[0-7_]+|[0-9][0-9_]*(:[0-5]?[0-9])*)")


class _Limits:
    """Expanded value counts per open collection and per anchor, and the nesting depth, as events arrive."""

    def __init__(self):
        self.open: list[tuple[int, str | None]] = []  # (values so far, anchor) per open collection
        self.anchored: dict[str, int] = {}
        self.total = 0

    def add(self, n: int) -> str | None:
        self.total += n
        if self.open:
            count, anchor = self.open[-1]
            self.open[-1] = (count + n, anchor)
        if self.total > MAX_VALUES:
            return f"expands to more than {MAX_VALUES} values (through aliases); a recipe needs a few hundred"
        return None

    def event(self, ev) -> str | None:
        if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            self.open.append((1, ev.anchor))
            if len(self.open) > MAX_DEPTH:
                return f"nests deeper than {MAX_DEPTH} levels; a recipe nests a few"
        elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            count, anchor = self.open.pop()
            if anchor is not None:
                self.anchored[anchor] = count
            self.total -= count  # counted again, as one value of its parent
            return self.add(count)
        elif isinstance(ev, yaml.ScalarEvent):
            if ev.anchor is not None:
                self.anchored[ev.anchor] = 1
            digits = sum(c.isdigit() for c in ev.value)
            if ev.style is None and digits > MAX_DIGITS and _INT.fullmatch(ev.value):
                return f"holds an integer of {digits} digits; no recipe field takes one larger than 10^{MAX_DIGITS}"
            return self.add(1)
        elif isinstance(ev, yaml.AliasEvent):
            return self.add(self.anchored.get(ev.anchor, 1))
        return None


def yaml_limit_problem(text: str, source: str) -> str | None:
    """'SOURCE:LINE: ...' for the first limit TEXT breaks; None when it keeps them all (or is not valid YAML,
    which the parser that follows reports with its own line)."""
    limits = _Limits()
    try:
        for ev in yaml.parse(text, Loader=yaml.SafeLoader):
            problem = limits.event(ev)
            if problem:
                return f"{source}:{ev.start_mark.line + 1}: the recipe {problem}; fix the file"
    except yaml.YAMLError:
        return None
    return None
