"""load_format "dummy": weights generated from the seed and each tensor's name, so two
engines, and every tensor-parallel rank, hold the same model without a checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cluster.config import ClusterConfig, ConfigError
from engine import LLM, SamplingParams
from engine.attention.backend import get_backend
from engine.distributed.sharding import Shard
from engine.model.config import ModelConfig
from engine.model.dummy_weights import STD
from engine.model.loader import load_model


@pytest.fixture(scope="module")
def config_only(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's directory without its weights: config.json and tokenizer only."""
    out = tmp_path_factory.mktemp("dummy") / "llama"
    shutil.copytree(tiny_models["llama"], out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


def _load(model_dir: Path, shard_of=None, seed: int = 0):
    cfg = ModelConfig.from_model_dir(model_dir)
    shard = Shard.of(cfg, *shard_of) if shard_of else None
    return load_model(model_dir, cfg, "float32", "cpu", get_backend("torch", "cpu"), 256, shard,
                      load_format="dummy", seed=seed), cfg


def test_generated_from_the_seed_without_a_checkpoint(config_only: Path) -> None:
    assert not list(config_only.glob("*.safetensors"))
    a, _ = _load(config_only)
    b, _ = _load(config_only)
    other, _ = _load(config_only, seed=1)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), other.parameters()):
        assert torch.equal(p, q), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)) and torch.equal(r, p), name
        else:
            assert abs(p.std().item() - STD) < 0.1 * STD and not torch.equal(p, r), name
    # Fused parameters are built from differently named pieces: q, k and v differ.
    qkv = a.layers[0].self_attn.qkv_proj.weight
    assert not torch.equal(qkv[:16], qkv[-16:])


@pytest.mark.parametrize("arch", ["qwen2", "llama_mqa"])  # qkv biases + untied lm_head; one KV head, replicated
def test_each_rank_holds_its_slice_of_the_same_full_tensor(tiny_models: dict[str, Path], arch: str,
                                                           request: pytest.FixtureRequest) -> None:
    model_dir = tiny_models[arch] if arch in tiny_models else request.getfixturevalue("mqa_model_dir")
    full, cfg = _load(model_dir)
    whole = dict(full.named_parameters())
    d, inter = cfg.head_dim, cfg.intermediate_size // 2
    q, Q, KV = cfg.num_heads // 2 * d, cfg.num_heads * d, cfg.num_kv_heads * d
    for rank in range(2):
        part, _ = _load(model_dir, (rank, 2))
        attn, full_attn = part.layers[1].self_attn, full.layers[1].self_attn
        kv0, kv1 = Shard.of(cfg, rank, 2).kv_heads
        assert torch.equal(attn.qkv_proj.weight[:q], full_attn.qkv_proj.weight[rank * q:(rank + 1) * q])
        assert torch.equal(attn.qkv_proj.weight[q:], torch.cat([full_attn.qkv_proj.weight[Q + kv0 * d:Q + kv1 * d],
                                                                full_attn.qkv_proj.weight[Q + KV + kv0 * d:Q + KV + kv1 * d]]))
        assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, rank * q:(rank + 1) * q])
        assert torch.equal(part.layers[0].mlp.down_proj.weight,
                           full.layers[0].mlp.down_proj.weight[:, rank * inter:(rank + 1) * inter])
        rows = part.embed_tokens.weight.shape[0]
        assert torch.equal(part.lm_head.weight, whole["lm_head.weight"][rank * rows:(rank + 1) * rows])
        if arch == "qwen2":
            assert torch.equal(attn.qkv_proj.bias[:q], full_attn.qkv_proj.bias[rank * q:(rank + 1) * q])


def test_two_engines_give_the_same_greedy_tokens(config_only: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    runs = [[(o.token_ids, [(t.logprob, t.top) for t in o.logprobs])
             for o in LLM(str(config_only), load_format="dummy", num_threads=1, seed=seed,
                          kv_cache_memory_gib=0.05).generate(prompts, params, use_tqdm=False)]
            for seed in (0, 0, 1)]
    # A model this narrow and this small-weighted repeats the prompt's last token (its tied
    # embedding dominates the logits) whatever the seed: the runners-up tell the weights apart.
    assert runs[0] == runs[1] and runs[2] != runs[0]


def test_load_format_is_checked(config_only: Path) -> None:
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(str(config_only), load_format="pt")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(str(config_only))
    base = {"model": str(config_only), "load_format": "dummy"}
    assert ClusterConfig.from_dict(base).engine_config("decode").load_format == "dummy"
    with pytest.raises(ConfigError, match=r"^load_format: must be one of \('safetensors', 'dummy'\), got 'pt'"):
        ClusterConfig.from_dict({**base, "load_format": "pt"})
    with pytest.raises(ConfigError, match=r"^prefill\.engine\.load_format: is set once, at the top"):
        ClusterConfig.from_dict({**base, "prefill": {"engine": {"load_format": "dummy"}}})
    with pytest.raises(ConfigError, match=r"^decode\.engine\.seed: must equal prefill\.engine\.seed"):
        ClusterConfig.from_dict({**base, "decode": {"engine": {"seed": 1}}})
    # No prefill pool: nothing to agree with.
    ClusterConfig.from_dict({**base, "prefill": {"replicas": 0}, "decode": {"engine": {"seed": 1}}})


def test_a_tensor_parallel_engine_runs_the_same_model(config_only: Path) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    outs = {}
    for size in (1, 2):
        llm = LLM(str(config_only), load_format="dummy", num_threads=1, tensor_parallel_size=size,
                  kv_cache_memory_gib=0.05)
        outs[size] = llm.generate(prompts, params, use_tqdm=False)
        llm.core.close()  # the follower rank
    for one, two in zip(outs[1], outs[2]):
        assert one.token_ids == two.token_ids
        for a, b in zip(one.logprobs, two.logprobs):  # all-reduce sums in another order: not bit-equal
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
