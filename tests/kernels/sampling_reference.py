"""Torch reference of the sampling algorithm in kernels/sampling.cu, step for step (for the tests).

Thresholds are found by sorting instead of a binary search, and sums run in float64 in a different
order than the kernel's tree reductions; the kept sets agree exactly unless a value sits within an
ulp of a threshold, which random test data does not hit.
"""

from __future__ import annotations

import torch


def order_key(z: torch.Tensor) -> torch.Tensor:
    """The kernel's order-preserving float32 -> uint32 map, as int64."""
    bits = z.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    negative = bits >= 0x80000000
    return torch.where(negative, (~bits) & 0xFFFFFFFF, bits | 0x80000000)


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    for r in range(rows):
        x = logits[r]
        temp = float(temperature[r])
        if not temp > 0:
            out[r] = int(torch.nonzero(x == x[~x.isnan()].max())[0, 0])
            continue
        z = x / temperature[r]  # float32 division, as in the kernel
        valid = ~z.isnan()
        z_max = z[valid].max()
        keys = order_key(z)
        kept = valid.clone()
        k = int(top_k[r])
        if 0 < k < vocab:
            kth = torch.sort(keys[valid], descending=True).values[k - 1]
            kept &= keys >= kth
        if float(min_p[r]) > 0:
            kept &= (z - z_max) >= torch.log(min_p[r])
        p = torch.exp(z - z_max).double()
        p = torch.where(kept, p, torch.zeros_like(p))
        tp = float(top_p[r])
        if 0 < tp < 1:
            total = p.sum()
            order = torch.argsort(keys.masked_fill(~kept, -1), descending=True, stable=True)
            sorted_keys = keys[order]
            mass = torch.cumsum(p[order], 0)
            # Mass at or above each distinct key: ties share the mass of the whole tie group.
            last_at_or_above = (sorted_keys.unsqueeze(0) >= sorted_keys.unsqueeze(1)).sum(1) - 1
            at_or_above = mass[last_at_or_above]
            ok = (at_or_above >= tp * total) & kept[order]
            threshold = sorted_keys[ok].max()
            kept &= keys >= threshold
            p = torch.where(kept, p, torch.zeros_like(p))
        running = torch.cumsum(p, 0)
        target = float(uniform[r]) * float(running[-1])
        hits = torch.nonzero((running > target) & kept)
        out[r] = int(hits[0, 0]) if len(hits) else int(torch.nonzero(kept)[-1, 0])
    return out
