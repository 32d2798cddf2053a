"""A linear projection through the ops backend, so a backend can run its own GEMM/GEMV kernels.

Its parameters are named and shaped as nn.Linear's (`weight` [out, in], optional `bias` [out]), so
checkpoints load into it unchanged; TorchOps computes it with F.linear, the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from conduit_engine.ops import Ops


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
