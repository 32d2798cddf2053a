"""Top-k, top-p (nucleus) and min-p truncation of temperature-scaled logits, per row.

Semantics follow transformers' TopK/TopP/MinP warpers and vLLM: top-k keeps every token whose logit
is >= the k-th largest (ties at the boundary survive); top-p sorts ascending and drops the tokens
whose cumulative probability is <= 1 - top_p, always keeping the most likely one; min-p drops tokens
whose probability is below min_p times the most likely token's probability. Dropped tokens get -inf.
"""

from __future__ import annotations

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask [N, V] logits outside each row's top-k (long [N], V = off) and top-p (float [N], 1 = off)."""
    if top_k is None and top_p is None:
        return logits
    # One ascending sort serves both filters.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_position = (logits.shape[-1] - top_k).clamp(min=0).unsqueeze(1)
        kth_largest = sorted_logits.gather(1, kth_position)
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask [N, V] logits with probability below min_p (float [N], 0 = off) × the row's top probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
