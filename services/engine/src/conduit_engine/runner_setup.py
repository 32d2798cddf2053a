"""Which runner the engine steps: the model in this process (the default with one rank), or in worker
processes (--tensor-parallel-size N > 1, or --worker-process), and how many KV blocks it has."""

from __future__ import annotations

import torch

from conduit_engine import model_setup
from conduit_engine.config import EngineConfig
from conduit_engine.model_runner import ModelRunner, Runner
from conduit_engine.model_setup import ModelFacts
from conduit_engine.parallel.sharding import check_tensor_parallel
from conduit_engine.parallel.worker_group import WorkerGroup
from conduit_engine.parallel.worker_runner import WorkerRunner, check_devices, start_workers


def build_runner(
    config: EngineConfig, facts: ModelFacts, workers: WorkerGroup | None = None
) -> tuple[Runner, int]:
    """(runner, KV blocks). `workers`: processes spawned earlier (before gRPC started); spawned here when
    None and the configuration needs them. Raises ModelLoadError; no worker survives a failed start."""
    if not config.parallel.uses_workers:
        model, num_blocks = model_setup.load_in_process(config, facts)
        runner = ModelRunner(
            model,
            facts.arch,
            num_blocks,
            config.cache.block_size,
            facts.dtype,
            config.model.device,
            facts.eos_token_ids,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=facts.max_model_len,
            use_cuda_graphs=not config.enforce_eager,
        )
        return runner, num_blocks
    try:
        check_tensor_parallel(facts.arch, config.parallel.tensor_parallel_size)
        check_devices(config)
        if workers is None:
            workers = WorkerGroup(config.parallel.tensor_parallel_size)
        num_blocks = start_workers(workers, config, facts)
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    torch.set_num_threads(1)  # this process only schedules, detokenizes and encodes steps
    return WorkerRunner(
        workers, config.cache.block_size, facts.eos_token_ids, facts.arch.vocab_size
    ), num_blocks
