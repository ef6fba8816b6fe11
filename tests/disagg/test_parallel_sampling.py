"""n > 1 end to end: the router, 1 prefill and 1 decode worker process, over real HTTP.
A seeded request with n=4 answers 4 choices, each equal to a single request sent with
its derived seed (seed + i), the prompt prefilled once on the prefill worker."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.disagg.conftest import Served

# Its own: no other test on the shared deployment sends it (a prefix-cache hit there
# would leave too few tokens to prefill remotely).
PROMPT = "Speculative decoding drafts a few tokens that the target model then verifies at once."


@pytest.fixture(scope="module")
def client(pd_server: Served) -> tuple[openai.OpenAI, str]:
    return pd_server.client, pd_server.config.model


def remote_prefills(openai_client: openai.OpenAI) -> int:
    with urllib.request.urlopen(str(openai_client.base_url).replace("/v1/", "/status"), timeout=10) as reply:
        return json.load(reply)["decode_workers"][0]["stats"]["remote"]


@pytest.mark.timeout(180)
def test_n_4_seeded_equals_4_single_requests_with_seed_plus_i(client: tuple[openai.OpenAI, str]) -> None:
    openai_client, model = client
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    before = remote_prefills(openai_client)
    out = openai_client.completions.create(n=4, seed=1234, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert remote_prefills(openai_client) == before + 1  # one remote prefill for the 4 choices
    singles = [openai_client.completions.create(seed=1234 + i, **kwargs) for i in range(4)]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in out.choices}) == 4 and all(c.finish_reason == "length" for c in out.choices)
    # The prompt counted once, every choice's tokens summed.
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (singles[0].usage.prompt_tokens, 32)
