"""Speculative decoding served disaggregated: the decode pool drafts with n-grams, the
prefill pool pushes prompt KV, and greedy tokens equal the engine's without
speculation. k = 3 over HTTP (completions, streamed and not, /metrics); k = 1 and 5
through the engines and a KV transport (tests/disagg/test_remote_prefill.py's pair),
which costs no deployment."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from cluster.config import ClusterConfig
from cluster.serve import build
from engine import LLM, SamplingParams
from engine.speculative import speculator as speculator_module
from tests.disagg.test_http import scrape
from tests.disagg.test_remote_prefill import GREEDY, run, tokens, worker_pair
from tests.http_server import free_port, serving
from tests.unit.test_grafana_dashboard import load_dashboard, missing_metrics
from tests.unit.test_speculative import _oracle

# Text that repeats itself, so that n-gram drafts (from the prompt) are accepted at times
# even from the random tiny model; 60-80 tokens each, prefilled on the prefill worker.
TEXT_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 4,
                "Paged attention stores keys and values in fixed-size blocks. " * 3]
MAX_TOKENS = 32
# Token prompts for the engine pair (its run() samples test_remote_prefill.GREEDY).
TOKEN_PROMPTS = [[7, 8, 9, 10, 11] * 6, [3, 4] * 12 + [5], [20, 21, 22, 23] * 10 + [20, 21]]
ACCEPTED = 'pdserve_spec_decode_num_accepted_tokens_total{role="decode",worker="decode-0"}'


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def plain(llama_dir: Path) -> dict:
    """The colocated engine without speculation: per text prompt its greedy output
    (tokens, text, logprobs); per token prompt its greedy tokens."""
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    return {"text": llm.generate(TEXT_PROMPTS, params, use_tqdm=False), "tokenizer": llm.tokenizer,
            "tokens": {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(TOKEN_PROMPTS, GREEDY, use_tqdm=False))}}


@pytest.fixture(scope="module")
def served(llama_dir: Path) -> Iterator[tuple[openai.OpenAI, ClusterConfig]]:
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 5.0,
        "router": {"port": free_port(), "remote_prefill_min_tokens": 8},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 80, "max_num_batched_tokens": 32}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 80, "speculative_config": ngram(3)}}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60, max_retries=0), config
    finally:
        workers.stop()


@pytest.mark.timeout(120)
def test_greedy_completions_over_http_match_the_plain_engine(served, plain: dict) -> None:
    client, config = served
    for prompt, ref in zip(TEXT_PROMPTS, plain["text"]):
        out = client.completions.create(model=config.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                        logprobs=1, extra_body={"ignore_eos": True})
        choice = out.choices[0]
        assert choice.text == ref.text and out.usage.completion_tokens == MAX_TOKENS
        # Each token decoded alone, but for one that alone is a partial UTF-8 character: it
        # says "" and the token completing the character says it whole (router/logprobs.py).
        alone = [plain["tokenizer"].decode([t]) for t in ref.token_ids]
        whole = [a for a in alone if not a.endswith("\ufffd")]
        assert [t for t, a in zip(choice.logprobs.tokens, alone) if not a.endswith("\ufffd")] == whole
        assert "".join(choice.logprobs.tokens) == ref.text.replace("\ufffd", "")
        # accepted drafts carry their own logprobs, computed in the verifying step
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
    values, names = scrape(config.router.port)
    labels = '{role="decode",worker="decode-0"}'
    assert values[ACCEPTED] > 0, "no draft was accepted: the test proves nothing"
    assert values[f"pdserve_spec_decode_num_draft_tokens_total{labels}"] >= values[ACCEPTED]
    per_position = [values[f'pdserve_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}",role="decode",'
                           f'worker="decode-0"}}'] for i in range(3)]
    assert sum(per_position) == values[ACCEPTED] and per_position == sorted(per_position, reverse=True)
    assert values[f"pdserve_worker_remote{labels}"] >= len(TEXT_PROMPTS)  # the prompts were prefilled remotely
    assert not any("spec_decode" in name and "prefill" in name for name in values)  # the prefill pool does not draft
    spec_panels = [m for m in missing_metrics(load_dashboard(), names) if "pdserve_spec_decode_" in m]
    assert spec_panels == []  # the dashboard's speculative decoding panels read metrics that exist


@pytest.mark.timeout(120)
def test_a_stream_of_multi_token_steps_gives_the_same_text(served, plain: dict) -> None:
    client, config = served
    prompt, ref = TEXT_PROMPTS[0], plain["text"][0]
    before = scrape(config.router.port)[0][ACCEPTED]
    chunks = list(client.completions.create(model=config.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert scrape(config.router.port)[0][ACCEPTED] > before, "the stream accepted no draft: it tested nothing"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k,oracle", [(1, False), (5, False), (5, True)])
def test_pushed_kv_then_speculative_decode_gives_the_plain_tokens(llama_dir: Path, plain: dict, monkeypatch,
                                                                  k: int, oracle: bool) -> None:
    """n-grams from the random tiny model rarely get past the first draft position, so
    an oracle proposer (always right) fills all k in a step as well."""
    if oracle:
        monkeypatch.setattr(speculator_module, "propose_ngram", _oracle(
            {tuple(p): plain["tokens"][f"r{i}"] for i, p in enumerate(TOKEN_PROMPTS)}, wrong=False))
    decode, prefill = worker_pair(llama_dir, "shm", speculative_config=ngram(k))
    try:
        assert tokens(run(decode, prefill, TOKEN_PROMPTS)) == plain["tokens"]
        assert decode.stats["remote"] == len(TOKEN_PROMPTS) and decode.stats["fallbacks"] == 0
        spec = decode.engine.stats().spec
        assert spec is not None and spec.num_accepted_tokens > 0, "no draft was accepted: the test proves nothing"
        assert len(spec.accepted_per_position) == k and sum(spec.accepted_per_position) == spec.num_accepted_tokens
        if oracle:
            assert spec.num_accepted_tokens == spec.num_draft_tokens and spec.accepted_per_position[-1] > 0
        assert decode.engine.kv.num_free_blocks == decode.engine.kv.pool.num_blocks, "blocks leaked"
    finally:
        decode.transport.close()
        prefill.transport.close()
