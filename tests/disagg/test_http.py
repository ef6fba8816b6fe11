"""The whole service over real HTTP with the official `openai` client: 1 prefill + 1
decode worker process behind the router (uvicorn on 127.0.0.1)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from cluster.config import ClusterConfig
from cluster.local.workers import LocalWorkers
from engine import LLM, SamplingParams
from tests.disagg.conftest import Served
from tests.disagg.test_worker_processes import Client
from tests.http_server import free_port
from tests.unit.test_grafana_dashboard import load_dashboard, missing_metrics

PROMPTS = ["The quick brown fox", "Paged attention stores keys and values in fixed-size blocks. " * 2]


@pytest.fixture(scope="module")
def server(pd_server: Served) -> tuple[openai.OpenAI, ClusterConfig, LocalWorkers]:
    return pd_server.client, pd_server.config, pd_server.workers


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[str]:
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.timeout(180)
def test_completions_streamed_and_not_match_the_engine(server, expected: list[str]) -> None:
    client, config, _ = server
    for prompt, text in zip(PROMPTS, expected):
        out = client.completions.create(model=config.model, prompt=prompt, max_tokens=12,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 12
        chunks = list(client.completions.create(model=config.model, prompt=prompt, max_tokens=12,
                                                temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.timeout(120)
def test_chat_models_and_stop_strings(server, expected: list[str]) -> None:
    client, config, _ = server
    assert [m.id for m in client.models.list().data] == [config.model]
    chat = client.chat.completions.create(model=config.model, max_tokens=8, temperature=0.0,
                                          messages=[{"role": "user", "content": "Hello"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    words = expected[0].split()
    if len(words) >= 2:  # stop on the second word: the text ends before it
        out = client.completions.create(model=config.model, prompt=PROMPTS[0], max_tokens=12,
                                        temperature=0.0, stop=[words[1]], extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "stop"
        assert out.choices[0].text == expected[0][:expected[0].find(words[1])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=-1), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=0), "max_tokens=0 needs echo: true"),  # with echo it scores the prompt
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(prompt="x " * 2000), "context length"),
])
def test_bad_requests_get_400_naming_the_problem(server, kwargs: dict, message: str) -> None:
    client, config, _ = server
    args = dict(model=config.model, prompt="Hello", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert message in str(err.value)
    assert client.completions.create(model=config.model, prompt="Hello", max_tokens=2).choices[0].text is not None


@pytest.mark.timeout(120)
def test_another_model_is_a_404_model_not_found(server) -> None:
    client, config, _ = server
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt="Hello", max_tokens=4)
    assert "model 'gpt-9' is not served here" in str(err.value) and err.value.code == "model_not_found"
    assert client.models.retrieve(config.model).id == config.model


@pytest.mark.timeout(120)
def test_logprobs_match_the_engine_in_both_api_shapes(server, llama_dir: Path) -> None:
    client, config, _ = server
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    ref = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                    logprobs=2), use_tqdm=False)[0]
    tokenizer = llm.tokenizer
    out = client.completions.create(model=config.model, prompt=PROMPTS[1], max_tokens=5, temperature=0.0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    # Each token decoded alone, but for one that alone is a partial UTF-8 character
    # (router/logprobs.py): the tokens join to the text, as vLLM's do, but for bytes that
    # never make a character (the text's U+FFFD; the tiny model's output has some).
    alone = [tokenizer.decode([t]) for t in ref.token_ids]
    assert [t for t, a in zip(lp.tokens, alone) if not a.endswith("\ufffd")] == [a for a in alone
                                                                                 if not a.endswith("\ufffd")]
    assert "".join(lp.tokens) == ref.text.replace("\ufffd", "") and out.choices[0].text == ref.text
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-4)
    assert [len(top) for top in lp.top_logprobs] == [2] * 5
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chunks = list(client.completions.create(model=config.model, prompt=PROMPTS[1], max_tokens=5, temperature=0.0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)

    chat = client.chat.completions.create(model=config.model, max_tokens=4, temperature=0.0, logprobs=True,
                                          top_logprobs=3, messages=[{"role": "user", "content": "Hello"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be an integer in \\[0, 20\\]"):
        client.chat.completions.create(model=config.model, max_tokens=2, logprobs=True, top_logprobs=21,
                                       messages=[{"role": "user", "content": "Hello"}])


@pytest.mark.timeout(180)
def test_concurrent_requests_complete_and_free_every_block(server, llama_dir: Path) -> None:
    client, config, workers = server
    prompts = [f"request {i}: " + "blocks and tokens " * (i % 5 + 1) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda p: client.completions.create(
            model=config.model, prompt=p, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}),
            prompts))
    assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == 6 for o in outs)
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [o.choices[0].text for o in outs] == [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
    probe = Client(workers.decode[0].address, workers.secret)
    stats = probe.stats()
    probe.close()
    assert stats.free_blocks == stats.num_blocks and stats.remote >= 1


@pytest.mark.timeout(120)
def test_client_gone_mid_stream_aborts_the_request(server) -> None:
    client, config, workers = server
    before = aborted(config.router.port)
    stream = client.completions.create(model=config.model, prompt="Hello there", max_tokens=500,
                                       temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # hang up after the first chunk
    wait_until_aborted(config, workers, before)


def wait_until_aborted(config: ClusterConfig, workers: LocalWorkers, before: float) -> None:
    """The router counts one more request aborted (not finished by length) than
    `before`, and the decode worker has freed everything."""
    probe = Client(workers.decode[0].address, workers.secret)
    try:
        end = time.monotonic() + 30
        while True:
            stats = probe.stats()
            if (aborted(config.router.port) == before + 1 and stats.free_blocks == stats.num_blocks
                    and stats.running == 0):
                return
            assert time.monotonic() < end, f"the abandoned request was not aborted: {stats}"
            time.sleep(0.2)
    finally:
        probe.close()


def aborted(port: int) -> float:
    """The router's count of requests aborted because their client went away."""

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    line = next((x for x in text.splitlines() if x.startswith('pdserve_requests_finished_total{reason="abort"}')), "")
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


@pytest.mark.timeout(120)
def test_client_gone_before_a_non_streamed_answer_aborts_the_request(server) -> None:
    _, config, workers = server
    before = aborted(config.router.port)
    conn = http.client.HTTPConnection("127.0.0.1", config.router.port, timeout=30)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"prompt": "Hello there", "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}))
    # Hang up once the decode worker runs it, not after a fixed wait: a fast
    # machine finishes 1000 tiny-model tokens within a second.
    probe = Client(workers.decode[0].address, workers.secret)
    try:
        end = time.monotonic() + 30
        while probe.stats().running == 0:
            assert time.monotonic() < end, "the request never started running"
            time.sleep(0.005)
    finally:
        probe.close()
    conn.close()
    wait_until_aborted(config, workers, before)


@pytest.mark.timeout(60)
def test_stop_token_ids_end_the_output(server, llama_dir: Path) -> None:
    client, config, _ = server
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    ref = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].token_ids
    stop = ref[3]
    out = client.completions.create(model=config.model, prompt=PROMPTS[0], max_tokens=12, temperature=0.0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == ref.index(stop) + 1


@pytest.mark.timeout(60)
def test_metrics_count_requests_latencies_and_worker_blocks(server) -> None:
    client, config, _ = server
    # Of its own (the module's other tests may not have run): a local prefill, a remote
    # one (remote_prefill_min_tokens 8), and a 400.
    client.completions.create(model=config.model, prompt="Hello", max_tokens=3, temperature=0.0)
    client.completions.create(model=config.model, prompt=PROMPTS[1], max_tokens=3, temperature=0.0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=config.model, prompt="Hello", max_tokens=-1)
    decode = '{role="decode",worker="decode-0"}'
    link = f'{{fabric="host",role="decode",transport="{config.transport}",worker="decode-0"}}'  # transfer figures: which wire
    # The worker gauges are its figures as of the router's latest ask (health pings):
    # once they show the remote prefill's bytes, and every block free again.
    end = time.monotonic() + 30
    while True:
        values, _ = scrape(config.router.port)
        if values.get(f"pdserve_worker_kv_bytes_received{link}", 0) > 0 and values.get(
                f"pdserve_worker_free_blocks{decode}") == values.get(f"pdserve_worker_num_blocks{decode}"):
            break
        assert time.monotonic() < end, "the worker gauges never showed the remote prefill, all blocks free"
        time.sleep(0.2)
    assert values["pdserve_time_to_first_token_seconds_count"] >= 1
    assert values["pdserve_e2e_request_latency_seconds_count"] >= 1
    assert values['pdserve_requests_finished_total{reason="length"}'] >= 1
    assert values['pdserve_requests_rejected_total{status="400"}'] >= 1
    assert values[f"pdserve_worker_remote{decode}"] >= 1
    assert values["pdserve_prompt_tokens_total"] >= values["pdserve_prefix_cache_hit_tokens_total"] >= 0
    for phase in ("queue", "prefill", "transfer", "decode", "kv_write"):  # from the remote prefill
        assert values[f'pdserve_request_phase_seconds_count{{phase="{phase}",prefill="remote"}}'] >= 1
    assert values['pdserve_request_phase_seconds_count{phase="prefill",prefill="local"}'] >= 1
    assert 'pdserve_request_phase_seconds_count{phase="kv_write",prefill="local"}' not in values  # remote only


def scrape(port: int) -> tuple[dict[str, float], set[str]]:
    """/metrics: sample (name with labels, as exposed) -> value, and the sample names."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    values = {name: float(value) for name, value in
              (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}
    return values, {name.split("{")[0] for name in values}


@pytest.mark.timeout(60)
def test_every_worker_reports_its_steps_and_figures_by_role(server) -> None:
    client, config, _ = server
    # Long enough to be prefilled on the prefill worker (remote_prefill_min_tokens 8).
    out = client.completions.create(model=config.model, prompt=PROMPTS[1], max_tokens=4, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError):  # a rejection too, for the dashboard's rejected rate
        client.completions.create(model=config.model, prompt="x", max_tokens=-1)
    values, names = scrape(config.router.port)
    decode, prefill = '{role="decode",worker="decode-0"}', '{role="prefill",worker="prefill-0"}'
    for labels in (decode, prefill):
        assert values[f"pdserve_worker_step_seconds_count{labels}"] > 0
        assert values[f"pdserve_worker_step_seconds_sum{labels}"] > 0
        assert values[f"pdserve_worker_step_requests_sum{labels}"] >= values[f"pdserve_worker_step_requests_count{labels}"]
        assert values[f"pdserve_worker_step_tokens_sum{labels}"] > 0
        assert values[f"pdserve_worker_preemptions{labels}"] == 0
        assert values[f"pdserve_worker_running{labels}"] == 0 and values[f"pdserve_worker_waiting{labels}"] == 0
        assert values[f"pdserve_worker_live{labels}"] == 1
    assert values[f"pdserve_worker_waiting_for_kv{decode}"] == 0
    assert values[f"pdserve_worker_prefill_tokens_computed{prefill}"] >= len(PROMPTS[1].split())
    link = f'{{fabric="host",role="prefill",transport="{config.transport}",worker="prefill-0"}}'
    assert values[f"pdserve_worker_prefill_blocks_written{link}"] > 0
    assert values[f"pdserve_worker_prefills_done{prefill}"] >= 1
    assert values[f"pdserve_worker_prefills_failed{prefill}"] == 0 and values[f"pdserve_worker_prefill_jobs{prefill}"] == 0
    assert values["pdserve_time_per_output_token_seconds_count"] >= 1
    assert f"pdserve_worker_prefill_jobs{decode}" not in values  # a worker reports its role's figures only
    # docs/grafana/pdserve.json reads only these; its speculative decoding panels' counters
    # come from a speculating worker only (tests/disagg/test_spec_serving.py checks them)
    assert [m for m in missing_metrics(load_dashboard(), names) if "pdserve_spec_decode_" not in m] == []


@pytest.mark.timeout(60)
def test_a_one_token_answer_to_a_remote_prefill_counts_as_remote(server) -> None:
    """Its one token needs only the pushed KV, so it may end before the prefill worker's
    prefill_done reaches the decode worker: still a remote prefill, in the metrics."""
    client, config, _ = server
    def counts() -> tuple[float, float]:
        values, _ = scrape(config.router.port)
        return tuple(values.get(f'pdserve_request_phase_seconds_count{{phase="decode",prefill="{where}"}}', 0.0)
                     for where in ("remote", "local"))

    before = counts()
    for i in range(3):
        prompt = " ".join(f"w{j}x{i}" for j in range(40))  # new each time: no prefix-cache hit
        out = client.completions.create(model=config.model, prompt=prompt, max_tokens=1, temperature=0.0)
        assert out.usage.completion_tokens == 1
    remote, local = counts()
    assert (remote - before[0], local - before[1]) == (3, 0)


@pytest.mark.timeout(60)
def test_pdserve_status_lists_the_workers_of_both_pools(server, capsys) -> None:
    from cluster.cli import main

    _, config, _ = server
    assert main(["status", "--url", f"http://127.0.0.1:{config.router.port}/v1"]) == 0  # as `serve` prints it
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"model {config.model}; requests in flight: 0"
    assert out[2] == "decode pool" and out[3].split()[:6] == ["worker", "live", "address", "stats_age", "tp", "running"]
    row = out[4].split()
    assert row[:2] == ["decode-0", "yes"] and row[2].startswith("tcp://127.0.0.1:")
    assert row[3] == "0s"  # figures of a reply to this /status
    assert row[4].startswith("1:") and row[4][2:].isdigit()  # one rank: the worker's own process
    assert row[8] == "0.0%" and int(row[9]) >= 1  # idle: no blocks held; remote prefills so far
    assert out[3].split()[-4:] == ["step_p50", "batch", "preempted", "kv_tiers"]
    # steps have run; none preempted; no offload tiers in this deployment
    assert row[-4].endswith("ms") and float(row[-3]) >= 1 and row[-2] == "0" and row[-1] == "-"
    assert out[6] == "prefill pool" and out[7].split()[3:] == ["stats_age", "tp", "jobs", "kv_used", "prefills",
                                                              "blocks_sent", "failed", "tokens", "running", "waiting",
                                                              "step_p50", "batch", "preempted", "kv_tiers"]
    row = out[8].split()
    assert row[:2] == ["prefill-0", "yes"] and row[3] == "0s" and row[5:7] == ["0", "0.0%"] and int(row[7]) >= 1
    assert int(row[10]) > 0 and row[11:13] == ["0", "0"]  # prompt tokens computed; nothing queued
    assert row[13].endswith("ms") and float(row[14]) >= 1 and row[15] == "0" and row[16] == "-"
    assert main(["status", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "no pdserve router answers at" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_token_controls_through_remote_prefill_match_the_engine(server, llama_dir: Path) -> None:
    """logit_bias, allowed_token_ids and bad_words travel with the request to the decode
    worker (its prompt prefilled remotely), and give the offline engine's tokens."""
    client, config, _ = server
    prompt = "Continuous batching mixes prefill and decode tokens in one step. Prefix caching reuses blocks."
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = llm.generate([prompt], greedy, use_tqdm=False)[0]
    word = llm.tokenizer.decode(ref.token_ids[2:4])
    controls = {"logit_bias": {str(ref.token_ids[0]): -100, "17": 1.5},
                "allowed_token_ids": sorted(set(ref.token_ids) | {17, 40, 41}), "bad_words": [word]}
    want = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **controls),
                        use_tqdm=False)[0]
    assert want.token_ids != ref.token_ids
    before, _ = scrape(config.router.port)
    out = client.completions.create(model=config.model, prompt=prompt, max_tokens=10, temperature=0.0,
                                    extra_body={"ignore_eos": True, **controls})
    assert out.choices[0].text == want.text
    after, _ = scrape(config.router.port)
    remote = 'pdserve_request_phase_seconds_count{phase="decode",prefill="remote"}'
    assert after.get(remote, 0.0) == before.get(remote, 0.0) + 1
