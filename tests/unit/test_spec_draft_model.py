"""Speculative decoding with a draft model (engine/speculative/draft_model.py): greedy
outputs token-identical to the engine without it, in float32. The target as its own
draft must have every draft accepted, which only a draft KV cache kept exactly in step
with the target's sequences gives: across preemption, chunked prefill, prefix caching,
forks (n > 1) and a prompt whose KV a prefill worker pushed."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode_worker.remote_kv import DecodeWorkerCore
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.errors import RequestsFailed
from engine.gpu_memory import profile_num_kv_blocks
from kv_transfer import TransportConfig, create_transport
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.fidelity.test_hf_fidelity import random_prompts
from tests.unit.test_gpu_memory import fake_cuda_memory

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHARED = random_prompts([40], seed=5)[0]
# Random prompts, one longer than a small step's budget, two sharing a 40-token prefix.
PROMPTS = random_prompts([5, 23, 61], seed=3) + [SHARED + [7, 8], SHARED + [9]]


def llm(model: Path, draft: Path | None = None, k: int = 3, **options) -> LLM:
    spec = None if draft is None else {"model": str(draft), "num_speculative_tokens": k}
    return LLM(str(model), speculative_config=spec, **{"num_kv_blocks": 64, "block_size": 16, **options})


def tokens(model: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in model.generate(prompts, params, use_tqdm=False)]


def derived_model(target: Path, out: Path, num_layers: int | None = None, **config: object) -> Path:
    """A copy of the target's directory (tokenizer included) keeping its first
    num_layers layers, with `config` overriding config.json."""
    out.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(config)
    layers = cfg["num_hidden_layers"] = num_layers or cfg["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({name: t for name, t in load_file(target / "model.safetensors").items()
               if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < layers},
              out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[list[int]]:
    return tokens(llm(llama_dir))


@pytest.fixture(scope="module")
def small_draft(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's first layer alone (a layer-skipping draft): it agrees with the
    target on some tokens, not all, and its KV cache has another shape."""
    return derived_model(llama_dir, tmp_path_factory.mktemp("draft") / "one_layer", num_layers=1)


def assert_all_accepted(model: LLM) -> None:
    stats = model.core.speculator.stats
    assert stats.num_draft_tokens > 0, "no drafts were tried: the test proves nothing"
    assert stats.num_accepted_tokens == stats.num_draft_tokens, (
        f"the target as its own draft had {stats.num_draft_tokens - stats.num_accepted_tokens} of "
        f"{stats.num_draft_tokens} drafts rejected: its draft KV is not the target's")


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_target_as_its_own_draft_is_always_right(llama_dir: Path, reference: list[list[int]], k: int) -> None:
    model = llm(llama_dir, llama_dir, k)
    assert tokens(model) == reference
    assert_all_accepted(model)
    stats = model.core.speculator.stats
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length > min(k, 2)


@pytest.mark.parametrize("options", [
    {"num_kv_blocks": 12},  # preempts
    {"max_num_batched_tokens": 8},  # chunks prompts and catch-ups, truncates drafts
    {"max_num_batched_tokens": 8, "enable_prefix_caching": False},
], ids=["preemption", "chunked", "no-prefix-caching"])
def test_self_draft_under_preemption_chunking_and_caching(llama_dir: Path, reference: list[list[int]],
                                                         options: dict) -> None:
    model = llm(llama_dir, llama_dir, 4, **options)
    assert tokens(model) == reference
    assert_all_accepted(model)
    if "num_kv_blocks" in options:
        assert model.core.scheduler.num_preemptions > 0, "nothing was preempted: the test proves nothing"


def test_prefix_hits_without_draft_kv_are_recomputed(llama_dir: Path) -> None:
    """A request that sampled one token never ran the draft over the prompt blocks it
    cached; a later request hitting them computes their draft KV itself."""
    model = llm(llama_dir, llama_dir, 3)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    assert tokens(model, [SHARED + [7]], one) == [tokens(llm(llama_dir), [SHARED + [7]], one)[0]]
    assert model.core.speculator.stats.num_draft_tokens == 0
    out = model.generate([SHARED + [9]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32 and [out.token_ids] == tokens(llm(llama_dir), [SHARED + [9]])
    assert_all_accepted(model)


def test_a_smaller_draft_gives_the_same_tokens(llama_dir: Path, small_draft: Path,
                                               reference: list[list[int]]) -> None:
    for options in ({}, {"num_kv_blocks": 12, "max_num_batched_tokens": 8}):
        model = llm(llama_dir, small_draft, 3, **options)
        assert tokens(model) == reference
        stats = model.core.speculator.stats
        assert 0 < stats.acceptance_rate < 1, f"acceptance {stats.acceptance_rate}: the test proves nothing"
    assert model.core.speculator.draft_model.kv_cache.shape[2] == 1  # its own cache: one layer


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forked_sequences_compute_their_draft_kv(llama_dir: Path, prefix_caching: bool) -> None:
    """n > 1: the group's prompt request never runs the draft, so its sequences must
    not trust draft KV in the blocks they inherit (a partial last block among them)."""
    params = SamplingParams(n=2, max_tokens=12, temperature=0.0, ignore_eos=True)
    model = llm(llama_dir, llama_dir, 3, enable_prefix_caching=prefix_caching)
    out = model.generate([SHARED], params, use_tqdm=False)[0]
    single = tokens(llm(llama_dir), [SHARED], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert [s.token_ids for s in out.sequences] == [single, single]
    assert_all_accepted(model)


def test_a_sampled_request_runs_with_drafts(llama_dir: Path, small_draft: Path) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, ignore_eos=True)
    model = llm(llama_dir, small_draft, 3)
    out = model.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [MAX_TOKENS] * 2
    assert all(0 <= t < 384 for o in out for t in o.token_ids)
    assert model.core.speculator.stats.num_draft_tokens > 0


def test_a_catch_up_longer_than_a_step_is_split(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No draft forward exceeds max_num_batched_tokens, however long the catch-up."""
    model = llm(llama_dir, llama_dir, 3, max_num_batched_tokens=16)
    runner = model.core.speculator.draft_model.runner
    sizes, forward = [], runner.forward
    monkeypatch.setattr(runner, "forward", lambda inputs, dev=None: sizes.append(len(inputs.input_ids))
                        or forward(inputs, dev))
    assert tokens(model, PROMPTS[2:3]) == tokens(llm(llama_dir), PROMPTS[2:3])
    assert max(sizes) == 16 and sizes[:4] == [16, 16, 16, 14]  # 62 tokens before the first drafts
    # Then each catch-up covers only the tokens the last step added: at most k + 1.
    assert len(sizes) > 4 and max(sizes[4:]) <= 4
    assert_all_accepted(model)


@pytest.mark.parametrize("where", ["draft", "target"])
def test_a_failed_step_is_void_and_the_drafts_go_on(llama_dir: Path, reference: list[list[int]], where: str) -> None:
    """A draft forward that fails voids the step as a target's does (RequestsFailed);
    after either, the next drafts start from the tokens as they stood."""
    core = llm(llama_dir, llama_dir, 3).core
    for i, prompt in enumerate(PROMPTS[:2]):
        core.add_request(f"r{i}", prompt, GREEDY)
    core.step()  # the prompts; the next step has drafts
    runner = core.speculator.draft_model.runner if where == "draft" else core.runner
    name = "forward" if where == "draft" else "launch"
    real = getattr(runner, name)

    def failing(*args, **kwargs):
        setattr(runner, name, real)
        raise RuntimeError("device lost")
    setattr(runner, name, failing)
    with pytest.raises(RequestsFailed, match=r"the model step failed \(RuntimeError: device lost\)"):
        core.step()
    done, end = {}, time.monotonic() + 60
    while core.has_unfinished():
        assert time.monotonic() < end
        done.update((r.request_id, r.output_token_ids) for r in core.step().finished)
    assert [done["r0"], done["r1"]] == reference[:2]
    stats = core.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def remote_pair(model_dir: Path, draft: Path):
    """A decode engine speculating with `draft`, fed by a plain prefill engine (shm)."""
    config = TransportConfig(timeout_s=5.0, cancel_grace_s=5.0)
    t_dec, t_pre = create_transport("shm", "decode", config), create_transport("shm", "prefill", config)
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    dec = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=80, max_num_batched_tokens=32,
                                  speculative_config=spec), t_dec.allocate_kv_cache)
    pre = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=80, max_num_batched_tokens=24),
                     t_pre.allocate_kv_cache)
    for t, core in ((t_dec, dec), (t_pre, pre)):
        t.register_kv_cache(core.kv_cache, "tiny-llama")
    t_pre.add_peer(t_dec.metadata())
    return DecodeWorkerCore(dec, t_dec, 30.0), PrefillWorkerCore(pre, t_pre)


@pytest.mark.timeout(120)
def test_a_remotely_prefilled_prompt_gets_its_draft_kv_on_the_decode_side(llama_dir: Path,
                                                                         reference: list[list[int]]) -> None:
    """The prefill worker pushes only the target's KV; the decode engine's draft
    computes the prompt's (in chunks of its 32-token budget) before its first drafts."""
    decode, prefill = remote_pair(llama_dir, llama_dir)
    try:
        done = {}
        for i, prompt in enumerate(PROMPTS):  # one after another: the shared prefix is a local hit
            rp = decode.add_request(f"r{i}", prompt, GREEDY, remote=True)
            assert rp is not None
            prefill.submit(rp)
            end = time.monotonic() + 60
            while decode.engine.has_unfinished() or prefill.engine.has_unfinished():
                assert time.monotonic() < end, "disaggregated run did not finish"
                for result in prefill.step():
                    assert result.error is None
                for r in decode.step().finished:
                    done[r.request_id] = r
        assert [done[f"r{i}"].output_token_ids for i in range(len(PROMPTS))] == reference
        assert decode.stats["remote"] == len(PROMPTS) and decode.stats["fallbacks"] == 0
        assert done["r4"].num_remote_tokens > 0 and done["r4"].num_cached_tokens == 32
        speculator = decode.engine.speculator
        assert speculator.stats.num_draft_tokens > 0
        assert speculator.stats.num_accepted_tokens == speculator.stats.num_draft_tokens
    finally:
        decode.transport.close()
        prefill.transport.close()


def test_unusable_drafts_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    def refused(draft: Path, match: str, **options) -> None:
        with pytest.raises(ValueError, match=match):
            llm(llama_dir, draft, **options)

    refused(derived_model(llama_dir, tmp_path / "vocab", vocab_size=400),
            r"speculative_config.model '.*vocab' has a vocabulary of 400 tokens, the target model 384")
    short = derived_model(llama_dir, tmp_path / "short", max_position_embeddings=256)
    refused(short, r"speculative_config.model '.*short' supports 256 positions \(its max_position_embeddings\), "
                   r"fewer than the target's max_model_len 1024")
    assert llm(llama_dir, short, max_model_len=256).core.max_model_len == 256  # within its context: fine
    refused(tmp_path / "missing", r"speculative_config.model '.*missing' does not load as a draft model: "
                                  r"model directory .* does not exist")
    refused(derived_model(llama_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]),
            r"speculative_config.model '.*gpt2' does not load as a draft model: unsupported model architecture")
    # The same vocabulary size, but a tokenizer whose ids mean other strings.
    other = derived_model(llama_dir, tmp_path / "tokenizer")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused(other, r"speculative_config.model '.*tokenizer': its tokenizer's vocabulary differs from the target "
                   r"model's \(2 token strings have other ids")


def test_gpu_profiling_counts_the_draft(llama_dir: Path, small_draft: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the pool is sized for both caches: a block costs the target's KV bytes
    plus the draft's (torch.cuda's counters faked, as in tests/unit/test_gpu_memory.py)."""
    core = llm(llama_dir, small_draft, max_model_len=128).core
    draft = core.speculator.draft_model.runner
    gib = 2**30
    fake_cuda_memory(monkeypatch, 2 * gib, 3 * gib, 8 * gib, 10 * gib)
    blocks = profile_num_kv_blocks(core.model, core.model_config, core.runner.attention_backend, "cpu",
                                   torch.float32, 16, 64, core.max_model_len, 64, 0.9,
                                   [(draft.model, draft.model.config, draft.attention_backend)])
    target_bytes = core.model_config.kv_bytes_per_token(4) * 16
    draft_bytes = draft.model.config.kv_bytes_per_token(4) * 16
    assert draft_bytes == target_bytes // 2  # one layer of two
    # Each forward's peak is counted without its own scratch cache (4 blocks): the
    # draft's, with the smaller scratch, is the larger.
    activations = gib - 4 * draft_bytes
    assert blocks == int((9 * gib - 2 * gib - activations) // (target_bytes + draft_bytes))
