"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # first token computed this step (request.num_started_tokens when scheduled)
    num_new_tokens: int  # tokens computed this step
    samples: bool  # the step reaches the sequence's end: sample its logits
    # Speculative decoding: the step's last len(draft_token_ids) tokens are drafts after
    # the sequence's end, each scored (a sampled row per token from its last one on).
    draft_token_ids: Sequence[int] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_samples: int = 0  # scheduled requests that sample a token
    num_draft_tokens: int = 0  # drafts among the scheduled tokens (speculative decoding)
    # Some token sampled here depends on the tokens so far (penalties, min_tokens), so
    # the next step must not be scheduled before this one's tokens are on the host.
    reads_history: bool = False
    # KV blocks (source, destination) to copy before the step's forward writes: a
    # forked sequence's shared last block, copied on its first write.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
