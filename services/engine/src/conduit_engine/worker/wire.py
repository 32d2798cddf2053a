"""The frames the engine and its workers exchange: a kind, a few integers, a few flat typed arrays.

Layout, little-endian: a 16-byte header (magic, kind, number of integers, number of arrays); the
integers (int64 each); one 16-byte descriptor per array (its type code, its element count); then each
array's bytes, starting at a multiple of 8. Encoding joins the arrays' buffers once; decoding views
them in the received buffer (numpy.frombuffer), without copying. Nothing is pickled: a frame holds
numbers only, and control messages (start-up, errors) carry UTF-8 JSON as a byte array.

Frames travel over multiprocessing pipes (`Connection.send_bytes` / `recv_bytes`): a length prefix and
the bytes, blocking reads, so an idle worker sleeps in the kernel instead of spinning.
"""

from __future__ import annotations

import array
import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

_MAGIC = 0x43445446  # "CDTF"
_HEADER = struct.Struct("<IIII")
_DESCRIPTOR = struct.Struct("<c7xQ")
# Type codes: those of the array module, so lists encode through array.array without numpy.
DTYPES = {"i": np.int32, "q": np.int64, "d": np.float64, "f": np.float32, "B": np.uint8}


class Kind(enum.IntEnum):
    INIT = 1  # engine → worker: what to load (JSON)
    LOADED = 2  # worker → engine: weights are in (JSON: memory it has left)
    ALLOCATE = 3  # engine → worker: KV blocks to allocate (JSON)
    READY = 4  # worker → engine: KV cache allocated (and graphs captured)
    STEP = 5  # engine → workers: one step's inputs (step_codec)
    RESULT = 6  # rank 0 → engine: the sampled tokens and logprobs (step_codec)
    GATHER_KV = 7  # engine → workers: read KV blocks (their ids)
    KV_DATA = 8  # rank 0 → engine: the gathered blocks in the full layout
    SCATTER_KV = 9  # engine → workers: write KV blocks (ids and a full-layout payload)
    DONE = 10  # rank 0 → engine: a command without an answer went through
    ERROR = 11  # worker → engine: the exception that stops it (JSON)
    SHUTDOWN = 12  # engine → worker: exit
    LORA_WRITE = 13  # engine → workers: write a LoRA adapter into a pool slot (JSON); rank 0 answers DONE
    # NIXL KV transfers (--kv-transport nixl): every rank answers these, each for its own agent.
    NIXL_START = 20  # engine → workers: start a NIXL agent over the rank's KV cache (JSON)
    NIXL_INFO = 21  # every rank → engine: its agent, regions and KV heads (JSON), and its metadata
    NIXL_READ = 22  # engine → workers: read a source's blocks into the rank's shard (nixl_rank.py)
    NIXL_DONE = 23  # every rank → engine: how its read ended (JSON)


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    ints: tuple[int, ...]
    arrays: list[np.ndarray]

    def json(self) -> Any:
        """The JSON document of a control frame."""
        return json.loads(self.arrays[0].tobytes().decode())


Array = tuple[str, Any]  # (type code, a buffer of that type: array.array, numpy array, bytes)


def as_array(code: str, values: Sequence[int] | Sequence[float]) -> Array:
    """A list as an encodable array of type `code`."""
    return code, array.array(code, values)


def encode(kind: Kind, ints: Sequence[int] = (), arrays: Sequence[Array] = ()) -> bytes:
    views = [memoryview(buffer).cast("B") for _, buffer in arrays]
    parts: list[Any] = [
        _HEADER.pack(_MAGIC, int(kind), len(ints), len(arrays)),
        struct.pack(f"<{len(ints)}q", *ints),
    ]
    for (code, _), view in zip(arrays, views, strict=True):
        parts.append(_DESCRIPTOR.pack(code.encode(), view.nbytes // np.dtype(DTYPES[code]).itemsize))
    for view in views:
        parts.append(view)
        if view.nbytes % 8:
            parts.append(bytes(8 - view.nbytes % 8))
    return b"".join(parts)


def decode(buffer: bytearray) -> Frame:
    """The frame in `buffer` (its arrays are views of it)."""
    magic, kind, num_ints, num_arrays = _HEADER.unpack_from(buffer, 0)
    if magic != _MAGIC:
        raise ValueError(f"not a worker frame (magic {magic:#x})")
    offset = _HEADER.size
    ints = struct.unpack_from(f"<{num_ints}q", buffer, offset)
    offset += 8 * num_ints
    descriptors = []
    for _ in range(num_arrays):
        code, count = _DESCRIPTOR.unpack_from(buffer, offset)
        descriptors.append((DTYPES[code.decode()], count))
        offset += _DESCRIPTOR.size
    arrays = []
    for dtype, count in descriptors:
        arrays.append(np.frombuffer(buffer, dtype=dtype, count=count, offset=offset))
        nbytes = count * np.dtype(dtype).itemsize
        offset += nbytes + (-nbytes % 8)
    return Frame(Kind(kind), ints, arrays)


def control(kind: Kind, document: Any) -> bytes:
    """A control frame carrying `document` as JSON."""
    return encode(kind, (), [("B", json.dumps(document).encode())])


def receive(conn: Connection) -> Frame:
    """The next frame on `conn` (raises EOFError when the other end has closed)."""
    return decode(bytearray(conn.recv_bytes()))
