"""LoRA adapters (engine/lora) against Hugging Face transformers + PEFT in float32, each
adapter merged into a copy of the base model (PEFT's merge_and_unload): three adapters
of ranks 4, 8 (rsLoRA) and 16 over different projections, in one batch with base-model
requests, with fewer slots than adapters, chunked prefill and preemption; prefix-cache
hits never cross adapters; what an adapter cannot be is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# name -> (int id, PEFT LoraConfig options)
ADAPTERS = {
    "a1": (1, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "a2": (2, dict(r=8, lora_alpha=16, use_rslora=True,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])),
    "a3": (3, dict(r=16, lora_alpha=8, target_modules=["gate_proj", "down_proj", "o_proj"])),
}
PROMPTS = [torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 17, 33, 40, 9, 26, 50)]
NAMES = [None, "a1", "a2", "a3", "a1", None, "a2"]


def make_adapter(base: Path, out: Path, seed: int, **options: object) -> Path:
    """A PEFT adapter of random weights (PEFT starts B at zero: no effect) saved as PEFT saves."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(**options))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model("llama", root / "base")
    return {"base": base, **{name: make_adapter(base, root / name, i, **options)
                             for name, (i, options) in ADAPTERS.items()}}


def request_of(models: dict[str, Path], name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, ADAPTERS[name][0], str(models[name]))


def hf_greedy(models: dict[str, Path], name: str | None, prompt: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["base"], dtype=torch.float32)
    if name is not None:
        model = PeftModel.from_pretrained(model, models[name]).merge_and_unload()
    with torch.no_grad():
        ids = model.eval().generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                    pad_token_id=0)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(lora_models: dict[str, Path]) -> list[list[int]]:
    return [hf_greedy(lora_models, name, p) for name, p in zip(NAMES, PROMPTS)]


@pytest.mark.parametrize("options", [
    dict(max_loras=3),
    dict(max_loras=2),  # three adapters, two slots: one waits for a slot to drain
    dict(max_loras=1, max_num_batched_tokens=8),  # one slot, prompts in chunks
    dict(max_loras=2, max_num_batched_tokens=16, num_kv_blocks=10),  # preemption: recomputed with its adapter
])
def test_adapters_mixed_with_base_requests_equal_peft_merged(lora_models: dict[str, Path],
                                                            reference: list[list[int]], options: dict) -> None:
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16, block_size=8, **options)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[request_of(lora_models, n) for n in NAMES])
    assert [o.token_ids for o in outputs] == reference
    base = [hf_greedy(lora_models, None, p) for p in PROMPTS[1:5]]
    assert all(w != b for w, b in zip(reference[1:5], base)), "an adapter that changes nothing tests nothing"
    if "num_kv_blocks" in options:
        assert llm.core.scheduler.num_preemptions > 0


def test_prefix_cache_hits_never_cross_adapters(lora_models: dict[str, Path], reference: list[list[int]]) -> None:
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16, block_size=8)
    prompt = PROMPTS[6]  # 50 tokens: six full blocks
    runs = []
    for name in ("a2", "a1", None, "a2"):
        [out] = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request_of(lora_models, name))
        runs.append(out)
    assert [o.num_cached_tokens for o in runs] == [0, 0, 0, 48]
    assert runs[0].token_ids == runs[3].token_ids == reference[6]


def test_parallel_samples_share_the_adapter(lora_models: dict[str, Path], reference: list[list[int]]) -> None:
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2)
    [out] = llm.generate([PROMPTS[3]], params, use_tqdm=False, lora_request=request_of(lora_models, "a3"))
    assert out.sequences is not None
    assert [s.token_ids for s in out.sequences] == [reference[3]] * 2


def test_what_cannot_be_served_is_refused_by_name(lora_models: dict[str, Path], tmp_path: Path) -> None:
    base = str(lora_models["base"])
    with pytest.raises(ValueError, match="started without enable_lora"):
        LLM(base).generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=request_of(lora_models, "a1"))
    llm = LLM(base, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=request_of(lora_models, "a3"))
    with pytest.raises(ValueError, match="needs adapter_config.json and adapter_model.safetensors"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 9, str(tmp_path)))
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in lora_models["a1"].iterdir():
        (dora / f.name).write_bytes(f.read_bytes())
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA is not supported"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 5, str(dora)))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a1", 0, str(lora_models["a1"]))
    # The engine serves on after each refusal.
    [out] = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=request_of(lora_models, "a1"))
    assert out.token_ids == hf_greedy(lora_models, "a1", PROMPTS[1])
