"""The engine's NIXL endpoint when its KV cache lives in worker processes (tensor parallelism, or
--worker-process): an agent per rank, each over its own shard, driven through the executor's pipes.

At start every rank registers its shard and reports its agent, regions, KV heads and metadata
(worker/nixl_rank.py); a rank that cannot start NIXL makes the whole engine fall back to gRPC (setup.py).
As a source the engine answers a NIXL pull from what the ranks reported, without asking them: one
KvNixlRank per rank holding distinct KV heads (replicas are left out), each with its own agent, so the
puller reads every head range straight from the process that holds it. As a puller it sends one
NIXL_READ to every rank: each reads the heads of its own shard from the source ranks holding them and
answers when its transfers ended. The executor's lock orders the read with the steps, as a scatter is.
A pull cancelled meanwhile still waits for every rank's answer (UCX may be writing the destination
blocks), then raises CancelledError.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransportUnavailableError
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.nixl_agent import check_blocks
from conduit_engine.kv_transfer.nixl_regions import NixlRegions
from conduit_engine.worker.nixl_rank import decode_info, encode_read
from conduit_engine.worker.wire import Frame, Kind, control


class RankCommands(Protocol):
    """The multi-process executor's way to ask every rank (MultiprocExecutor.ask_every_rank)."""

    def ask_every_rank(self, frame: bytes, answer: Kind) -> list[Frame]: ...


class WorkerNixlEndpoint:
    """NIXL over the workers' agents. Raises RuntimeError naming the rank when one cannot start."""

    def __init__(self, executor: RankCommands, timeout_s: float = 60.0) -> None:
        self._executor = executor
        self._timeout_s = timeout_s
        answers = executor.ask_every_rank(control(Kind.NIXL_START, {}), Kind.NIXL_INFO)
        self._ranks = [decode_info(frame) for frame in answers]  # every rank: (shard, metadata)
        self._agents = {regions.agent_name for regions, _ in self._ranks}
        self._owners: list[tuple[NixlRegions, bytes]] = []  # one rank per distinct head range
        for regions, metadata in self._ranks:
            if not self._owners or regions.head_start >= self._owners[-1][0].head_end:
                self._owners.append((regions, metadata))
        self.name = ", ".join(regions.agent_name for regions, _ in self._ranks)
        self.memory = self._ranks[0][0].memory
        self._num_regions = len(self._ranks[0][0].regions)
        self._known: dict[str, set[str]] = {}  # source address → agents every rank holds

    def describe(self, block_ids: Sequence[int], known_agents: Sequence[str]) -> pb.KvNixlBlocks:
        """Where cache blocks `block_ids` lie: each owner rank's shard (its metadata unless known)."""
        known = set(known_agents)
        ranks = [
            regions.to_pb(b"" if regions.agent_name in known else metadata)
            for regions, metadata in self._owners
        ]
        return pb.KvNixlBlocks(block_ids=block_ids, ranks=ranks)

    def known_agents(self, source_address: str) -> list[str]:
        return sorted(self._known.get(source_address, ()))

    async def read(
        self,
        source_address: str,
        remote: pb.KvNixlBlocks,
        dest_block_ids: Sequence[int],
        layout: KvLayoutSpec,
    ) -> int:
        """Every rank reads its heads of the remote blocks into `dest_block_ids`; the bytes read.
        KvTransportUnavailableError when a rank's read did not end DONE (pull over gRPC instead)."""
        ranks = check_blocks(remote, len(dest_block_ids), self._num_regions, layout)
        frame = encode_read(source_address, ranks, remote.block_ids, dest_block_ids, self._timeout_s)
        asked = asyncio.ensure_future(asyncio.to_thread(self._executor.ask_every_rank, frame, Kind.NIXL_DONE))
        try:
            answers = await asyncio.shield(asked)
        except asyncio.CancelledError:
            while not asked.done():  # the ranks may still write the destination blocks
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([asked])
            if not asked.cancelled():
                asked.exception()  # retrieved: the pull is cancelled whatever the ranks answered
            raise
        failed = [doc for doc in (frame.json() for frame in answers) if doc["state"] != "DONE"]
        if failed:
            self._known.pop(source_address, None)
            reasons = "; ".join(f"{doc['state']} {doc['error']}".strip() for doc in failed)
            raise KvTransportUnavailableError(f"NIXL read from {source_address} failed on a rank: {reasons}")
        self._known[source_address] = {regions.agent_name for regions, _ in ranks}
        return len(dest_block_ids) * layout.block_bytes

    def close(self) -> None:
        """Nothing to do here: each agent ends with its worker."""
