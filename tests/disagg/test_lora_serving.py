"""LoRA adapters served 1P1D over HTTP (cluster config `lora`): a request's `model`
names an adapter, the decode worker reserves its blocks and the prefill worker
computes the prompt's KV with the same adapter, and the greedy tokens equal HF + PEFT
with the adapter merged, mixed with base-model requests. /v1/models lists the adapters
with the model as parent; the admin endpoints load and unload one at runtime (admin
key only); prefix-cache hits never cross adapters; bad input is a 400 or 404 naming
the field, and the server keeps serving."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from cluster.config import ClusterConfig
from cluster.serve import build
from engine import LLM
from tests.fidelity.test_lora_fidelity import GREEDY, hf_greedy, request_of
from tests.fidelity.test_lora_fidelity import NAMES as NAMES_FIDELITY
from tests.fidelity.test_lora_fidelity import PROMPTS as PROMPTS_FIDELITY
from tests.http_server import free_port, serving

ADMIN = "sk-admin-lora-test"
# Long enough to be prefilled remotely (remote_prefill_min_tokens 8), two full blocks
# of 8 and more: the second request of a prompt hits the prefix cache.
PROMPTS = [[(7 * i + 3 * j) % 290 + 2 for j in range(n)] for i, n in enumerate((21, 30, 26, 19))]
NAMES = [None, "a1", "a2", "a2"]


@pytest.fixture(scope="module")
def served(lora_models: dict[str, Path]) -> Iterator[tuple[str, ClusterConfig]]:
    config = ClusterConfig.from_dict({
        "model": str(lora_models["base"]), "transport": "shm", "prefill_deadline_s": 10.0,
        "router": {"port": free_port(), "remote_prefill_min_tokens": 8, "admin_keys": [ADMIN]},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 80, "block_size": 8}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 80, "block_size": 8}},
        "lora": {"adapters": {"a1": str(lora_models["a1"]), "a2": str(lora_models["a2"])}, "max_loras": 2,
                 "max_lora_rank": 16}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            yield base, config
    finally:
        workers.stop()


def post(base: str, path: str, body: Any, key: str | None = ADMIN) -> tuple[int, str]:
    request = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def complete(base: str, model: str, prompt: list[int]) -> dict[str, Any]:
    status, text = post(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True}, key=None)
    assert status == 200, text
    return json.loads(text)


def get(base: str, path: str) -> Any:
    with urllib.request.urlopen(f"{base}{path}", timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def offline(lora_models: dict[str, Path]) -> Callable[[str | None, list[int]], str]:
    """The colocated engine's text for (adapter, prompt), its tokens checked against HF + PEFT merged."""
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16, num_kv_blocks=80)

    def text(name: str | None, prompt: list[int]) -> str:
        [out] = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request_of(lora_models, name))
        assert out.token_ids == hf_greedy(lora_models, name, prompt)
        return out.text
    return text


@pytest.mark.timeout(300)
def test_adapters_served_1p1d_equal_peft_merged(served: tuple[str, ClusterConfig],
                                                offline: Callable[[str | None, list[int]], str]) -> None:
    base, config = served
    model = config.model
    want = [offline(name, p) for name, p in zip(NAMES, PROMPTS)]
    with ThreadPoolExecutor(4) as pool:  # in one batch on the decode worker
        answers = list(pool.map(lambda i: complete(base, NAMES[i] or model, PROMPTS[i]), range(len(PROMPTS))))
    assert [a["choices"][0]["text"] for a in answers] == want
    assert [a["model"] for a in answers] == [name or model for name in NAMES]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    streamed = client.completions.create(model="a2", prompt=PROMPTS[2], max_tokens=12, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want[2]
    status = get(base, "/status")
    [decode], [prefill] = status["decode_workers"], status["prefill_workers"]
    assert decode["stats"]["remote"] >= len(PROMPTS) and decode["stats"]["fallbacks"] == 0
    assert prefill["stats"]["prefills"] >= len(PROMPTS) and prefill["stats"]["refused"] == 0
    assert {"a1", "a2"} <= set(decode["stats"]["lora_adapters"]) and {"a1", "a2"} <= set(
        prefill["stats"]["lora_adapters"])


@pytest.mark.timeout(300)
def test_models_listing_admin_load_unload_and_bad_input(served: tuple[str, ClusterConfig],
                                                        lora_models: dict[str, Path], tmp_path: Path,
                                                        offline: Callable[[str | None, list[int]], str]) -> None:
    base, config = served
    listed = {m["id"]: m for m in get(base, "/v1/models")["data"]}
    assert listed["a1"]["parent"] == config.model and listed["a1"]["root"] == str(lora_models["a1"])
    assert listed[config.model]["parent"] is None and "a3" not in listed
    assert get(base, "/v1/models/a2")["parent"] == config.model

    # Not served yet: 404 naming model. Loading needs an admin key.
    status, text = post(base, "/v1/completions", {"model": "a3", "prompt": [5, 6], "max_tokens": 2}, key=None)
    assert status == 404 and json.loads(text)["error"]["param"] == "model"
    body = {"lora_name": "a3", "lora_path": str(lora_models["a3"])}
    assert post(base, "/v1/load_lora_adapter", body, key=None)[0] == 401
    assert post(base, "/v1/load_lora_adapter", body, key="sk-not-admin")[0] == 401
    status, text = post(base, "/v1/load_lora_adapter", body)
    assert status == 200 and "a3" in text, text
    want = offline("a3", PROMPTS[1])
    assert complete(base, "a3", PROMPTS[1])["choices"][0]["text"] == want
    assert get(base, "/v1/models/a3")["root"] == str(lora_models["a3"])

    # Bad loads: each a 400 naming the field; nothing changes.
    big = tmp_path / "big"
    big.mkdir()
    cfg = json.loads((lora_models["a3"] / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 64}))
    (big / "adapter_model.safetensors").write_bytes((lora_models["a3"] / "adapter_model.safetensors").read_bytes())
    for bad, param, words in [({"lora_name": "a3", "lora_path": str(lora_models["a1"])}, "lora_name", "already loaded"),
                              ({"lora_name": config.model, "lora_path": str(lora_models["a1"])}, "lora_name",
                               "base model"),
                              ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, "lora_path",
                               "adapter_config.json"),
                              ({"lora_name": "x", "lora_path": str(big)}, "lora_path", "declares 64"),
                              ({"lora_name": "x"}, "lora_path", "required"),
                              ({"lora_name": "x", "lora_path": "p", "extra": 1}, "extra", "unknown field")]:
        status, text = post(base, "/v1/load_lora_adapter", bad)
        error = json.loads(text)["error"]
        assert status == 400 and error["param"] == param and words in error["message"], (bad, text)

    # An adapter whose files went away before any worker read them: its requests are
    # refused naming `model`, and the server goes on serving.
    gone = tmp_path / "gone"
    gone.mkdir()
    for f in lora_models["a2"].iterdir():
        (gone / f.name).write_bytes(f.read_bytes())
    assert post(base, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(gone)})[0] == 200
    for f in gone.iterdir():
        f.unlink()
    status, text = post(base, "/v1/completions", {"model": "gone", "prompt": PROMPTS[1], "max_tokens": 2},
                        key=None)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "model" and "LoRA adapter 'gone'" in error["message"], text
    assert post(base, "/v1/unload_lora_adapter", {"lora_name": "gone"})[0] == 200

    # Unloaded: no longer served; unloading again is a 404.
    assert post(base, "/v1/unload_lora_adapter", {"lora_name": "a3"})[0] == 200
    assert post(base, "/v1/unload_lora_adapter", {"lora_name": "a3"})[0] == 404
    status, _ = post(base, "/v1/completions", {"model": "a3", "prompt": [5, 6], "max_tokens": 2}, key=None)
    assert status == 404
    # Loaded again in place of a1 (load_inplace): a1 now runs a3's weights.
    status, _ = post(base, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(lora_models["a3"]),
                                                     "load_inplace": True})
    assert status == 200
    try:
        assert complete(base, "a1", PROMPTS[1])["choices"][0]["text"] == want
    finally:
        post(base, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(lora_models["a1"]),
                                             "load_inplace": True})
    assert complete(base, config.model, PROMPTS[0])["choices"][0]["text"] == offline(None, PROMPTS[0])


@pytest.mark.timeout(300)
def test_prefix_cache_hits_never_cross_adapters_served(served: tuple[str, ClusterConfig]) -> None:
    base, config = served
    prompt = [(11 * j) % 280 + 5 for j in range(41)]  # five full blocks of 8

    def cached(model: str) -> int:
        usage = complete(base, model, prompt)["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    assert [cached(m) for m in ("a2", "a1", config.model, "a2")] == [0, 0, 0, 40]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)])
def test_adapters_through_pools_of_different_tp_sizes(lora_models: dict[str, Path], prefill_tp: int,
                                                      decode_tp: int) -> None:
    """Each rank of either pool holds its slice of the adapter (the prefill worker's of
    its own TP size): the KV it pushes, computed with the adapter, decodes to HF + PEFT's
    tokens, each request's adapter named on the way (RemotePrefill.lora)."""
    from decode_worker.remote_kv import DecodeWorkerCore
    from prefill_worker.remote_prefill import PrefillWorkerCore
    from tests.disagg.test_fp8_remote_prefill import workers
    from tests.lora_adapters import spec_of

    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=16, block_size=8)
    # The fidelity test's prompts: HF's reference bans EOS (min_new_tokens), so prompts
    # whose greedy output has none (this module's PROMPTS[3] under a3 has one).
    names, prompts = NAMES_FIDELITY[1:6], PROMPTS_FIDELITY[1:6]
    with workers(lora_models["base"], "shm", dict(lora, tp=decode_tp, num_kv_blocks=80),
                 dict(lora, tp=prefill_tp, num_kv_blocks=80, max_num_batched_tokens=24)) as ((t_dec, t_pre), engines):
        t_pre.add_peer(t_dec.metadata())
        decode, prefill = DecodeWorkerCore(engines[0], t_dec, 30.0), PrefillWorkerCore(engines[1], t_pre)
        pending = {}
        for i, (name, prompt) in enumerate(zip(names, prompts)):
            r = request_of(lora_models, name)
            spec = None if r is None else spec_of(r)
            rp = decode.add_request(f"r{i}", prompt, GREEDY, remote=True, sender="prefill0", lora=spec)
            assert rp is not None and rp.lora == spec
            prefill.submit(rp)
            pending[f"r{i}"] = (name, prompt)
        done = {}
        end = time.monotonic() + 180
        while decode.engine.has_unfinished() or prefill.engine.has_unfinished():
            assert time.monotonic() < end, "disaggregated run did not finish"
            for result in prefill.step():
                assert result.error is None, result.error
            for finished in decode.step().finished:
                done[finished.request_id] = finished.output_token_ids
        assert decode.stats["remote"] == len(names) and decode.stats["fallbacks"] == 0
        assert done == {rid: hf_greedy(lora_models, name, prompt) for rid, (name, prompt) in pending.items()}


@pytest.mark.timeout(300)
def test_files_changed_in_place_and_reloaded_serve_the_new_weights(served: tuple[str, ClusterConfig],
                                                                   lora_models: dict[str, Path], tmp_path: Path,
                                                                   offline: Callable[[str | None, list[int]], str]
                                                                   ) -> None:
    """An operator rewrites an adapter's files where they are and reloads it
    (load_inplace): both workers, holding reads of the old files, read the new ones and
    compute with them; before the reload, the router still sends the old digest, and
    the workers run the read they hold of those files. (A worker that must read files
    changed since refuses the request: tests/fidelity/test_lora_fidelity.py.)"""
    base, _ = served
    live = tmp_path / "live"
    live.mkdir()

    def put(name: str) -> None:
        for f in lora_models[name].iterdir():
            (live / f.name).write_bytes(f.read_bytes())
    put("a1")
    assert post(base, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": str(live)})[0] == 200
    try:
        assert complete(base, "live", PROMPTS[1])["choices"][0]["text"] == offline("a1", PROMPTS[1])
        put("a2")  # changed under the served name: the router's digest is still a1's
        status, text = post(base, "/v1/completions", {"model": "live", "prompt": PROMPTS[2], "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True}, key=None)
        # Both workers hold a read of a1's files, which the digest names: they run it.
        assert status == 200 and json.loads(text)["choices"][0]["text"] == offline("a1", PROMPTS[2]), text
        assert post(base, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": str(live),
                                                    "load_inplace": True})[0] == 200
        for prompt in (PROMPTS[1], PROMPTS[2]):
            assert complete(base, "live", prompt)["choices"][0]["text"] == offline("a2", prompt)
    finally:
        post(base, "/v1/unload_lora_adapter", {"lora_name": "live"})
