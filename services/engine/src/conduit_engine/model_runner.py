"""The only place sequences become tensors: builds a step's inputs, runs the model, samples.

Owns the model, the KV cache tensors and the sampler. Everything above it is plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conduit_engine.kv_transfer.cache_io import LocalKvBlocks, layout_of
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.layers.decoder import KVCache
from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import ArchConfig
from conduit_engine.ops import AttentionMetadata
from conduit_engine.sampling import (
    Sampler,
    SamplingRow,
    TokenLogprobs,
    build_sampling_metadata,
    compute_prompt_logprobs,
)
from conduit_engine.sampling.grammar_mask import apply_grammar_mask
from conduit_engine.scheduler import SchedulerOutput
from conduit_engine.sequence import Sequence
from conduit_engine.stop_rules import blocked_token_ids


@dataclass(slots=True)
class SeqStepResult:
    seq: Sequence
    token_id: int | None = None  # sampled token, when the step reached the sequence's end
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # for prompt positions computed now


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to sample from
    sampling_seqs: list[Sequence]


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
        self.device = torch.device(device)
        self.eos_token_ids = eos_token_ids
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]
        for k_cache, v_cache in self.kv_caches:
            model.ops.check_kv_cache(k_cache, v_cache)
        # What KV transfers (disaggregation) read and write: cache blocks by id, as payload bytes.
        self.kv_blocks = LocalKvBlocks(model.ops, self.kv_caches)
        self.sampler = Sampler()
        self._bitmasks = None  # BitmaskBuilder, made on the first step with a constrained row
        self.graphs = None
        if use_cuda_graphs and self.device.type == "cuda":
            self._capture_cuda_graphs(max_num_seqs, max_model_len)

    def _capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode steps for a set of batch sizes (CUDA only; `--enforce-eager` skips this)."""
        from conduit_engine.cuda_graphs import CudaGraphRunner, StaticDecodeInputs, capture_batch_sizes

        sizes = capture_batch_sizes(max_num_seqs)
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        inputs = StaticDecodeInputs(max(sizes), max_blocks, max_model_len, self.block_size, self.device)
        self.graphs = CudaGraphRunner(self.model, self.kv_caches, sizes, inputs)
        self.graphs.capture()

    def kv_layout(self, model_name: str) -> KvLayoutSpec:
        """The cache's layout; engines with equal fingerprints can exchange blocks."""
        return layout_of(model_name, self.kv_caches)

    # ----- inputs ----------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        bs = self.block_size
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
        max_blocks = max((len(item.seq.block_table) for item in out.scheduled), default=0)
        tables = [
            item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table)) for item in out.scheduled
        ]
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev).reshape(len(tables), max_blocks),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
            block_size=bs,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            sampling_seqs=sampling_seqs,
        )

    # ----- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SeqStepResult]:
        inputs = self.prepare(out)
        if self.graphs is not None and self.graphs.can_run(inputs.meta):
            # A view of the graph's output buffer: consumed below, before the next step.
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        results = {id(item.seq): SeqStepResult(item.seq) for item in out.scheduled}
        self._prompt_logprobs(out, hidden, results)
        if inputs.sampling_seqs:
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
            eos = self.eos_token_ids
            rows = [
                SamplingRow(
                    params=seq.params,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                    seed=seq.seed,
                    blocked_token_ids=blocked_token_ids(seq.params, eos, seq.num_output_tokens),
                )
                for seq in inputs.sampling_seqs
            ]
            self._mask_grammars(logits, inputs.sampling_seqs)
            meta = build_sampling_metadata(rows, logits.shape[-1], logits.device)
            sampled = self.sampler(logits, meta)
            for seq, token_id, logprobs in zip(
                inputs.sampling_seqs, sampled.token_ids, sampled.logprobs, strict=True
            ):
                result = results[id(seq)]
                result.token_id = token_id
                result.logprobs = logprobs
        return list(results.values())

    def _mask_grammars(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask the logits rows of sequences with an output structure (one batched op); others untouched."""
        rows = [(i, seq.grammar) for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return
        if self._bitmasks is None:
            from conduit_engine.structured.batch_mask import BitmaskBuilder

            self._bitmasks = BitmaskBuilder(logits.shape[-1], logits.device)
        apply_grammar_mask(logits, self._bitmasks.build(rows), self.model.ops)

    def _prompt_logprobs(
        self, out: SchedulerOutput, hidden: torch.Tensor, results: dict[int, SeqStepResult]
    ) -> None:
        offset = 0
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            k = seq.params.prompt_logprobs
            # Positions start..end-1 predict tokens start+1..end; only prompt targets count.
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if k is not None and seq.num_output_tokens == 0 and end > start:
                rows = hidden[offset : offset + (end - start)]
                logits = self.model.compute_logits(rows)
                targets = seq.prompt_token_ids[start + 1 : end + 1]
                results[id(seq)].prompt_logprobs = compute_prompt_logprobs(logits, targets, k)
            offset += item.num_new_tokens
