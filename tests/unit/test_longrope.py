"""Phi-3's LongRoPE ("longrope", the older "su"/"yarn"), against transformers in float32.

The engine turns every position by one factor set, picked once by its max_model_len
(rope.py longrope_factors): short when max_model_len <= original_max_position_embeddings,
long beyond. transformers picks per forward pass, so the two agree wherever it uses one
set for a whole sequence: everything on a short engine, and a prompt longer than the
original context on a long one.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.config import ModelConfig
from engine.model.rope import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ORIGINAL, MAX_POSITIONS = 32, 128  # the tiny model's pretraining context and its extended one
# 4 factors: partial_rotary_factor 0.5 turns 8 of each head's 16 dims. Distinct sets, so
# that the choice between them shows in the tokens (test_the_factor_choice_shows).
SHORT = [1.0, 1.25, 1.5, 2.0]
LONG = [1.0, 3.0, 9.0, 27.0]
NEW_TOKENS = 12
SHORT_PROMPT = torch.randint(2, 384, (14,), generator=torch.Generator().manual_seed(3)).tolist()
LONG_PROMPT = torch.randint(2, 384, (45,), generator=torch.Generator().manual_seed(4)).tolist()  # > ORIGINAL


def build_phi3(out_dir: Path, rope: dict[str, Any]) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    from tests.tiny_models import VOCAB_SIZE, train_tokenizer

    out_dir.mkdir(parents=True)
    tok = train_tokenizer(out_dir)
    config = Phi3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                        original_max_position_embeddings=ORIGINAL, rope_scaling=rope, partial_rotary_factor=0.5,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
                        tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config)
    with torch.no_grad():  # decisive logits, as tests/tiny_models.py makes them
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_phi3(tmp_path_factory.mktemp("longrope") / "phi3",
                      {"type": "longrope", "short_factor": SHORT, "long_factor": LONG})


def with_factors(model_dir: Path, tmp_path: Path, short: list[float], long: list[float]) -> Path:
    """A copy of model_dir whose config has these factors (the same weights)."""
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_parameters"].update(short_factor=short, long_factor=long)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def hf_greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


def engine_greedy(model_dir: Path, prompts: list[list[int]], **options: Any) -> list[Any]:
    llm = LLM(str(model_dir), num_kv_blocks=48, num_threads=1, **options)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one at a time: the 2nd may hit


def test_cos_sin_tables_equal_transformers(phi3_longrope: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(phi3_longrope, dtype=torch.float32).model.rotary_emb
    cfg = ModelConfig.from_model_dir(phi3_longrope)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope" and cfg.rotary_dim == 8
    x = torch.zeros(1, dtype=torch.float32)
    for model_len in (ORIGINAL, MAX_POSITIONS):  # transformers: short up to ORIGINAL positions, long beyond
        ours = RotaryEmbedding(cfg.rotary_dim, model_len, cfg.rope_theta, cfg.rope_scaling, "cpu")
        cos, sin = hf(x, torch.arange(model_len)[None])
        assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0]), model_len
    assert hf.attention_scaling != 1.0  # sqrt(1 + ln 4 / ln 32): scaled as the tables above


def test_a_short_engine_equals_transformers(phi3_longrope: Path) -> None:
    """max_model_len <= original: short factors, as transformers uses within them."""
    [out] = engine_greedy(phi3_longrope, [SHORT_PROMPT], max_model_len=ORIGINAL)
    assert len(SHORT_PROMPT) + NEW_TOKENS <= ORIGINAL
    assert out.token_ids == hf_greedy(phi3_longrope, SHORT_PROMPT)


def test_a_long_prompt_on_a_long_engine_equals_transformers(phi3_longrope: Path) -> None:
    """max_model_len > original and a prompt beyond original: long factors from the first
    forward on, as transformers; whole, in chunks, and from the prefix cache."""
    reference = hf_greedy(phi3_longrope, LONG_PROMPT)
    whole = engine_greedy(phi3_longrope, [LONG_PROMPT], max_model_len=MAX_POSITIONS, enable_prefix_caching=False)
    assert whole[0].token_ids == reference
    chunked, cached = engine_greedy(phi3_longrope, [LONG_PROMPT, LONG_PROMPT], max_model_len=MAX_POSITIONS,
                                    max_num_batched_tokens=8, block_size=8)
    assert chunked.token_ids == cached.token_ids == reference
    assert chunked.num_cached_tokens == 0 and cached.num_cached_tokens >= 40  # 5 of its blocks hit


@pytest.mark.timeout(120)
def test_tensor_parallel_ranks_turn_by_the_same_factors(phi3_longrope: Path) -> None:
    """TP 2: each rank builds its own tables, by the same max_model_len."""
    reference = hf_greedy(phi3_longrope, LONG_PROMPT)
    [out] = engine_greedy(phi3_longrope, [LONG_PROMPT], max_model_len=MAX_POSITIONS, tensor_parallel_size=2)
    assert out.token_ids == reference


def test_the_factor_choice_shows(phi3_longrope: Path, tmp_path: Path) -> None:
    """Turned by the other factor set, the tests above would fail: each one's tokens change."""
    swapped = with_factors(phi3_longrope, tmp_path, LONG, SHORT)
    [short] = engine_greedy(swapped, [SHORT_PROMPT], max_model_len=ORIGINAL)
    assert short.token_ids != hf_greedy(phi3_longrope, SHORT_PROMPT)
    [long] = engine_greedy(swapped, [LONG_PROMPT], max_model_len=MAX_POSITIONS)
    assert long.token_ids != hf_greedy(phi3_longrope, LONG_PROMPT)
    # The rule's one departure (as vLLM's): a short prompt on a long engine turns by the
    # long factors, where transformers would use the short ones.
    [departs] = engine_greedy(phi3_longrope, [SHORT_PROMPT], max_model_len=MAX_POSITIONS)
    assert departs.token_ids != hf_greedy(phi3_longrope, SHORT_PROMPT)


PHI3 = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096}


def test_phi3_rope_names_and_defaults() -> None:
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for rope in ({"type": "su", **factors}, {"type": "yarn", **factors}, {"rope_type": "longrope", **factors}):
        scaling = ModelConfig.from_dict({**PHI3, "rope_scaling": rope}).rope_scaling
        assert scaling is not None and scaling["rope_type"] == "longrope" and scaling["factor"] == 32.0
    # original_max_position_embeddings: the top-level one, else Phi3Config's 4096, as
    # transformers reads it; never rope_parameters' own.
    top_less = {k: v for k, v in PHI3.items() if k != "original_max_position_embeddings"}
    inside = {"rope_type": "longrope", **factors, "original_max_position_embeddings": 8192}
    scaling = ModelConfig.from_dict({**top_less, "rope_parameters": inside}).rope_scaling
    assert scaling["original_max_position_embeddings"] == 4096 and scaling["factor"] == 32.0
    assert ModelConfig.from_dict({**PHI3, "rope_parameters": inside}).rope_scaling["factor"] == 32.0
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic' for Phi3ForCausalLM"):
        ModelConfig.from_dict({**PHI3, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    llama = {**PHI3, "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError, match="unsupported rope_type 'longrope'"):
        ModelConfig.from_dict({**llama, "rope_scaling": {"rope_type": "longrope", **factors}})


@pytest.mark.parametrize(("change", "message"), [
    ({"short_factor": [1.0] * 7}, r"rope_scaling.short_factor must be a list of 8 positive numbers .* got a list of 7"),
    ({"long_factor": [2.0] * 4}, r"rope_scaling.long_factor must be a list of 8 .* got a list of 4"),
    ({"long_factor": None}, r"rope_scaling.long_factor must be a list of 8 .* got None"),
    ({"short_factor": [1.0] * 7 + ["2"]}, r"rope_scaling.short_factor must be a list of 8 positive numbers"),
    ({"attention_factor": "1.2"}, r"rope_scaling.attention_factor must be a positive number, got '1.2'"),
])
def test_bad_longrope_fields_are_named(change: dict[str, Any], message: str) -> None:
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**PHI3, "rope_scaling": rope})


def test_bad_factor_lengths_count_partial_rotary_and_original_is_checked() -> None:
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ValueError, match="rope_parameters.short_factor must be a list of 6 .* of the 12 rotary dims"):
        ModelConfig.from_dict({**PHI3, "rope_parameters": {**rope, "partial_rotary_factor": 0.75}})
    for bad in (0, 1, -5, 4096.0, "4096", True):
        with pytest.raises(ValueError, match="original_max_position_embeddings must be an integer >= 2"):
            ModelConfig.from_dict({**PHI3, "original_max_position_embeddings": bad, "rope_scaling": rope})


@pytest.mark.timeout(120)
def test_a_shared_kv_store_keeps_the_factor_sets_apart(phi3_longrope: Path) -> None:
    """An engine turning keys with the long factors writes its prefix to a shared
    store; one turning them with the short factors must not load it as its own."""
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore
    from kv_store import StoreClient, StoreServer
    from tests.unit.test_kv_tiers import drain

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = SHORT_PROMPT + SHORT_PROMPT[:6]  # 20 tokens: two full blocks of 8

    def run(max_len: int, client: StoreClient, wait_s: float = 0.0) -> tuple[EngineCore, Any]:
        core = EngineCore(EngineConfig.from_options(str(phi3_longrope), num_kv_blocks=16, block_size=8,
                                                    max_model_len=max_len, kv_offload_gib=2**-12, num_threads=1),
                          shared_kv=client)
        deadline = time.monotonic() + wait_s  # time to hear of the store's blocks in its namespace: none
        while client.blocks() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        request = core.add_request("r", prompt, params)
        while core.has_unfinished():
            core.step()
        return core, request

    server = StoreServer(64 << 20, "127.0.0.1").start()
    try:
        long_engine, _ = run(MAX_POSITIONS, StoreClient(server.address, None))
        drain(long_engine.kv.tiers)
        deadline = time.monotonic() + 10
        while server.store.puts == 0:
            assert time.monotonic() < deadline, "the long engine wrote nothing to the store"
            time.sleep(0.05)
        long_engine.close()
        short_engine, request = run(ORIGINAL, StoreClient(server.address, None), wait_s=3.0)
        short_engine.close()
    finally:
        server.stop()
    assert request.num_cached_tokens == 0
    assert list(request.output_token_ids) == hf_greedy(phi3_longrope, prompt)[:6]
