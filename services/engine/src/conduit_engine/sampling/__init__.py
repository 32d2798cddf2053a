"""Token sampling: per-step metadata, logit processors, truncation, random selection and logprobs."""

from __future__ import annotations

from conduit_engine.sampling.logprobs import TokenLogprobs, compute_prompt_logprobs
from conduit_engine.sampling.metadata import SamplingMetadata, SamplingRow, build_sampling_metadata
from conduit_engine.sampling.sampler import Sampler, SamplerOutput

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "TokenLogprobs",
    "build_sampling_metadata",
    "compute_prompt_logprobs",
]
