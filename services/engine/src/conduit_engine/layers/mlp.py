"""Gated feed-forward (SwiGLU, or GeGLU with the tanh GELU) with a fused gate|up projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from conduit_engine.layers.linear import Linear, RowParallelLinear
from conduit_engine.models.config import ArchConfig
from conduit_engine.ops import Ops, StepContext

if TYPE_CHECKING:
    from conduit_engine.layers.collectives import Communicator


class GatedMLP(nn.Module):
    """`config.intermediate_size` is this rank's slice; with a communicator down_proj sums the ranks'."""

    def __init__(self, config: ArchConfig, ops: Ops, comm: Communicator | None = None) -> None:
        super().__init__()
        self.gelu = config.hidden_act == "gelu_tanh"
        self.act_and_mul = ops.gelu_tanh_and_mul if self.gelu else ops.silu_and_mul
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, ops)
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, config.mlp_bias, ops, comm
        )

    def forward(self, x: torch.Tensor, step: StepContext | None = None) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x, step)), step)
