"""Multi-head latent attention (engine/model/mla.py) beyond plain greedy decoding:
speculative verify rows and forks (n > 1) over the latent cache, and the cache's size:
one kv_lora_rank + qk_rope_head_dim vector per token and layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.model.config import ModelConfig
from tests.fidelity.test_hf_fidelity import hf_greedy
from tests.fidelity.test_moe_fidelity import GREEDY
from tests.fidelity.test_tp_fidelity import PROMPTS


def test_speculative_verify_rows_over_the_latent_cache_match_hf(moe_models: dict[str, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts that are always right (every verify row accepted), then always wrong
    (every draft's latent written, then rolled back)."""
    from engine.speculative import speculator

    model = moe_models["deepseek_v3"]
    prompts = PROMPTS[1:3]
    expected = hf_greedy(model, prompts)
    for wrong in (False, True):
        def propose(sequence, room, *_, wrong=wrong):
            prompt, out = next((p, e) for p, e in zip(prompts, expected) if sequence[:len(p)] == p)
            return [(t + wrong) % 384 for t in out[len(sequence) - len(prompt):][:room]]

        monkeypatch.setattr(speculator, "propose_ngram", propose)
        llm = LLM(str(model), speculative_config={"num_speculative_tokens": 3})
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.core.speculator.stats
        assert stats.num_draft_tokens > 0 and (stats.num_accepted_tokens == 0) == wrong


def test_forks_over_a_shared_latent_prefix_equal_single_seeded_requests(moe_models: dict[str, Path]) -> None:
    llm = LLM(str(moe_models["deepseek_v2"]), block_size=16)
    prompt = PROMPTS[0]
    forked = llm.generate([prompt], SamplingParams(n=3, seed=11, temperature=0.9, max_tokens=10), use_tqdm=False)[0]
    singles = [llm.generate([prompt], SamplingParams(seed=11 + i, temperature=0.9, max_tokens=10),
                            use_tqdm=False)[0].token_ids for i in range(3)]
    assert [s.token_ids for s in forked.sequences] == singles
    assert len(set(map(tuple, singles))) > 1  # the forks did diverge


def test_the_latent_cache_holds_one_vector_per_token_and_layer(moe_models: dict[str, Path]) -> None:
    llm = LLM(str(moe_models["deepseek_v3"]), num_kv_blocks=8, block_size=16)
    cfg: ModelConfig = llm.core.model_config
    assert cfg.mla is not None and (cfg.num_kv_heads, cfg.head_dim, cfg.kv_planes) == (1, 32 + 16, 1)
    assert tuple(llm.core.kv_caches[0].shape) == (8, 1, 3, 1, 16, 48)
    assert cfg.kv_bytes_per_token(4) == 3 * 48 * 4


@pytest.mark.timeout(240)
def test_the_moe_demo_gives_the_same_tokens_at_tp1_and_tp2_expert_parallel(tmp_path: Path) -> None:
    """configs/local-moe.yaml's model: config.json and the dense demo's tokenizer, weights
    generated from the seed alike by every rank, whichever experts it holds."""
    from cluster.demo_model import DEMO_MODELS, default_models_dir
    from cluster.moe_demo import prepare_moe_demo

    dense = default_models_dir() / DEMO_MODELS["smollm2"].dir_name
    (tmp_path / dense.name).symlink_to(dense)  # the dense demo is there already: nothing to download
    model = prepare_moe_demo(tmp_path)
    prompts = ["The capital of France is", "Paged attention stores keys and values in"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        llm = LLM(str(model), load_format="dummy", tensor_parallel_size=tp, enable_expert_parallel=tp > 1,
                  num_kv_blocks=32, num_threads=1)
        try:
            assert llm.core.model_config.mla is not None and llm.core.model_config.moe is not None
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.core.close()
    assert outs[0] == outs[1]


@pytest.mark.timeout(240)
def test_tp2_tiers_keep_one_copy_of_the_latent_and_load_it_into_every_rank(moe_models: dict[str, Path]) -> None:
    """Every rank holds the same latent: a tier slot holds rank 0's block only, and a
    load writes it into both ranks' caches (the tokens then equal the unevicted run's)."""
    from tests.unit.test_kv_tiers import chat_turns, run_chat

    model = moe_models["deepseek_v3"]
    expected = run_chat(LLM(str(model), num_kv_blocks=400), chat_turns())
    block_bytes = 3 * 48 * 16 * 4  # layers x latent x block_size x float32
    llm = LLM(str(model), tensor_parallel_size=2, num_threads=1, num_kv_blocks=12, block_size=16,
              kv_offload_gib=200 * block_bytes / 2**30)
    try:
        assert llm.core.kv.tiers.block_bytes == block_bytes
        tokens, cached = run_chat(llm, chat_turns())
        stats = llm.stats().offload
    finally:
        llm.core.close()
    assert tokens == expected[0]
    assert stats is not None and stats.tiers[0].hits > 0 and stats.failed_loads == 0
    assert sum(cached) > sum(expected[1])
