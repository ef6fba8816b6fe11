"""A worker that errors does not vanish (workers/loop.py): real worker processes
under the local supervisor, with faults injected into their engines through
PDSERVE_TEST_FAULTS (workers/fault_injection.py), each keyed to one
request id so it fires only for the request that names it.

- A decode step whose model launch raises fails the requests in it (status 500) and
  the worker serves on; the same prompt afterwards gets the engine's tokens.
- A prefill step that raises fails that job: its decode worker prefills it locally.
- An EngineStateError (the scheduler failed part-way) fails every request on the
  worker, which exits non-zero and is restarted by its supervisor.
- A step that never returns: the worker's hang watchdog ends the process after
  router.stall_timeout_s (+ grace), and it is restarted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from engine import LLM, SamplingParams
from protocol import Generate
from tests.disagg.test_local_supervision import Supervised
from tests.disagg.test_worker_processes import PARAMS, Client
from tests.fidelity.test_hf_fidelity import random_prompts
from workers.fault_injection import TEST_FAULTS_ENV

PROMPTS = random_prompts([40, 70], seed=23)
STALL_TIMEOUT_S = 4.0
FAULTS = ",".join([
    "decode-0:launch:d-launch",  # RequestsFailed on the decode worker
    "prefill-0:launch:p-launch",  # RequestsFailed on the prefill worker
    "decode-0:schedule:d-state",  # EngineStateError on the decode worker
    "decode-0:hang:d-hang",  # a decode step that never returns
])


@pytest.fixture(scope="module")
def supervised(llama_dir: Path) -> Iterator[Supervised]:
    previous = os.environ.get(TEST_FAULTS_ENV)
    os.environ[TEST_FAULTS_ENV] = FAULTS  # spawned workers (restarts too) inherit it
    s = None
    try:
        s = Supervised(ClusterConfig.from_dict({
            "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 10.0,
            # grace before a stalled worker exits: 2 health intervals (>= 1 s)
            "router": {"health_interval_s": 0.5, "worker_timeout_s": 2.0, "stall_timeout_s": STALL_TIMEOUT_S},
            "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 80}},
            "decode": {"replicas": 1, "engine": {"num_kv_blocks": 80}}}))
        yield s
    finally:
        if s is not None:
            s.supervisor.stop()
            s.workers.stop()
        if previous is None:
            os.environ.pop(TEST_FAULTS_ENV, None)
        else:
            os.environ[TEST_FAULTS_ENV] = previous


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[list[int]]:
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**PARAMS), use_tqdm=False)]


def outcomes(client: Client, requests: dict[str, tuple[list[int], dict]], remote: bool,
             timeout: float = 60.0) -> dict[str, dict]:
    """Send each request; wait until each has finished or been rejected (with status)."""
    for rid, (prompt, params) in requests.items():
        client.send(Generate(request_id=rid, prompt=prompt, params=params, remote=remote, priority=0))
    results = {rid: {"tokens": [], "finished": False, "error": "", "status": 0} for rid in requests}
    end = time.monotonic() + timeout
    while not all(r["finished"] or r["error"] for r in results.values()):
        msg = client.recv(max(0.1, end - time.monotonic()))
        r = results[msg.request_id]
        if msg.kind == "rejected":
            r["error"], r["status"] = msg.error, msg.status
        else:
            r["tokens"] += msg.tokens
            r["finished"] = msg.finished
    return results


def wait_exit(process, timeout: float) -> int:
    process.join(timeout)
    assert not process.is_alive(), f"still running after {timeout} s"
    return process.exitcode


@pytest.mark.timeout(180)
def test_a_failed_decode_step_fails_its_requests_and_the_worker_serves_on(supervised: Supervised,
                                                                          reference) -> None:
    worker = supervised.workers.decode[0]
    client = Client(worker.address, supervised.workers.secret)
    try:
        failed = outcomes(client, {"d-launch": (PROMPTS[0], PARAMS)}, remote=False)["d-launch"]
        assert failed["status"] == 500 and not failed["finished"]
        assert "engine step this request was in failed" in failed["error"]
        assert "injected fault" in failed["error"]  # the exception's own message
        after = outcomes(client, {"after": (PROMPTS[0], PARAMS)}, remote=False)["after"]
        assert after["tokens"] == reference[0] and not after["error"]
        stats = client.stats()
        assert stats.free_blocks == stats.num_blocks and stats.stalled is False
        assert worker.process.is_alive() and not supervised.events
    finally:
        client.close()


@pytest.mark.timeout(180)
def test_a_failed_prefill_step_is_prefilled_locally_and_the_prefill_worker_serves_on(
        supervised: Supervised, reference) -> None:
    client = Client(supervised.workers.decode[0].address, supervised.workers.secret)
    try:
        before = client.stats()
        result = outcomes(client, {"p-launch": (PROMPTS[1], PARAMS)}, remote=True)["p-launch"]
        assert result["tokens"] == reference[1] and not result["error"]
        stats = client.stats()
        assert stats.fallbacks == before.fallbacks + 1
        assert stats.kv_transfer_failures == before.kv_transfer_failures + 1
        result = outcomes(client, {"p-after": (PROMPTS[1], PARAMS)}, remote=True)["p-after"]
        assert result["tokens"] == reference[1]
        stats = client.stats()
        assert stats.remote == before.remote + 2 and stats.fallbacks == before.fallbacks + 1
        assert supervised.workers.prefill[0].process.is_alive() and not supervised.events
    finally:
        client.close()


@pytest.mark.timeout(240)
def test_an_engine_state_error_fails_every_request_and_the_worker_is_restarted(
        supervised: Supervised, reference) -> None:
    old = supervised.workers.decode[0]
    client = Client(old.address, supervised.workers.secret)
    try:
        long = dict(PARAMS, max_tokens=64)  # still running when d-state is scheduled
        results = outcomes(client, {"bystander": (PROMPTS[0], long), "d-state": (PROMPTS[1], PARAMS)},
                           remote=False)
        for rid in ("bystander", "d-state"):
            assert results[rid]["status"] == 500 and not results[rid]["finished"], results[rid]
            assert "is being restarted" in results[rid]["error"]
            assert "EngineStateError" in results[rid]["error"] or "scheduler failed" in results[rid]["error"]
        assert wait_exit(old.process, 30) == 1
    finally:
        client.close()
    restarted_serves(supervised, "new", PROMPTS[0], reference[0])


def restarted_serves(supervised: Supervised, request_id: str, prompt: list[int], expected: list[int]) -> None:
    """decode-0 was reported down, is restarted, and serves `prompt` with `expected`."""
    supervised.wait_for(("down", "decode-0"), 10)
    _, _, address = supervised.wait_for(("moved", "decode-0"), 120)
    client = Client(address, supervised.workers.secret)
    try:
        result = outcomes(client, {request_id: (prompt, PARAMS)}, remote=True)[request_id]
        assert result["tokens"] == expected
    finally:
        client.close()


@pytest.mark.timeout(240)
def test_a_step_that_never_returns_ends_the_process_and_the_worker_is_restarted(
        supervised: Supervised, reference) -> None:
    supervised.events.clear()
    old = supervised.workers.decode[0]
    client = Client(old.address, supervised.workers.secret)
    try:
        client.send(Generate(request_id="d-hang", prompt=PROMPTS[0], params=PARAMS, remote=False, priority=0))
        start = time.monotonic()
        assert wait_exit(old.process, 60) == 1
        # Not before stall_timeout_s + grace (1 s here) without the loop coming round.
        assert time.monotonic() - start >= STALL_TIMEOUT_S
    finally:
        client.close()
    restarted_serves(supervised, "again", PROMPTS[1], reference[1])
