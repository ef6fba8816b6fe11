"""Per-request sampling settings, validated at construction (vLLM-compatible names)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from engine.structured.params import StructuredOutputsError, StructuredOutputsParams
from engine.user_values import encodable, show

# Integers cross the router -> worker boundary as msgpack, which holds int64 (and
# uint64, for seeds); anything larger is refused here rather than failing to encode.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed accepts
# Logits are divided (positive) or multiplied (negative) by the repetition penalty in
# float32: within [0.01, 100] a logit of any realistic size (|x| < 1e30) stays finite,
# and vLLM users use values near 1 (1.0 is off; 1.1-1.3 usual).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class SamplingParamsError(ValueError):
    """A bad sampling setting; `param` names the field. The message is
    f"{param} {problem}", so a caller that received the value under another name (an
    HTTP alias) can say it with that name."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"{param} {problem}")
        self.param, self.problem = param, problem


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. Penalties follow vLLM: presence/frequency apply
    to generated tokens only, repetition to prompt and generated tokens.

    Construction checks every field's type first (bools are not numbers; floats must be
    finite), then its range, and raises SamplingParamsError (a ValueError) naming the
    field.
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
    # vLLM's: every prompt token's logprob (the first has none) and this many top
    # alternatives, from the raw distribution; computed in the prompt's own steps, so
    # such a request takes no prefix-cache hit (engine/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # What the output must follow (JSON schema, regex, choice, grammar...); a dict of its
    # fields is taken too (the wire form).
    structured_outputs: StructuredOutputsParams | None = None
    # Parallel sampling: this many sequences from one prompt, whose KV is computed once
    # and shared (engine: a fork group). Sequence i is the request child(i).
    n: int = 1

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
            except StructuredOutputsError as exc:
                raise SamplingParamsError(exc.param, exc.problem) from None

    def _check_types(self) -> None:
        for name in ("max_tokens", "top_k", "min_tokens", "n"):
            _require_int(name, getattr(self, name))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), " or null")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, _require_float(name, getattr(self, name)))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be a boolean, got {show(getattr(self, name))}")
        self.stop = _require_list("stop", self.stop, str, "a string or a list of strings")
        self.stop_token_ids = _require_list("stop_token_ids", self.stop_token_ids, int, "a list of integers")

    def _check_ranges(self) -> None:
        lo, hi = REPETITION_PENALTY_RANGE
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be an integer >= 1"),
            ("n", self.n >= 1, "must be an integer >= 1"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_k", self.top_k >= -1, "must be -1 (disabled) or >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"must be in [0, max_tokens={self.max_tokens}]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", lo <= self.repetition_penalty <= hi,
             f"must be in [{lo:g}, {hi:g}] (1 = no penalty)"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             "must be None or an integer in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "must be None or an integer in [0, 20]"),
            ("stop", all(s and encodable(s) for s in self.stop),
             "must be a list of non-empty strings of valid Unicode (no lone surrogates)"),
            ("stop_token_ids", all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
             f"must be integers in [0, {INT64_MAX}]"),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise SamplingParamsError(name, f"{problem}, got {show(getattr(self, name))}")

    def child(self, index: int) -> SamplingParams:
        """Sequence `index` of a request with n > 1: one sequence (n=1), and a seeded
        request's seed + index (vLLM's derivation, wrapped into the seed range), so
        that each sequence equals a single request sent with that seed."""
        if not 0 <= index < self.n:
            raise ValueError(f"sequence index {index} is not in [0, n={self.n})")
        seed = self.seed
        if seed is not None:
            seed += index
            if seed > SEED_MAX:
                seed -= 2**64
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value: Any, also: str = "") -> None:
    if not _is_int(value):
        raise SamplingParamsError(name, f"must be an integer{also}, got {show(value)}")
    lo, hi = (SEED_MIN, SEED_MAX) if name == "seed" else (INT64_MIN, INT64_MAX)
    if not lo <= value <= hi:
        raise SamplingParamsError(name, f"must be an integer in [{lo}, {hi}], got {show(value)}")


def _require_float(name: str, value: Any) -> float:
    if not (isinstance(value, float) or _is_int(value)):
        raise SamplingParamsError(name, f"must be a number, got {show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not math.isfinite(number):
        raise SamplingParamsError(name, f"must be a finite number, got {show(value)}")
    return number


def _require_list(name: str, value: Any, item: type, expected: str) -> list:
    """A list (or tuple; a lone string for stop) whose items are all of type `item`."""
    if item is str and isinstance(value, str):
        value = [value]
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(v, item) and not isinstance(v, bool) for v in value)
    if not ok:
        raise SamplingParamsError(name, f"must be {expected}, got {show(value)}")
    return list(value)
