"""The real demo model (SmolLM2-135M-Instruct) through the chat path, against transformers."""

from __future__ import annotations

import pytest
import torch

from cluster.demo_model import DEMO_MODELS, default_models_dir
from engine import LLM, SamplingParams

MODEL_DIR = default_models_dir() / DEMO_MODELS["smollm2"].dir_name

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                                reason="demo model not prepared (make model)")

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(MODEL_DIR), dtype="float32")


def test_chat_matches_hf_and_answers(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    for out in outs:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=24, do_sample=False)
        assert out.token_ids == ref[0, len(out.prompt_token_ids):].tolist()
    assert outs[0].text == "The capital of France is Paris."
    assert outs[0].finish_reason == "stop"


def test_stop_string_on_real_text(llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=[" is"])
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], params, use_tqdm=False)[0]
    assert out.text == "The capital of France"
    assert out.finish_reason == "stop"
