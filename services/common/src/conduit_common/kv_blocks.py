"""The prefix-cache block hash, shared by the engine (which caches blocks under it) and the gateway (which
predicts from a prompt's token ids which blocks an engine holds): both must compute it byte for byte alike.

A full block of `block_size` tokens hashes as SHA-256(parent hash, or nothing for the first block ‖ the
tokens as little-endian signed 64-bit integers); equal hashes mean equal prefixes.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes


def chain_hash(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
    """Hash of a full block given its parent block's hash; equal hashes mean equal prefixes.

    SHA-256, not Python's 64-bit `hash()`: that one is not collision resistant, so a user who knows
    a prompt others send (a shared system prompt) could craft different tokens with the same hash
    and have the cache serve one request's KV to another.
    """
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def prefix_block_hashes(token_ids: list[int] | tuple[int, ...], block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`: what the engine's prefix cache registers."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes
