"""A Corpus is what every source reduces to: an indexable list of rows, each plain text or a chat.

Rows are read lazily (a hub split can hold hundreds of thousands) and turned into text or a message list
by a RowReader that knows which field holds the text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import UserError


@dataclass
class Corpus:
    rows: Sequence  # each a str, a chat (list of {role, content}) or None; None and "" are skipped
    source: dict  # the resolved source, recorded in the calibration metadata
    # continuous: the rows are consecutive pieces of one running text (a .txt file, WikiText), so they are
    # joined in order with `separator`; otherwise each row is an independent document.
    continuous: bool = False
    separator: str = "\n\n"


class LazyRows(Sequence):
    def __init__(self, n: int, get: Callable[[int], object]):
        self._n, self._get = n, get

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._get(j) for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._get(i % self._n)


def _is_chat(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


class RowReader:
    """Turns a record (dict) into a row (text or chat), given which field (or template) holds the text."""

    def __init__(self, columns: Sequence[str], where: str, text_field: str | None = "text",
                 messages_field: str | None = None, text_template: str | None = None):
        self.where = where
        self.template = text_template
        self.field = None
        if text_template:
            return
        wanted = messages_field or text_field or "text"
        if wanted in columns:
            self.field = wanted
        elif text_field in (None, "text") and "messages" in columns:
            # Chat sets name their column `messages`; take it when the user left --text-field at its default.
            self.field = "messages"
        else:
            present = ", ".join(map(str, columns)) or "(none)"
            raise UserError(f"{where} has no field '{wanted}'; fields present: {present}; "
                            f"pass --text-field NAME")

    def __call__(self, record: dict, where: str | None = None):
        if self.template:
            try:
                return self.template.format_map(record)
            except KeyError as e:
                raise UserError(f"{where or self.where}: text template needs field {e}; "
                                f"fields present: {', '.join(map(str, record))}") from None
        if self.field not in record:
            raise UserError(f"{where or self.where} has no field '{self.field}'; fields present: "
                            f"{', '.join(map(str, record)) or '(none)'}; pass --text-field NAME")
        value = record[self.field]
        if value is None or isinstance(value, str):
            return value
        if _is_chat(value):
            return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
        raise UserError(f"{where or self.where}: field '{self.field}' holds {type(value).__name__}, "
                        f"not text or a chat message list; pass --text-field NAME")
