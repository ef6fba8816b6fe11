"""pdserve's engine: the model, paged KV cache, scheduler and sampler both worker roles run.

The names below load on first use (PEP 562), so that importing a torch-free module of
the engine (engine.sampling_params, engine.config, engine.tokenizer) does not import
torch through engine.llm; the router relies on that.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.output_processor import RequestOutput
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams"]

_MODULES = {"LLM": "engine.llm", "LoRARequest": "engine.lora.request", "RequestOutput": "engine.output_processor",
            "SamplingParams": "engine.sampling_params"}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(_MODULES[name]), name)
    globals()[name] = value
    return value
