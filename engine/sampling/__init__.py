"""Token sampling: the batched Sampler, its per-row inputs, and its outputs on their way
back to the host."""

from engine.sampling.pending import PendingSample, SamplerOutput, TokenLogprobs, UnusableLogitsError
from engine.sampling.sampler import Sampler, SamplingRow, make_generator

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "SamplingRow", "TokenLogprobs", "UnusableLogitsError",
           "make_generator"]
