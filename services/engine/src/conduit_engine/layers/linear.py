"""Linear projections through the ops backend, so a backend can run its own GEMM/GEMV kernels (the CPU
kernels prepack every weight once loading finishes: `Ops.prepare_linear`).

`Linear` is the plain projection, and the column-parallel one (qkv_proj, gate_up_proj): a sharded model
builds it with this rank's output features, so it needs no communication. `RowParallelLinear` (o_proj,
down_proj): each rank multiplies its slice of the input features, an all-reduce sums the partial outputs,
then the bias is added once; without a communicator (the model runs whole) it is exactly `Linear`.

With LoRA enabled (`lora`, set by lora/pool.py), a step whose rows name adapters adds each row's delta
after the base projection (`Ops.lora_delta`), whatever the base weight's format; a row-parallel layer adds
its rank's partial delta before the all-reduce (the delta is linear in the input's slices).

Parameters are named and shaped as nn.Linear's (`weight` [out, in], optional `bias` [out]), so
checkpoints load into them unchanged; TorchOps computes them with F.linear, the reference.

Quantized (`--quantization int8`, or an int8 checkpoint), `weight` is int8 [out, in] and `weight_scale`
float32 [out] (`quantize`); the layer hands both to the ops, which alone know how to multiply them
(ops/quant.py), and the output is in the input's dtype either way, so whatever runs after a projection
(an all-reduce, a bias, an adapter's delta) never sees the weight's format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from conduit_engine.ops import LoraWeights, Ops, StepContext

if TYPE_CHECKING:
    from conduit_engine.layers.collectives import Communicator


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
        self.register_parameter("weight_scale", None)
        self.lora: LoraWeights | None = None  # this layer's adapter pool, with LoRA enabled

    @property
    def quantized(self) -> bool:
        return self.weight_scale is not None

    def quantize(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold int8 `weight` [out, in] with per-output-channel float32 `scale` [out] instead."""
        if weight.dtype != torch.int8 or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"int8 weight [{self.out_features}, {self.in_features}] expected")
        self._parameters["weight"] = nn.Parameter(weight.contiguous(), requires_grad=False)
        scale = scale.to(device=weight.device, dtype=torch.float32).reshape(-1).contiguous()
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor, step: StepContext | None = None) -> torch.Tensor:
        out = self.ops.linear(x, self.weight, self.bias, self.weight_scale)
        self._add_lora(out, x, step)
        return out

    def _add_lora(self, out: torch.Tensor, x: torch.Tensor, step: StepContext | None) -> None:
        if step is not None and step.lora is not None and self.lora is not None:
            self.ops.lora_delta(out, x, self.lora, step.lora)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
            + (", int8" if self.quantized else "")
        )


class RowParallelLinear(Linear):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, ops: Ops, comm: Communicator | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias, ops)
        self.comm = comm

    def forward(self, x: torch.Tensor, step: StepContext | None = None) -> torch.Tensor:
        if self.comm is None:
            return super().forward(x, step)
        out = self.ops.linear(x, self.weight, None, self.weight_scale)
        self._add_lora(out, x, step)
        self.comm.all_reduce(out)
        if self.bias is not None:
            out += self.bias
        return out
