"""Per-request sampling settings, validated at construction (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. Penalties follow vLLM: presence/frequency apply
    to generated tokens only, repetition to prompt and generated tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top alternatives to return besides the sampled token
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
             f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop must be a list of non-empty strings, got {self.stop!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (self.seed is None or isinstance(self.seed, int),
             f"seed must be an integer or None, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
