"""CPU ops backend on the kernels of kernels/cpu (AVX-512 with or without BF16, AVX2, or portable C++),
and the start-up choice between it and the torch reference (`select_cpu_ops`).

`CpuOps` is `TorchOps` with the step's hot ops replaced: linear for small batches (GEMV/GEMM tiles that
stream the weights once), RMSNorm with and without the residual add, rotary, the gated activations,
KV-cache writes, and paged attention that reads the KV blocks in place (decode and prefill chunks,
sliding windows, soft-capping). Linear for large batches (prefill), KV transfer and grammar masking stay
TorchOps'. Every kernel is checked against TorchOps in tests/kernels/test_cpu_ops.py, on every
instruction set the machine runs.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from conduit_engine.config import CPU_KERNEL_CHOICES
from conduit_engine.errors import ModelLoadError
from conduit_engine.ops import cpu_kernels
from conduit_engine.ops.base import Ops, StepContext
from conduit_engine.ops.torch_ops import TorchOps

log = logging.getLogger(__name__)

# Most rows of x for which the kernels' linear beats torch's (oneDNN/MKL), measured on AVX-512 (Zen 5):
# float32 tiles stay ahead up to 64 rows; oneDNN's bfloat16 GEMM (packed weights) wins from a few rows.
_LINEAR_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 4}


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self, isa: str, kernels: ModuleType | None = None) -> None:
        module = kernels if kernels is not None else cpu_kernels.load()
        supported = tuple(module.supported_isas())
        if isa not in supported:
            raise ValueError(f"this CPU cannot run the {isa} kernels (it runs: {', '.join(supported)})")
        self.isa = isa
        self._k = getattr(module, isa)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= _LINEAR_MAX_ROWS.get(x.dtype, 0):
            return self._k.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # per-head q/k norms: [T, H, D]
        return self._k.rms_norm(rows, weight, eps).view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, step: StepContext) -> None:
        self._k.rotary(q, k, step.positions, step.cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.gelu_tanh_and_mul(x)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._k.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        meta = step.meta
        return self._k.attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            sliding_window or 0,
            logit_softcap or 0.0,
        )


def select_cpu_ops(choice: str) -> Ops:
    """The ops of `--cpu-kernels`: auto (the best instruction set this CPU runs, else the torch ops
    with a log line saying why), torch (the reference), or one instruction set (an error if it cannot
    run here)."""
    if choice not in CPU_KERNEL_CHOICES:
        raise ModelLoadError(f"--cpu-kernels must be one of {', '.join(CPU_KERNEL_CHOICES)}, got {choice!r}")
    if choice == "torch":
        log.info("CPU ops: torch (--cpu-kernels torch)")
        return TorchOps()
    try:
        isas = cpu_kernels.supported_isas()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        if choice != "auto":
            raise ModelLoadError(f"--cpu-kernels {choice}: {exc}") from exc
        log.warning("CPU ops: torch, because the CPU kernels are unavailable: %s", exc)
        return TorchOps()
    isa = isas[0] if choice == "auto" else choice
    if isa not in isas:
        raise ModelLoadError(f"--cpu-kernels {choice}: this CPU runs only {', '.join(isas)}")
    log.info("CPU ops: kernels/cpu for %s (this CPU runs %s)", isa, ", ".join(isas))
    return CpuOps(isa)
