"""Runs steps on one model, or on one tensor-parallel rank's shard of it: StepBatch → tensors → forward →
logits → grammar mask → sample.

Owns the model (shard), this rank's KV cache, its CUDA graphs and the sampler. The in-process executor and
every worker process use it the same way. Sharded, every rank runs the forward pass and the logits
(collectives inside), and only rank 0 (`samples`) masks, samples and answers; the other ranks return
None. Sampling reads only the step's SamplingPlan, so rank 0 needs no request objects, and seeded rows
draw the uniforms the engine computed (batch-independent, whichever process samples).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from conduit_engine.kv_transfer.shm_cache import SharedKvCacheFile
from conduit_engine.layers.decoder import KVCache
from conduit_engine.lora.manager import lora_batch
from conduit_engine.models.base import CausalLM
from conduit_engine.ops import AttentionMetadata, LoraBatch
from conduit_engine.ops.kv_quant import cache_layout
from conduit_engine.sampling.grammar_mask import StepBitmask, apply_grammar_mask
from conduit_engine.sampling.logprobs import compute_prompt_logprobs
from conduit_engine.sampling.metadata import metadata_from_plan
from conduit_engine.sampling.sampler import Sampler
from conduit_engine.sampling.token_logprobs import TokenLogprobs
from conduit_engine.worker.kv_cache import allocate_kv_caches, populate_in_background, shared_kv_cache_file
from conduit_engine.worker.step_inputs import PromptSpan, StepBatch, StepOutput


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        *,
        samples: bool = True,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        use_cuda_graphs: bool = False,
        kv_cache_dtype: str = "auto",
        shared_kv_cache: bool = False,
    ) -> None:
        """`shared_kv_cache`: on the host, the KV cache lives in one memfd (`kv_cache_file`) that same-host
        KV pullers copy from (--kv-transport shm); elsewhere it is ignored."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.samples = samples  # whether this rank masks, samples and answers (rank 0)
        local = model.local_config
        cache_dtype, row = cache_layout(kv_cache_dtype, dtype, local.head_dim)
        shape = (num_blocks, block_size, local.num_kv_heads, row)
        self.kv_cache_file: SharedKvCacheFile | None = None
        if shared_kv_cache and self.device.type == "cpu":
            self.kv_cache_file = shared_kv_cache_file(local.num_layers, shape, cache_dtype)
        self.kv_caches: list[KVCache] = allocate_kv_caches(
            local.num_layers, shape, cache_dtype, self.device, self.kv_cache_file
        )
        populate_in_background(self.kv_caches)
        for k_cache, v_cache in self.kv_caches:
            model.ops.check_kv_cache(k_cache, v_cache)
        self.sampler = Sampler()
        self.graphs = None
        if use_cuda_graphs and self.device.type == "cuda":
            self._capture_cuda_graphs(max_num_seqs, max_model_len)

    def _capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode steps for a set of batch sizes (CUDA only; `--enforce-eager` skips this)."""
        from conduit_engine.worker.cuda_graphs import CudaGraphRunner, StaticDecodeInputs, capture_batch_sizes

        sizes = capture_batch_sizes(max_num_seqs)
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        inputs = StaticDecodeInputs(max(sizes), max_blocks, max_model_len, self.block_size, self.device)
        self.graphs = CudaGraphRunner(self.model, self.kv_caches, sizes, inputs)
        self.graphs.capture()

    # ----- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, batch: StepBatch, bitmask: StepBitmask | None = None, lora: LoraBatch | None = None
    ) -> StepOutput | None:
        """The step's sampled tokens and logprobs (rank 0), or None (the other ranks). `lora`: the rows
        that run an adapter (lora/manager.py), None when all run the base model; or, from a worker's
        step, `batch.lora_slots`."""
        if lora is None and batch.lora_slots:
            lora = lora_batch(batch.lora_slots, batch.query_lens, self.device)
        input_ids, positions, meta = self._tensors(batch)
        hidden = self._forward(input_ids, positions, meta, lora)
        prompt = [self._prompt_logprobs(hidden, span) for span in batch.prompt_spans]
        if batch.sampling is None:
            return StepOutput([], [], prompt) if self.samples else None
        rows = torch.as_tensor(batch.logits_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        if logits is None:
            return None
        apply_grammar_mask(logits, bitmask, self.model.ops)
        sampled = self.sampler(logits, metadata_from_plan(batch.sampling, logits.shape[-1], logits.device))
        return StepOutput(sampled.token_ids, sampled.logprobs, prompt)

    @torch.inference_mode()
    def run_passes(self, batch: StepBatch, passes: int, lora: LoraBatch | None = None) -> list[list[int]]:
        """A decode burst (core/decode_bursts.py): `passes` forward passes, each fed the tokens the one before
        sampled; the tokens of each pass, in logits-row order. Every row decodes one token and samples
        without history, so the step's sampling plan holds for every pass; the block tables already
        hold the slots of all passes. Only the whole model (rank 0 of one) runs bursts."""
        assert batch.sampling is not None and len(batch.logits_rows) == batch.num_seqs
        input_ids, positions, meta = self._tensors(batch)
        sampling = None
        rows = torch.arange(batch.num_seqs, device=self.device)
        tokens: list[list[int]] = []
        for i in range(passes):
            if i:
                input_ids = torch.as_tensor(tokens[-1], dtype=torch.int64, device=self.device)
                positions = positions + 1
                meta = _advanced(meta, positions, rows)
            logits = self.model.compute_logits(self._forward(input_ids, positions, meta, lora))
            assert logits is not None
            if sampling is None:
                sampling = metadata_from_plan(batch.sampling, logits.shape[-1], logits.device)
            tokens.append(self.sampler(logits, sampling).token_ids)
        return tokens

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """The final hidden states: a captured CUDA graph where one fits the batch (and no row runs an
        adapter), else the model."""
        if lora is None and self.graphs is not None and self.graphs.can_run(meta):
            # A view of the graph's output buffer: consumed before the next pass.
            return self.graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta, lora)

    def _tensors(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        query_lens, seq_lens = tuple(batch.query_lens), tuple(batch.seq_lens)
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.as_tensor(batch.slot_mapping, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.as_tensor(batch.block_tables, dtype=torch.int32, device=dev).view(
                len(seq_lens), batch.table_width
            ),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
        input_ids = torch.as_tensor(batch.input_ids, dtype=torch.int64, device=dev)
        positions = torch.as_tensor(batch.positions, dtype=torch.int64, device=dev)
        return input_ids, positions, meta

    def _prompt_logprobs(self, hidden: torch.Tensor, span: PromptSpan) -> list[TokenLogprobs]:
        logits = self.model.compute_logits(hidden[span.row : span.row + len(span.targets)])
        if logits is None:
            return []
        return compute_prompt_logprobs(logits, span.targets, span.k)

    # ----- KV transfer -----------------------------------------------------------------------------
    def gather_kv_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """This rank's KV of `block_ids`, laid out [layer][k, v][block][block_size][kv_head][head_dim]."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        return self.model.ops.gather_kv_blocks(self.kv_caches, ids)

    def gather_kv_blocks_into(self, block_ids: Sequence[int], out: memoryview) -> None:
        """gather_kv_blocks written straight into host memory `out` (a shared-memory segment's slice)."""
        first = self.kv_caches[0][0]
        shape = (len(self.kv_caches), 2, len(block_ids), *first.shape[1:])
        target = torch.frombuffer(out, dtype=first.dtype).view(shape)
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        self.model.ops.gather_kv_blocks(self.kv_caches, ids, out=target)

    def scatter_kv_blocks(self, block_ids: Sequence[int], buffer: torch.Tensor) -> None:
        """Write `buffer` (gather_kv_blocks' layout, this rank's heads) into cache blocks `block_ids`."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        self.model.ops.scatter_kv_blocks(buffer.to(self.device).contiguous(), self.kv_caches, ids)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _advanced(meta: AttentionMetadata, positions: torch.Tensor, rows: torch.Tensor) -> AttentionMetadata:
    """The decode metadata of the next pass of a burst: every sequence one token longer, writing the
    token at `positions` (already advanced) into its block table's slot."""
    size = meta.block_size
    blocks = meta.block_tables[rows, positions // size].to(torch.int64)
    return dataclasses.replace(
        meta,
        slot_mapping=blocks * size + positions % size,
        seq_lens=meta.seq_lens + 1,
        seq_lens_cpu=tuple(n + 1 for n in meta.seq_lens_cpu),
    )
