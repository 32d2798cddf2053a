"""This engine's NIXL agent for KV transfers (--kv-transport nixl): its KV cache registered once, the
descriptors a source hands out, and the one-sided reads a puller makes.

NIXL (the `nixl-cu12` wheel; UCX underneath: RDMA, NVLink/CUDA IPC, shared memory or TCP, whichever UCX
finds usable between the two agents) moves memory between registered regions. At start the engine
registers every layer's K and V cache tensor (DRAM on the CPU, VRAM on CUDA) under an agent named
`conduit-<random hex>`. A source answers a NIXL pull with `describe`: its agent name, its metadata (only
when the puller does not hold it yet: the metadata tells UCX how to reach this process), the regions' base
addresses, the bytes of one block in a region, and the transfer's block ids. The puller's `read` loads the
metadata once per source agent, builds one descriptor per run of consecutive blocks per region (a block's
[block_size][kv_head][head_dim] slice is contiguous in both caches, which have the same layout: the
fingerprints matched) and reads them all in one transfer into its own cache blocks, no copy through
Python. The transfer is polled from the event loop; a pull cancelled meanwhile still waits for it to end
(the destination blocks must not be freed while UCX writes them), then raises CancelledError.

Only a puller presenting a live transfer id (and the engine token) gets the metadata: PullKv hands it out.
The metadata lets its holder read any registered block of this engine's cache while this agent lives;
what UCX opens on the network is described in the engine README (UCX_TLS, UCX_NET_DEVICES).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransferError, KvTransportUnavailableError
from conduit_engine.kv_transfer.layout import KvLayoutSpec

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


class NixlKvEndpoint:
    """One engine's NIXL agent over its KV cache tensors ([num_blocks, block_size, heads, head_dim] each,
    contiguous, one dtype and device). Raises ImportError or RuntimeError when NIXL cannot start here."""

    def __init__(self, kv_caches: Sequence[tuple[Any, Any]], timeout_s: float = 60.0) -> None:
        api = load_nixl()
        self.name = f"conduit-{uuid.uuid4().hex}"
        self._timeout_s = timeout_s
        self._agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL's UCX backend did not start (no UCX plugin in the wheel?)")
        first = kv_caches[0][0]
        self.memory = "VRAM" if first.device.type == "cuda" else "DRAM"
        self.device_id = (first.device.index or 0) if first.device.type == "cuda" else 0
        self._caches = kv_caches  # the registered memory stays alive with the agent
        self.regions = [int(cache.data_ptr()) for pair in kv_caches for cache in pair]
        region_bytes = first.numel() * first.element_size()
        self.block_stride = region_bytes // first.shape[0]
        descs = [(address, region_bytes, self.device_id, "") for address in self.regions]
        self._registered = self._agent.register_memory(descs, self.memory)
        self._metadata = self._agent.get_agent_metadata()
        self._remote: dict[str, str] = {}  # source address → the agent name whose metadata is loaded

    def describe(self, block_ids: Sequence[int], known_agent: str) -> pb.KvNixlBlocks:
        """Where cache blocks `block_ids` lie (a source's NIXL answer)."""
        return pb.KvNixlBlocks(
            agent_name=self.name,
            agent_metadata=b"" if known_agent == self.name else self._metadata,
            memory=self.memory,
            device_id=self.device_id,
            region_addresses=self.regions,
            block_stride=self.block_stride,
            block_ids=block_ids,
        )

    def known_agent(self, source_address: str) -> str:
        """The source agent whose metadata this agent holds for `source_address` ('' when none)."""
        return self._remote.get(source_address, "")

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
        self._check(remote, len(dest_block_ids), layout)
        agent_name = self._load_remote(source_address, remote)
        local, remote_descs = self._descriptors(remote, dest_block_ids)
        try:  # NIXL refuses descriptors outside the source's registered memory here
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, self.memory),
                self._agent.get_xfer_descs(remote_descs, remote.memory),
                agent_name,
            )
        except Exception as exc:
            raise KvTransportUnavailableError(f"NIXL cannot read from {agent_name}: {exc!r}") from None
        try:
            try:
                posted = self._agent.transfer(handle)
            except Exception as exc:
                raise KvTransportUnavailableError(f"NIXL cannot read from {agent_name}: {exc!r}") from None
            state = await self._wait(handle, posted)
        finally:
            self._agent.release_xfer_handle(handle)
        if state != "DONE":
            # UCX could not reach the source (no common transport, a blocked port): the puller uses
            # gRPC, and this agent reloads the source's metadata next time (it may have moved).
            self._remote.pop(source_address, None)
            raise KvTransportUnavailableError(
                f"NIXL read from {agent_name} at {source_address} ended {state}"
            )
        return len(dest_block_ids) * len(self.regions) * self.block_stride

    def close(self) -> None:
        """Drop the remote agents and the registration (at shutdown)."""
        for agent_name in set(self._remote.values()):
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as exc:  # shutting down: nothing else to do
                log.debug("removing NIXL agent %s: %s", agent_name, exc)
        self._remote.clear()
        self._agent.deregister_memory(self._registered)

    # ----- internals -------------------------------------------------------------------------------
    def _check(self, remote: pb.KvNixlBlocks, num_blocks: int, layout: KvLayoutSpec) -> None:
        problem = None
        if len(remote.block_ids) != num_blocks:
            problem = f"{len(remote.block_ids)} block ids for a pull of {num_blocks}"
        elif len(remote.region_addresses) != len(self.regions):
            problem = f"{len(remote.region_addresses)} regions, this cache has {len(self.regions)}"
        elif (
            remote.block_stride != self.block_stride
            or self.block_stride * len(self.regions) != layout.block_bytes
        ):
            problem = f"block stride {remote.block_stride}, this cache's is {self.block_stride}"
        elif remote.memory not in ("DRAM", "VRAM"):
            problem = f"memory {remote.memory!r} is neither DRAM nor VRAM"
        elif not remote.agent_name:
            problem = "no agent name"
        if problem is not None:
            raise KvTransferError(f"the source's NIXL blocks do not fit the pull: {problem}")

    def _load_remote(self, source_address: str, remote: pb.KvNixlBlocks) -> str:
        if self._remote.get(source_address) == remote.agent_name and not remote.agent_metadata:
            return remote.agent_name
        if not remote.agent_metadata:
            raise KvTransferError(f"the source's NIXL agent {remote.agent_name} sent no metadata")
        previous = self._remote.pop(source_address, None)
        if previous is not None and previous not in self._remote.values():
            try:
                self._agent.remove_remote_agent(previous)
            except Exception as exc:
                log.debug("removing NIXL agent %s: %s", previous, exc)
        try:
            name = self._agent.add_remote_agent(remote.agent_metadata)
        except Exception as exc:
            raise KvTransportUnavailableError(
                f"NIXL cannot load the agent of {source_address}: {exc}"
            ) from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != remote.agent_name:
            raise KvTransferError(f"the NIXL metadata names agent {name}, the reply {remote.agent_name}")
        self._remote[source_address] = name
        return name

    def _descriptors(
        self, remote: pb.KvNixlBlocks, dest_block_ids: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) Nx3 descriptors: a row per region and run of blocks consecutive on both sides."""
        src = np.asarray(remote.block_ids, dtype=np.uint64)
        dst = np.asarray(dest_block_ids, dtype=np.uint64)
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64)
        lengths = np.diff(np.concatenate([starts, [len(src)]])).astype(np.uint64) * np.uint64(
            self.block_stride
        )
        stride = np.uint64(self.block_stride)

        def table(bases: Sequence[int], ids: np.ndarray, device_id: int) -> np.ndarray:
            addresses = np.asarray(bases, dtype=np.uint64)[:, None] + (ids[starts] * stride)[None, :]
            rows = addresses.size
            out = np.empty((rows, 3), dtype=np.uint64)
            out[:, 0] = addresses.reshape(-1)
            out[:, 1] = np.tile(lengths, len(bases))
            out[:, 2] = device_id
            return out

        return table(self.regions, dst, self.device_id), table(remote.region_addresses, src, remote.device_id)

    async def _wait(self, handle: Any, state: str) -> str:
        """Poll the transfer to its end; a cancellation meanwhile is raised once it ended (or timed out)."""
        cancelled = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        spins = 0
        while state == "PROC":
            try:
                await asyncio.sleep(0 if spins < _POLL_SPINS else 0.001)
            except asyncio.CancelledError:
                cancelled = True  # UCX may still write the destination blocks: wait for it
            spins += 1
            state = self._agent.check_xfer_state(handle)
            if state == "PROC" and loop.time() > deadline:
                state = "TIMEOUT"  # releasing the handle asks NIXL to cancel the transfer
        if cancelled:
            raise asyncio.CancelledError
        return state
