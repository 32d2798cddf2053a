"""Loading the whole model into this process (the in-process executor; each worker process loads its shard
through the same `load_model`), and the CPU thread policy. Runs once, when the engine starts."""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path

import torch

from conduit_engine.config import EngineConfig
from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import ArchConfig
from conduit_engine.models.facts import ModelFacts
from conduit_engine.models.loader import DTYPES, load_model
from conduit_engine.models.quantization import QuantizationPlan, plan_quantization
from conduit_engine.ops import get_ops

log = logging.getLogger(__name__)

# Below this many parameters, intra-op threads only contend (measured: up to 10x slower with 2).
_TINY_MODEL_PARAMS = 20_000_000


def load_in_process(config: EngineConfig, facts: ModelFacts) -> CausalLM:
    """The whole model on this process's device, with the CPU thread policy applied."""
    mc = config.model
    torch.manual_seed(mc.seed)
    dtype = DTYPES[facts.dtype]
    quant = plan_quantization(facts.folder, mc.quantization, mc.quantize_lm_head)
    model = _timed_load(
        facts.folder, facts.arch, dtype, mc.device, facts.max_model_len, mc.cpu_kernels, quant
    )
    set_cpu_threads(mc.num_threads, model)
    return model


def _timed_load(
    folder: Path,
    arch: ArchConfig,
    dtype: torch.dtype,
    device: str,
    max_len: int,
    cpu_kernels: str,
    quant: QuantizationPlan,
) -> CausalLM:
    """load_model, then one line: the time it took and the peak memory (device memory on CUDA, the
    process's peak resident memory on the CPU)."""
    started = time.monotonic()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = load_model(folder, arch, get_ops(device, cpu_kernels), dtype, device, max_len, quantization=quant)
    seconds = time.monotonic() - started
    params = sum(p.numel() for p in model.parameters())
    if device == "cuda":
        peak = f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"
    else:  # ru_maxrss is in KiB on Linux
        peak = f"peak process memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    log.info(
        "loaded %s (%.1fM parameters, %s, %s) in %.1f s; %s; runs on %s",
        arch.architecture,
        params / 1e6,
        str(dtype).removeprefix("torch."),
        quant.describe(),
        seconds,
        peak,
        model.describe_ops(),
    )
    return model


def free_device_bytes(device: torch.device) -> int | None:
    """Device memory left after loading (CUDA), for sizing the KV cache; None on the CPU."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def set_cpu_threads(requested: int, model: torch.nn.Module, ranks: int = 1) -> None:
    """Intra-op threads only pay off for matrices big enough; for tiny models they just contend. `ranks`
    processes sharing the CPU (tensor-parallel workers) split its cores between them by default."""
    if requested > 0:
        torch.set_num_threads(requested)
    elif sum(p.numel() for p in model.parameters()) * ranks < _TINY_MODEL_PARAMS:
        torch.set_num_threads(1)
    elif ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


def load_draft_in_process(
    folder: Path, arch: ArchConfig, config: EngineConfig, facts: ModelFacts, beside_workers: bool = False
) -> CausalLM:
    """Speculative decoding's draft model, whole, in the engine process (the target's dtype, device, CPU
    ops and --quantization). `beside_workers`: the target runs in worker processes, and this process's
    threads (one until now: it only scheduled) follow the draft's size; the workers wait while it
    proposes, so a draft big enough for threads gets the cores."""
    mc = config.model
    quant = plan_quantization(folder, mc.quantization, mc.quantize_lm_head)
    model = _timed_load(
        folder, arch, DTYPES[facts.dtype], mc.device, facts.max_model_len, mc.cpu_kernels, quant
    )
    if beside_workers and mc.device == "cpu":
        set_cpu_threads(mc.num_threads, model)
        if mc.num_threads <= 0 and sum(p.numel() for p in model.parameters()) >= _TINY_MODEL_PARAMS:
            torch.set_num_threads(os.cpu_count() or 1)
    return model
