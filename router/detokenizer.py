"""Incremental detokenization of one request's output, with stop strings."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Incremental text for one request, holding back what may still change: a partial
    UTF-8 character, or the start of a stop string. The text ends before the earliest
    stop string found (after it with include_stop: include_stop_str_in_output)."""

    def __init__(self, tokenizer: Any, stop: list[str], include_stop: bool = False) -> None:
        self.tokenizer, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.ids: list[int] = []
        self.sent = 0  # characters of text already returned
        self.text = ""
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def add(self, tokens: list[int]) -> tuple[str, bool]:
        self.ids += tokens
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_at()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self.flush(), True
        hold = max((len(s) - 1 for s in self.stop), default=0)
        end = len(self.text.rstrip("\ufffd")) - hold
        delta = self.text[self.sent:max(self.sent, end)]
        self.sent += len(delta)
        return delta, False

    def _stop_at(self) -> int | None:
        """Where the text ends if it holds a stop string: the earliest one wins."""
        found = [(i, s) for s in self.stop if (i := self.text.find(s)) != -1]
        if not found:
            return None
        i, s = min(found)
        return i + len(s) if self.include_stop else i

    def flush(self) -> str:
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
