"""Which executor the engine steps: the model in this process (the default with one rank), or in worker
processes (--tensor-parallel-size N > 1, or --worker-process), and how many KV blocks it has.

Each configuration imports only its own executor (and so torch and the model code only here, when the
engine is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conduit_engine.config import EngineConfig
from conduit_engine.executor.base import Executor
from conduit_engine.models.facts import ModelFacts

if TYPE_CHECKING:
    from pathlib import Path

    from conduit_engine.executor.worker_group import WorkerGroup
    from conduit_engine.lora.manager import LoraManager
    from conduit_engine.models.base import CausalLM
    from conduit_engine.models.config import ArchConfig
    from conduit_engine.worker.draft_runner import DraftRunner


def build_executor(
    config: EngineConfig, facts: ModelFacts, workers: WorkerGroup | None = None
) -> tuple[Executor, int]:
    """(executor, KV blocks). `workers`: processes spawned earlier (before gRPC started); spawned here
    when None and the configuration needs them. Raises ModelLoadError; no worker survives a failed start."""
    if not config.parallel.uses_workers:
        return _in_process(config, facts)
    from conduit_engine.executor.multiproc import start_multiproc

    try:
        checked = _check_draft(config, facts)  # before the target loads: a draft that cannot serve fails fast
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    executor, num_blocks = start_multiproc(config, facts, workers)
    try:
        executor.draft = _draft(config, facts, num_blocks, checked, beside_workers=True)
    except BaseException:
        executor.shutdown()
        raise
    return executor, num_blocks


def _in_process(config: EngineConfig, facts: ModelFacts) -> tuple[Executor, int]:
    from conduit_engine.executor.in_process import InProcessExecutor
    from conduit_engine.models.loader import DTYPES
    from conduit_engine.worker.kv_cache import size_kv_cache
    from conduit_engine.worker.loading import free_device_bytes, load_in_process

    model = load_in_process(config, facts)
    lora = _lora_manager(config, model) if config.lora.enable_lora else None
    free = free_device_bytes(next(model.parameters()).device)
    num_blocks = size_kv_cache(config, facts, facts.arch, 1, [free])
    executor = InProcessExecutor(
        model,
        facts.arch,
        num_blocks,
        config.cache.block_size,
        DTYPES[facts.dtype],
        config.model.device,
        facts.eos_token_ids,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=facts.max_model_len,
        use_cuda_graphs=not config.enforce_eager,
        draft=_draft(config, facts, num_blocks),
        kv_cache_dtype=config.cache.kv_cache_dtype,
        lora=lora,
        shared_kv_cache=config.disaggregation.kv_transport == "shm",
    )
    return executor, num_blocks


def _check_draft(config: EngineConfig, facts: ModelFacts) -> tuple[Path, ArchConfig] | None:
    """The draft's folder and architecture once checked against the target (ModelLoadError naming the
    field if it cannot propose for it), or None without method draft_model."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return None
    from conduit_engine.models.draft import check_draft

    return check_draft(spec.model, facts, config.model.revision, config.model.download_dir)


def _draft(
    config: EngineConfig,
    facts: ModelFacts,
    num_blocks: int,
    checked: tuple[Path, ArchConfig] | None = None,
    beside_workers: bool = False,
) -> DraftRunner | None:
    """Speculative decoding's draft model (method draft_model), checked against the target, or None.

    It always runs whole in the engine process, also when the target runs in worker processes
    (`beside_workers`): its k passes per step then cost no pipe round trips and no collectives, and its
    proposals reach the workers inside the one STEP frame of the verification (README: *Workers and
    tensor parallelism*). `checked`: what `_check_draft` returned, when it ran already."""
    if checked is None:
        checked = _check_draft(config, facts)
    if checked is None:
        return None
    from conduit_engine.models.loader import DTYPES
    from conduit_engine.worker.draft_runner import DraftRunner
    from conduit_engine.worker.loading import load_draft_in_process

    folder, arch = checked
    model = load_draft_in_process(folder, arch, config, facts, beside_workers)
    dtype = DTYPES[facts.dtype]
    return DraftRunner(model, num_blocks, config.cache.block_size, dtype, config.model.device)


def _lora_manager(config: EngineConfig, model: CausalLM) -> LoraManager:
    """The adapter pool (allocated before the KV cache is sized) with --lora-modules loaded."""
    import logging

    from conduit_engine.errors import InvalidRequestError, ModelLoadError
    from conduit_engine.lora.manager import LoraManager

    lc = config.lora
    manager = LoraManager.in_process(
        model, lc.max_loras, lc.cpu_loras, lc.max_lora_rank, config.model.download_dir
    )
    logging.getLogger(__name__).info(
        "LoRA: %d slots of rank %d (%.1f MiB), %d adapters kept in memory",
        lc.max_loras,
        lc.max_lora_rank,
        manager.pool_bytes / 2**20,
        lc.cpu_loras,
    )
    for name, path in lc.lora_modules:
        try:
            manager.load(name, path)
        except InvalidRequestError as exc:
            raise ModelLoadError(f"--lora-modules {name}={path}: {exc}") from exc
    return manager
