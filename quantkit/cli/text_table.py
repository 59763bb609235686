"""Plain-text tables that fit the terminal without cutting names.

rich fits a table to the terminal by cutting its widest column, which is the layer name, so every row read
"model.layer…". Here a name is never cut: when a row is too wide, the name takes a line of its own and the
figures follow on the next, indented; a row's note (what the solver did) follows the figures when it fits,
else wraps on its own indented lines.
"""
from __future__ import annotations

import shutil
import textwrap

GAP = "  "
NOTE_INDENT = "    "


def terminal_width() -> int:
    """COLUMNS when set (scripts, tests), else the terminal's, else 80 (a pipe)."""
    return shutil.get_terminal_size((80, 24)).columns


def fill(text: str, width: int) -> str:
    """A sentence under the table, wrapped at word boundaries."""
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def render(headers: list[str], rows: list[tuple[str, list[str]]], width: int,
           notes: list[str] | None = None) -> list[str]:
    """The lines of a table whose first column is a name (left-aligned) and the rest figures (right-aligned)."""
    widths = [max([len(h)] + [len(cells[i]) for _, cells in rows]) for i, h in enumerate(headers[1:])]
    name_w = max([len(headers[0])] + [len(name) for name, _ in rows])
    figures = lambda cells: GAP.join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    row_w = name_w + len(GAP) + len(figures(headers[1:]))
    inline = row_w <= width
    notes = notes or [""] * len(rows)
    notes_inline = inline and row_w + len(GAP) + max(map(len, notes), default=0) <= width

    def lines(name: str, cells: list[str], note: str) -> list[str]:
        out = [name.ljust(name_w) + GAP + figures(cells)] if inline else [name, GAP + figures(cells)]
        if note and notes_inline:
            out[-1] += GAP + note
        elif note:
            out += textwrap.wrap(note, width, initial_indent=NOTE_INDENT, subsequent_indent=NOTE_INDENT,
                                 break_long_words=False)
        return [line.rstrip() for line in out]

    head = lines(headers[0], headers[1:], "solver" if notes_inline and any(notes) else "")
    rule = "-" * min(width, max(map(len, head)))
    return head + [rule] + [line for (name, cells), note in zip(rows, notes) for line in lines(name, cells, note)]
