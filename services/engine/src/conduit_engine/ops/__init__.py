"""Ops backends: one interface (`Ops`), chosen once at start-up by device name, imported lazily."""

from __future__ import annotations

from conduit_engine.ops.base import (
    AttentionMetadata,
    DecoderLayerSpec,
    DecoderRunner,
    LoraBatch,
    LoraWeights,
    Ops,
    StepContext,
)

__all__ = [
    "AttentionMetadata",
    "DecoderLayerSpec",
    "DecoderRunner",
    "LoraBatch",
    "LoraWeights",
    "Ops",
    "StepContext",
    "get_ops",
]


def get_ops(device: str, cpu_kernels: str = "auto") -> Ops:
    """Return the ops backend for `device`: on "cpu" the kernels of kernels/cpu or the torch reference
    ops, as `cpu_kernels` (--cpu-kernels) says (see cpu_ops.select_cpu_ops); on "cuda" CuPy raw kernels."""
    if device == "cpu":
        from conduit_engine.ops.cpu_ops import select_cpu_ops

        return select_cpu_ops(cpu_kernels)
    if device == "cuda":
        # Imported only here: a CPU install never imports CuPy.
        from conduit_engine.ops.cuda_ops import CudaOps

        # The engine's model code fixes every activation's layout; weights, caches and each step's
        # inputs are still checked (at load, allocation and begin_step).
        return CudaOps(check_calls=False)
    raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")
