"""The row-parallel projection (o_proj, down_proj): each rank multiplies its slice of the input
features, an all-reduce sums the partial outputs, then the bias is added once.

Without a communicator (the model runs whole) it is exactly nn.Linear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from conduit_engine.parallel.comm import Communicator


class RowParallelLinear(nn.Linear):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, comm: Communicator | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x, self.weight)
        self.comm.all_reduce(out)
        if self.bias is not None:
            out += self.bias
        return out
