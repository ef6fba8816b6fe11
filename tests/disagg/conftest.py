"""Fixtures of the disaggregation tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from tests.disagg.test_remote_prefill import GREEDY, PROMPTS


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> dict[str, list[int]]:
    """The colocated engine's greedy tokens for test_remote_prefill.PROMPTS, by request id."""
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    return {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(PROMPTS, GREEDY, use_tqdm=False))}
