"""Incremental detokenisation with stop strings.

Text is re-decoded from the generated ids (never re-tokenised), and the part that is released is held back
while it could still be the start of a stop string or ends in an incomplete UTF-8 character.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # all text so far, cut at a stop string once one appears
        self.released = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; returns the text that is now safe to hand out."""
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                text = text[:at]
                self.stopped = True
        self.text = text
        if self.stopped:
            return self.flush()
        safe = len(text)
        if text.endswith("\ufffd"):  # a multi-byte character whose remaining bytes are still to come
            safe -= 1
        for s in self.stop:  # hold back a suffix that a stop string could still grow from
            for n in range(min(len(s) - 1, safe), 0, -1):
                if s.startswith(text[safe - n:safe]):
                    safe -= n
                    break
        out = text[self.released:max(safe, self.released)]
        self.released = max(safe, self.released)
        return out

    def flush(self) -> str:
        out = self.text[self.released:]
        self.released = len(self.text)
        return out
