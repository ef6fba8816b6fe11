"""Incremental detokenization of one request's output, with stop strings and min_tokens.

The one implementation of output text: the offline LLM's OutputProcessor and the router
both feed it a request's output tokens as they arrive, so the same token stream gives
the same text, the same cut at a stop string and the same finish reason on either path.
It must stay torch-free (the router imports it and does not load torch).

The min_tokens rule (vLLM's): no stop string is matched while the output has fewer than
min_tokens tokens, and then only one that ends in text the first min_tokens - 1 tokens
had not completed. A stop string that starts in that text and ends after it counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


class Detokenizer:
    """Incremental text for one request, holding back what may still change: a partial
    UTF-8 character, or the start of a stop string. The text ends before the earliest
    stop string found (after it with include_stop: include_stop_str_in_output).

    Each step decodes only the new tokens, behind a few tokens of context (as vLLM
    does), since decoding every token so far each step is O(n^2) over a generation.
    The context is needed where a token's text depends on the one before it
    (SentencePiece's leading spaces). Tokenizers that clean up spaces around punctuation
    over the whole text (`clean_up_tokenization_spaces`) are decoded whole each step
    instead, so the text always equals a decode of every token. Special tokens are
    always skipped (`skip_special_tokens=False` is refused at the API).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        self.tokenizer, self.stop, self.include_stop = tokenizer, list(stop), include_stop
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.sent = 0  # characters of text already returned
        self.text = ""  # complete characters only, until flush()
        self.stopped = False
        self._whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        # self.text is the decode of ids[:self._read]; ids[self._context:self._read] are
        # decoded again with each new token for context.
        self._context = self._read = 0
        # No stop string that counts ends in self.text[:self._searched]: it was searched,
        # or the tokens before min_tokens made it.
        self._searched = 0
        self._hold = max((len(s) - 1 for s in self.stop), default=0)

    @classmethod
    def for_params(cls, tokenizer: Any, params: SamplingParams) -> Detokenizer:
        return cls(tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def add(self, tokens: list[int]) -> tuple[str, bool]:
        """The next output tokens -> (text now safe to show, whether a stop string ended
        the output). Once it has, the text is final: call flush() only, not add().

        With stop strings, tokens that come several at once (a speculative step) are
        taken one by one, as they would come without drafts: the output ends at the
        token that completes a stop string, and the tokens after it are not taken
        (num_tokens counts the output's tokens)."""
        if self.stop and len(tokens) > 1:
            text = []
            for token in tokens:
                delta, stopped = self._add([token])
                text.append(delta)
                if stopped:
                    return "".join(text), True
            return "".join(text), False
        return self._add(tokens)

    def _add(self, tokens: list[int]) -> tuple[str, bool]:
        """add() of a single token, or of any number without stop strings."""
        pending = self._extend(tokens)
        if self.stop and len(self.ids) >= self.min_tokens:
            # A stop string may be in text held back behind a partial character.
            cut = self._stop_at(self.text + pending)
            if cut is not None:
                self.text, self.stopped = (self.text + pending)[:cut], True
                return self.flush(), True
        end = len(self.text.rstrip("\ufffd")) - self._hold
        delta = self.text[self.sent:max(self.sent, end)]
        self.sent += len(delta)
        return delta, False

    def _extend(self, tokens: list[int]) -> str:
        """Append tokens and decode them; returns the new text held back, if any."""
        self.ids += tokens
        pending = self._decode_new(final=False)
        if len(self.ids) < self.min_tokens:
            # The characters completed so far are exempt; a partial one at the end is not.
            done = self.text if self._whole else self.text + pending
            self._searched = len(done.rstrip("\ufffd"))
        return pending

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
        """Where `text` ends if it holds a stop string ending past self._searched: the
        earliest one wins; of several found at one place, the first listed in `stop`
        (it decides the cut with include_stop)."""
        found = []
        for s in self.stop:
            i = text.find(s, max(0, self._searched - len(s) + 1))
            if i != -1:
                found.append((i, s))
        # self.text is final in the incremental decode, so it need not be searched again;
        # a whole decode may still change (a partial character, spaces cleaned up).
        if not self._whole:
            self._searched = max(self._searched, len(self.text))
        if not found:
            return None
        i, s = min(found, key=lambda hit: hit[0])  # min() keeps the first of equals: list order
        return i + len(s) if self.include_stop else i

    def flush(self) -> str:
        """The rest of the text, once the output has ended."""
        if not self.stopped:
            self._decode_new(final=True)
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
