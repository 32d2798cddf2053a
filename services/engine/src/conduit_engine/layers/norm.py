"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from conduit_engine.ops import Ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (normed, residual for the next block)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
