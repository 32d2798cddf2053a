"""The LoRA delta on the CUDA kernels (kernels/lora.cu): one shrink launch and one expand launch per
projection whatever the adapters of the step, each row reading its own slot's matrices (punica's BGMV)."""

from __future__ import annotations

import math

import numpy as np
import torch

from conduit_engine.ops import kernel_loader as kl
from conduit_engine.ops.base import LoraBatch, LoraWeights
from conduit_engine.ops.cuda_checks import check
from conduit_engine.ops.kernel_loader import KernelLauncher

SHRINK_WARPS = 8  # h elements per shrink block (one warp each)
EXPAND_THREADS = 256


def check_lora_args(y: torch.Tensor, x: torch.Tensor, w: LoraWeights, batch: LoraBatch) -> None:
    slots, num_slices, rank, k = w.a.shape
    n = w.b.shape[2]
    check(w.a.is_contiguous() and w.b.is_contiguous(), "lora pool: a and b must be contiguous")
    check(
        tuple(w.b.shape) == (slots, num_slices * rank, n)
        and sum(w.splits) == n
        and len(w.splits) == num_slices <= 3,
        f"lora pool: b {tuple(w.b.shape)} and splits {w.splits} do not fit a {tuple(w.a.shape)}",
    )
    check(
        x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1,
        f"x: expected [T, {k}] with unit inner stride, got {tuple(x.shape)}",
    )
    check(
        y.dim() == 2 and tuple(y.shape) == (x.shape[0], n) and y.stride(1) == 1,
        f"y: expected [{x.shape[0]}, {n}] with unit inner stride, got {tuple(y.shape)}",
    )
    check(x.dtype == y.dtype == w.a.dtype == w.b.dtype, "x, y and the lora pool must share a dtype")
    rows = batch.row_slots
    check(
        rows.dtype == torch.int32 and rows.is_contiguous() and tuple(rows.shape) == (x.shape[0],),
        f"row_slots: expected a contiguous int32 [{x.shape[0]}], got {rows.dtype} {tuple(rows.shape)}",
    )


def lora_delta(
    launcher: KernelLauncher, y: torch.Tensor, x: torch.Tensor, w: LoraWeights, batch: LoraBatch
) -> None:
    """y += each row's delta (Ops.lora_delta), in place."""
    num_slices, rank, k = w.a.shape[1:]
    tokens, n = y.shape
    sr = num_slices * rank
    if tokens == 0:
        return
    h = torch.empty((tokens, sr), dtype=torch.float32, device=x.device)
    launcher.launch(
        kl.lora_shrink_kernel(x.dtype),
        (tokens, math.ceil(sr / SHRINK_WARPS), 1),
        (32 * SHRINK_WARPS, 1, 1),
        [h, x, w.a, batch.row_slots, np.int32(k), np.int32(sr), np.int64(x.stride(0))],
    )
    split1 = w.splits[0] if num_slices > 1 else n
    split2 = w.splits[0] + w.splits[1] if num_slices > 2 else n
    threads = min(EXPAND_THREADS, max(32, 32 * math.ceil(n / 32)))
    launcher.launch(
        kl.lora_expand_kernel(x.dtype),
        (tokens, math.ceil(n / threads), 1),
        (threads, 1, 1),
        [
            y,
            h,
            w.b,
            batch.row_slots,
            np.int32(n),
            np.int32(rank),
            np.int32(sr),
            np.int32(split1),
            np.int32(split2),
            np.int64(y.stride(0)),
        ],
    )
