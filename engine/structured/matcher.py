"""One request's place in its grammar."""

from __future__ import annotations

import time

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

    def error(self) -> BaseException | None:
        return self._compiled.exception() if self._compiled.done() else None

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the
        mask should have made that impossible)."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): the request is done."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, a bit per token)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
