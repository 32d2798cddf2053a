"""What a Generate request asks of KV transfer (engine.proto's KvTransferParams), as plain domain objects.

Plain Python: no torch, no protobuf. `proto.py` builds these from the wire, checking each field once;
`checks.py` checks them against this engine (role, layout, prompt, choices) when the request is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SourceTransports:
    """How a source serves a transfer besides gRPC bytes (KvHandle.transports)."""

    shm_host: str = ""  # its host and /dev/shm identity when it serves shared memory
    nixl: bool = False  # whether it answers NIXL pulls


@dataclass(frozen=True, slots=True)
class KvHandleRef:
    """The parts of a KvHandle a decode engine uses: where the prompt's KV is, and its shape."""

    transfer_id: str
    source_address: str  # HOST:PORT the source engine advertises
    num_tokens: int  # prompt tokens the transfer holds
    layout_fingerprint: str
    transports: SourceTransports = SourceTransports()
    lora_name: str | None = None  # the LoRA adapter the KV was computed with (None: the base model)


@dataclass(frozen=True, slots=True)
class KvFirstToken:
    """The token a prefill engine sampled first for one choice."""

    index: int  # choice index in [0, n)
    token_id: int


@dataclass(frozen=True, slots=True)
class KvConsume:
    """Decode side of a disaggregated request: pull `handle`'s KV and go on from the first tokens."""

    handle: KvHandleRef
    first_tokens: tuple[KvFirstToken, ...]  # the choices still generating, by index

    @property
    def choice_indices(self) -> list[int]:
        return [first.index for first in self.first_tokens]
