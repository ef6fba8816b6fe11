"""n > 1 end to end: the router, 1 prefill and 1 decode worker process, over real HTTP.
A seeded request with n=4 answers 4 choices, each equal to a single request sent with
its derived seed (seed + i), the prompt prefilled once on the prefill worker."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from cluster.config import ClusterConfig
from cluster.serve import build
from tests.http_server import free_port, serving

PROMPT = "Paged attention stores keys and values in fixed-size blocks."


@pytest.fixture(scope="module")
def client(llama_dir: Path) -> Iterator[tuple[openai.OpenAI, str]]:
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 5.0,
        "router": {"port": free_port(), "remote_prefill_min_tokens": 8},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 80}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 80}}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60, max_retries=0), config.model
    finally:
        workers.stop()


@pytest.mark.timeout(180)
def test_n_4_seeded_equals_4_single_requests_with_seed_plus_i(client: tuple[openai.OpenAI, str]) -> None:
    openai_client, model = client
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    out = openai_client.completions.create(n=4, seed=1234, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    with urllib.request.urlopen(str(openai_client.base_url).replace("/v1/", "/status"), timeout=10) as reply:
        status = json.load(reply)
    assert status["decode_workers"][0]["stats"]["remote"] == 1  # one remote prefill for the 4 choices
    singles = [openai_client.completions.create(seed=1234 + i, **kwargs) for i in range(4)]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in out.choices}) == 4 and all(c.finish_reason == "length" for c in out.choices)
    # The prompt counted once, every choice's tokens summed.
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (singles[0].usage.prompt_tokens, 32)
