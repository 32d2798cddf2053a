"""This engine's NIXL agent for KV transfers (--kv-transport nixl): its KV cache registered once, the
descriptors a source hands out, and the one-sided reads a puller makes. `NixlRankAgent` is one agent
over one rank's cache shard (the whole cache without tensor parallelism; each worker process has its
own, executor/nixl_workers.py); `NixlKvEndpoint` is the engine's endpoint when the cache lives in its process.

NIXL (the `nixl-cu12` wheel; UCX underneath: RDMA, NVLink/CUDA IPC, shared memory or TCP, whichever UCX
finds usable between the two agents) moves memory between registered regions. At start the engine
registers every layer's K and V cache tensor (DRAM on the CPU, VRAM on CUDA) under an agent named
`conduit-<random hex>`. A source answers a NIXL pull with `describe`: its agent name, its metadata (only
when the puller does not hold it yet: the metadata tells UCX how to reach this process), the regions' base
addresses, the bytes of one block in a region, the KV heads it holds, and the transfer's block ids; one
such rank per distinct head range under tensor parallelism. The puller's `read` loads the metadata once
per source agent, builds descriptors for the heads each source rank shares with its own shard
(nixl_regions.read_descriptors: a run of consecutive blocks when both hold the same heads, else a token's
heads) and reads them, one transfer per source agent, into its own cache blocks, no copy through Python.
The transfers are polled from the event loop; a pull cancelled meanwhile still waits for them to end
(the destination blocks must not be freed while UCX writes them), then raises CancelledError.

Only a puller presenting a live transfer id (and the engine token) gets the metadata: PullKv hands it out.
The metadata lets its holder read any registered block of this engine's cache while this agent lives;
what UCX opens on the network is described in the engine README (UCX_TLS, UCX_NET_DEVICES).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransferError, KvTransportUnavailableError
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.nixl_regions import NixlRegions, check_source, read_descriptors, source_ranks

log = logging.getLogger(__name__)

_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
_POLL_SPINS = 2000  # polls that only yield to the loop before each waits a millisecond


def load_nixl() -> Any:
    """The NIXL Python API module (nixl_agent, nixl_agent_config); ImportError naming what to install."""
    reasons = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except Exception as exc:  # an installed wheel whose shared libraries fail to load, too
            reasons.append(f"{name}: {exc}")
    raise ImportError("NIXL is not importable (pip install --no-deps nixl-cu12): " + "; ".join(reasons))


class NixlRankAgent:
    """A NIXL agent over one rank's KV cache tensors ([num_blocks, block_size, heads, head bytes] each,
    contiguous, one dtype and device), which hold the model's KV heads from `head_start` on. Raises
    ImportError or RuntimeError when NIXL cannot start here."""

    def __init__(self, kv_caches: Sequence[tuple[Any, Any]], head_start: int = 0) -> None:
        api = load_nixl()
        name = f"conduit-{uuid.uuid4().hex}"
        self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL's UCX backend did not start (no UCX plugin in the wheel?)")
        first = kv_caches[0][0]
        memory = "VRAM" if first.device.type == "cuda" else "DRAM"
        device_id = (first.device.index or 0) if first.device.type == "cuda" else 0
        self._caches = kv_caches  # the registered memory stays alive with the agent
        self.block_size = int(first.shape[1])
        addresses = tuple(int(cache.data_ptr()) for pair in kv_caches for cache in pair)
        region_bytes = first.numel() * first.element_size()
        self.regions = NixlRegions(
            name,
            memory,
            device_id,
            addresses,
            region_bytes // first.shape[0],
            head_start,
            int(first.shape[2]),
        )
        descs = [(address, region_bytes, device_id, "") for address in addresses]
        self._registered = self._agent.register_memory(descs, memory)
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._remote: dict[str, set[str]] = {}  # source address → the agents whose metadata is loaded

    @property
    def name(self) -> str:
        return self.regions.agent_name

    def known_agents(self, source_address: str) -> set[str]:
        return set(self._remote.get(source_address, ()))

    def load(self, source_address: str, ranks: Sequence[tuple[NixlRegions, bytes]]) -> None:
        """Hold the metadata of `source_address`'s agents (dropping agents it had before: it restarted).
        KvTransferError for an agent sent without metadata that is not loaded; KvTransportUnavailableError
        when NIXL refuses the metadata."""
        loaded = self._remote.setdefault(source_address, set())
        names = {rank.agent_name for rank, _ in ranks}
        for stale in loaded - names:
            loaded.discard(stale)
            self._remove(stale)
        for rank, metadata in ranks:
            if rank.agent_name in loaded:
                continue
            if not metadata:
                raise KvTransferError(f"the source's NIXL agent {rank.agent_name} sent no metadata")
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise KvTransportUnavailableError(
                    f"NIXL cannot load the agent of {source_address}: {exc}"
                ) from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != rank.agent_name:
                self._remove(name)
                raise KvTransferError(f"the NIXL metadata names agent {name}, the reply {rank.agent_name}")
            loaded.add(name)

    def forget(self, source_address: str) -> None:
        """Reload `source_address`'s agents next time (a read from them failed: they may have moved)."""
        for name in self._remote.pop(source_address, set()):
            self._remove(name)

    def post(self, ranks: Sequence[NixlRegions], src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Any]:
        """Start reading the heads each of `ranks` shares with this shard (loaded agents), blocks `src_ids`
        into `dst_ids`: one transfer per agent. The caller waits (`state`) and releases (`release`) them.
        KvTransportUnavailableError when NIXL refuses one (descriptors outside the source's memory)."""
        handles: list[Any] = []
        try:
            for remote in ranks:
                tables = read_descriptors(self.regions, remote, dst_ids, src_ids, self.block_size)
                if tables is None:
                    continue
                try:
                    handle = self._agent.initialize_xfer(
                        "READ",
                        self._agent.get_xfer_descs(tables[0], self.regions.memory),
                        self._agent.get_xfer_descs(tables[1], remote.memory),
                        remote.agent_name,
                    )
                    handles.append(handle)
                    posted = self._agent.transfer(handle)
                except Exception as exc:
                    raise KvTransportUnavailableError(
                        f"NIXL cannot read from {remote.agent_name}: {exc!r}"
                    ) from None
                if posted == "ERR":
                    raise KvTransportUnavailableError(f"NIXL cannot read from {remote.agent_name}: ERR")
        except BaseException:
            self.release(self.wait_blocking(handles, 5.0)[1])
            raise
        return handles

    def state(self, handles: Sequence[Any]) -> str:
        """PROC while any transfer runs, else DONE when all are, else the first other state."""
        states = [self._agent.check_xfer_state(handle) for handle in handles]
        if "PROC" in states:
            return "PROC"
        return next((s for s in states if s != "DONE"), "DONE")

    def wait_blocking(self, handles: Sequence[Any], timeout_s: float) -> tuple[str, Sequence[Any]]:
        """Poll the transfers to their end on this thread (TIMEOUT after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        spins = 0
        while (state := self.state(handles)) == "PROC":
            if time.monotonic() > deadline:
                return "TIMEOUT", handles
            spins += 1
            if spins > _POLL_SPINS:
                time.sleep(0.001)
        return state, handles

    def release(self, handles: Sequence[Any]) -> None:
        """Free the transfers (NIXL cancels one still running)."""
        for handle in handles:
            self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        """Drop the remote agents and the registration (at shutdown)."""
        for source in list(self._remote):
            self.forget(source)
        self._agent.deregister_memory(self._registered)

    def _remove(self, agent_name: str) -> None:
        """Unload a remote agent no source address holds any more."""
        if any(agent_name in names for names in self._remote.values()):
            return  # another address of the same engine still reads from it
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:  # nothing else to do: it is not used again
            log.debug("removing NIXL agent %s: %s", agent_name, exc)


def check_blocks(blocks: pb.KvNixlBlocks, num_blocks: int, num_regions: int, layout: KvLayoutSpec) -> list:
    """The source's shards and metadata of a NIXL answer, checked against a pull of `num_blocks` blocks
    into a cache of `num_regions` regions; KvTransferError when it does not fit."""
    if len(blocks.block_ids) != num_blocks:
        raise KvTransferError(
            f"the source's NIXL blocks do not fit the pull: {len(blocks.block_ids)} block ids for a pull "
            f"of {num_blocks}"
        )
    ranks = source_ranks(blocks, layout.num_kv_heads)
    check_source([rank for rank, _ in ranks], num_regions, layout.num_kv_heads)
    return ranks


class NixlEndpoint(Protocol):
    """An engine's NIXL side, source and puller: `NixlKvEndpoint` (the cache in this process) or
    executor.nixl_workers.WorkerNixlEndpoint (the cache in tensor-parallel worker processes)."""

    name: str  # for the log: the agent(s)
    memory: str  # DRAM or VRAM

    def describe(self, block_ids: Sequence[int], known_agents: Sequence[str]) -> pb.KvNixlBlocks:
        """Where cache blocks `block_ids` lie (a source's NIXL answer), metadata unless known."""
        ...

    def known_agents(self, source_address: str) -> list[str]:
        """The source agents whose metadata this engine holds for `source_address`."""
        ...

    async def read(
        self,
        source_address: str,
        remote: pb.KvNixlBlocks,
        dest_block_ids: Sequence[int],
        layout: KvLayoutSpec,
    ) -> int:
        """Read the described blocks into `dest_block_ids`; the bytes read (see NixlKvEndpoint.read)."""
        ...

    def close(self) -> None: ...


class NixlKvEndpoint:
    """The engine's NIXL endpoint over the KV cache tensors in its own process (one rank holding every
    head). Raises ImportError or RuntimeError when NIXL cannot start here."""

    def __init__(self, kv_caches: Sequence[tuple[Any, Any]], timeout_s: float = 60.0) -> None:
        self._agent = NixlRankAgent(kv_caches)
        self._timeout_s = timeout_s
        self.name = self._agent.name
        self.memory = self._agent.regions.memory

    def describe(self, block_ids: Sequence[int], known_agents: Sequence[str]) -> pb.KvNixlBlocks:
        """Where cache blocks `block_ids` lie (a source's NIXL answer); the metadata unless the puller
        holds it already (`known_agents`)."""
        metadata = b"" if self.name in known_agents else self._agent.metadata
        return pb.KvNixlBlocks(block_ids=block_ids, ranks=[self._agent.regions.to_pb(metadata)])

    def known_agents(self, source_address: str) -> list[str]:
        """The source agents whose metadata this agent holds for `source_address`."""
        return sorted(self._agent.known_agents(source_address))

    async def read(
        self,
        source_address: str,
        remote: pb.KvNixlBlocks,
        dest_block_ids: Sequence[int],
        layout: KvLayoutSpec,
    ) -> int:
        """Read the remote blocks into cache blocks `dest_block_ids` (pairwise); returns the bytes read.
        KvTransportUnavailableError when the source's agent cannot be loaded or the read fails (pull over
        gRPC instead: the transfer is still pinned there); KvTransferError for a description that does not
        fit the pull."""
        ranks = check_blocks(remote, len(dest_block_ids), len(self._agent.regions.regions), layout)
        self._agent.load(source_address, ranks)
        handles = self._agent.post([rank for rank, _ in ranks], remote.block_ids, dest_block_ids)
        try:
            state = await self._wait(handles)
        finally:
            self._agent.release(handles)
        if state != "DONE":
            # UCX could not reach the source (no common transport, a blocked port): the puller uses
            # gRPC, and this agent reloads the source's metadata next time (it may have moved).
            self._agent.forget(source_address)
            raise KvTransportUnavailableError(f"NIXL read from {source_address} ended {state}")
        return len(dest_block_ids) * layout.block_bytes

    def close(self) -> None:
        """Drop the remote agents and the registration (at shutdown)."""
        self._agent.close()

    async def _wait(self, handles: Sequence[Any]) -> str:
        """Poll the transfers to their end; a cancellation meanwhile is raised once they ended (or timed
        out)."""
        cancelled = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        spins = 0
        state = self._agent.state(handles)
        while state == "PROC":
            try:
                await asyncio.sleep(0 if spins < _POLL_SPINS else 0.001)
            except asyncio.CancelledError:
                cancelled = True  # UCX may still write the destination blocks: wait for it
            spins += 1
            state = self._agent.state(handles)
            if state == "PROC" and loop.time() > deadline:
                state = "TIMEOUT"  # releasing the handles asks NIXL to cancel the transfers
        if cancelled:
            raise asyncio.CancelledError
        return state
