"""One request's place in its grammar."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch
import xgrammar as xgr


class GrammarState:
    """Waits for the request's compiled grammar, then follows its tokens.

    `resumed`: tokens at the end of the prompt that are the request's own output from an
    earlier worker (the router's failover resubmits prompt + output so far): the matcher
    accepts them first, so the grammar goes on where it was.
    """

    def __init__(self, compiled: Future, resumed: list[int] | None = None) -> None:
        self._compiled = compiled
        self.created = time.monotonic()  # when its compile was asked for
        self._resumed = list(resumed or ())
        self.matcher: xgr.GrammarMatcher | None = None

    def ready(self) -> bool:
        """The grammar is compiled (or its compile failed: error() says so)."""
        if self.matcher is not None:
            return True
        if not self._compiled.done() or self._compiled.exception() is not None:
            return self._compiled.done()
        matcher = xgr.GrammarMatcher(self._compiled.result())
        for token in self._resumed:
            if not matcher.accept_token(token):
                raise ValueError(f"the output so far (token {token}) does not follow the request's grammar")
        self.matcher = matcher
        return True

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for the compile (the engine has nothing else to do)."""
        try:
            self._compiled.exception(timeout)
        except TimeoutError:
            pass

    @property
    def _matcher(self) -> xgr.GrammarMatcher:
        """The matcher, for what the engine calls only once ready() said so."""
        if self.matcher is None:
            raise RuntimeError("the grammar is not compiled yet: ready() first")
        return self.matcher

    def error(self) -> BaseException | None:
        return self._compiled.exception() if self._compiled.done() else None

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the
        mask should have made that impossible)."""
        return self._matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): the request is done."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, a bit per token)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def num_valid(self, drafts: Sequence[int]) -> int:
        """How many of `drafts` (speculative decoding), in order, the grammar allows
        from here, up to one that ends it; the matcher is left where it was."""
        valid = _advance(self._matcher, drafts)
        if valid:
            self._matcher.rollback(valid)
        return valid

    def after(self, drafts: Sequence[int]) -> GrammarState:
        """A view whose fill() masks as if `drafts` had been accepted (the row that
        verifies the draft after them). Drafts past one the grammar refuses are
        skipped: that row is never reached, as the refused draft's own row rejects it."""
        return _After(self._matcher, drafts)


def _advance(matcher: xgr.GrammarMatcher, drafts: Sequence[int]) -> int:
    """Accept drafts while the grammar allows them and has not ended; how many it took."""
    taken = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        taken += 1
    return taken


class _After(GrammarState):
    def __init__(self, matcher: xgr.GrammarMatcher, drafts: Sequence[int]) -> None:  # a view: no compile to wait for
        self.matcher = matcher
        self._drafts = drafts

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        taken = _advance(self._matcher, self._drafts)
        try:
            if self._matcher.is_terminated():  # a row after the grammar's end is never reached
                bitmask[row].fill_(-1)
            else:
                self._matcher.fill_next_token_bitmask(bitmask, row)
        finally:
            if taken:
                self._matcher.rollback(taken)
