"""Model and KV-cache setup: find the model (local folder or Hub id) and read what the engine needs of it
(`describe`), load it into this process (`load_in_process`), set the CPU thread policy, and size the
paged KV cache from the memory budget. Runs once, when the engine starts; with workers
(parallel/worker_group.py) the workers load the weights and the engine only describes the model."""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from conduit_engine import model_source
from conduit_engine.config import EngineConfig
from conduit_engine.errors import ModelLoadError
from conduit_engine.generation_defaults import GenerationDefaults, read_generation_defaults
from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import ArchConfig
from conduit_engine.models.loader import load_model, resolve_dtype
from conduit_engine.models.registry import read_arch_config
from conduit_engine.ops import get_ops
from conduit_engine.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

# Auto-sized caches hold at most this many full batches of full-length sequences.
_MAX_AUTO_BLOCKS_FACTOR = 2
# Below this many parameters, intra-op threads only contend (measured: up to 10x slower with 2).
_TINY_MODEL_PARAMS = 20_000_000


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the engine learns from the model folder and the flags, without loading any weight."""

    name: str  # served model name
    folder: Path  # the local folder (a Hub id resolved to its snapshot)
    arch: ArchConfig
    tokenizer: ModelTokenizer
    eos_token_ids: tuple[int, ...]
    generation_defaults: GenerationDefaults
    max_model_len: int
    dtype: torch.dtype


def describe(config: EngineConfig) -> ModelFacts:
    """Find the model of `config` and read its config, tokenizer and generation defaults; raises
    ModelLoadError with a clear message."""
    mc = config.model
    source = model_source.resolve(mc.path, mc.revision, mc.download_dir)
    folder = source.folder
    arch = read_arch_config(folder)
    tokenizer = ModelTokenizer(folder)
    defaults = read_generation_defaults(folder, mc.generation_config)
    log.info(
        "generation defaults from %s (--generation-config %s): %s",
        folder.name,
        mc.generation_config,
        defaults.described,
    )
    return ModelFacts(
        name=mc.served_name or source.name,
        folder=folder,
        arch=arch,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(arch, defaults),
        generation_defaults=defaults,
        max_model_len=max_model_len(config, arch),
        dtype=resolve_dtype(mc.dtype, arch, mc.device),
    )


def load_in_process(config: EngineConfig, facts: ModelFacts) -> tuple[CausalLM, int]:
    """The whole model on this process's device, and the number of KV blocks the budget allows."""
    mc = config.model
    torch.manual_seed(mc.seed)
    model = _timed_load(facts.folder, facts.arch, facts.dtype, mc.device, facts.max_model_len)
    set_cpu_threads(mc.num_threads, model)
    per_block = kv_block_bytes(facts.arch, config.cache.block_size, facts.dtype)
    if mc.device == "cuda":
        budget = int(torch.cuda.mem_get_info()[0] * config.cache.memory_fraction)
    else:
        budget = host_kv_budget(config)
    return model, num_kv_blocks(config, facts.max_model_len, budget // per_block)


def _timed_load(folder: Path, arch: ArchConfig, dtype: torch.dtype, device: str, max_len: int) -> CausalLM:
    """load_model, then one line: the time it took and the peak memory (device memory on CUDA, the
    process's peak resident memory on the CPU)."""
    started = time.monotonic()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = load_model(folder, arch, get_ops(device), dtype, device, max_len)
    seconds = time.monotonic() - started
    params = sum(p.numel() for p in model.parameters())
    if device == "cuda":
        peak = f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"
    else:  # ru_maxrss is in KiB on Linux
        peak = f"peak process memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    log.info(
        "loaded %s (%.1fM parameters, %s) in %.1f s; %s",
        arch.architecture,
        params / 1e6,
        str(dtype).removeprefix("torch."),
        seconds,
        peak,
    )
    return model


def eos_token_ids(arch: ArchConfig, defaults: GenerationDefaults) -> tuple[int, ...]:
    """The EOS ids of config.json and generation_config.json that lie within the vocabulary."""
    ids = list(dict.fromkeys((*arch.eos_token_ids, *defaults.eos_token_ids)))
    # An id the model has no logit for can never be sampled; keeping it would only mislead.
    return tuple(i for i in ids if 0 <= i < arch.vocab_size)


def max_model_len(config: EngineConfig, arch: ArchConfig) -> int:
    """The longest prompt + completion: --max-model-len, which may not exceed the model's own limit."""
    limit = arch.context_limit
    requested = config.model.max_model_len
    if requested is None:
        return limit
    if requested > limit:
        raise ModelLoadError(f"--max-model-len {requested} exceeds the model's limit of {limit}")
    return requested


def set_cpu_threads(requested: int, model: torch.nn.Module, ranks: int = 1) -> None:
    """Intra-op threads only pay off for matrices big enough; for tiny models they just contend. `ranks`
    processes sharing the CPU (tensor-parallel workers) split its cores between them by default."""
    if requested > 0:
        torch.set_num_threads(requested)
    elif sum(p.numel() for p in model.parameters()) * ranks < _TINY_MODEL_PARAMS:
        torch.set_num_threads(1)
    elif ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


def kv_block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers (keys and values) of `arch`'s KV heads."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element


def host_kv_budget(config: EngineConfig) -> int:
    """Bytes of host memory the KV cache may take (--kv-cache-memory-fraction of the total)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * config.cache.memory_fraction)


def num_kv_blocks(config: EngineConfig, max_len: int, affordable: int) -> int:
    """--kv-cache-blocks, or the `affordable` blocks of the memory budget, capped so an idle cache is not
    absurdly large (and never below one full-length sequence)."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_seq = (max_len + cache.block_size - 1) // cache.block_size
    cap = _MAX_AUTO_BLOCKS_FACTOR * config.scheduler.max_num_seqs * per_seq
    return max(per_seq, min(affordable, cap))
