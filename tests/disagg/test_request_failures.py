"""A request whose logits cannot be sampled fails alone: its client gets an error, every
other request on the decode worker finishes with the tokens it would have had, and the
worker keeps serving (driven in-process over its real ZMQ socket)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from decode_worker.remote_kv import DecodeWorkerCore
from decode_worker.server import DecodeWorker
from engine import LLM
from engine.config import EngineConfig
from engine.engine_core import EngineCore, RequestsFailed
from engine.sampling_params import SamplingParams
from kv_transfer import TransportConfig, create_transport
from protocol import WORKER_MESSAGES, Generate, encode
from tests.fidelity.test_hf_fidelity import random_prompts

decode = WORKER_MESSAGES.decode

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
POISONED = 7  # max_tokens that marks the request whose logits turn NaN


def poison_rows(engine: EngineCore, after_steps: int) -> None:
    """From the `after_steps`-th sampling on, rows of POISONED requests get NaN logits."""
    sample, calls = engine.runner.sampler.sample, 0

    def poisoned(logits, rows, drafts=None):
        nonlocal calls
        calls += 1
        if calls >= after_steps:
            for i, row in enumerate(rows):
                if row.params.max_tokens == POISONED:
                    logits[i] = float("nan")
        return sample(logits, rows, drafts)

    engine.runner.sampler.sample = poisoned


@pytest.mark.timeout(60)
def test_the_engine_names_the_requests_whose_logits_were_unusable(llama_dir: Path) -> None:
    engine = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=64))
    poison_rows(engine, after_steps=2)
    for rid, max_tokens in (("a", 8), ("bad", POISONED), ("b", 8)):
        engine.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    engine.step()
    with pytest.raises(RequestsFailed, match="unusable logits") as failure:
        engine.step()
    assert failure.value.request_ids == ["bad"]
    engine.abort(["bad"])
    while engine.has_unfinished():
        engine.step()


@pytest.mark.timeout(90)
def test_a_request_whose_logits_are_unusable_fails_alone_and_serving_goes_on(llama_dir: Path) -> None:
    prompts = random_prompts([12, 30, 21], seed=4)
    expected = [o.token_ids for o in LLM(str(llama_dir), num_kv_blocks=64).generate(
        prompts, SamplingParams(**GREEDY), use_tqdm=False)]
    transport = create_transport("tcp", "decode-0", TransportConfig())
    engine = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=64), transport.allocate_kv_cache)
    transport.register_kv_cache(engine.kv_cache, "tiny-llama")
    worker = DecodeWorker("decode-0", DecodeWorkerCore(engine, transport))
    poison_rows(engine, after_steps=3)  # the bad request has streamed tokens before it fails
    client = worker.ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.ROUTING_ID, b"router")
    client.connect(worker.address)
    try:
        requests = {"a": (prompts[0], GREEDY), "bad": (prompts[1], dict(GREEDY, max_tokens=POISONED)),
                    "b": (prompts[2], GREEDY)}
        for rid, (prompt, params) in requests.items():
            client.send(encode(Generate(request_id=rid, prompt=prompt, params=params, remote=False, priority=0)))
        tokens, errors, finished = {rid: [] for rid in requests}, {}, set()
        end = time.monotonic() + 60
        while len(finished) + len(errors) < len(requests):
            assert time.monotonic() < end, f"not done: {tokens}, {errors}"
            worker._drain(worker.sock)
            worker.step()
            while client.poll(0):
                msg = decode(client.recv())
                if msg.kind == "rejected":
                    errors[msg.request_id] = msg.error
                else:
                    tokens[msg.request_id] += msg.tokens
                    if msg.finished:
                        finished.add(msg.request_id)
        assert list(errors) == ["bad"] and "logits were NaN" in errors["bad"]
        assert tokens["bad"] != []  # it had streamed tokens before
        assert [tokens["a"], tokens["b"]] == [expected[0], expected[2]]
        assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    finally:
        client.close(0)
        worker.close()
        transport.close()
