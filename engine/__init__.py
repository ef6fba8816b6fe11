"""pdserve's engine: the model, paged KV cache, scheduler and sampler both worker roles run."""

from engine.llm import LLM
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
