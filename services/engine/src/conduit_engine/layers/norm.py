"""RMSNorm with an optional fused residual add, and Gemma's `(1 + weight)` form as a weight offset."""

from __future__ import annotations

import torch
from torch import nn

from conduit_engine.ops import Ops


class RMSNorm(nn.Module):
    """`offset` is added to the checkpoint's weight once, when loading finishes (`fold_offset`), so the
    ops always compute x / rms(x) * weight."""

    def __init__(self, hidden_size: int, eps: float, ops: Ops, offset: float = 0.0) -> None:
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def fold_offset(self) -> None:
        if self.offset:
            with torch.no_grad():
                # In float32, then rounded once, as Gemma computes (1.0 + weight.float()).
                self.weight.data = (self.weight.float() + self.offset).to(self.weight.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (normed, residual for the next block)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise without a residual stream (per-head q/k norms, Gemma 2's post-norms)."""
        return self.ops.rms_norm(x, self.weight, self.eps)
