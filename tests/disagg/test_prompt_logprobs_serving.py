"""Completions `echo` with `logprobs` over HTTP, served by the demo model: the prompt's
logprobs equal HF transformers' float32 log-softmax, in a colocated deployment and in
a P/D one (where such a request is prefilled on the decode worker, never remotely).
Also the in-house equivalent of lm-eval's `local-completions` loglikelihood scoring
(tests/data/mc_task.json; tests/disagg/lm_eval_check.py runs lm-eval itself)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.demo_model import DEMO_MODELS, default_models_dir
from cluster.serve import build
from engine.tokenizer import load_tokenizer
from router.app import Router
from tests.http_server import free_port, serving
from tests.unit.test_router_http import request

MODEL_DIR = default_models_dir() / DEMO_MODELS["smollm2"].dir_name
TASK = Path(__file__).parents[1] / "data" / "mc_task.json"
PROMPT = "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is"

pytestmark = [pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                                 reason="demo model not prepared (make model)"), pytest.mark.timeout(240)]


def _deploy(prefill_replicas: int) -> tuple[Any, Router, ClusterConfig]:
    config = ClusterConfig.from_dict({
        "model": str(MODEL_DIR), "transport": "shm", "dtype": "float32",
        "router": {"port": free_port(), "remote_prefill_min_tokens": 8},
        "prefill": {"replicas": prefill_replicas, "engine": {"num_kv_blocks": 64}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 64, "max_num_batched_tokens": 16}}})
    workers, router = build(config)
    return workers, router, config


@pytest.fixture(scope="module")
def deployments() -> Iterator[dict[str, tuple[str, Router]]]:
    """A colocated deployment and a P/D one (1 prefill + 1 decode worker), started side by side."""
    load_tokenizer(str(MODEL_DIR))  # transformers' lazy imports are not safe from two threads at once
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(_deploy, [0, 1]))
    try:
        with serving(built[0][1], built[0][2].router.port) as colocated, \
                serving(built[1][1], built[1][2].router.port) as pd:
            yield {"colocated": (colocated, built[0][1]), "pd": (pd, built[1][1])}
    finally:
        for workers, _, _ in built:
            workers.stop()


@pytest.fixture(scope="module")
def hf() -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(MODEL_DIR))


def hf_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log P(ids[j] | ids[:j]) for j >= 1, float32."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def completion(base: str, body: dict[str, Any]) -> dict[str, Any]:
    # A batch of them on a loaded 2-core machine (tests in parallel) is slow, not lost.
    status, out = request(base, "POST", "/v1/completions", body, timeout=120)
    assert status == 200, out
    return out


def routed(router: Router, prefill: str) -> float:
    return router.metrics.requests.labels(prefill=prefill)._value.get()


@pytest.mark.parametrize("where", ["colocated", "pd"])
def test_echoed_prompt_logprobs_equal_hf(deployments, hf, where: str) -> None:
    base, router = deployments[where]
    model, tokenizer = hf
    ids = tokenizer.encode(PROMPT)
    assert len(ids) >= 8  # long enough for a remote prefill in the P/D deployment (16-token chunks too)
    local, remote = routed(router, "local"), routed(router, "remote")
    out = completion(base, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                            "prompt_tokens_details": {"cached_tokens": 0}}  # scoring takes no prefix hit
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(model, ids)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], ref)) < 1e-4
    # The token itself, then the one most likely (the same entry when it is that token).
    assert all(top[t] == v and len(top) in (1, 2) and max(top.values()) >= v - 1e-6
               for t, top, v in zip(lp["tokens"][1:], lp["top_logprobs"][1:], lp["token_logprobs"][1:]))
    assert any(len(top) == 2 for top in lp["top_logprobs"][1:])  # some prompt token is not the model's first choice
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    # Prefilled on the decode worker, even where a plain request of such a prompt (one
    # not in its prefix cache yet, as this one was not) goes remote.
    assert (routed(router, "local"), routed(router, "remote")) == (local + 1, remote)
    completion(base, {"prompt": "Paged attention keeps keys and values in blocks of a fixed size.", "max_tokens": 1})
    assert routed(router, "remote") == remote + (where == "pd")


def test_echo_with_generated_tokens_and_vllm_prompt_logprobs(deployments, hf) -> None:
    base, _ = deployments["colocated"]
    model, tokenizer = hf
    ids = tokenizer.encode(PROMPT)
    plain = completion(base, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 0})["choices"][0]
    out = completion(base, {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0,
                            "prompt_logprobs": 2})["choices"][0]
    assert out["text"] == tokenizer.decode(ids) + plain["text"]
    lp = out["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["top_logprobs"][len(ids):] == plain["logprobs"]["top_logprobs"]
    assert lp["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
    # logprobs 0: no alternatives, only the token's own logprob (as vLLM answers)
    assert lp["top_logprobs"][1:len(ids)] == [{t: v} for t, v in zip(lp["tokens"][1:len(ids)],
                                                                       lp["token_logprobs"][1:len(ids)])]
    # vLLM's shape: None, then {token id: {logprob, rank, decoded_token}} with the top 2.
    vllm = out["prompt_logprobs"]
    ref = hf_logprobs(model, ids)
    assert vllm[0] is None and len(vllm) == len(ids)
    for j, entry in enumerate(vllm[1:]):
        mine = entry[str(ids[j + 1])]
        assert abs(mine["logprob"] - ref[j]) < 1e-4 and mine["decoded_token"] == tokenizer.decode([ids[j + 1]])
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:2] == [1, 2] and len(entry) in (2, 3)
    two = completion(base, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})["choices"][0]["text"]
    streamed = request_stream(base, {"prompt": PROMPT, "echo": True, "max_tokens": 2, "temperature": 0})
    assert streamed[0].startswith(PROMPT) and "".join(streamed) == PROMPT + two


def request_stream(base: str, body: dict[str, Any]) -> list[str]:
    """The texts of a streamed completion's events."""
    import urllib.request

    req = urllib.request.Request(f"{base}/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"content-type": "application/json"})
    texts = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    return texts


def test_multiple_choice_loglikelihoods_equal_hf(deployments, hf) -> None:
    """lm-eval's local-completions scoring without lm-eval: each choice's continuation
    scored by echo + logprobs + max_tokens 0 on the token ids of context + continuation
    (lm-eval's split: the continuation's tokens are those past the context's)."""
    base, _ = deployments["colocated"]
    model, tokenizer = hf
    docs = json.loads(TASK.read_text())
    items = []  # (doc index, context tokens, context + continuation tokens)
    for i, doc in enumerate(docs):
        context = f"Question: {doc['question']}\nAnswer:"
        for choice in doc["choices"]:
            items.append((i, tokenizer.encode(context), tokenizer.encode(context + " " + choice)))
    assert all(ids[:len(ctx)] == ctx for _, ctx, ids in items)

    def score(item: tuple[int, list[int], list[int]]) -> float:
        out = completion(base, {"prompt": item[2], "echo": True, "logprobs": 1, "max_tokens": 0})
        return sum(out["choices"][0]["logprobs"]["token_logprobs"][len(item[1]):])

    with ThreadPoolExecutor(8) as pool:  # the decode worker batches them
        server = list(pool.map(score, items))
    width = max(len(ids) for _, _, ids in items)
    batch = torch.tensor([ids + [0] * (width - len(ids)) for _, _, ids in items])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for _, _, ids in items])
    with torch.no_grad():  # right padding: no real token attends to it
        lp = torch.log_softmax(model(batch, attention_mask=mask).logits.float(), dim=-1)
    ref = [sum(lp[row, j - 1, ids[j]].item() for j in range(len(ctx), len(ids)))
           for row, (_, ctx, ids) in enumerate(items)]
    assert max(abs(a - b) for a, b in zip(server, ref)) < 1e-4

    def accuracy(scores: list[float]) -> float:
        best: dict[int, tuple[float, int]] = {}  # doc -> (best score, its choice)
        choice = 0
        for k, ((i, _, _), score) in enumerate(zip(items, scores)):
            choice = choice + 1 if k and items[k - 1][0] == i else 0
            if i not in best or score > best[i][0]:
                best[i] = (score, choice)
        return sum(best[i][1] == doc["answer"] for i, doc in enumerate(docs)) / len(docs)

    assert accuracy(server) == accuracy(ref) >= 0.5
