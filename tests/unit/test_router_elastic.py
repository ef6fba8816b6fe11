"""The router's side of elastic pools against fake decode workers (no model runs):
what a worker scaled away leaves behind, for the requests it served and the endpoints
that were asking it something when it left."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.config import ClusterConfig
from cluster.elastic import Bounds, PoolScaler
from cluster.serve import router_for
from engine.sampling_params import SamplingParams
from protocol import WorkerStats
from router.app import Router
from router.app import health as app_health
from router.app import metrics as app_metrics
from router.app import status as app_status
from tests.unit.test_elastic_scaler import FakeBackend
from tests.unit.test_router_http import FakeDecodeWorker
from tests.worker_stats import worker_stats

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def two() -> Iterator[tuple[FakeDecodeWorker, FakeDecodeWorker]]:
    workers = FakeDecodeWorker(step_s=0.01), FakeDecodeWorker(step_s=0.01)
    yield workers
    for w in workers:
        w.close()


def router_of(llama_dir: Path, workers: dict[str, str]) -> Router:
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0},
                                      "router": {"policy": "round_robin", "health_interval_s": 0.1}})
    return router_for(config, workers)


@pytest.mark.timeout(20)
def test_a_request_moved_at_the_drain_deadline_finishes_though_it_reads_its_move_late(llama_dir, two) -> None:
    """Evacuate then remove: a sequence whose consumer was busy meanwhile reads its
    WORKER_LOST after the socket closed; its resubmission must not fail on the abort
    it sends there."""
    router = router_of(llama_dir, {"decode-0": two[0].address, "decode-1": two[1].address})
    scaler = PoolScaler(FakeBackend(prefill=0, decode=2), router.control, Bounds((0, 2), (1, 2)), 0.0, poll_s=0.01)

    async def main() -> tuple[str, int, str | None]:
        router.start()
        try:
            await router.run([1, 2, 3], GREEDY).__anext__()  # round robin: decode-0, then decode-1
            stream = router.run([4, 5, 6], GREEDY)
            assert (await stream.__anext__()).worker == "decode-1"
            await stream.__anext__()
            done = threading.Event()
            threading.Thread(target=lambda: (scaler.scale(decode=1), done.set()), daemon=True).start()
            while not done.is_set():  # a busy consumer: it reads nothing while decode-1 leaves
                await asyncio.sleep(0.01)
            chunks = [chunk async for chunk in stream]
            return chunks[-1].worker, chunks[-1].num_tokens, chunks[-1].finish_reason
        finally:
            router.stop()

    assert asyncio.run(main()) == ("decode-0", 12, "length")
    assert list(router.pool.decode) == ["decode-0"]


@pytest.mark.timeout(20)
def test_a_worker_leaving_while_a_snapshot_asks_for_stats_reads_as_silent(llama_dir, two) -> None:
    """The planner's snapshot (and /status) list the workers, then ask each: one whose
    socket closed in between answers nothing, instead of failing the whole snapshot."""
    router = router_of(llama_dir, {"decode-0": two[0].address, "decode-1": two[1].address})

    async def main():  # type: ignore[no-untyped-def]  # a test-local coroutine
        router.start()
        try:
            asyncio.get_running_loop().call_soon(router.pool.decode["decode-1"].close)  # lands after the listing
            return await router.control.load_snapshot()
        finally:
            router.stop()

    snapshot = asyncio.run(main())
    assert [(w.name, w.answered) for w in snapshot.workers] == [("decode-0", True), ("decode-1", False)]


@pytest.mark.timeout(20)
def test_a_worker_scaled_away_while_metrics_waits_for_another_stays_out_of_metrics(llama_dir, two) -> None:
    """/metrics has decode-1's stats and waits for decode-0's when decode-1 leaves: the
    reply it holds must not bring decode-1's series back for good."""
    router = router_of(llama_dir, {"decode-0": two[0].address, "decode-1": two[1].address})
    two[1].stats = worker_stats(running=3, waiting=1)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(router=router)), query_params={})

    async def main() -> str:
        router.start()
        try:
            release = asyncio.Event()

            async def held(timeout: float = 2.0) -> WorkerStats:  # decode-0 answers once decode-1 left
                await release.wait()
                return worker_stats()
            router.pool.decode["decode-0"].stats = held
            scrape = asyncio.create_task(app_metrics(request))
            for _ in range(200):  # until decode-1's reply is in
                await asyncio.sleep(0.005)
                if not router.pool.decode["decode-1"]._stats_waiters:
                    break
            await asyncio.to_thread(router.control.remove_worker, "decode-1")
            release.set()
            await scrape
            return router.metrics.render().decode()
        finally:
            router.stop()

    text = asyncio.run(main())
    assert 'pdserve_worker_running{role="decode",worker="decode-0"}' in text
    assert 'worker="decode-1"' not in text


def test_health_is_503_when_the_only_live_decode_worker_is_draining(llama_dir, two) -> None:
    """decode-0 down, decode-1 being scaled away: nothing takes a new request, and a load
    balancer must see it."""
    router = router_of(llama_dir, {"decode-0": two[0].address, "decode-1": two[1].address})
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(router=router)), query_params={})
    router.pool.decode["decode-0"].declare_dead("is down (its supervisor saw it exit)")
    assert asyncio.run(app_health(request)).status_code == 200  # decode-1 takes them
    router.pool.decode["decode-1"].draining = True
    answer = asyncio.run(app_health(request))
    assert answer.status_code == 503 and b"decode-1 is being drained" in answer.body


def test_a_worker_down_for_good_says_so_in_the_503(llama_dir, two) -> None:
    """Past its restarts a worker stays down: the 503 said "retry later" and the reason of
    its last crash; it says no restart will come (found over HTTP)."""
    router = router_of(llama_dir, {"decode-0": two[0].address})
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(router=router)), query_params={})
    router.pool.decode["decode-0"].declare_dead("is down (its supervisor saw it exit)")
    router.control.worker_stays_down("decode-0", "stays down: it was started again 3 times (local.max_restarts)")

    async def health():
        router.control.attach()  # runs what the supervisor said before the loop ran
        try:
            return await app_health(request)
        finally:
            router.control.detach()

    answer = asyncio.run(health())
    assert answer.status_code == 503 and b"decode-0 stays down: it was started again 3 times" in answer.body


def test_a_blocking_verb_called_on_the_routers_own_loop_fails_at_once(llama_dir, two) -> None:
    """The scaler's verbs wait for the loop to run them: on the loop itself they would
    hold it (and every request) until their timeout."""
    router = router_of(llama_dir, {"decode-0": two[0].address})

    async def main() -> None:
        router.start()
        try:
            with pytest.raises(RuntimeError, match="RouterControl.call blocks until the router's event loop runs it"):
                router.control.drain_worker("decode-0", timeout=1.0)
            with pytest.raises(RuntimeError, match="RouterControl.snapshot blocks"):
                router.control.snapshot(timeout=1.0)
            assert not router.pool.decode["decode-0"].draining
            await asyncio.to_thread(router.control.drain_worker, "decode-0")  # from another thread: fine
            assert router.pool.decode["decode-0"].draining
        finally:
            router.stop()

    asyncio.run(main())


def test_worker_live_is_the_routers_view_for_the_scaler(llama_dir, two) -> None:
    router = router_of(llama_dir, {"decode-0": two[0].address, "decode-1": two[1].address})
    router.pool.decode["decode-0"].declare_dead("is down (its supervisor saw it exit)")
    assert [router.control.worker_live(n) for n in ("decode-0", "decode-1", "decode-9")] == [False, True, False]


@pytest.mark.timeout(20)
def test_status_keeps_each_worker_under_its_pool_when_one_leaves_meanwhile(llama_dir, two) -> None:
    config = ClusterConfig.from_dict({"model": str(llama_dir)})
    router = router_for(config, {"decode-0": two[0].address, "decode-1": two[1].address},
                        {"prefill-0": two[1].address})  # a fake that answers pings serves as a prefill worker
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(router=router)), query_params={})

    async def main() -> dict:
        router.start()
        try:
            release = asyncio.Event()

            async def busy(timeout: float = 2.0) -> WorkerStats:  # decode-0 answers once decode-1 left
                await release.wait()
                return worker_stats()
            router.pool.decode["decode-0"].stats = busy
            answer = asyncio.create_task(app_status(request))
            await asyncio.sleep(0.05)
            await asyncio.to_thread(router.control.remove_worker, "decode-1")
            release.set()
            return await answer
        finally:
            router.stop()

    out = asyncio.run(main())
    assert [r["name"] for r in out["decode_workers"]] == ["decode-0", "decode-1"]
    assert [r["name"] for r in out["prefill_workers"]] == ["prefill-0"]


@pytest.mark.timeout(20)
def test_status_shows_a_worker_too_busy_to_answer_with_its_latest_figures_and_their_age(llama_dir, two) -> None:
    """A worker in a step longer than /status's wait (a long prefill on a CPU) answers
    late: its row keeps the figures of its latest reply (a ping's), with their age,
    rather than none."""
    router = router_of(llama_dir, {"decode-0": two[0].address, "decode-1": two[1].address})
    two[0].stats = worker_stats(running=4)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(router=router)), query_params={})

    async def main() -> dict:
        router.start()
        try:
            while router.pool.decode["decode-0"].latest_stats is None:  # a ping's reply came in
                await asyncio.sleep(0.01)
            two[0].silent.set()  # busy from now on
            return await app_status(request)
        finally:
            router.stop()

    rows = {w["name"]: w for w in asyncio.run(main())["decode_workers"]}
    assert rows["decode-0"]["stats"]["running"] == 4 and rows["decode-0"]["stats_age_s"] >= 1.5  # waited 2 s
    assert rows["decode-1"]["stats_age_s"] == 0 and rows["decode-1"]["stats"] is not None
