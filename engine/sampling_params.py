"""Per-request sampling settings, validated at construction (vLLM-compatible names)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
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
# OpenAI's logit_bias range: -100 bans a token in practice, 100 all but forces it.
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def child_request_id(request_id: str, index: int) -> str:
    """The id of sequence `index` of a request with n > 1 sequences: the engine's
    request for it, and on the wire the id its Tokens and Rejected carry and an Abort
    names (the group's own id names no request a client sees)."""
    return f"{request_id}-{index}"


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
    # Token controls (engine/sampling/controls.py), applied after a grammar's mask and
    # before penalties. logit_bias: token id -> bias added to its logit (JSON's string
    # keys of decimal ids are taken, and kept as ints); allowed_token_ids: only these
    # may be sampled (None: any); bad_words: words that may not be generated, which a
    # front end with a tokenizer turns into bad_words_token_ids (bad_words_token_ids()
    # below), the form the tokenizer-free engine reads: a sequence's last token is
    # banned where the output so far ends with the tokens before it.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        self._check_token_controls()
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

    def _check_token_controls(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsError("logit_bias", "must be an object mapping token ids to biases, got "
                                                        f"{show(self.logit_bias)}")
            lo, hi = LOGIT_BIAS_RANGE
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                token = _token_id(key)
                if token is None:
                    raise SamplingParamsError("logit_bias", f"keys must be token ids (integers in [0, {INT64_MAX}]), "
                                                            f"got {show(key)}")
                number = _require_float("logit_bias", value)
                if not lo <= number <= hi:
                    raise SamplingParamsError("logit_bias", f"values must be in [{lo:g}, {hi:g}], got {show(value)} "
                                                            f"for token {token}")
                bias[token] = number
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not (isinstance(ids, (list, tuple)) and ids and all(_token_id(t, strings=False) is not None
                                                                  for t in ids)):
                raise SamplingParamsError("allowed_token_ids", "must be a non-empty list of token ids (integers in "
                                                               f"[0, {INT64_MAX}]) or null, got {show(ids)}")
            self.allowed_token_ids = list(ids)
        self.bad_words = _require_list("bad_words", self.bad_words, str, "a list of strings")
        if not all(w.strip() and encodable(w) for w in self.bad_words):
            raise SamplingParamsError("bad_words", "must be a list of strings with some non-space text and valid "
                                                   f"Unicode, got {show(self.bad_words)}")
        seqs = self.bad_words_token_ids
        if not (isinstance(seqs, (list, tuple)) and all(
                isinstance(s, (list, tuple)) and s and all(_token_id(t, strings=False) is not None for t in s)
                for s in seqs)):
            raise SamplingParamsError("bad_words_token_ids", "must be a list of non-empty lists of token ids "
                                                             f"(integers in [0, {INT64_MAX}]), got {show(seqs)}")
        self.bad_words_token_ids = [list(s) for s in seqs]

    def out_of_vocab(self, vocab_size: int) -> tuple[str, list[int]] | None:
        """The first token control naming ids outside [0, vocab_size), with (up to 5 of)
        those ids; None if all are inside."""
        for name, ids in (("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("stop_token_ids", self.stop_token_ids),  # one outside would never match
                          ("bad_words", [t for s in self.bad_words_token_ids for t in s])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                return name, bad[:5]
        return None

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

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These params with bad_words' token sequences (bad_words_token_ids(), given
        the tokenizer's encode without special tokens) added to bad_words_token_ids,
        which is what the engine reads: a front end calls this once per request."""
        if not self.bad_words:
            return self
        seqs = list(self.bad_words_token_ids)
        seqs += [s for s in bad_words_token_ids(self.bad_words, encode) if s not in seqs]
        return dataclasses.replace(self, bad_words_token_ids=seqs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_token_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's rule for turning bad words into token sequences, given a tokenizer's
    encode without special tokens: each word (its leading spaces stripped) as it would
    start the text, and with a leading space as in the middle of it, the latter only
    where that spells the word with as many tokens and a different first one."""
    seqs: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if not bare:
            continue
        seqs.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            seqs.append(spaced)
    return seqs


def _token_id(value: Any, strings: bool = True) -> int | None:
    """A token id (an int in [0, INT64_MAX], or with `strings` a string of decimal
    digits, as JSON object keys are), else None."""
    if strings and isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        value = int(value)  # at most 20 digits: int() refuses strings of thousands
    return value if _is_int(value) and 0 <= value <= INT64_MAX else None


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
    """A list (or tuple; a lone string for stop, as OpenAI allows) whose items are all
    of type `item`."""
    if name == "stop" and isinstance(value, str):
        value = [value]
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(v, item) and not isinstance(v, bool) for v in value)
    if not ok:
        raise SamplingParamsError(name, f"must be {expected}, got {show(value)}")
    return list(value)
