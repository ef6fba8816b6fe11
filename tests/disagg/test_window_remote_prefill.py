"""Disaggregated prefill of sliding-window models: the decode worker reserves and
fences only the blocks the window of the prompt's last token reads (the rest are
released at once), the prefill worker writes only those, and the decoded tokens are
the colocated engine's: the tiny Mistral (a window of 20 on every layer) at (1, 1)
and (1, 2) over shm and tcp, and Gemma 3 (a sliding and a full layer), whose full
layer needs every block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from decode_worker.remote_kv import DecodeWorkerCore
from engine import LLM
from engine.kv_cache.manager import cdiv
from kv_transfer import IncompatiblePeerError, create_transport
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.disagg.test_fp8_remote_prefill import CONFIG, workers
from tests.disagg.test_remote_prefill import GREEDY, PROMPTS, run, tokens
from tests.disagg.test_tp_remote_prefill import tp_engine

BLOCK = 16  # EngineConfig's default block_size


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


@pytest.mark.timeout(240)
def test_mixed_model_pushes_every_block(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["gemma3"]
    got, _, blocks = push_all(model, "shm", 1)
    assert got == colocated(model)
    # Its full layer reads every block; the second shared-prefix prompt finds 2 cached.
    assert blocks == sum(window_blocks(p, 0) for p in PROMPTS) - 2


@pytest.mark.timeout(120)
def test_pools_with_other_windows_are_refused_as_a_pair(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The same weights attending without the window compute other KV: refused at the
    handshake, as another model."""
    unwindowed = tmp_path / "mistral-no-window"
    shutil.copytree(tiny_models["mistral"], unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    t_dec, t_pre = create_transport("tcp", "decode", CONFIG), create_transport("tcp", "prefill", CONFIG)
    engines = []
    try:
        engines.append(tp_engine(tiny_models["mistral"], t_dec, 1, num_kv_blocks=16))
        engines.append(tp_engine(unwindowed, t_pre, 1, num_kv_blocks=16))
        with pytest.raises(IncompatiblePeerError, match=r"model is 'tiny-llama \[sliding windows 20,20\]' there, "
                                                        r"'tiny-llama' here"):
            t_pre.add_peer(t_dec.metadata())
    finally:
        for t in (t_pre, t_dec):
            t.close()
        for core in engines:
            core.close()
