"""The runner's flattened step inputs and the KV manager's block table, against the plain
per-request construction, over scheduler runs with chunked prefill, prefix hits,
preemption and aborts (no model)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.runner import build_step_inputs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler


def reference_inputs(scheduled: list[ScheduledRequest], block_ids: list[list[int]], block_size: int):
    """One request at a time, straight from the definitions."""
    ids, positions, slots, qsl, seq_lens, logits_indices = [], [], [], [0], [], []
    tables = np.zeros((len(scheduled), max(len(b) for b in block_ids)), dtype=np.int32)
    for i, (s, blocks) in enumerate(zip(scheduled, block_ids)):
        start, n = s.request.num_computed_tokens, s.num_new_tokens
        tables[i, :len(blocks)] = blocks
        for pos in range(start, start + n):
            ids.append(s.request.all_token_ids[pos])
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        if s.samples:
            logits_indices.append(qsl[-1] - 1)
    return dict(input_ids=np.array(ids, np.int64), positions=np.array(positions, np.int64),
                slot_mapping=np.array(slots, np.int64), query_start_loc=np.array(qsl, np.int32),
                seq_lens=np.array(seq_lens, np.int32), block_tables=tables,
                logits_indices=np.array(logits_indices, np.int64))


def check_step(sched: Scheduler, scheduled: list[ScheduledRequest]) -> None:
    kv = sched.kv
    ids = [s.request.request_id for s in scheduled]
    block_ids = [kv.block_ids(r) for r in ids]
    inputs = build_step_inputs(scheduled, kv.block_tables(ids), kv.block_size)
    for name, want in reference_inputs(scheduled, block_ids, kv.block_size).items():
        got = getattr(inputs, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert np.array_equal(got, want), name
    assert inputs.query_lens == [s.num_new_tokens for s in scheduled]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_size", [4, 16])
def test_step_inputs_match_reference_through_preemption_and_aborts(seed: int, block_size: int) -> None:
    rng = random.Random(seed)
    # A small pool forces preemption; shared prompt prefixes give prefix-cache hits.
    sched = Scheduler(KVCacheManager(num_blocks=320 // block_size, block_size=block_size),
                      max_num_batched_tokens=48, max_num_seqs=12, max_model_len=400)
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    live: list[Request] = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
        request = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True))
        sched.add_request(request)
        live.append(request)
    steps = 0
    while sched.has_unfinished:
        out = sched.schedule()
        if out.scheduled:
            check_step(sched, out.scheduled)
        sched.update(out, [rng.randrange(1, 500) for _ in range(out.num_samples)])
        if rng.random() < 0.05:
            sched.finish_requests([rng.choice(live).request_id], RequestStatus.FINISHED_ABORTED)
        steps += 1
    assert sched.num_preemptions > 0 and sched.kv.pool.num_cache_hits > 0 and steps > 40
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert not sched.kv.block_table._row_of  # every row handed back


def test_block_table_grows_and_pads_reused_rows_with_zero() -> None:
    table = BlockTable(rows=2, cols=2)
    lists = {f"r{i}": [] for i in range(5)}
    for i in range(100):  # interleaved appends past the initial rows and columns
        rid = f"r{i % 5}"
        new = [1000 * (i % 5) + len(lists[rid]) + 1, 7]
        table.append(rid, new)
        lists[rid] += new
    table.remove("r1")
    table.append("r9", [3])  # takes r1's old row
    lists["r9"] = [3]
    order = ["r9", "r4", "r0"]
    want = np.zeros((3, 40), dtype=np.int32)
    for i, rid in enumerate(order):
        want[i, :len(lists[rid])] = lists[rid]
    assert np.array_equal(table.gather(order), want)
    assert np.array_equal(table.gather(["r9"]), [[3]])
