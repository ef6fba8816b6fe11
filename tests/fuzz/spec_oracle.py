"""The speculative fuzzer's oracle, its stand-in proposer and its checks
(tests/fuzz/spec.py)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine import LLM
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from engine.speculative.ngram import propose_ngram
from tests.fuzz.common import VOCAB
from tests.fuzz.structured import violation

EOS = 1  # tests/tiny_models.py's "</s>"
LOGPROB_TOLERANCE = 1e-4


class SpecOracle:
    """Each request alone in a roomy engine without speculation (and without prefix
    caching, so every prompt is computed from scratch); cached by prompt and params."""

    def __init__(self, model_dir: str | Path, device: str = "cpu") -> None:
        options = dict(num_kv_blocks=256, block_size=16, max_num_batched_tokens=2048, enable_prefix_caching=False,
                       device=device)
        self.llm = LLM(str(model_dir), **options)
        # Seeded sampling under speculation: its draws are keyed on the output position,
        # so a request gives the same tokens whatever its drafts (any engine that speculates).
        self.speculative = LLM(str(model_dir), speculative_config={"num_speculative_tokens": 3}, **options)
        self._cache: dict[tuple, RequestOutput] = {}

    def expect(self, prompt: list[int], params: SamplingParams) -> RequestOutput:
        """What `params` gives alone: greedy without speculation, seeded sampling with it
        (unseeded sampling has no one answer: not asked)."""
        assert params.greedy or params.seed is not None, "no oracle for unseeded sampling"
        key = (tuple(prompt), repr(params))
        if key not in self._cache:
            llm = self.llm if params.greedy else self.speculative
            self._cache[key] = llm.generate([list(prompt)], params, use_tqdm=False)[0]
        return self._cache[key]

    def text(self, tokens: list[int]) -> str:
        return self.llm.tokenizer.decode(tokens)


class Proposer:
    """Stands in for propose_ngram. "ngram": the real one. "oracle": knows the greedy
    continuation of every request (refs) and, call by call at random, drafts it right,
    wrong (each token off by one), right then wrong, random tokens, n-grams or nothing."""

    MODES = ("right", "right", "wrong", "half", "random", "ngram", "none")

    def __init__(self, kind: str, rng: random.Random) -> None:
        self.kind = kind
        self.rng = rng
        self.refs: list[tuple[tuple[int, ...], list[int]]] = []  # (prompt, its greedy tokens)
        self.counts: Counter = Counter()

    def __call__(self, tokens: list[int], room: int, min_n: int, max_n: int) -> list[int]:
        if self.kind == "ngram":
            return propose_ngram(tokens, room, min_n, max_n)
        mode = self.rng.choice(self.MODES)
        room = self.rng.randint(1, room)
        if mode == "ngram":
            return propose_ngram(tokens, room, min_n, max_n)
        if mode == "none":
            return []
        if mode == "random":
            return [self.rng.randrange(VOCAB) for _ in range(room)]
        ahead = self._ahead(tokens)[:room]
        self.counts["known" if ahead else "unknown"] += 1
        if mode == "right":
            return ahead
        cut = self.rng.randint(0, len(ahead)) if mode == "half" else 0
        return ahead[:cut] + [(t + 1) % VOCAB for t in ahead[cut:]]

    def _ahead(self, tokens: list[int]) -> list[int]:
        """The greedy tokens that come next after `tokens` ([] if no ref goes this way)."""
        for prompt, out in self.refs:
            n = len(prompt)
            if len(tokens) >= n and tuple(tokens[:n]) == prompt and tokens[n:] == out[:len(tokens) - n]:
                return out[len(tokens) - n:]
        return []


# ----------------------------------------------------------------------------- checks

def _logprobs_differ(mine: Sequence[Any], want: Sequence[Any]) -> str:
    """Where two lists of TokenLogprobs (None entries allowed) differ beyond the
    tolerance ("" when they agree)."""
    if len(mine) != len(want):
        return f"{len(mine)} entries, alone {len(want)}"
    for i, (a, b) in enumerate(zip(mine, want)):
        if a is None or b is None:
            if a is not b:
                return f"entry {i}: {a} alone {b}"
            continue
        if (a.token_id != b.token_id or abs(a.logprob - b.logprob) > LOGPROB_TOLERANCE or a.rank != b.rank
                or [t for t, _ in a.top] != [t for t, _ in b.top]
                or any(abs(x - y) > LOGPROB_TOLERANCE for (_, x), (_, y) in zip(a.top, b.top))):
            return f"entry {i}: {a} alone {b}"
    return ""


def check_greedy(what: str, tokens: list[int], finish: str | None, logprobs: Sequence[Any] | None,
                 want: RequestOutput, aborted: bool = False, text: str | None = None,
                 prompt_logprobs: Sequence[Any] | None = None) -> list[str]:
    """A greedy request's outcome against the oracle's: the same tokens, finish reason,
    text (if given), logprobs and prompt logprobs (if asked); aborted: a prefix."""
    if aborted:
        if tokens != want.token_ids[:len(tokens)]:
            return [f"{what} (aborted): tokens so far {tokens} are not a prefix of {want.token_ids}"]
    elif tokens != want.token_ids or finish != want.finish_reason or (text is not None and text != want.text):
        return [f"{what}: got {tokens} {text!r} ({finish}), alone {want.token_ids} {want.text!r} "
                f"({want.finish_reason})"]
    if logprobs is not None:
        why = _logprobs_differ(logprobs, want.logprobs[:len(tokens)])
        if why:
            return [f"{what}: logprobs differ: {why}"]
    if prompt_logprobs is not None and not aborted:
        why = _logprobs_differ(prompt_logprobs, want.prompt_logprobs)
        if why:
            return [f"{what}: prompt logprobs differ: {why}"]
    return []


def check_sampled(what: str, tokens: list[int], finish: str | None, params: SamplingParams,
                  logprobs: Sequence[Any] | None) -> list[str]:
    """A sampled request keeps to its params (its tokens vary with the drafts)."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    problems = []
    if len(tokens) > params.max_tokens:
        problems.append(f"{what}: {len(tokens)} tokens, max_tokens {params.max_tokens}")
    if finish == "length" and len(tokens) != params.max_tokens:
        problems.append(f"{what}: ended length after {len(tokens)} of {params.max_tokens}")
    if finish == "stop" and not params.stop and (not tokens or tokens[-1] not in stops
                                                 or len(tokens) < params.min_tokens):
        problems.append(f"{what}: ended stop on {tokens[-1:]} after {len(tokens)} (min_tokens {params.min_tokens})")
    if any(t in stops for t in tokens[:-1]):
        problems.append(f"{what}: a stop token inside {tokens}")
    if logprobs is not None and [lp.token_id for lp in logprobs] != tokens:
        problems.append(f"{what}: logprobs of {[lp.token_id for lp in logprobs]} for tokens {tokens}")
    return problems


def check_constraint(what: str, params: dict[str, Any], tokens: list[int], finish: str | None,
                     oracle: SpecOracle) -> list[str]:
    """A request that finished "stop" obeys its structured_outputs, if it has one."""
    why = violation(params, tokens, oracle.text) if finish == "stop" else ""
    return [f"{what}: {why} (tokens {tokens})"] if why else []
