"""Token sampling: the batched Sampler and its per-row inputs/outputs."""

from engine.sampling.sampler import (
    PendingSample,
    Sampler,
    SamplerOutput,
    SamplingRow,
    TokenLogprobs,
    make_generator,
)

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "SamplingRow", "TokenLogprobs", "make_generator"]
