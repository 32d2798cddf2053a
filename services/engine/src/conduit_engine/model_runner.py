"""The runner the engine steps when the model runs in the engine process (the default with one device).

Host side (`step_batch.build_step`): the scheduler's output becomes flat lists and a sampling plan;
device side (`ModelExecutor`): tensors, the forward pass, sampling. No copies or encodings in between.
The worker-backed runner (parallel/worker_runner.py) has the same interface: `execute`, the KV-block
transfer (`gather_kv_blocks` / `scatter_kv_blocks`, payloads in the full layout of ops/base.py) and
`shutdown`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from conduit_engine.layers.decoder import KVCache
from conduit_engine.model_executor import ModelExecutor
from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import ArchConfig
from conduit_engine.scheduler import SchedulerOutput
from conduit_engine.step_batch import SeqStepResult, build_step, collect_results
from conduit_engine.structured.batch_mask import SequenceMasks

__all__ = ["ModelRunner", "Runner", "SeqStepResult"]


class Runner(Protocol):
    """What the engine needs of a runner, in process or backed by workers."""

    def execute(self, out: SchedulerOutput) -> list[SeqStepResult]:
        """Run one step; one result per scheduled sequence, in schedule order."""
        ...

    def gather_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        """KV of cache blocks `block_ids` (in that order) as one payload: little-endian, laid out
        [layer][k, v][block][block_size][num_kv_heads][head_dim] over all of the model's KV heads."""
        ...

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: bytes) -> None:
        """Write a payload of that layout into cache blocks `block_ids` (distinct)."""
        ...

    def failure(self) -> str | None:
        """Why the runner cannot run steps any more (a worker failed), or None."""
        ...

    def on_failure(self, listener: Callable[[], None]) -> None:
        """Call `listener` (from any thread) when the runner fails."""
        ...

    def shutdown(self) -> None:
        """Release the runner's processes, if any (idempotent)."""
        ...


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        config: ArchConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        eos_token_ids: tuple[int, ...],
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        use_cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.executor = ModelExecutor(
            model,
            num_blocks,
            block_size,
            dtype,
            device,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            use_cuda_graphs=use_cuda_graphs,
        )
        self._masks = SequenceMasks(config.vocab_size, device)

    @property
    def kv_caches(self) -> list[KVCache]:
        return self.executor.kv_caches

    def execute(self, out: SchedulerOutput) -> list[SeqStepResult]:
        batch, sampling_seqs = build_step(out, self.block_size, self.eos_token_ids)
        step = self.executor.run(batch, self._masks.build(sampling_seqs))
        assert step is not None  # the whole model samples
        return collect_results(out, batch, sampling_seqs, step)

    def execute_burst(self, out: SchedulerOutput, passes: int) -> list[list[int]]:
        """Run a decode burst (decode_bursts.py) of `passes` forward passes; each scheduled sequence's
        tokens, in schedule order. Only this in-process runner runs bursts: a worker step carries one."""
        batch, _ = build_step(out, self.block_size, self.eos_token_ids)
        tokens = self.executor.run_burst(batch, passes)
        return [list(row) for row in zip(*tokens, strict=True)]

    def gather_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        buffer = self.executor.gather_kv_blocks(block_ids)
        return buffer.cpu().view(torch.uint8).numpy().tobytes()

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: bytes) -> None:
        first = self.kv_caches[0][0]
        buffer = bytes_to_tensor(data, first.dtype).view(
            len(self.kv_caches), 2, len(block_ids), *first.shape[1:]
        )
        self.executor.scatter_kv_blocks(block_ids, buffer)

    def failure(self) -> str | None:
        return None  # a failing step raises; the model itself cannot vanish

    def on_failure(self, listener: Callable[[], None]) -> None:
        """Nothing to watch: the model lives in this process."""

    def shutdown(self) -> None:
        """Nothing to release: the model lives in this process."""


def bytes_to_tensor(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of `dtype` over a copy of `data` (writable, so no read-only warning)."""
    return torch.frombuffer(bytearray(data), dtype=dtype)
