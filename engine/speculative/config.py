"""Speculative decoding's settings (vLLM's names): a validated dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config_check import check_instance_types

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b}`, or `{"model": DIR, "num_speculative_tokens": k}` (a draft
    model sharing the target's vocabulary; method then defaults to "draft_model").

    A request whose drafts are mostly rejected stops speculating: once it has been
    offered `acceptance_window` draft tokens, if fewer than `min_acceptance_rate` of
    them were accepted, its later steps compute one token each again.
    """

    num_speculative_tokens: int
    method: str | None = None
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 32

    def __post_init__(self) -> None:
        check_instance_types(self)
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config: {message}")

        require(self.method in METHODS, f"method must be one of {METHODS}, got {self.method!r}")
        require(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        if self.method == "ngram":
            require(self.model is None, "model is for method 'draft_model'; ngram needs no model")
            require(self.prompt_lookup_min >= 1, f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
            require(self.prompt_lookup_max >= self.prompt_lookup_min,
                    f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                    f"({self.prompt_lookup_min})")
        else:
            require(isinstance(self.model, str) and self.model != "",
                    "method 'draft_model' needs model, the draft model's directory")
        require(0 <= self.min_acceptance_rate <= 1,
                f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")
        require(self.acceptance_window >= 1, f"acceptance_window must be >= 1, got {self.acceptance_window}")

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig:
        """From a mapping (YAML, keyword options), naming any unknown key."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known keys: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        return cls(**value)
