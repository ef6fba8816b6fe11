"""Counting and logging what the worker plane refuses, without letting a flood of
refusals flood the log: the first is logged at once, later ones at most once per
LOG_EVERY_S, each line saying how many went unlogged since the last."""

from __future__ import annotations

import logging
import time

LOG_EVERY_S = 10.0


class RefusalLog:
    def __init__(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        self.logger = logger
        self.level = level
        self.count = 0  # refusals so far
        self._unlogged = 0
        self._last_log = float("-inf")

    def refused(self, message: str, *args: object) -> None:
        """One refusal; `message % args` says what was refused (logged at `level`)."""
        self.count += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            more = f" ({self._unlogged - 1} more since the last report)" if self._unlogged > 1 else ""
            self.logger.log(self.level, message + "%s", *args, more)
            self._last_log, self._unlogged = now, 0
