"""Top-k, top-p (nucleus) and min-p truncation of temperature-scaled logits, per row.

Semantics follow transformers' TopK/TopP/MinP warpers and vLLM: top-k keeps every token whose logit
is >= the k-th largest (ties at the boundary survive); top-p keeps the most likely tokens while the
probability of the tokens more likely than them is below top_p (transformers: drop where the ascending
cumulative probability is <= 1 - top_p), always keeping the most likely one; min-p drops tokens whose
probability is below min_p times the most likely token's probability. Dropped tokens get -inf.

Cost: a full sort of a 32k vocabulary per row is the most expensive thing a CPU sampler can do, so
top-k uses `topk`, and top-p first looks at the _TOP_P_CANDIDATES most likely tokens; only rows whose
nucleus reaches past them (very flat distributions) pay for the sort.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask [N, V] logits outside each row's top-k (long [N], V = off) and top-p (float [N], 1 = off)."""
    if top_k is not None:
        logits = _on_rows(logits, top_k < logits.shape[-1], _top_k, top_k)
    if top_p is not None:
        logits = _on_rows(logits, top_p < 1.0, _top_p, top_p)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask [N, V] logits with probability below min_p (float [N], 0 = off) × the row's top probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _on_rows(
    logits: torch.Tensor,
    active: torch.Tensor,
    mask_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    param: torch.Tensor,
) -> torch.Tensor:
    """Apply `mask_fn` only to the rows that use the filter: topk and sorts cost per row."""
    if bool(active.all()):
        return mask_fn(logits, param)
    rows = active.nonzero().squeeze(1)
    if rows.numel() == 0:
        return logits
    result = logits.clone()
    result[rows] = mask_fn(logits[rows], param[rows])
    return result


def _top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    kth_largest = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    num_candidates = min(vocab_size, _TOP_P_CANDIDATES)
    candidate_probs, candidate_ids = probs.topk(num_candidates, dim=-1)
    # float64: over a thousand terms float32 rounding would move the boundary for top_p near 1.
    cumulative = candidate_probs.double().cumsum(dim=-1)
    more_likely = cumulative - candidate_probs.double()
    keep = more_likely < top_p.double().unsqueeze(1)
    keep[:, 0] = True
    drop = torch.ones_like(logits, dtype=torch.bool).scatter_(1, candidate_ids, ~keep)
    result = logits.masked_fill(drop, float("-inf"))
    if num_candidates < vocab_size:
        # The nucleus may reach past the candidates only where the last candidate is still kept.
        beyond = keep[:, -1] & (candidate_probs[:, -1] > 0)
        if bool(beyond.any()):
            rows = beyond.nonzero().squeeze(1)
            result[rows] = _top_p_sorted(logits[rows], top_p[rows])
    return result


def _top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Exact top-p by one ascending sort of the whole vocabulary (transformers' formulation)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
