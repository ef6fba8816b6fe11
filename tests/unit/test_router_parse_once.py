"""The router builds a request's SamplingParams once: parsing (router/parsing.py) and
admission (router/sequences.py) construct, and so validate, it a single time, whatever
the request asks (bad_words, a grammar, prompt logprobs, best_of)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from router.config import ModelLimits
from router.metrics import RouterMetrics
from router.parsing import RequestParser
from router.sequences import SequenceGroup

BODIES = [
    ("completion", {"prompt": "Hello there", "max_tokens": 4}),
    ("completion", {"prompt": "Hello there", "max_tokens": 4, "bad_words": ["cat"], "echo": True, "logprobs": 1,
                    "response_format": {"type": "json_object"}, "logit_bias": {"5": 1.0}}),
    ("completion", {"prompt": "Hello there", "max_tokens": 4, "best_of": 3, "n": 2, "seed": 7}),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "bad_words": ["dog"],
              "logprobs": True, "top_logprobs": 2, "structured_outputs": {"choice": ["yes", "no"]}}),
]


@pytest.fixture(scope="module")
def parser(llama_dir: Path) -> RequestParser:
    limits = ModelLimits(model=str(llama_dir), max_model_len=1024, vocab_size=384, block_size=16, num_kv_blocks=None)
    return RequestParser(load_tokenizer(str(llama_dir)), limits, list)


@pytest.mark.parametrize("endpoint,body", BODIES)
def test_a_request_builds_its_sampling_params_once(parser: RequestParser, monkeypatch, endpoint: str,
                                                   body: dict) -> None:
    built: list[SamplingParams] = []
    check = SamplingParams.__post_init__

    def counted(self: SamplingParams) -> None:
        built.append(self)
        check(self)
    monkeypatch.setattr(SamplingParams, "__post_init__", counted)

    async def admit() -> SamplingParams:
        request = await getattr(parser, endpoint)(json.dumps(body).encode())
        group = SequenceGroup(request.prompts, request.params, parser.tokenizer, lambda *a: None, RouterMetrics())
        assert all(s.params.n == 1 for s in group.seqs)
        return request.params

    params = asyncio.run(admit())
    # A group's sequences (best_of > 1) each get their own params (seed + index): those
    # are derived from the request's, not parsed again.
    assert len(built) == 1 + (params.n if params.n > 1 else 0), built
    assert built[0] is params
    if body.get("bad_words"):
        assert params.bad_words_token_ids  # tokenized into the params built


@pytest.mark.parametrize("endpoint,body,param,where", [
    ("completion", {"prompt": "Hello there", "max_tokens": 4}, "prompt", "prompt"),
    ("completion", {"prompt": ["Hi", "Hello there"], "max_tokens": 4}, "prompt", "prompt[0]"),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, "messages", "messages"),
])
def test_text_the_tokenizer_turns_into_ids_past_the_model_s_vocabulary_is_a_400(
        llama_dir: Path, endpoint: str, body: dict, param: str, where: str) -> None:
    """The router owns the vocabulary rule for every prompt, tokenized ones too (a
    tokenizer with tokens past the model's embedding): else the decode worker's guard
    would answer the user's input as a router bug (500)."""
    from router.errors import APIError

    limits = ModelLimits(model=str(llama_dir), max_model_len=1024, vocab_size=5, block_size=16, num_kv_blocks=None)
    small = RequestParser(load_tokenizer(str(llama_dir)), limits, list)
    with pytest.raises(APIError) as refused:
        asyncio.run(getattr(small, endpoint)(json.dumps(body).encode()))
    assert refused.value.status == 400 and refused.value.param == param
    assert str(refused.value).startswith(f"{where} tokenizes to ids outside the model's vocabulary [0, 5)")
