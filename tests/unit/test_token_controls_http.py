"""Token controls over HTTP: logit_bias, allowed_token_ids and bad_words reach the
decode worker (bad_words as the token sequences the router's tokenizer made), and bad
values get a 400 naming the field, on both endpoints. The router runs against a fake
decode worker (tests/unit/test_router_http.py): no model runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cluster.config import ClusterConfig
from cluster.serve import router_for
from engine.sampling_params import bad_words_token_ids
from protocol.sampling import from_wire
from router.app import Router, create_app
from tests.unit.test_router_http import FakeDecodeWorker

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def client(llama_dir: Path) -> Iterator[tuple[TestClient, FakeDecodeWorker, Router]]:
    fake = FakeDecodeWorker(step_s=0.01)
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0},
                                      "router": {"max_stop": 4}})
    router = router_for(config, {"decode-0": fake.address})
    try:
        with TestClient(create_app(router)) as http:
            yield http, fake, router
    finally:
        fake.close()


def post(http: TestClient, chat: bool, **fields):
    if chat:
        return http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **fields})
    return http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **fields})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chat", [False, True])
def test_controls_reach_the_worker_with_bad_words_tokenized(client, chat: bool) -> None:
    http, fake, router = client
    words = ["capital", " quick brown"]
    r = post(http, chat, temperature=0, logit_bias={"5": -100, "17": 2.5}, allowed_token_ids=[5, 17, 70],
             bad_words=words)
    assert r.status_code == 200, r.text
    params = from_wire(fake.messages("generate")[-1].params)
    assert params.greedy
    assert params.logit_bias == {5: -100.0, 17: 2.5} and params.allowed_token_ids == [5, 17, 70]
    want = bad_words_token_ids(words, lambda w: router.tokenizer.encode(w, add_special_tokens=False))
    assert params.bad_words == words and params.bad_words_token_ids == want
    assert any(len(s) > 1 for s in want)  # the space-prefixed spelling or a multi-token word


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("fields,param,message", [
    ({"logit_bias": {"384": 1}}, "logit_bias", "logit_bias token ids must be in [0, 384), got [384]"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias values must be in [-100, 100], got 101 for token 5"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "logit_bias must be a number, got 'x'"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"logit_bias": [5]}, "logit_bias", "logit_bias must be an object mapping token ids to biases"),
    ({"allowed_token_ids": [3, 1000, 384]}, "allowed_token_ids",
     "allowed_token_ids token ids must be in [0, 384), got [1000, 384]"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": ["5"]}, "allowed_token_ids", "allowed_token_ids must be a non-empty list"),
    ({"bad_words": [5]}, "bad_words", "bad_words must be a list of strings"),
    ({"bad_words": [""]}, "bad_words", "bad_words must be a list of strings with some non-space text"),
    ({"bad_words": ["a", "b", "c", "d", "e"]}, "bad_words", "bad_words has 5 entries; at most 4"),
])
def test_bad_controls_get_400_naming_the_field(client, chat: bool, fields, param: str, message: str) -> None:
    http, fake, _ = client
    r = post(http, chat, **fields)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param
    assert not fake.messages("generate")


def test_off_values_are_accepted(client) -> None:
    http, fake, _ = client
    r = post(http, False, logit_bias=None, allowed_token_ids=None, bad_words=[])
    assert r.status_code == 200, r.text
    params = from_wire(fake.messages("generate")[-1].params)
    assert params.logit_bias is None and params.allowed_token_ids is None and params.bad_words_token_ids == []
