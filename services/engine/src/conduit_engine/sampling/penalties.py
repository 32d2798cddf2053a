"""Logit processors that run before greedy selection: bias, min_tokens, repetition/presence/frequency.

Order (as vLLM v1 applies them): logit_bias (additive) → min_tokens (EOS and stop_token_ids at -inf
while the output is shorter than min_tokens) → repetition penalty over prompt + output tokens
(transformers: positive logits divided, negative multiplied) → presence/frequency penalties over the
output tokens only (OpenAI: logit -= frequency * count + presence * (count > 0)).
"""

from __future__ import annotations

import torch

from conduit_engine.sampling.metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Return the processed [B, V] logits; the input tensor is left unchanged."""
    if not meta.has_penalties:
        return logits
    logits = logits.clone()
    if meta.logit_bias is not None:
        rows, token_ids, values = meta.logit_bias
        logits.index_put_((rows, token_ids), values, accumulate=True)
    if meta.min_tokens_block is not None:
        rows, token_ids = meta.min_tokens_block
        logits[rows, token_ids] = float("-inf")
    if meta.repetition_penalty is not None and meta.seen_mask is not None:
        penalty = meta.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(meta.seen_mask, penalised, logits)
    if meta.output_counts is not None:
        assert meta.presence_penalty is not None and meta.frequency_penalty is not None
        counts = meta.output_counts
        logits -= meta.frequency_penalty.unsqueeze(1) * counts
        logits -= meta.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits
