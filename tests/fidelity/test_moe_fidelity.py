"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 with and without a q
LoRA, DeepSeek-V3; engine/model/moe.py, mla.py): greedy float32 tokens identical to
transformers at TP 1, TP 2 and TP 2 expert parallel, with prefix hits, 32-token chunks
and preemption; generated weights the same at any TP size; an expert width that
does not split over the ranks refused before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.distributed.sharding import check_shardable
from engine.model.config import ModelConfig
from tests.fidelity.test_hf_fidelity import MIXED, hf_greedy, random_prompts, step_tokens
from tests.fidelity.test_tp_fidelity import PROMPTS, SHARED, tp_llm
from tests.tiny_models import MOE_ARCHS

# min_tokens as hf_greedy's min_new_tokens: EOS masked until the end (these tiny models
# put it first now and then, which ignore_eos alone would sample).
GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, ignore_eos=True)
LONGER = SamplingParams(max_tokens=20, min_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_batch_matches_hf(moe_models: dict[str, Path], arch: str) -> None:
    llm = LLM(str(moe_models[arch]), enable_prefix_caching=False)
    assert llm.core.model_config.moe is not None
    outs = llm.generate(MIXED, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(moe_models[arch], MIXED)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefix_hits_chunks_and_preemption_match_hf(moe_models: dict[str, Path], arch: str) -> None:
    llm = LLM(str(moe_models[arch]), max_num_batched_tokens=32, block_size=16, num_kv_blocks=16)
    steps = step_tokens(llm)
    first = llm.generate([SHARED], LONGER, use_tqdm=False)  # fills the prefix cache
    rest = llm.generate(PROMPTS, LONGER, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == hf_greedy(moe_models[arch], [SHARED] + PROMPTS, max_tokens=20)
    assert max(steps) <= 32 and llm.core.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in rest) > 0  # some of the shared prefix outlived the preemptions


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tp2_matches_hf_with_chunks_prefix_hits_and_preemption(moe_models: dict[str, Path], arch: str,
                                                               expert_parallel: bool) -> None:
    llm = tp_llm(moe_models[arch], max_num_batched_tokens=32, block_size=16, num_kv_blocks=16,
                 enable_expert_parallel=expert_parallel)
    try:
        # Expert parallel: rank 0 holds experts 0-3 whole; else all 8, half of each one's width.
        assert (llm.core.shard.experts, llm.core.shard.expert_intermediate) == (
            ((0, 4), (0, 32)) if expert_parallel else ((0, 8), (0, 16)))
        steps = step_tokens(llm)
        first = llm.generate([SHARED], LONGER, use_tqdm=False)
        rest = llm.generate(PROMPTS, LONGER, use_tqdm=False)
        assert [o.token_ids for o in first + rest] == hf_greedy(moe_models[arch], [SHARED] + PROMPTS, max_tokens=20)
        assert max(steps) <= 32 and llm.core.scheduler.num_preemptions > 0
        assert sum(o.num_cached_tokens for o in rest) > 0
    finally:
        llm.core.close()


def test_generated_weights_give_the_same_tokens_at_tp1_and_tp2(moe_models: dict[str, Path]) -> None:
    """load_format dummy draws each expert's tensors by checkpoint name: a rank slices
    them as it would slice read ones."""
    prompts = random_prompts([9, 40], seed=21)
    outs = []
    for tp in (1, 2):
        llm = LLM(str(moe_models["qwen2_moe"]), load_format="dummy", tensor_parallel_size=tp, num_threads=1)
        try:
            outs.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        finally:
            llm.core.close()
    assert outs[0] == outs[1]


def test_an_expert_width_that_does_not_split_is_refused(moe_models: dict[str, Path]) -> None:
    import json

    cfg = json.loads((moe_models["qwen2_moe"] / "config.json").read_text())
    model = ModelConfig.from_dict({**cfg, "moe_intermediate_size": 33})
    with pytest.raises(ValueError, match="moe_intermediate_size 33 does not divide by tensor_parallel_size 2"):
        check_shardable(model, 2)
    assert model.moe is not None and model.moe.sparse_layers == (1,)  # mlp_only_layers [0]


def test_expert_parallel_needs_experts_that_divide(moe_models: dict[str, Path], tiny_models: dict[str, Path]) -> None:
    import json

    cfg = json.loads((moe_models["qwen3_moe"] / "config.json").read_text())
    six = ModelConfig.from_dict({**cfg, "num_local_experts": 6})
    with pytest.raises(ValueError, match="enable_expert_parallel: 6 experts do not divide by tensor_parallel_size 4"):
        check_shardable(six, 4, expert_parallel=True)
    check_shardable(six, 2, expert_parallel=True)
    dense = ModelConfig.from_model_dir(tiny_models["llama"])
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no experts"):
        check_shardable(dense, 2, expert_parallel=True)
