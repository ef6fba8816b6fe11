"""Incremental detokenization of one request's output, with stop strings."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Incremental text for one request, holding back what may still change: a partial
    UTF-8 character, or the start of a stop string. The text ends before the earliest
    stop string found (after it with include_stop: include_stop_str_in_output).

    Each step decodes only the new tokens, behind a few tokens of context (as vLLM
    does): decoding every token so far each step cost O(n^2) over a generation, about
    1 ms a step per 2,000-token request on the demo model's tokenizer. The context is
    needed where a token's text depends on the one before it (SentencePiece's leading
    spaces). Tokenizers that clean up spaces around punctuation over the whole text
    (`clean_up_tokenization_spaces`) are decoded whole each step instead, so the text
    always equals a decode of every token.
    """

    def __init__(self, tokenizer: Any, stop: list[str], include_stop: bool = False) -> None:
        self.tokenizer, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.ids: list[int] = []
        self.sent = 0  # characters of text already returned
        self.text = ""  # complete characters only, until flush()
        self.stopped = False
        self._whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        # self.text is the decode of ids[:self._read]; ids[self._context:self._read] are
        # decoded again with each new token for context.
        self._context = self._read = 0

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def add(self, tokens: list[int]) -> tuple[str, bool]:
        self.ids += tokens
        pending = self._decode_new(final=False)
        # A stop string may be in text held back behind a partial character.
        cut = self._stop_at(self.text + pending)
        if cut is not None:
            self.text, self.stopped = (self.text + pending)[:cut], True
            return self.flush(), True
        hold = max((len(s) - 1 for s in self.stop), default=0)
        end = len(self.text.rstrip("\ufffd")) - hold
        delta = self.text[self.sent:max(self.sent, end)]
        self.sent += len(delta)
        return delta, False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self, final: bool) -> str:
        """Extend self.text by the new tokens' text once it ends on a whole character
        (or, `final`, whatever it is); returns the new text held back, if any."""
        if self._whole:
            self.text = self._decode(self.ids)
            return ""
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._context:self._read])
        after = self._decode(self.ids[self._context:])
        new = after[len(before):]
        if not new or (after.endswith("\ufffd") and not final):
            return new
        self.text += new
        self._context, self._read = self._read, len(self.ids)
        return ""

    def _stop_at(self, text: str) -> int | None:
        """Where `text` ends if it holds a stop string: the earliest one wins."""
        found = [(i, s) for s in self.stop if (i := text.find(s)) != -1]
        if not found:
            return None
        i, s = min(found)
        return i + len(s) if self.include_stop else i

    def flush(self) -> str:
        if not self.stopped:
            self._decode_new(final=True)
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
