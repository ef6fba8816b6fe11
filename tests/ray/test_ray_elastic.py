"""Elastic pools on Ray (cluster/ray/elastic.py), on a private local Ray of 4 CPUs with
configs/ray-local.yaml and the demo model, while greedy requests stream over HTTP: the
ratio flips from 2P1D to 1P2D and back. The decode worker added gets a placement group
of its own, and is removed with it (its actor dead); the initial prefill worker
removed drains first (no new prompt reaches it) and leaves its bundle of the pool's
group reserved, where the prefill worker added next is placed, under a new name. No
request fails and every text equals the colocated engine's. Then `pdserve scale`'s
path (cluster/ray/scale.py) to a DeploymentActor: targets out of bounds, and a worker
Ray cannot place, get clear errors and change nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
import ray
from ray.util import placement_group_table

from cluster.config import ClusterConfig, PoolConfig
from cluster.elastic import ScaleFailed
from cluster.ray.deployment import NAMESPACE, DeploymentActor, _stop, unwrap
from cluster.ray.scale import scale_on_ray
from cluster.ray.supervisor import Supervisor
from cluster.ray.workers import RayWorkers
from cluster.serve import build
from engine import LLM, SamplingParams
from router.app import WORKER_HEADER
from tests.disagg.test_worker_processes import Client
from tests.http_server import free_port, serving
from tests.ray.conftest import REPO, assert_ray_gone, descendants, ray_local_config

# Long enough to be prefilled by the prefill pool (router.remote_prefill_min_tokens 32).
PROMPTS = [f"Request {i}: paged attention keeps the keys and values of every sequence in blocks of sixteen "
           "tokens, and a prefill worker writes them into the decode worker's blocks. " for i in range(6)]
# New to every cache when sent together while a prefill worker drains.
FRESH = [f"Fresh {i}: a prompt no worker has seen, sent while a prefill worker drains, is prefilled by "
         "another one of its pool and never by the worker that is about to leave the deployment." for i in range(4)]
MAX_TOKENS = 12
KV_BLOCKS = 128
CLIENTS = 2
PAUSE_S = 0.2  # between a client's requests: CPU left for the workers being started (2 cores)


def _config(port: int, prefill: int, **ray_changes: object) -> ClusterConfig:
    """configs/ray-local.yaml with `prefill` prefill workers, small KV caches (not the
    YAML's GiBs per worker), and round-robin routing (each decode worker gets turns)."""
    config = ray_local_config(port=port, num_cpus=4, placement_timeout_s=3.0, probe_interval_s=0.5,
                              **ray_changes)
    small = {"num_kv_blocks": KV_BLOCKS}
    return dataclasses.replace(
        config, router=dataclasses.replace(config.router, policy="round_robin", remote_prefill_min_tokens=32),
        prefill=PoolConfig(prefill, {**config.prefill.engine, **small}),
        decode=PoolConfig(config.decode.replicas, {**config.decode.engine, **small}))


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[str, ClusterConfig, RayWorkers, object]]:
    assert not ray.is_initialized(), "another test left Ray connected in this process"
    before = descendants()
    config = _config(free_port(), prefill=2)
    workers, router = build(config)
    assert isinstance(workers, RayWorkers)
    try:
        with serving(router, config.router.port) as base:
            yield base, config, workers, router
    finally:
        workers.stop()
    assert_ray_gone(before)


@pytest.fixture(scope="module")
def expected(deployment) -> dict[str, str]:
    llm = LLM(deployment[1].model, dtype="float32", device="cpu", num_threads=1, num_kv_blocks=KV_BLOCKS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {p: o.text for p, o in zip(PROMPTS + FRESH, llm.generate(PROMPTS + FRESH, params, use_tqdm=False))}


def stream(base: str, prompt: str) -> tuple[str, str]:
    """A streamed greedy completion run to max_tokens: its decode worker and its text."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    parts, finish = [], None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        worker = response.headers[WORKER_HEADER]
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice["text"])
                finish = choice["finish_reason"] or finish
    assert finish == "length", f"the stream ended with {finish!r}"
    return worker, "".join(parts)


def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def live_groups() -> set[str]:
    return {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}


def group_state(group) -> str:
    return placement_group_table()[group.id.hex()]["state"]


def is_dead(actor) -> bool:
    try:
        ray.get(actor.incarnation.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def fallbacks(workers: RayWorkers) -> int:
    """Prompts the decode worker prefilled itself after their prefill worker failed or left."""
    client = Client(workers.decode[0].address, workers.secret)
    try:
        return client.stats().fallbacks
    finally:
        client.close()


def prefilled(router, name: str) -> int:
    """Prompts the prefill worker `name` has prefilled so far."""
    return router.control.worker_stats(name).prefills


def jobs(router, name: str) -> int:
    stats = router.control.worker_stats(name)
    return 1 if stats is None else stats.jobs


@pytest.mark.timeout(240)
def test_scaling_under_streaming_load_fails_no_request_and_releases_placement(deployment, expected,
                                                                             monkeypatch) -> None:
    base, config, workers, router = deployment
    scaler = router.scaler
    scaler.drain_timeout_s = 30.0  # every request here ends within it: nothing should move
    initial = [w.group for w in workers.prefill] + [w.group for w in workers.decode]
    assert initial[0] is initial[1]  # one group for the prefill pool, a bundle per worker
    results: list[tuple[str, str, str]] = []  # prompt, decode worker, text
    stop = threading.Event()

    def load(first: int) -> None:  # one client's requests, one after another, until stopped
        i = first
        while not stop.wait(PAUSE_S):
            prompt = PROMPTS[i % len(PROMPTS)]
            results.append((prompt, *stream(base, prompt)))
            i += CLIENTS

    def send_together() -> None:
        """FRESH, all at once: a decode worker sends each to the prefill worker with the
        fewest of its prompts in flight, so they spread over the pool."""
        with ThreadPoolExecutor(len(FRESH)) as senders:
            results.extend((p, *out) for p, out in zip(FRESH, senders.map(lambda p: stream(base, p), FRESH)))

    def fresh_prompts_avoid(name: str) -> None:
        """Checked once `name` is marked draining, before the scaler drains it: none of
        the prompts sent together reaches it."""
        until(lambda: jobs(router, name) == 0, f"{name} kept its jobs")
        before = prefilled(router, name)
        send_together()
        assert prefilled(router, name) == before, f"a new prompt reached the draining {name}"

    with ThreadPoolExecutor(CLIENTS) as clients:
        running = [clients.submit(load, i) for i in range(CLIENTS)]
        try:
            # 2P1D -> 1P2D: decode-1 first, in a new placement group of one worker's
            # bundle; then prefill-1 drains (checked as it is marked) and leaves its
            # bundle of the prefill pool's group reserved.
            mark = scaler.backend.set_draining

            def set_draining(name: str) -> None:
                mark(name)
                if name == "prefill-1":
                    fresh_prompts_avoid(name)

            monkeypatch.setattr(scaler.backend, "set_draining", set_draining)
            leaving = workers.prefill[1]
            flip = scaler.scale(prefill=1, decode=2)
            monkeypatch.undo()
            assert (flip.added, flip.removed, flip.sizes) == (["decode-1"], ["prefill-1"], {"prefill": 1, "decode": 2})
            added = workers.decode[1]
            assert added.own_group and added.group not in initial and group_state(added.group) == "CREATED"
            assert is_dead(leaving.actor) and group_state(initial[0]) == "CREATED"
            assert workers.free_bundles["prefill"] == [(initial[0], 1)]
            until(lambda: any(w == "decode-1" for _, w, _ in results), "decode-1 never served a request")

            # 1P2D -> 2P1D: prefill-2 in the reserved bundle (no new group), then
            # decode-1 drains and leaves, dead for good, its group removed.
            groups = live_groups()
            back = scaler.scale(prefill=2, decode=1)
            assert (back.added, back.removed, back.moved, back.sizes) == (["prefill-2"], ["decode-1"], 0,
                                                                          {"prefill": 2, "decode": 1})
            again = workers.prefill[1]
            assert (again.name, again.group, again.bundle, again.own_group) == ("prefill-2", initial[0], 1, False)
            assert workers.free_bundles["prefill"] == [] and live_groups() == groups - {added.group.id.hex()}
            assert [w.name for w in workers.all] == ["decode-0", "prefill-0", "prefill-2"]
            assert is_dead(added.actor) and group_state(added.group) == "REMOVED"
            # Its CPU is free again (Ray's view of what is free lags a little).
            until(lambda: ray.available_resources().get("CPU", 0) == 1.0, "decode-1's CPU was not released")
            send_together()
            assert prefilled(router, "prefill-2") > 0, "prefill-2 never prefilled a prompt"
        finally:
            stop.set()
            for client in running:
                client.result(timeout=120)  # a failed request fails the test here
    assert len(results) >= 20
    for prompt, _, text in results:
        assert text == expected[prompt], f"{prompt!r} differs from the colocated engine"
    assert fallbacks(workers) == 0  # no prompt was on a prefill worker when it left


@pytest.mark.timeout(120)
def test_pdserve_scale_reaches_the_deployment_actor_and_refuses_clearly(deployment) -> None:
    """The in-process deployment holds 3 of the 4 CPUs; a second one, run by a
    DeploymentActor as `pdserve serve` runs it, takes the last with its decode worker."""
    config = _config(free_port(), prefill=0, name="elastic-test")
    actor = ray.remote(DeploymentActor).options(name="elastic-test", namespace=NAMESPACE, num_cpus=0,
                                                max_restarts=0, max_concurrency=4).remote(config)
    try:
        unwrap(lambda: ray.get(actor.start.remote(), timeout=90))
        with pytest.raises(ValueError, match=r"decode: 1000 is beyond autoscale\.decode\.max"):
            scale_on_ray("elastic-test", prefill=None, decode=1000)
        with pytest.raises(ValueError, match="decode: cannot scale to 0 workers"):
            scale_on_ray("elastic-test", decode=0)
        with pytest.raises(LookupError, match="no pdserve deployment named 'elsewhere'"):
            scale_on_ray("elsewhere", decode=2)
        # No CPU is free: Ray cannot place a third decode worker; the error says so and
        # nothing is left behind.
        groups = live_groups()
        start = time.monotonic()
        with pytest.raises(ScaleFailed, match=r"decode: a new worker did not start: Ray did not place decode-1 "
                           r"within 3 s \(ray\.placement_timeout_s\): it needs \{CPU: 1\} on one node; "
                           r"free in the cluster now: \{CPU: 0\}"):
            scale_on_ray("elastic-test", decode=2)
        assert time.monotonic() - start < 15
        assert live_groups() == groups
        pools = scale_on_ray("elastic-test")  # no target: the pools as they are
        assert (pools["prefill"], pools["decode"]) == (0, 1) and [w["name"] for w in pools["workers"]] == ["decode-0"]
        # `pdserve scale NAME`, in another process that joins the cluster by its address.
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "scale", "elastic-test", "--decode", "1000",
                              "--ray-address", ray.get_runtime_context().gcs_address], cwd=REPO,
                             capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 2, out.stdout + out.stderr
        assert "pdserve: error: decode: 1000 is beyond autoscale.decode.max" in out.stderr, out.stderr
    finally:
        _stop(actor)


def test_a_supervisor_pass_never_overlaps_a_pool_change_and_forgets_removed_restarts() -> None:
    """Without a cluster: a pass waits for the workers' lock, which RayPools holds while
    it changes the pools, and a restart it awaited for a worker since removed is dropped."""
    workers = RayWorkers()
    supervisor = Supervisor(workers, None, interval_s=1.0, probe_timeout_s=1.0)
    supervisor._starting["decode-1"] = ("its new incarnation", None, time.monotonic() + 60)  # then scaled away
    with workers.lock:
        passing = threading.Thread(target=supervisor.check)
        passing.start()
        passing.join(0.2)
        assert passing.is_alive(), "a supervisor pass ran while the pools were changing"
    passing.join(5)
    assert not passing.is_alive() and supervisor._starting == {}


def test_pdserve_scale_refuses_a_private_ray_it_cannot_join() -> None:
    with pytest.raises(ValueError, match="ray.address 'local': the deployment runs on a private Ray"):
        scale_on_ray("pdserve", "local", decode=2)
