"""Token sampling: per-step metadata, logit processors, truncation, random selection and logprobs."""

from __future__ import annotations

from conduit_engine.sampling.logprobs import TokenLogprobs, compute_prompt_logprobs
from conduit_engine.sampling.metadata import SamplingMetadata, build_sampling_metadata, metadata_from_plan
from conduit_engine.sampling.plan import SamplingPlan, SamplingRow, plan_sampling
from conduit_engine.sampling.sampler import Sampler, SamplerOutput

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingPlan",
    "SamplingRow",
    "TokenLogprobs",
    "build_sampling_metadata",
    "compute_prompt_logprobs",
    "metadata_from_plan",
    "plan_sampling",
]
