"""The KV offload tiers (engine/kv_cache/tiers.py): a device pool far smaller than a
chat's working set, whose evicted prefixes come back from the host (and disk) tier with
the tokens a roomy engine computes; bytes changed in a tier are refused by their
checksum (the request computes instead); a request aborted while its load runs leaks
nothing; and the index's LRU and pins."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kv_cache import tier_io, tier_store
from engine.kv_cache import tiers as tiers_module
from engine.kv_cache.events import DISK, HOST, KVEvents
from engine.kv_cache.tier_store import SlotIndex, TierEntry
from engine.kv_cache.tiers import KVTiers, OffloadStats
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_BYTES = 16 * 512  # the tiny llama's block of 16 tokens (2 layers x K,V x 2 heads x 16 dims x 4 bytes)
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def gib(blocks: float) -> float:
    return blocks * BLOCK_BYTES / 2**30


def chat_turns(num_convs: int = 6, num_turns: int = 3, seed: int = 0) -> list[list[list[int]]]:
    """Per turn, each conversation's prompt: a shared system prompt, then the turns so far."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 300) for _ in range(40)]
    convs = [list(system) for _ in range(num_convs)]
    turns = []
    for _ in range(num_turns):
        for conv in convs:
            conv += [rng.randrange(5, 300) for _ in range(rng.randint(10, 30))]
        turns.append([list(c) for c in convs])
    return turns


def run_chat(llm: LLM, turns: list[list[list[int]]]) -> tuple[list[list[int]], list[int]]:
    """Each turn after the last one ended, as a chat's turns come: (tokens, cached tokens)."""
    tokens, cached = [], []
    for prompts in turns:
        for out in llm.generate(prompts, GREEDY, use_tqdm=False):
            tokens.append(out.token_ids)
            cached.append(out.num_cached_tokens)
    return tokens, cached


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> tuple[list[list[int]], list[int]]:
    llm = LLM(str(llama_dir), num_kv_blocks=400)
    try:
        return run_chat(llm, chat_turns())
    finally:
        llm.core.close()


def drain(tiers: KVTiers) -> None:
    deadline = time.monotonic() + 10
    while tiers.io.pending and time.monotonic() < deadline:
        tiers.poll(0.05)
    assert tiers.io.pending == 0


def test_host_tier_serves_evicted_prefixes_with_the_same_tokens(llama_dir: Path, expected) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=12, kv_offload_gib=gib(200))
    try:
        tokens, cached = run_chat(llm, chat_turns())
        stats = llm.stats().offload
    finally:
        llm.core.close()
    assert tokens == expected[0]
    assert stats is not None and stats.loads > 0 and stats.tiers[0].hits > 0, stats
    assert stats.offloaded_bytes > 0 and stats.loaded_bytes == stats.tiers[0].hits * BLOCK_BYTES
    assert stats.failed_loads == 0 and stats.dropped_blocks == 0
    # Later turns find their conversation so far: in a pool of 12 blocks only the tier holds it.
    assert sum(cached) > sum(expected[1]), (cached, expected[1])


def test_without_tiers_the_small_pool_recomputes(llama_dir: Path, expected) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=12)
    try:
        tokens, cached = run_chat(llm, chat_turns())
        assert llm.stats().offload is None
    finally:
        llm.core.close()
    assert tokens == expected[0]
    with_tiers = LLM(str(llama_dir), num_kv_blocks=12, kv_offload_gib=gib(200))
    try:
        assert sum(run_chat(with_tiers, chat_turns())[1]) > sum(cached)
    finally:
        with_tiers.core.close()


def test_disk_tier_under_a_tiny_host_tier(llama_dir: Path, expected, tmp_path: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=12, kv_offload_gib=gib(2.5), kv_offload_dir=str(tmp_path),
              kv_offload_disk_gib=gib(200))
    try:
        # The file is unlinked once open (a killed worker leaves nothing), sized for 200 blocks.
        assert list(tmp_path.iterdir()) == []
        assert os.fstat(llm.core.kv.tiers._disk_store._fd).st_size == 200 * BLOCK_BYTES
        tokens, _ = run_chat(llm, chat_turns())
        host, disk = llm.stats().offload.tiers
    finally:
        llm.core.close()
    assert tokens == expected[0]
    assert (host.name, host.capacity_blocks, disk.name, disk.capacity_blocks) == ("host", 2, "disk", 200)
    assert disk.hits > 0 and disk.used_blocks > host.used_blocks


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_changed_bytes_are_refused_and_computed_again(llama_dir: Path, expected, tmp_path: Path,
                                                      tier: str) -> None:
    disk = dict(kv_offload_dir=str(tmp_path), kv_offload_disk_gib=gib(200)) if tier == "disk" else {}
    llm = LLM(str(llama_dir), num_kv_blocks=12, kv_offload_gib=gib(200 if tier == "host" else 1.5), **disk)
    tiers = llm.core.kv.tiers
    assert tiers is not None
    original = tier_io.TierIO._load
    flipped: list[int] = []

    def corrupting_load(io: tier_io.TierIO, job: tier_io.LoadJob) -> None:
        name, entry = job.sources[0]
        if name == tier and len(flipped) < 3:  # one byte of the first block, as a bad disk or DIMM would
            if tier == "host":
                io.host.buffers[0][entry.slot].view(-1)[7] += 1.0
            else:
                assert io.disk is not None
                at = entry.slot * io.disk.slot_bytes + 5  # the file is unlinked: through its descriptor
                os.pwrite(io.disk._fd, bytes([os.pread(io.disk._fd, 1, at)[0] ^ 0x40]), at)
            flipped.append(entry.slot)
        original(io, job)

    tier_io.TierIO._load = corrupting_load  # type: ignore[method-assign]
    try:
        tokens, _ = run_chat(llm, chat_turns())
        stats = llm.stats().offload
    finally:
        tier_io.TierIO._load = original  # type: ignore[method-assign]
        llm.core.close()
    assert flipped, "no load read the tier"
    assert tokens == expected[0]  # each refused load computed its prefix instead
    assert stats is not None and stats.failed_loads == len(flipped), stats


@pytest.mark.timeout(120)
def chat_on_a_failing_disk(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                           errno: int, host_blocks: float) -> tuple[list[list[int]], OffloadStats]:
    """The chat over a disk tier whose every `method` ("read" or "write") fails with
    OSError(errno): its tokens and the tiers' stats."""
    def failing(*args: object) -> None:
        raise OSError(errno, os.strerror(errno))

    monkeypatch.setattr(tier_store.DiskStore, method, failing)
    llm = LLM(str(llama_dir), num_kv_blocks=12, kv_offload_gib=gib(host_blocks), kv_offload_dir=str(tmp_path),
              kv_offload_disk_gib=gib(200))
    try:
        tokens, _ = run_chat(llm, chat_turns())
        return tokens, llm.stats().offload
    finally:
        llm.core.close()


def test_a_disk_that_fails_every_read_costs_only_time(llama_dir: Path, expected, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error (no checksum involved) drops the entry like a bad checksum does: the
    request computes that block on its retry instead of loading it again forever."""
    tokens, stats = chat_on_a_failing_disk(llama_dir, tmp_path, monkeypatch, "read", 5, host_blocks=2.5)
    assert tokens == expected[0]
    assert stats.failed_loads > 0 and stats.tiers[1].hits == 0
    # each failure drops the entry it read: at most one per block ever offloaded
    assert stats.failed_loads <= stats.offloaded_bytes // BLOCK_BYTES, stats


def test_a_disk_that_fails_every_write_leaves_the_host_tier_serving(llama_dir: Path, expected, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk (ENOSPC on every write) costs the disk tier only: the blocks stay in
    the host tier and are loaded back from there (an attack over HTTP found a full disk
    turned every tier off)."""
    tokens, stats = chat_on_a_failing_disk(llama_dir, tmp_path, monkeypatch, "write", 28, host_blocks=200)
    assert tokens == expected[0]
    host, disk = stats.tiers
    assert host.hits > 0 and host.used_blocks > 0 and disk.used_blocks == 0 and disk.hits == 0, stats
    assert stats.failed_loads == 0


def test_a_burst_of_evictions_reaches_the_disk_tier(llama_dir: Path, tmp_path: Path) -> None:
    """One admission evicts more blocks than the host tier has slots (their seals not yet
    polled): those go to the disk tier through staging memory, not dropped."""
    rng = random.Random(1)
    a, b = ([rng.randrange(5, 300) for _ in range(30 * 16 + 3)] for _ in range(2))
    llm = LLM(str(llama_dir), num_kv_blocks=40, max_num_batched_tokens=1024, kv_offload_gib=gib(4),
              kv_offload_dir=str(tmp_path), kv_offload_disk_gib=gib(200))
    try:
        want = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in (a, b)]  # b evicts a
        drain(llm.core.kv.tiers)
        stats = llm.stats().offload
        again = llm.generate([a], GREEDY, use_tqdm=False)[0]
    finally:
        llm.core.close()
    offloaded = stats.offloaded_bytes // BLOCK_BYTES  # b evicts about 20 of a's 30 full blocks
    assert offloaded > 16 and stats.dropped_blocks == 0 and stats.tiers[1].used_blocks == offloaded, stats
    assert again.token_ids == want[0] and again.num_cached_tokens == 30 * 16, again.num_cached_tokens


def test_staging_memory_is_bounded_also_on_the_way_to_disk(llama_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers_module, "MAX_STAGED", 3)
    rng = random.Random(1)
    a, b = ([rng.randrange(5, 300) for _ in range(30 * 16 + 3)] for _ in range(2))
    llm = LLM(str(llama_dir), num_kv_blocks=40, max_num_batched_tokens=1024, kv_offload_gib=gib(4),
              kv_offload_dir=str(tmp_path), kv_offload_disk_gib=gib(200))
    try:
        for p in (a, b):
            llm.generate([p], GREEDY, use_tqdm=False)
        assert llm.core.kv.tiers._staged <= 3
        drain(llm.core.kv.tiers)
        stats = llm.stats().offload
    finally:
        llm.core.close()
    # 4 host slots + 3 staged reach the disk tier per burst; the rest is dropped
    assert stats.dropped_blocks > 0 and stats.tiers[1].used_blocks <= 4 + 3, stats


def test_a_checksum_from_another_configuration_never_passes(llama_dir: Path) -> None:
    """The checksums are seeded with the engine's namespace: the same bytes read by
    an engine of another configuration fail them."""
    llm = LLM(str(llama_dir), num_kv_blocks=12, kv_offload_gib=gib(200))
    try:
        tiers = llm.core.kv.tiers
        assert tiers is not None
        run_chat(llm, chat_turns(num_turns=1))
        drain(tiers)
        entry = next(iter(tiers.host.entries.values()))
        pieces = tiers._host_store.pieces(entry.slot)
        assert tier_io.checksum(pieces, tiers.io.seed) == entry.checksum
        assert tier_io.checksum(pieces, tiers.io.seed ^ 1) != entry.checksum
    finally:
        llm.core.close()


def test_abort_while_loading_frees_every_block(llama_dir: Path) -> None:
    core = EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=12, kv_offload_gib=gib(200)))
    gate = threading.Event()
    original = tier_io.TierIO._load

    def held_load(io: tier_io.TierIO, job: tier_io.LoadJob) -> None:
        gate.wait(10)
        original(io, job)

    try:
        prompts = chat_turns(num_convs=4, num_turns=2)
        for i, prompt in enumerate(prompts[0]):  # the first turns fill the pool; their blocks go to the host tier
            core.add_request(f"a{i}", prompt, GREEDY)
        while core.has_unfinished():
            core.step()
        drain(core.kv.tiers)
        tier_io.TierIO._load = held_load  # type: ignore[method-assign]
        core.add_request("b", prompts[1][0], GREEDY)
        core.step()
        assert core.scheduler.requests["b"].status.value == "loading_kv"
        assert core.has_runnable()
        held = core.kv.num_free_blocks
        core.abort(["b"])
        assert core.kv.num_free_blocks == held  # the I/O thread still writes them
        # ... so the engine is not done: a caller that steps while has_unfinished() frees
        # them (the randomised schedules found them held after the last request ended).
        assert core.has_unfinished()
        core.add_request("b", prompts[1][1], GREEDY)  # its id is free at once
        gate.set()
        while core.has_unfinished():
            core.step()
        assert core.kv.num_free_blocks == core.kv.pool.num_blocks
        assert not any(e.pins for e in core.kv.tiers.host.entries.values())
    finally:
        gate.set()
        tier_io.TierIO._load = original  # type: ignore[method-assign]
        core.close()


def test_slot_index_evicts_least_recently_used_and_never_a_pinned_slot() -> None:
    index = SlotIndex("host", HOST, 2)
    index.events = KVEvents(limit=100)
    a, b = (TierEntry(h, 0, (h,), index.take_slot(), checksum=h) for h in (1, 2))
    index.add(a)
    index.add(b)
    assert index.lookup(0, 1, (1,)) is a  # a is now the most recently used
    assert index.lookup(0, 1, (9,)) is None  # other tokens: no hit
    a.pins = 1
    b.pins = 1
    assert index.take_slot() is None  # every slot is busy: the caller drops the block
    b.pins = 0
    assert index.take_slot() == b.slot and b.dropped and 2 not in index.entries
    assert index.events.take() == ([(2, HOST, False)], False)  # only sealed entries were ever stored
    with pytest.raises(ValueError, match="not this index's"):
        SlotIndex("disk", DISK, 1).drop(a)
    index.drop(a)  # pinned: its slot is freed at the last unpin
    assert index.num_used == 2
    index.unpin(a)
    assert index.num_used == 1


@pytest.mark.parametrize("options, message", [
    (dict(kv_offload_gib=-1.0), "kv_offload_gib must be >= 0"),
    (dict(kv_offload_dir="/tmp/x"), "kv_offload_dir needs kv_offload_gib > 0"),
    (dict(kv_offload_gib=1.0, enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(kv_offload_gib=1.0, kv_offload_disk_gib=0.0), "kv_offload_disk_gib must be > 0"),
])
def test_bad_options_name_the_problem(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)


def test_a_tier_too_small_for_one_block_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="too small for one KV block"):
        EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=8, kv_offload_gib=gib(0.5)))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_host_tier_pages_are_faulted_in_without_changing_a_byte() -> None:
    """populate() makes a fresh buffer resident (so offload copies do not pay a page
    fault each) and leaves bytes already written there as they are: it runs while the
    engine offloads into the same buffer."""
    import mmap

    import torch

    # Fresh anonymous pages: torch.empty may reuse memory the allocator already faulted in
    # (CI: RSS unchanged in a process that had freed that much).
    region = mmap.mmap(-1, 64 << 20)
    fresh = torch.frombuffer(region, dtype=torch.uint8)
    before = _rss_bytes()
    tier_store.populate([fresh])
    assert _rss_bytes() - before >= 56 << 20, "the buffer's pages were not faulted in"
    written = torch.empty(8 << 20, dtype=torch.uint8)
    written[: 4 << 20].random_()
    copy = written[: 4 << 20].clone()
    tier_store.populate([written])
    assert torch.equal(written[: 4 << 20], copy)
