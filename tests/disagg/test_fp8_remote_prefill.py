"""Disaggregated prefill with an fp8 KV cache (engine/attention/kv_quant.py): the
pushed fp8 blocks give the colocated fp8 engine's greedy tokens, at TP 1 and between
TP sizes, over shm and tcp; they move half the bytes of a 16-bit cache; and a peer
with another cache dtype or other scales is refused at the handshake, naming why. With
fp8 weights (engine/model/fp8_linear.py) on both pools, the colocated fp8-weight
engine's tokens; a pool without them is refused as another model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import load_file, save_file

from decode_worker.remote_kv import DecodeWorkerCore
from engine import LLM
from kv_transfer import IncompatiblePeerError, TransportConfig, create_transport
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.disagg.test_remote_prefill import GREEDY, PROMPTS, run, tokens
from tests.disagg.test_tp_remote_prefill import tp_engine

CONFIG = TransportConfig(timeout_s=10.0, cancel_grace_s=5.0)


@pytest.fixture(scope="module")
def fp8_reference(llama_dir: Path) -> dict[str, list[int]]:
    llm = LLM(str(llama_dir), num_kv_blocks=80, kv_cache_dtype="fp8")
    return {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


@contextmanager
def workers(model: Path, transport: str, decode: dict, *prefills: dict) -> Iterator[tuple[list, list]]:
    """A decode engine and prefill engines (each options dict with its "tp"), each
    registered with its own transport: (transports, engines), the decode worker's
    first; every one closed on the way out."""
    names = ["decode"] + [f"prefill{i}" for i in range(len(prefills))]
    transports = [create_transport(transport, name, CONFIG) for name in names]
    engines = []
    try:
        for t, options in zip(transports, (decode, *prefills)):
            options = dict(options)
            engines.append(tp_engine(model, t, options.pop("tp", 1), **options))
        yield transports, engines
    finally:
        for t in transports[::-1]:
            t.close()
        for core in engines:
            core.close()


def push_all(model: Path, transport: str, prefill_tp: int, decode_tp: int, **engine) -> tuple[dict, int]:
    """Every prompt prefilled by one worker and decoded by another: (tokens by request,
    bytes the prefill worker wrote)."""
    decode_options = dict(engine, tp=decode_tp, num_kv_blocks=80)
    prefill_options = dict(engine, tp=prefill_tp, num_kv_blocks=80, max_num_batched_tokens=24)
    with workers(model, transport, decode_options, prefill_options) as ((t_dec, t_pre), engines):
        t_pre.add_peer(t_dec.metadata())
        decode, prefill = DecodeWorkerCore(engines[0], t_dec, 30.0), PrefillWorkerCore(engines[1], t_pre)
        done = run(decode, prefill, PROMPTS, timeout=120)
        assert decode.stats["remote"] == len(PROMPTS) and decode.stats["fallbacks"] == 0
        for core in engines:
            assert core.kv.num_free_blocks == core.kv.pool.num_blocks, "blocks leaked"
        return tokens(done), t_pre.stats["bytes_written"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport,prefill_tp,decode_tp", [("shm", 1, 1), ("tcp", 1, 1), ("shm", 2, 1),
                                                            ("tcp", 1, 2)])
def test_pushed_fp8_kv_gives_the_colocated_fp8_tokens(llama_dir: Path, fp8_reference, transport: str,
                                                      prefill_tp: int, decode_tp: int) -> None:
    got, _ = push_all(llama_dir, transport, prefill_tp, decode_tp, kv_cache_dtype="fp8")
    assert got == fp8_reference


@pytest.mark.timeout(240)
def test_fp8_weights_on_both_pools_give_the_colocated_tokens(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=80, quantization="fp8", kv_cache_dtype="fp8")
    want = {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(PROMPTS, GREEDY, use_tqdm=False))}
    got, _ = push_all(llama_dir, "shm", 2, 1, quantization="fp8", kv_cache_dtype="fp8")
    assert got == want


@pytest.mark.timeout(120)
def test_pools_with_and_without_fp8_weights_are_refused_as_a_pair(llama_dir: Path) -> None:
    with workers(llama_dir, "tcp", dict(num_kv_blocks=16, quantization="fp8"), dict(num_kv_blocks=16)) as (
            (t_dec, t_pre), _):
        with pytest.raises(IncompatiblePeerError, match=r"model is 'tiny-llama \[fp8 weights\]' there, 'tiny-llama'"):
            t_pre.add_peer(t_dec.metadata())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_fp8_cache_moves_half_the_bytes_of_a_bf16_one(llama_dir: Path, transport: str) -> None:
    _, wide = push_all(llama_dir, transport, 1, 1, dtype="bfloat16")
    _, narrow = push_all(llama_dir, transport, 1, 1, dtype="bfloat16", kv_cache_dtype="fp8")
    assert wide > 0 and narrow * 2 == wide


@pytest.mark.timeout(120)
def test_a_peer_with_another_kv_dtype_or_other_scales_is_refused(llama_dir: Path) -> None:
    fp8 = dict(num_kv_blocks=16, kv_cache_dtype="fp8")
    with workers(llama_dir, "shm", fp8, dict(num_kv_blocks=16), fp8) as ((t_dec, t_wide, t_fp8), engines):
        with pytest.raises(IncompatiblePeerError, match="dtype is 'float8_e4m3fn' there, 'float32' here .*kv_cache_dtype"):
            t_wide.add_peer(t_dec.metadata())
        meta = msgpack.unpackb(t_dec.metadata(), raw=False)
        assert meta["compat"]["kv_scales"] == [[1.0, 1.0]] * engines[0].model_config.num_layers
        meta["compat"]["kv_scales"][0] = [0.5, 1.0]
        with pytest.raises(IncompatiblePeerError, match="kv_scales .* both pools must load the same checkpoint"):
            t_fp8.add_peer(msgpack.packb(meta, use_bin_type=True))
        t_fp8.add_peer(t_dec.metadata())  # the same scales pair


def with_kv_scales(model: Path, out: Path, names: tuple[str, str], k: float, v: float) -> Path:
    """A copy of `model` whose checkpoint carries KV cache scales under `names`."""
    shutil.copytree(model, out)
    files = sorted(out.glob("*.safetensors"))
    tensors = load_file(files[0])
    layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
    for layer in layers:
        tensors[f"model.layers.{layer}.self_attn.{names[0]}"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.{names[1]}"] = torch.tensor([v])
    save_file(tensors, files[0])
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("names", [("k_scale", "v_scale"), ("k_proj.output_scale", "v_proj.output_scale")])
def test_checkpoint_kv_scales_are_loaded_and_applied(llama_dir: Path, tmp_path: Path, names) -> None:
    """Scales of powers of two only move fp8's exponent window, so the logprobs stay
    close to the unscaled fp8 engine's; forgetting either scale on the read side
    would multiply the scores or the attention output by 4."""
    scaled = with_kv_scales(llama_dir, tmp_path / "scaled", names, 4.0, 0.25)
    params = dict(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    from engine import SamplingParams

    prompts = PROMPTS[2:4]
    plain = LLM(str(llama_dir), num_kv_blocks=40, kv_cache_dtype="fp8")
    base = plain.generate(prompts, SamplingParams(**params), use_tqdm=False)
    llm = LLM(str(scaled), num_kv_blocks=40, kv_cache_dtype="fp8")
    assert llm.core.kv_scales == ((4.0, 0.25),) * llm.core.model_config.num_layers
    outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    for a, b in zip(base, outs):
        diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
        assert max(diffs) < 0.05, max(diffs)
    # Without an fp8 cache the scales are read and not used: the float32 engine is unchanged.
    assert LLM(str(scaled), num_kv_blocks=40).core.kv_scales == ()
