"""The shape of an engine's paged KV cache and its fingerprint (KvLayout in engine.proto).

Two engines can exchange KV blocks only when their layouts are equal, byte for byte: the same model,
element type (a compute dtype, or "int8"/"fp8_e4m3" for a quantized cache, whose rows carry their
scales: kv_format.py), block size, layer count, KV heads and head size. The fingerprint is the hex
SHA-256 of a canonical JSON encoding of those fields plus a format version, so a change of the
transfer's byte layout (the KvChunk payload) gives every engine a new fingerprint. Torch-free: the
dtype is its name ("bfloat16").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from conduit_engine.kv_format import kv_head_bytes

# Bumped when the KvChunk payload layout changes: engines of different formats must not pair.
KV_FORMAT_VERSION = 1
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1}


def layout_fingerprint(
    model: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int
) -> str:
    """Hex SHA-256 of the layout's fields; equal fingerprints mean interchangeable blocks."""
    canonical = json.dumps(
        {
            "format": KV_FORMAT_VERSION,
            "model": model,
            "dtype": dtype,
            "block_size": block_size,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KvLayoutSpec:
    """One engine's KV cache layout (served model name, cache dtype name, block geometry)."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"dtype: expected one of {', '.join(ELEMENT_BYTES)}, got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    @property
    def fingerprint(self) -> str:
        return layout_fingerprint(
            self.model, self.dtype, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every layer's K and V: one block's share of a KvChunk payload."""
        rows = 2 * self.num_layers * self.block_size * self.num_kv_heads
        return rows * kv_head_bytes(self.dtype, self.head_dim)

    @property
    def region_block_bytes(self) -> int:
        """Bytes of one block in one layer's K (or V) cache of the whole model's KV heads."""
        return self.block_size * self.num_kv_heads * kv_head_bytes(self.dtype, self.head_dim)

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks holding `num_tokens` tokens (the last one may be partly filled)."""
        return (num_tokens + self.block_size - 1) // self.block_size
