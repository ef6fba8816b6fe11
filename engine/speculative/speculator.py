"""Each step's drafts, and what came of them.

Before a step is scheduled, every running request that is about to sample (its last
token is all it has left to compute) is offered up to k drafts, never more than its
max_tokens or the context length leave room for. The scheduler appends them after
its last token; the sampler scores each (runner.sampling_rows); accepted() reads the
verdicts back; record() counts them, and turns speculation off for a request whose
drafts keep being rejected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.request import Request
from engine.sampling import SamplerOutput, TokenLogprobs
from engine.scheduler_output import SchedulerOutput
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import propose_ngram


class DraftModel(Protocol):
    """A proposer that needs the step's blocks (engine/speculative/draft_model.py):
    it fills in the drafts of a scheduled step, whose draft ids are placeholders."""

    def fill(self, out: SchedulerOutput) -> None: ...


@dataclass
class SpecStats:
    """Speculative decoding's counters since the engine started (vLLM's metrics)."""

    num_drafts: int = 0  # request steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i
    num_disabled: int = 0  # requests that stopped speculating (low acceptance)

    def copy(self) -> SpecStats:
        """A copy to report: the speculator's own counters keep moving."""
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: the accepted drafts plus the token sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft_model: DraftModel | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def propose(self, running: Sequence[Request]) -> None:
        """Set the drafts of each running request about to sample (placeholders, -1,
        for a draft model: fill() writes them once the step has its blocks)."""
        config = self.config
        for request in running:
            spec = request.spec
            if (spec is None or not spec.enabled or request.prefill_only or request.num_output_placeholders
                    or request.num_computed_tokens + request.num_scheduled_tokens != request.num_tokens - 1):
                continue
            # Never past max_tokens or the context: each draft may be accepted, and one
            # more token is sampled after them.
            room = min(config.num_speculative_tokens,
                       request.sampling_params.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1)
            if room < 1:
                continue
            if self.draft_model is not None:
                spec.token_ids = [-1] * room
                continue
            drafts = propose_ngram(request.all_token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max)
            if drafts and request.grammar is not None:  # the grammar checks them first
                drafts = drafts[:request.grammar.num_valid(drafts)]
            spec.token_ids = drafts

    def fill(self, out: SchedulerOutput) -> None:
        """Write a draft model's drafts into the scheduled step (nothing for n-grams)."""
        if self.draft_model is not None and out.num_draft_tokens:
            self.draft_model.fill(out)

    def accepted(self, out: SchedulerOutput, sampled: SamplerOutput
                 ) -> tuple[list[int], list[int], list[list[TokenLogprobs | None]]]:
        """From a step's rows to its sampling requests (out.scheduled order): the token
        each sampled after its accepted drafts, how many drafts it accepted, and the
        logprobs of its drafts and that token."""
        tokens, num_accepted, logprobs = [], [], []
        row = 0
        verdicts = sampled.accepted
        assert verdicts is not None  # the step verified drafts, so its sample judged them
        for s in out.scheduled:
            if not s.samples:
                continue
            n = 0
            while n < len(s.draft_token_ids) and verdicts[row + n]:
                n += 1
            tokens.append(sampled.token_ids[row + n])
            num_accepted.append(n)
            logprobs.append(sampled.logprobs[row:row + n + 1])
            row += len(s.draft_token_ids) + 1
        return tokens, num_accepted, logprobs

    def record(self, out: SchedulerOutput, num_accepted: Sequence[int]) -> None:
        """Count a step's verdicts; a request whose last acceptance_window drafts were
        mostly rejected stops speculating."""
        stats, config = self.stats, self.config
        verdicts = iter(num_accepted)
        for s in out.scheduled:
            if not s.samples:
                continue
            n = next(verdicts)
            if not s.draft_token_ids:
                continue
            stats.num_drafts += 1
            stats.num_draft_tokens += len(s.draft_token_ids)
            stats.num_accepted_tokens += n
            for i in range(n):
                stats.accepted_per_position[i] += 1
            spec = s.request.speculation  # it has drafts, so its engine speculates
            spec.num_offered += len(s.draft_token_ids)
            spec.num_accepted += n
            if spec.num_offered >= config.acceptance_window:
                if spec.num_accepted < config.min_acceptance_rate * spec.num_offered:
                    spec.enabled = False
                    stats.num_disabled += 1
                spec.num_offered = spec.num_accepted = 0
