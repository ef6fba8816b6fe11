"""The speculative fuzzer's random cases (tests/fuzz/spec.py): a pure function of the
seed (and of the oracle's plain outputs, which the prompts fix)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from tests.fuzz.cases import STOP_STRINGS, _fits, _max_tokens
from tests.fuzz.common import VOCAB, ReqSpec, spec_params
from tests.fuzz.spec_oracle import EOS, SpecOracle
from tests.fuzz.structured import draw_constraint


def _prompt(rng: random.Random, shared: list[int], earlier: list[list[int]]) -> list[int]:
    r = rng.random()
    if earlier and r < 0.15:
        return list(rng.choice(earlier))  # identical: a prefix hit up to its last block
    if r < 0.6:  # a pattern repeated, perhaps after a shared start and before a tail
        pattern = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 5))]
        head = shared[:rng.randint(0, len(shared))] if rng.random() < 0.4 else []
        tail = [rng.randrange(2, VOCAB) for _ in range(rng.choice((0, 0, 1, 3)))]
        return (head + pattern * rng.randint(2, 8) + tail)[:60]
    if r < 0.8:
        return shared[:rng.randint(1, len(shared))] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 6))]
    return [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 40))]


def _params(rng: random.Random, max_tokens: int, plain: list[int], text: str, llm: bool) -> dict[str, Any]:
    """Params besides greedy; `plain` (`text`) is the request's plain greedy output,
    from which stop tokens, stop strings, bad words and biases are drawn so they bite."""
    out: dict[str, Any] = {}
    seen = plain or [rng.randrange(2, VOCAB)]
    for _ in range(rng.choice((0, 0, 1, 1, 2))):
        kind = rng.randrange(9)
        if kind == 0:
            out["stop_token_ids"] = sorted({rng.choice(seen), *rng.sample(range(2, VOCAB), rng.randint(0, 20))})
            out["min_tokens"] = rng.randint(0, max_tokens)
            out["ignore_eos"] = rng.random() < 0.5
        elif kind == 1:
            out["repetition_penalty"] = rng.choice((0.7, 1.3, 2.0))
        elif kind == 2:
            out.update(presence_penalty=rng.choice((-0.5, 0.8)), frequency_penalty=rng.choice((-0.3, 0.0, 0.6)))
        elif kind == 3:  # ban a token it would take, favour another, sometimes EOS
            bias = {rng.choice(seen): -100.0, rng.randrange(2, VOCAB): rng.choice((2.0, 5.0))}
            if rng.random() < 0.3:
                bias[EOS] = 4.0
                out["ignore_eos"] = False
            out["logit_bias"] = bias
        elif kind == 4:  # a word of 1..3 tokens of its own output, and a random one
            start = rng.randrange(len(seen))
            out["bad_words_token_ids"] = [seen[start:start + rng.randint(1, 3)], [rng.randrange(2, VOCAB)]]
        elif kind == 5:
            out["allowed_token_ids"] = sorted(set(rng.sample(range(VOCAB), rng.randint(1, 30))) | {seen[0]})
        elif kind == 6:
            out["prompt_logprobs"] = rng.choice((0, 2))
        elif kind == 7 and llm:  # a piece of its own text, or a common one
            start = rng.randrange(max(1, len(text)))
            piece = text[start:start + rng.randint(1, 3)] if text.strip() else ""
            out["stop"] = [piece] if piece.strip() else rng.sample(STOP_STRINGS, 2)
            out["include_stop_str_in_output"] = rng.random() < 0.5
        else:
            out["logprobs"] = rng.choice((0, 1, 3))
    return out


def _sampled(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = dict(temperature=rng.choice((0.5, 1.0, 1.5)), top_k=rng.choice((-1, 3, 20)),
                               top_p=rng.choice((1.0, 0.8)))
    if rng.random() < 0.7:
        out["seed"] = rng.randrange(2**31)
    if rng.random() < 0.3:
        out["logprobs"] = 1
    return out


def _constrain(seed: int, specs: list[ReqSpec], fraction: float) -> None:
    """Give about `fraction` of the greedy requests a structured_outputs constraint,
    from a stream of their own (the seed's schedule stays the same at any fraction);
    token controls go (with a grammar they could leave nothing to sample)."""
    rng = random.Random(f"spec-structured-{seed}")
    for s in specs:
        if rng.random() < fraction and s.params.get("temperature", 0.0) == 0.0:
            for key in ("allowed_token_ids", "logit_bias", "bad_words_token_ids"):
                s.params.pop(key, None)
            s.params["structured_outputs"] = draw_constraint(rng)
            s.max_tokens = max(s.max_tokens, rng.choice((s.max_tokens, 24)))  # room to reach the grammar's end


def draw_case(seed: int, oracle: SpecOracle, structured: float = 0.0, draft_models: Sequence[str] = ()
              ) -> tuple[dict[str, Any], str, str, list[ReqSpec]]:
    """(engine options, mode "core" or "llm", proposer kind, requests). `structured`:
    the fraction of greedy requests constrained (_constrain); `draft_models`: model
    directories some seeds draft with (method draft_model) instead of n-grams."""
    rng = random.Random(f"spec-{seed}")
    mode = "llm" if rng.random() < 0.25 else "core"
    bs = rng.choice((8, 16))
    lookup_min = rng.randint(1, 3)
    spec: dict[str, Any] = dict(num_speculative_tokens=rng.randint(1, 6), prompt_lookup_min=lookup_min,
                                prompt_lookup_max=lookup_min + rng.randint(0, 3))
    if rng.random() < 0.5:  # else the default fallback; sometimes one that trips at once
        spec.update(min_acceptance_rate=rng.choice((0.0, 0.6)), acceptance_window=rng.choice((2, 8, 32)))
    shared = [rng.randrange(2, VOCAB) for _ in range(rng.randint(8, 40))]
    requests: list[ReqSpec] = []
    arrive = 0
    for i in range(rng.randint(1, 8)):
        prompt = _prompt(rng, shared, [s.prompt for s in requests])
        max_tokens = _max_tokens(rng) if rng.random() < 0.85 else rng.choice((1, 2))
        arrive += rng.choice((0, 0, 1, 2, 5))
        r = rng.random()
        if r < 0.12:
            params = dict(_sampled(rng), n=rng.choice((1, 1, 2, 3)))
        else:
            plain = oracle.expect(prompt, spec_params(ReqSpec("", prompt, max_tokens)))
            params = _params(rng, max_tokens, plain.token_ids, plain.text, mode == "llm")
            if r < 0.25 and "prompt_logprobs" not in params:  # refused with n > 1
                params["n"] = rng.randint(2, 3)
        abort = arrive + rng.randint(0, len(prompt) // 4 + max_tokens + 2) if rng.random() < 0.2 else None
        requests.append(ReqSpec(f"r{i}", prompt, max_tokens, rng.choice((0, 0, 0, 1, -1)), arrive, abort,
                                params=params))
    _constrain(seed, requests, structured)
    lengths = [len(s.prompt) + s.max_tokens for s in requests]
    need = max(-(-n // bs) for n in lengths)
    total = sum(-(-n // bs) for n in lengths)
    r = rng.random()
    blocks = need + rng.randint(0, 1) if r < 0.35 else need + rng.randint(1, max(1, total // 2)) if r < 0.7 \
        else total + rng.randint(0, 8)
    if rng.random() < 0.05:
        blocks = max(1, need - 1)  # the largest is refused
    chunked = rng.random() < 0.85
    budget = rng.choice((1, 2, 3, 4, 5, 7, 8, 16, 64, 512))
    if not chunked:
        budget = max(budget, max(len(s.prompt) for s in requests))
    engine = dict(block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=budget,
                  max_num_seqs=rng.choice((1, 2, 4, 64)), enable_chunked_prefill=chunked,
                  enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.random() < 0.3,
                  speculative_config=spec)
    if rng.random() < 0.15:  # a short context: room for drafts ends at it
        engine["max_model_len"] = max(2, max(lengths) - rng.choice((0, 0, 1)))
    extra = random.Random(f"spec-engine-{seed}")  # a stream of its own: the draws above stay as they were
    if extra.random() < 0.1:  # the most drafts a step verifies: 17 rows of one sequence
        spec["num_speculative_tokens"] = extra.choice((8, 16))
    # the torch backend's decode rows: the C kernel, or (no kernel) the blocked torch path;
    # or the reference backend
    engine["attention_backend"] = extra.choice(("auto", "auto", "auto", "no_kernel", "reference"))
    kind = rng.choice(("ngram", "oracle", "oracle"))
    if draft_models and extra.random() < 0.3:
        kind = "draft_model"
        engine["speculative_config"] = {"model": extra.choice(list(draft_models)),
                                        "num_speculative_tokens": spec["num_speculative_tokens"],
                                        **{k: v for k, v in spec.items() if k in ("min_acceptance_rate",
                                                                                  "acceptance_window")}}
    return engine, mode, kind, requests


def _fits_engine(engine: dict[str, Any], s: ReqSpec) -> bool:
    return _fits(len(s.prompt), s.max_tokens, engine["block_size"], engine["num_kv_blocks"],
                 engine["max_num_batched_tokens"], engine["enable_chunked_prefill"], engine.get("max_model_len"))
