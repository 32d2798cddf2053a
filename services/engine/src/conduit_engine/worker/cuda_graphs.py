"""CUDA graphs for decode steps: which batch sizes to capture, padding a decode batch up to the next
captured size, the static input buffers a graph reads, and the runner that captures and replays.

A captured graph replays fixed kernel launches on fixed addresses, so every input of a decode step is
copied into static buffers first, and the batch is padded: padded rows get slot -1 (write_kv skips
them), context length 1 and block table row 0, so they attend to one harmless cache entry and their
outputs are dropped. The host copy of the context lengths in the captured metadata is the longest
allowed context, so the split-K attention grid covers any real step; partitions past a sequence's end
exit at once. `--enforce-eager` turns all of this off (the model runner then never builds a runner).
Only `CudaGraphRunner.capture`/`run` need a GPU; everything else runs on any device.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from conduit_engine.ops.base import AttentionMetadata

# model(input_ids [T] int64, positions [T] int64, kv_caches, meta) -> hidden [T, H]
DecodeModel = Callable[
    [torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], AttentionMetadata], torch.Tensor
]


def capture_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to max_num_seqs, and max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= num_seqs, or None when the batch is larger than every graph."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs: must be >= 1, got {num_seqs}")
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class StaticDecodeInputs:
    """Fixed-address input buffers for decode graphs, sized for the largest captured batch."""

    def __init__(
        self,
        max_batch: int,
        max_blocks_per_seq: int,
        max_context_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if max_batch < 1 or max_blocks_per_seq < 1 or max_context_len < 1:
            raise ValueError(
                f"max_batch, max_blocks_per_seq, max_context_len: must be >= 1, got "
                f"{max_batch}, {max_blocks_per_seq}, {max_context_len}"
            )
        self.max_batch = max_batch
        self.max_context_len = max_context_len
        self.block_size = block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Decode: sequence i owns token i.
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)

    def metadata(self, batch: int) -> AttentionMetadata:
        """The metadata a graph of `batch` rows is captured with (views of the static buffers)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            query_lens_cpu=(1,) * batch,
            seq_lens_cpu=(self.max_context_len,) * batch,  # sizes the attention grid for any real step
            block_size=self.block_size,
        )

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, batch: int
    ) -> None:
        """Copy one decode step of meta.num_seqs rows into the buffers and pad rows up to `batch`."""
        n = meta.num_seqs
        if not meta.is_decode_only or input_ids.shape != (n,) or positions.shape != (n,):
            raise ValueError(f"not a decode step of {n} sequences: query lens {meta.query_lens_cpu}")
        if not n <= batch <= self.max_batch:
            raise ValueError(f"batch: {batch} must be within [{n}, {self.max_batch}]")
        if meta.max_seq_len > self.max_context_len:
            raise ValueError(f"meta: context of {meta.max_seq_len} tokens exceeds {self.max_context_len}")
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"meta.block_tables: {width} columns exceed {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:n, width:].zero_()
        # Padding rows: no cache write, one token of context in block 0.
        self.input_ids[n:batch].zero_()
        self.positions[n:batch].zero_()
        self.slot_mapping[n:batch].fill_(-1)
        self.seq_lens[n:batch].fill_(1)
        self.block_tables[n:batch].zero_()


class CudaGraphRunner:
    """Captures `model` for each batch size in `sizes` and replays the smallest graph that fits a step."""

    def __init__(
        self,
        model: DecodeModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: Sequence[int],
        inputs: StaticDecodeInputs,
    ) -> None:
        if not sizes or max(sizes) > inputs.max_batch:
            raise ValueError(f"sizes: {tuple(sizes)} must be non-empty and <= {inputs.max_batch}")
        self.sizes = tuple(sorted(sizes))
        self._model = model
        self._kv_caches = kv_caches
        self._inputs = inputs
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool. GPU only."""
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):
            meta = self._inputs.metadata(batch)
            ids, pos = self._inputs.input_ids[:batch], self._inputs.positions[:batch]
            # One eager run first: compiles the kernels (NVRTC) and settles lazy allocations outside capture.
            self._model(ids, pos, self._kv_caches, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[batch] = self._model(ids, pos, self._kv_caches, meta)
            self._graphs[batch] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            bool(self._graphs)
            and meta.is_decode_only
            and padded_batch_size(meta.num_seqs, self.sizes) is not None
            and meta.max_seq_len <= self._inputs.max_context_len
            and meta.block_tables.shape[1] <= self._inputs.block_tables.shape[1]
        )

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs, H] of a decode step, replayed from the graph of the padded size.

        The result is a view of the graph's output buffer: consume it (e.g. index_select) before the
        next replay overwrites it."""
        batch = padded_batch_size(meta.num_seqs, self.sizes)
        if batch is None or batch not in self._graphs:
            raise RuntimeError(f"no captured graph fits a decode batch of {meta.num_seqs}")
        self._inputs.load(input_ids, positions, meta, batch)
        self._graphs[batch].replay()
        return self._outputs[batch][: meta.num_seqs]
