"""The ops interface every backend implements, and the attention metadata it consumes.

Tensors of all sequences in a step are packed along dim 0 ("tokens"). The paged KV cache of one layer
is a pair of tensors shaped [num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
`block_id * block_size + offset`.

KV transfer (prefill/decode disaggregation) moves whole blocks of every layer through one contiguous
buffer laid out [num_layers][k, v][num_blocks][block_size][num_kv_heads][head_dim], the layout of a
KvChunk's payload in engine.proto; `check_kv_block_args` validates the arguments of both ops the same way
in every backend.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from conduit_engine.ops import quant


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's batch as the attention op sees it.

    Sequence i owns packed tokens [query_start_loc[i], query_start_loc[i+1]); those are its last
    `query_len` positions, so its earlier `seq_lens[i] - query_len` tokens are already in the cache.
    A decode sequence has query_len == 1; a prefill chunk may start after cached tokens.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_lens_cpu: tuple[int, ...]  # host copy of the query lengths
    seq_lens_cpu: tuple[int, ...]  # host copy of seq_lens
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One linear layer's LoRA pool: every adapter slot's matrices, zero where an adapter has none (and past
    its rank). Output column n belongs to slice j (the q, k, v of a fused qkv projection; one slice for an
    unfused layer): `splits` are the slices' widths. The shrink of slice j is a[s, j]; the expand is
    stored transposed and block-diagonal, b[s, j*R:(j+1)*R, n] for the columns n of slice j and zero
    elsewhere, so one product h · b[s] expands every slice at once (and a kernel reads a rank row of b
    along contiguous output columns). The adapter's scaling is already folded into b."""

    a: torch.Tensor  # [slots, S, R, K]: the shrink (lora_A) of each slice
    b: torch.Tensor  # [slots, S*R, N]: the expand (scale · lora_Bᵀ), block-diagonal over the slices
    splits: tuple[int, ...]  # widths of the S output slices (sum N)


@dataclass(frozen=True)
class LoraBatch:
    """Which adapter slot each packed row of a step uses (-1: the base model, no delta).

    `row_slots` says it per row, for kernels that walk rows (the CPU kernels and CUDA); `spans` lists each
    slot present with its runs of rows [start, end). `groups`, each slot with its rows (a slice when they
    are one run, else an int64 index tensor), is for backends that run one shrink and one expand per
    adapter (the punica / S-LoRA grouping); it is made on first use, once per step, since the kernels
    never read it."""

    row_slots: torch.Tensor  # [T] int32 on the model's device
    spans: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, slice | torch.Tensor], ...]:
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, runs in self.spans:
            if len(runs) == 1:
                groups.append((slot, slice(*runs[0])))
            else:
                rows = [t for start, end in runs for t in range(start, end)]
                groups.append((slot, torch.tensor(rows, device=self.row_slots.device)))
        return tuple(groups)


@dataclass(slots=True)
class StepContext:
    """What every layer of one step shares, made once per step by `Ops.begin_step`.

    `scratch` belongs to the backend: tensors it derives from the step's inputs once and reuses in
    every layer (rotary cos/sin of the positions, gather indices, masks). It lives and dies with the
    step, so no state hides in the backend between steps.
    """

    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    cos_sin_cache: torch.Tensor  # [max_positions, head_dim] float32: cos in [:, :D/2], sin in [:, D/2:]
    scratch: dict[str, object] = field(default_factory=dict)
    lora: LoraBatch | None = None  # the step's adapter rows; None: every row runs the base model


@dataclass(frozen=True, slots=True)
class DecoderLayerSpec:
    """One decoder layer as layers/decoder.py runs it: its weights (the loaded parameters themselves)
    and shape, for a backend that runs whole layers (`Ops.compile_decoder`). Optional tensors are None
    where the architecture has none (biases, per-head q/k norms, Gemma 2's feed-forward norms)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor | None
    post_feedforward_norm: torch.Tensor | None
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    eps: float
    sliding_window: int | None
    logit_softcap: float | None
    gelu: bool  # tanh-GELU gate (else SiLU)
    # The projections' adapter pools (lora/pool.py), with LoRA enabled: a runner given them adds each row's
    # delta when a step's StepContext.lora says which rows run which slot.
    qkv_lora: LoraWeights | None = None
    o_lora: LoraWeights | None = None
    gate_up_lora: LoraWeights | None = None
    down_lora: LoraWeights | None = None


# (hidden states after the embedding, every layer's (k_cache, v_cache), the step) → (last layer's output,
# the residual stream without it), as the layers run one by one would give them.
DecoderRunner = Callable[
    [torch.Tensor, Sequence[tuple[torch.Tensor, torch.Tensor]], StepContext],
    tuple[torch.Tensor, torch.Tensor],
]


class Ops(ABC):
    """Numerical building blocks of the model. `TorchOps` is the reference; others must match it."""

    name: str = "abstract"

    def describe(self) -> str:
        """How this backend runs, for the start-up log (and the workers' load reports)."""
        return f"{self.name} ops"

    def begin_step(
        self, positions: torch.Tensor, meta: AttentionMetadata, cos_sin_cache: torch.Tensor
    ) -> StepContext:
        """The context every layer of this step receives; a backend validates the step's inputs here,
        once, rather than in every layer."""
        return StepContext(positions, meta, cos_sin_cache)

    def check_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:  # noqa: B027
        """Validate one layer's cache tensors once, when they are allocated (raises ValueError).

        A backend whose ops accept any cache layout (the torch reference) has nothing to check.
        """

    def compile_decoder(self, layers: Sequence[DecoderLayerSpec]) -> DecoderRunner | None:
        """A backend that runs all decoder layers in one call returns that call (built once, after
        loading); None (the default) runs the layers one by one, op by op, through this interface."""
        return None

    def prepare_linear(  # noqa: B027
        self, weight: torch.Tensor, weight_scale: torch.Tensor | None = None
    ) -> None:
        """Called once for every linear layer's weight when loading finishes: a backend may prepack it
        for `linear` (which still receives the weight itself). Default: nothing to prepare."""

    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A float linear weight [N, K] → (int8 [N, K], float32 per-output-channel scales [N]), at load
        (`--quantization int8`): ops/quant.py's, which a backend may compute faster but never otherwise."""
        return quant.quantize_weight(weight)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, K] @ weight[N, K]ᵀ + bias [N] → [T, N] in x.dtype.

        A float weight shares x's dtype (as does the bias). With `weight_scale` [N] float32 the weight
        is int8 (`--quantization int8`): x is quantized per token and multiplied in int32 (ops/quant.py,
        the reference); the bias stays in x's dtype. Callers only pass what the layer holds, so the
        weight's format stays between the layer and the backend.

        The default is torch's (oneDNN/MKL on the CPU, cuBLAS on CUDA) and ops/quant.py's int8
        reference; a backend overrides it where it has a faster kernel for some shapes."""
        if weight_scale is not None:
            return quant.int8_linear(x, weight, weight_scale, bias)
        return F.linear(x, weight, bias)

    def lora_delta(self, y: torch.Tensor, x: torch.Tensor, w: LoraWeights, batch: LoraBatch) -> None:
        """y [T, N] += each row's LoRA delta, in place: for a row of slot s, (x · a[s]ᵀ) · b[s] (slice j of
        the output reads slice j of the shrink); rows of slot -1 are untouched. x [T, K]; y, x, a, b share
        a dtype. The reference: per adapter, one shrink and one expand over its rows."""
        num_slices, rank, k = w.a.shape[1:]
        for slot, rows in batch.groups:
            h = x[rows] @ w.a[slot].reshape(num_slices * rank, k).t()  # [t, S*R]
            delta = h @ w.b[slot]  # [t, N]
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] → x / rms(x) * weight (computed in float32, returned in x.dtype)."""

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (rms_norm(x + residual), x + residual); the sum is the next residual."""

    @abstractmethod
    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, step: StepContext) -> None:
        """Rotate-half RoPE applied in place at step.positions. q [T, Hq, D], k [T, Hk, D]."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] → silu(x[:, :I]) * x[:, I:]  ([T, I])."""

    @abstractmethod
    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] → gelu_tanh(x[:, :I]) * x[:, I:]  ([T, I]); GELU with the tanh approximation."""

    @abstractmethod
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store k, v [T, Hk, D] into the paged caches at slot_mapping [T]; slot -1 is skipped."""

    def rotary_and_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
    ) -> None:
        """What an attention layer does before attending: RoPE on q (in place) and on k, then the rotated
        k and v into the paged caches at step.meta.slot_mapping (-1 skipped). Backends may fuse the two;
        then k itself may be left unrotated (q and the caches are the contract)."""
        self.rotary_embedding(q, k, step)
        self.write_kv(k, v, k_cache, v_cache, step.meta.slot_mapping)

    @abstractmethod
    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of the packed queries q [T, Hq, D] over each sequence's cached context
        (new keys already written), as described by step.meta. Grouped-query: head h reads kv head
        h // (Hq // Hk). → [T, Hq, D].

        sliding_window w: the query at position p sees keys p - w + 1 .. p only (and never reads the
        cache below that, whose blocks may have been freed). logit_softcap c: scores (q·k * scale)
        become c * tanh(scores / c) before the softmax."""

    @abstractmethod
    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Grammar masking, in place: for each i, token t of logits row rows[i] becomes -inf unless bit
        t % 32 of bitmask[i, t // 32] is set (bit 0 is the least significant). logits [B, V] float32
        with unit stride along V; bitmask [R, ceil(V/32)] int32 (bits past V are ignored); rows [R]
        int64, distinct, in [0, B), in any order. Rows not listed are neither read nor written."""

    @abstractmethod
    def gather_kv_blocks(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_ids: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Copy cache blocks `block_ids` [n] (int64, any order) of every layer's K and V into a new
        contiguous buffer [num_layers, 2, n, block_size, num_kv_heads, head_dim] on the caches' device;
        transfer block j is cache block block_ids[j]. `out`: a contiguous tensor of that shape and dtype
        (on the caches' device or the host, e.g. a shared-memory segment) to write instead; returned."""

    @abstractmethod
    def scatter_kv_blocks(
        self,
        buffer: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_ids: torch.Tensor,
    ) -> None:
        """The inverse of `gather_kv_blocks`: write buffer [num_layers, 2, n, block_size, num_kv_heads,
        head_dim] (contiguous, on the caches' device) into cache blocks `block_ids` [n] (int64, distinct);
        no other block changes."""


def check_kv_block_args(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_ids: torch.Tensor,
    buffer: torch.Tensor | None = None,
) -> tuple[int, ...]:
    """Validate the arguments of gather/scatter_kv_blocks; returns the buffer shape for these block ids.

    Every layer's K and V must be contiguous with one shape, dtype and device; `block_ids` a 1-D int64
    tensor on that device naming existing blocks, distinct when `buffer` is given (a scatter: two writes
    to one block would race). Reading the ids' range synchronises with the device, which a transfer
    (followed by a host copy anyway) can afford.
    """
    _require(len(kv_caches) > 0, "kv_caches: expected at least one layer")
    first = kv_caches[0][0]
    _require(
        first.dim() == 4,
        f"kv_caches: expected [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(first.shape)}",
    )
    for layer, pair in enumerate(kv_caches):
        for name, cache in zip(("k", "v"), pair, strict=True):
            where = f"kv_caches[{layer}].{name}"
            _require(cache.shape == first.shape, f"{where}: shape {tuple(cache.shape)} differs from layer 0")
            _require(cache.dtype == first.dtype, f"{where}: dtype {cache.dtype} differs from layer 0")
            _require(cache.device == first.device, f"{where}: device {cache.device} differs from layer 0")
            _require(cache.is_contiguous(), f"{where}: must be contiguous")
    _require(
        block_ids.dim() == 1 and block_ids.dtype == torch.int64 and block_ids.device == first.device,
        f"block_ids: expected a 1-D int64 tensor on {first.device}, "
        f"got {block_ids.dtype} {tuple(block_ids.shape)} on {block_ids.device}",
    )
    num = block_ids.numel()
    if num:
        low, high = int(block_ids.min()), int(block_ids.max())
        _require(
            0 <= low and high < first.shape[0],
            f"block_ids: must lie in [0, {first.shape[0]}), got values from {low} to {high}",
        )
    shape = (len(kv_caches), 2, num, *first.shape[1:])
    if buffer is not None:
        _require(tuple(buffer.shape) == shape, f"buffer: expected shape {shape}, got {tuple(buffer.shape)}")
        _require(buffer.dtype == first.dtype, f"buffer: dtype {buffer.dtype} differs from the cache's")
        _require(buffer.device == first.device, f"buffer: on {buffer.device}, the cache is on {first.device}")
        _require(buffer.is_contiguous(), "buffer: must be contiguous")
        _require(torch.unique(block_ids).numel() == num, "block_ids: must be distinct for a scatter")
    return shape


def check_gather_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Validate gather_kv_blocks' `out` for a buffer of `shape` and `dtype`."""
    _require(tuple(out.shape) == shape, f"out: expected shape {shape}, got {tuple(out.shape)}")
    _require(out.dtype == dtype, f"out: dtype {out.dtype} differs from the cache's {dtype}")
    _require(out.is_contiguous(), "out: must be contiguous")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
