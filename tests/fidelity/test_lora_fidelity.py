"""LoRA adapters (engine/lora) against Hugging Face transformers + PEFT in float32, each
adapter merged into a copy of the base model (PEFT's merge_and_unload): three adapters
of ranks 4, 8 (rsLoRA) and 16 over different projections (tests/lora_adapters.py), in one batch with base-model
requests, with fewer slots than adapters, chunked prefill and preemption; prefix-cache
hits never cross adapters; what an adapter cannot be is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import ADAPTERS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 17, 33, 40, 9, 26, 50)]
NAMES = [None, "a1", "a2", "a3", "a1", None, "a2"]


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
    # Tensor parallel: each rank holds its slice of every adapter, sent by the driver
    # as the adapter takes a slot; two slots for three adapters, so slots are reloaded.
    dict(max_loras=2, tensor_parallel_size=2, num_threads=1),
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


def test_a_name_pointed_at_new_files_runs_them(lora_models: dict[str, Path], reference: list[list[int]],
                                                tmp_path: Path) -> None:
    """The name "x" first at a1's files, then at a2's: each request runs the files its
    name meant when it arrived, and the prefix cache keeps the two apart."""
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16, max_loras=1, block_size=8)
    prompt = PROMPTS[6]
    first = LoRARequest("x", 7, str(lora_models["a1"]))
    second = LoRARequest("x", 7, str(lora_models["a2"]))
    [a] = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=first)
    [b] = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=second)
    assert a.token_ids == hf_greedy(lora_models, "a1", prompt)
    assert b.token_ids == reference[6] and b.num_cached_tokens == 0  # a2's, its own KV


def test_a_read_adapter_serves_its_queued_requests_whatever_happens_to_its_files(
        lora_models: dict[str, Path], reference: list[list[int]], tmp_path: Path) -> None:
    """max_cpu_loras 1: reading a2 drops a1's read from memory; a1's queued request still
    runs with it (nothing is read inside a step), though its directory is gone."""
    gone = tmp_path / "a1"
    gone.mkdir()
    for f in lora_models["a1"].iterdir():
        (gone / f.name).write_bytes(f.read_bytes())
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16, max_loras=1, max_cpu_loras=1)
    core = llm.core
    r1 = core.add_request("r1", PROMPTS[1], GREEDY, lora_request=LoRARequest("a1", 1, str(gone)))
    r2 = core.add_request("r2", PROMPTS[2], GREEDY, lora_request=request_of(lora_models, "a2"))
    for f in gone.iterdir():
        f.unlink()
    while core.has_unfinished():
        core.step()
    assert [r1.output_token_ids, r2.output_token_ids] == reference[1:3]


def test_bad_adapters_and_requests_are_value_errors(lora_models: dict[str, Path], tmp_path: Path) -> None:
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16)

    def broken(name: str, config: dict | None = None, weights: bytes | None = None) -> LoRARequest:
        out = tmp_path / name
        out.mkdir()
        cfg = json.loads((lora_models["a1"] / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
        (out / "adapter_model.safetensors").write_bytes(
            weights if weights is not None else (lora_models["a1"] / "adapter_model.safetensors").read_bytes())
        return LoRARequest(name, 9, str(out))

    cases = [("lora_request must be a LoRARequest", {"lora_name": "a1"}),
             ("adapter_model.safetensors cannot be read", broken("torn", weights=b"\x08" * 20)),
             ("alpha_pattern must map module patterns to positive numbers", broken("listed", {"alpha_pattern": [1]})),
             ("rank_pattern must map module patterns to positive numbers", broken("zero", {"rank_pattern": {"q_proj": 0}})),
             ("rank_pattern key .* is not a regex", broken("regex", {"rank_pattern": {"q_proj(": 4}}))]
    for message, lora in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora)  # type: ignore[arg-type]


def test_a_request_runs_only_with_the_files_its_digest_names(lora_models: dict[str, Path], tmp_path: Path,
                                                            reference: list[list[int]]) -> None:
    """The server names each adapter's files by digest (LoRARequest.digest): an engine
    holding a read of those files runs it with them; one holding a read of other files
    under that name and path reads them again, and refuses the request if they are not
    the digest's (changed since), so a prefill and a decode worker never compute one
    request with different weights."""
    from engine.lora.files import read_files

    path = tmp_path / "swapped"
    path.mkdir()
    for f in lora_models["a1"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    old = read_files("x", path)[2]
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16)
    [first] = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(path), old))
    assert first.token_ids == reference[1]  # a1's weights
    for f in lora_models["a2"].iterdir():  # the files change in place
        (path / f.name).write_bytes(f.read_bytes())
    new = read_files("x", path)[2]
    # The read it holds is of the old files: the old digest runs with it.
    [again] = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(path), old))
    assert again.token_ids == reference[1]
    fresh = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16)  # holds none: reads the new files
    with pytest.raises(ValueError, match="changed since the server loaded them"):
        fresh.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(path), old))
    [second] = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 2, str(path), new))
    assert second.token_ids == reference[2]  # a2's weights: read again for the new digest


def test_the_triton_sgmv_kernels_in_the_engine_equal_peft_merged(lora_models: dict[str, Path],
                                                                 reference: list[list[int]],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's CUDA path (LoRAStep tiles, engine/kernels/lora_sgmv.py) run on CPU
    under the Triton interpreter: the same tokens as HF + PEFT, adapters mixed with
    base requests and with chunked prompts."""
    from engine.lora import layers

    monkeypatch.setattr(layers, "use_sgmv", lambda device: True)
    llm = LLM(str(lora_models["base"]), enable_lora=True, max_lora_rank=16, max_loras=3, block_size=8,
              max_num_batched_tokens=24)
    picked = [0, 1, 2, 3, 6]
    outputs = llm.generate([PROMPTS[i] for i in picked], GREEDY, use_tqdm=False,
                           lora_request=[request_of(lora_models, NAMES[i]) for i in picked])
    assert [o.token_ids for o in outputs] == [reference[i] for i in picked]
