"""The executor when the model runs in the engine process (the default with one device).

Host side (`step_batch.build_step`): the scheduler's output becomes flat lists and a sampling plan;
device side (`worker.model_runner.ModelRunner`): tensors, the forward passes, sampling. No copies or
encodings in between. Only this executor runs several passes in one step (decode bursts): a worker step
carries one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from conduit_engine.core.scheduler_output import SchedulerOutput
from conduit_engine.executor.draft_steps import propose_with_draft
from conduit_engine.executor.step_batch import (
    SeqStepResult,
    build_step,
    collect_passes,
    collect_results,
    mask_rows,
)
from conduit_engine.kv_transfer.shm_cache import SharedKvCacheFile
from conduit_engine.layers.decoder import KVCache
from conduit_engine.lora.manager import LoraManager
from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import ArchConfig
from conduit_engine.structured.batch_mask import SequenceMasks
from conduit_engine.worker.draft_runner import DraftRunner
from conduit_engine.worker.model_runner import ModelRunner


class InProcessExecutor:
    multi_pass = True

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
        draft: DraftRunner | None = None,
        kv_cache_dtype: str = "auto",
        lora: LoraManager | None = None,
        shared_kv_cache: bool = False,
    ) -> None:
        """`draft`: speculative decoding's draft model (method draft_model), over the same KV blocks.
        `lora`: the adapters (--enable-lora); its pool was allocated before the KV cache was sized.
        `shared_kv_cache`: a host cache in one memfd, for same-host pulls straight out of it."""
        self.model = model
        self.lora = lora
        self.config = config
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.runner = ModelRunner(
            model,
            num_blocks,
            block_size,
            dtype,
            device,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            use_cuda_graphs=use_cuda_graphs,
            kv_cache_dtype=kv_cache_dtype,
            shared_kv_cache=shared_kv_cache,
        )
        self._masks = SequenceMasks(config.vocab_size, device)
        self.draft = draft

    @property
    def kv_caches(self) -> list[KVCache]:
        return self.runner.kv_caches

    @property
    def kv_cache_file(self) -> SharedKvCacheFile | None:
        """The memfd the host cache lives in (shared_kv_cache), else None."""
        return self.runner.kv_cache_file

    def execute(self, out: SchedulerOutput) -> list[SeqStepResult]:
        if self.draft is not None:
            propose_with_draft(out, self.block_size, self.draft.greedy)
        batch, sampling_seqs = build_step(out, self.block_size, self.eos_token_ids)
        lora = None
        if self.lora is not None:
            lora = self.lora.batch([item.seq.lora_name for item in out.scheduled], batch.query_lens)
        if out.num_passes > 1:
            return collect_passes(out, self.runner.run_passes(batch, out.num_passes, lora))
        step = self.runner.run(batch, self._masks.build(mask_rows(out, sampling_seqs)), lora)
        assert step is not None  # the whole model samples
        return collect_results(out, batch, sampling_seqs, step)

    def gather_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        buffer = self.runner.gather_kv_blocks(block_ids)
        return buffer.cpu().view(torch.uint8).numpy().tobytes()

    def gather_kv_blocks_into(self, block_ids: Sequence[int], out: memoryview) -> None:
        self.runner.gather_kv_blocks_into(block_ids, out)

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        first = self.kv_caches[0][0]
        buffer = bytes_to_tensor(data, first.dtype).view(
            len(self.kv_caches), 2, len(block_ids), *first.shape[1:]
        )
        self.runner.scatter_kv_blocks(block_ids, buffer)

    def failure(self) -> str | None:
        return None  # a failing step raises; the model itself cannot vanish

    def on_failure(self, listener: Callable[[], None]) -> None:
        """Nothing to watch: the model lives in this process."""

    def shutdown(self) -> None:
        """Nothing to release: the model lives in this process."""


def bytes_to_tensor(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of `dtype` over `data`: its own memory for a writable memoryview (a shared-memory
    segment: no copy), else over a copy (writable, so no read-only warning)."""
    if isinstance(data, memoryview) and not data.readonly:
        return torch.frombuffer(data, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)
