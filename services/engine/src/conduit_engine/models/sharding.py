"""Tensor-parallel sharding: which part of every weight and of the KV cache each rank holds.

Megatron-style, as vLLM shards the Llama family:
- q/k/v (fused qkv_proj) and gate/up (fused gate_up_proj) are column-parallel: rank r computes its
  own attention heads and its own slice of the MLP's intermediate features;
- o_proj and down_proj are row-parallel: each rank multiplies its slice of the input features, and an
  all-reduce sums the partial outputs (their biases are added once, after the sum);
- the embedding and the LM head are vocabulary-parallel: rank r holds rows [r * s, (r + 1) * s) with
  s = ceil(vocab_size / N) (the last shard is zero-padded); an all-reduce completes the embedding, and
  rank 0 gathers the logits;
- KV heads are split like the query heads; when a model has fewer KV heads than ranks, each KV head
  is replicated on N / num_key_value_heads consecutive ranks (the ranks whose query heads read it);
- norms, biases of row-parallel layers and the RoPE table are replicated;
- int8 weights (a compressed-tensors checkpoint) shard as float ones; their per-output-channel scales
  ([N, 1]) follow the weight's rows: sliced like them for column-parallel and vocabulary-parallel
  layers, whole for row-parallel ones (each rank holds every output row); per-tensor scales are whole.

`read_shard` reads a rank's slices of a checkpoint tensor straight from safetensors (`get_slice`), so a
worker never reads the other ranks' weights. Plain arithmetic apart from `read_shard`, which receives
safetensors' slice handle and returns torch tensors (torch is not imported here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conduit_engine.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from conduit_engine.layers.collectives import Communicator
    from conduit_engine.models.config import ArchConfig


def check_tensor_parallel(arch: ArchConfig, size: int) -> None:
    """Raise ModelLoadError naming every config.json field that `size` ranks cannot split."""
    if size < 1:
        raise ModelLoadError(f"--tensor-parallel-size must be >= 1, got {size}")
    if size == 1:
        return
    problems = []
    if arch.num_heads % size:
        problems.append(f"num_attention_heads ({arch.num_heads}) must be divisible by it")
    kv = arch.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(
            f"num_key_value_heads ({kv}) must be divisible by it, or divide it "
            "(fewer KV heads than ranks are replicated)"
        )
    if arch.intermediate_size % size:
        problems.append(f"intermediate_size ({arch.intermediate_size}) must be divisible by it")
    if arch.vocab_size < size:
        problems.append(f"vocab_size ({arch.vocab_size}) must be at least it")
    if problems:
        raise ModelLoadError(
            f"--tensor-parallel-size {size} does not fit the model's config.json: " + "; ".join(problems)
        )


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Rank `rank` of `size`; the full model's sizes (from its ArchConfig)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, arch: ArchConfig, size: int, rank: int) -> ShardPlan:
        check_tensor_parallel(arch, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank: must be in [0, {size}), got {rank}")
        return cls(
            rank=rank,
            size=size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size,
            vocab_size=arch.vocab_size,
        )

    # ----- what this rank holds ------------------------------------------------------------------------
    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head: 1, or size / num_kv_heads when there are fewer KV heads."""
        return max(1, self.size // self.num_kv_heads)

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_shard(self) -> int:
        """Rows of every rank's embedding and LM head (the last rank's tail is padding)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    @property
    def vocab_rows(self) -> int:
        """Real (non-padding) rows of this rank's vocabulary shard."""
        return max(0, min(self.vocab_shard, self.vocab_size - self.vocab_start))

    def kv_owner_ranks(self) -> list[int]:
        """One rank per distinct KV-head shard, in head order (the others hold replicas)."""
        return list(range(0, self.size, self.kv_replicas))

    def kv_head_range_of(self, rank: int) -> tuple[int, int]:
        first = (rank // self.kv_replicas) * self.local_kv_heads
        return first, first + self.local_kv_heads

    def local_config(self, arch: ArchConfig) -> ArchConfig:
        """`arch` with this rank's head and MLP sizes (head_dim and everything else unchanged)."""
        return dataclasses.replace(
            arch,
            num_heads=self.local_heads,
            num_kv_heads=self.local_kv_heads,
            intermediate_size=self.local_intermediate,
        )

    # ----- checkpoint slices -----------------------------------------------------------------------------
    def pieces(self, name: str) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [start, stop) ranges concatenated along dim) of checkpoint tensor `name` (without the
        `model.` prefix) that this rank holds; None when it holds the whole tensor."""
        d = self.head_dim
        q = (self.rank * self.local_heads * d, (self.rank + 1) * self.local_heads * d)
        first_kv, end_kv = self.kv_head_range_of(self.rank)
        kv = (first_kv * d, end_kv * d)
        i = (self.rank * self.local_intermediate, (self.rank + 1) * self.local_intermediate)
        q_size, kv_size, inter = self.num_heads * d, self.num_kv_heads * d, self.intermediate_size
        rules: list[tuple[str, int, list[tuple[int, int]]]] = [
            (".self_attn.q_proj.", 0, [q]),
            (".self_attn.k_proj.", 0, [kv]),
            (".self_attn.v_proj.", 0, [kv]),
            (".self_attn.qkv_proj.", 0, [q, _shift(kv, q_size), _shift(kv, q_size + kv_size)]),
            (".self_attn.o_proj.weight", 1, [q]),
            (".mlp.gate_proj.", 0, [i]),
            (".mlp.up_proj.", 0, [i]),
            (".mlp.gate_up_proj.", 0, [i, _shift(i, inter)]),
            (".mlp.down_proj.weight", 1, [i]),
        ]
        for marker, dim, ranges in rules:
            if marker in name:
                return dim, ranges
        return None

    def is_vocab_parallel(self, name: str) -> bool:
        return name in ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class ModelShard:
    """What a model needs to be built as one rank's shard: the plan and the group's communicator."""

    plan: ShardPlan
    comm: Communicator


def _shift(span: tuple[int, int], offset: int) -> tuple[int, int]:
    return span[0] + offset, span[1] + offset


def read_shard(plan: ShardPlan, name: str, handle: Any) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` through safetensors' slice `handle` (only those
    bytes are read). Vocabulary shards are zero-padded to `plan.vocab_shard` rows."""
    import torch

    if name.endswith(".weight_scale"):
        return _read_scale_shard(plan, name, handle)
    if plan.is_vocab_parallel(name):
        start = plan.vocab_start
        rows = handle[start : start + plan.vocab_rows]
        padding = plan.vocab_shard - rows.shape[0]
        if padding:
            rows = torch.cat((rows, rows.new_zeros((padding, *rows.shape[1:]))))
        return rows
    pieces = plan.pieces(name)
    if pieces is None:
        return handle[:]
    dim, ranges = pieces
    parts = [handle[a:b] if dim == 0 else handle[:, a:b] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _read_scale_shard(plan: ShardPlan, name: str, handle: Any) -> torch.Tensor:
    """The rows of a `weight_scale` that go with this rank's rows of its weight."""
    import torch

    shape = tuple(handle.get_shape())
    if len(shape) == 0 or shape[0] == 1:
        return handle[:]  # per tensor
    weight = name.removesuffix("_scale")
    if plan.is_vocab_parallel(weight):
        start = plan.vocab_start
        rows = handle[start : start + plan.vocab_rows]
        padding = plan.vocab_shard - rows.shape[0]
        if padding:
            rows = torch.cat((rows, rows.new_ones((padding, *rows.shape[1:]))))
        return rows
    pieces = plan.pieces(weight)
    if pieces is None or pieces[0] == 1:
        return handle[:]  # replicated or row-parallel: every output channel
    parts = [handle[a:b] for a, b in pieces[1]]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
