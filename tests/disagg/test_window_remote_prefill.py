"""Disaggregated prefill of sliding-window models: the decode worker reserves and
fences only the blocks the window of the prompt's last token reads (the rest are
released at once), the prefill worker writes only those, and the decoded tokens are
the colocated engine's: the tiny Mistral (a window of 20 on every layer) at (1, 1)
and (1, 2) over shm and tcp; and Gemma 3 (a sliding and a full layer), whose full
layer reads every block: the blocks before the sliding layer's window carry the full
layer only, and the decode worker never caches them."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from decode_worker.remote_kv import DecodeWorkerCore
from engine import LLM, SamplingParams
from engine.kv_cache.manager import cdiv
from kv_transfer import IncompatiblePeerError, create_transport
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.disagg.test_fp8_remote_prefill import CONFIG, workers
from tests.disagg.test_remote_prefill import GREEDY, PROMPTS, run, tokens, worker_pair
from tests.disagg.test_stream_modes import run_counting
from tests.disagg.test_tp_remote_prefill import tp_engine
from tests.unit.test_longrope import LONG, SHORT, build_phi3

BLOCK = 16  # EngineConfig's default block_size
SCORED = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)


def colocated(model: Path) -> dict[str, list[int]]:
    llm = LLM(str(model), num_kv_blocks=80)
    return {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


def push_all(model: Path, transport: str, decode_tp: int) -> tuple[dict, int, int]:
    """Every prompt prefilled by one worker, decoded by another: (tokens, bytes the
    prefill worker wrote, blocks it wrote)."""
    with workers(model, transport, dict(tp=decode_tp, num_kv_blocks=80),
                 dict(tp=1, num_kv_blocks=80, max_num_batched_tokens=24)) as ((t_dec, t_pre), engines):
        t_pre.add_peer(t_dec.metadata())
        decode, prefill = DecodeWorkerCore(engines[0], t_dec, 30.0), PrefillWorkerCore(engines[1], t_pre)
        done = run(decode, prefill, PROMPTS, timeout=120)
        assert decode.stats["remote"] + decode.stats["local"] == len(PROMPTS) and decode.stats["fallbacks"] == 0
        for core in engines:
            assert core.kv.num_free_blocks == core.kv.pool.num_blocks, "blocks leaked"
        return tokens(done), t_pre.stats["bytes_written"], prefill.stats["blocks_written"]


def window_blocks(prompt: list[int], window: int) -> int:
    """Blocks of a prompt's pushed KV (every token's but the last) that the window of
    its last token reads."""
    end = cdiv(len(prompt) - 1, BLOCK)
    return end - max(0, len(prompt) - 1 - window + 1) // BLOCK if window else end


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport,decode_tp", [("shm", 1), ("tcp", 1), ("shm", 2), ("tcp", 2)])
def test_windowed_model_pushes_only_the_window(tiny_models: dict[str, Path], transport: str, decode_tp: int) -> None:
    model = tiny_models["mistral"]
    got, _, blocks = push_all(model, transport, decode_tp)
    assert got == colocated(model)
    # The two prompts sharing a 40-token prefix: the second's 2 cached blocks are
    # before its window anyway. PROMPTS[0] (2 tokens) pushes 1 block.
    assert blocks == sum(window_blocks(p, 20) for p in PROMPTS)
    assert blocks < sum(window_blocks(p, 0) for p in PROMPTS)


def mixed_bytes(prompts: list[list[int]], window: int, layers: int, block_bytes: int) -> int:
    """What pushing each prompt whole moves for a model of one full layer and the rest
    sliding (`window`): a block before the window of the prompt's last token carries
    the full layer alone."""
    total = 0
    for p in prompts:
        end, first = cdiv(len(p) - 1, BLOCK), max(0, len(p) - window) // BLOCK
        total += sum(block_bytes * (1 if i < first else layers) // layers for i in range(end))
    return total


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport,decode_tp", [("shm", 1), ("tcp", 1), ("shm", 2), ("tcp", 2)])
def test_mixed_model_pushes_each_layer_its_blocks(tiny_models: dict[str, Path], transport: str,
                                                  decode_tp: int) -> None:
    model = tiny_models["gemma3"]
    got, moved, blocks = push_all(model, transport, decode_tp)
    assert got == colocated(model)
    # Every block of every prompt is written (its full layer reads them all): the decode
    # worker caches none of the blocks that came with the full layer alone, so the
    # second shared-prefix prompt finds nothing cached there.
    assert blocks == sum(window_blocks(p, 0) for p in PROMPTS)
    block_bytes = 2 * 2 * 2 * BLOCK * 32 * 4  # layers x KV heads x K,V x tokens x head_dim x float32
    assert moved == mixed_bytes(PROMPTS, 20, 2, block_bytes) < blocks * block_bytes


@pytest.mark.timeout(240)
def test_blocks_written_for_some_layers_are_never_prefix_hits(tiny_models: dict[str, Path]) -> None:
    """A prompt pushed with its first block for the full layer only, then its first 20
    tokens asked of the decode worker alone: were that block cached, the sliding layer
    would read KV nobody wrote there."""
    model = tiny_models["gemma3"]
    long, short = PROMPTS[4], PROMPTS[4][:20]  # 90 tokens: blocks 0-3 are before its window
    with workers(model, "shm", dict(tp=1, num_kv_blocks=80), dict(tp=1, num_kv_blocks=80)) as ((t_dec, t_pre), engines):
        t_pre.add_peer(t_dec.metadata())
        cache = t_dec.registered_cache  # what no write reaches reads as noise, not zeros
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)) * 10)
        decode, prefill = DecodeWorkerCore(engines[0], t_dec, 30.0), PrefillWorkerCore(engines[1], t_pre)
        pushed = run(decode, prefill, [long], timeout=120)
        assert decode.stats["remote"] == 1
        assert decode.add_request("short", short, SCORED, remote=False) is None
        deadline = time.monotonic() + 60
        while decode.engine.has_unfinished():
            assert time.monotonic() < deadline
            for r in decode.step().finished:
                pushed[r.request_id] = r
    assert pushed["short"].num_cached_tokens == 0
    llm = LLM(str(model), num_kv_blocks=80)
    want_long, want_short = llm.generate([long, short], [GREEDY, SCORED], use_tqdm=False)
    assert pushed["r0"].output_token_ids == want_long.token_ids
    # The tiny model's greedy tokens hardly move; their logprobs do.
    assert want_short.logprobs is not None
    assert pushed["short"].output_token_ids == want_short.token_ids
    got = [t.logprob for t in pushed["short"].output_logprobs]
    assert got == pytest.approx([t.logprob for t in want_short.logprobs], abs=1e-4)


@pytest.mark.timeout(120)
def test_pools_with_other_windows_are_refused_as_a_pair(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The same weights attending without the window compute other KV: refused at the
    handshake, as another model."""
    unwindowed = tmp_path / "mistral-no-window"
    shutil.copytree(tiny_models["mistral"], unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    refused_as_a_pair((tiny_models["mistral"], {}), (unwindowed, {}),
                      r"model is 'tiny-llama \[sliding windows 20,20\]' there, 'tiny-llama' here")


def refused_as_a_pair(decode: tuple[Path, dict], prefill: tuple[Path, dict], message: str) -> None:
    """A decode and a prefill engine (model, options) whose handshake must refuse the pair."""
    t_dec, t_pre = create_transport("tcp", "decode", CONFIG), create_transport("tcp", "prefill", CONFIG)
    engines = []
    try:
        for t, (model, options) in ((t_dec, decode), (t_pre, prefill)):
            engines.append(tp_engine(model, t, 1, num_kv_blocks=16, **options))
        with pytest.raises(IncompatiblePeerError, match=message):
            t_pre.add_peer(t_dec.metadata())
    finally:
        for t in (t_pre, t_dec):
            t.close()
        for core in engines:
            core.close()


@pytest.mark.timeout(120)
def test_pools_with_other_longrope_factors_are_refused_as_a_pair(tmp_path: Path) -> None:
    """Phi-3's LongRoPE set follows each engine's max_model_len: a pool within the
    original context (short factors) and one past it (long) turn keys otherwise."""
    model = build_phi3(tmp_path / "phi3", {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG})
    refused_as_a_pair((model, dict(max_model_len=128)), (model, dict(max_model_len=32)),
                      r"model is 'tiny-llama \[longrope long factors\]' there, "
                      r"'tiny-llama \[longrope short factors\]' here")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stream,layers", [("off", 1), ("chunk", 1), ("layer", 1), ("layer", 2)])
def test_mixed_model_streams_each_layer_its_blocks(tiny_models: dict[str, Path], stream: str, layers: int) -> None:
    """Each stream mode, with the blocks before the window carrying the full layer only:
    the colocated engine's tokens, and the same bytes whichever way they went."""
    model = tiny_models["gemma3"]
    decode, prefill = worker_pair(model, "shm", stream=stream, stream_layers=layers)
    try:
        got, _, done = run_counting(decode, prefill)
        assert got == colocated(model)
        block_bytes = prefill.transport.registered_compat.block_bytes
        assert sum(d.bytes_written for d in done.values()) == mixed_bytes(PROMPTS, 20, 2, block_bytes)
    finally:
        for core in (decode, prefill):
            core.transport.close()
            core.engine.close()


@pytest.mark.timeout(240)
def test_a_windowed_model_with_a_draft_that_reads_every_block(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The decode worker's draft model attends over every position, so it releases
    nothing; the target's layers still read only their window's blocks, and only those
    are written (the ones before are the draft's alone, computed here)."""
    from tests.unit.test_spec_draft_model import derived_model

    model = tiny_models["mistral"]
    draft = derived_model(model, tmp_path / "draft", sliding_window=None)
    decode, prefill = worker_pair(model, "shm", speculative_config={"model": str(draft), "num_speculative_tokens": 2})
    try:
        got, _, done = run_counting(decode, prefill)
        assert decode.stats["fallbacks"] == 0 and decode.stats["remote"] == len(PROMPTS)
        assert got == colocated(model)
        assert prefill.stats["blocks_written"] == sum(window_blocks(p, 20) for p in PROMPTS)
    finally:
        for core in (decode, prefill):
            core.transport.close()
            core.engine.close()
