"""A worker's NIXL agent (--kv-transport nixl with worker processes) and the frames that drive it.

NIXL_START: the rank registers its KV cache shard (the KV heads its ShardPlan gives it) with an agent of
its own and answers NIXL_INFO (the agent's regions and heads as JSON, its metadata as a byte array; or an
`error`: the engine then falls back to gRPC, the worker goes on). NIXL_READ: one pull's source shards
(with the metadata of agents this rank may not hold), the source block ids and the destination ones;
every rank reads the heads it holds from the source ranks holding them, waits for its transfers to end
(or time out) and answers NIXL_DONE with the state. A failed read is an answer, never an ERROR frame: it
must not take the worker group down (the puller pulls over gRPC instead).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from conduit_engine.kv_transfer.nixl_agent import NixlRankAgent
from conduit_engine.kv_transfer.nixl_regions import NixlRegions
from conduit_engine.models.sharding import ShardPlan
from conduit_engine.worker.wire import Frame, Kind, as_array, control, encode

log = logging.getLogger(__name__)

EVERY_RANK_ANSWERS = frozenset({Kind.NIXL_START, Kind.NIXL_READ})


def encode_read(
    source_address: str,
    ranks: Sequence[tuple[NixlRegions, bytes]],
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    timeout_s: float,
) -> bytes:
    """The NIXL_READ frame of one pull: the source's shards (metadata where not empty), the blocks."""
    metadata = [blob for _, blob in ranks if blob]
    doc: dict[str, Any] = {"source": source_address, "timeout_s": timeout_s, "ranks": []}
    for regions, blob in ranks:
        doc["ranks"].append({**regions.to_json(), "has_metadata": bool(blob)})
    arrays = [("B", json.dumps(doc).encode()), as_array("q", src_ids), as_array("q", dst_ids)]
    arrays += [("B", blob) for blob in metadata]
    return encode(Kind.NIXL_READ, (), arrays)


def decode_info(frame: Frame) -> tuple[NixlRegions, bytes]:
    """A rank's NIXL_INFO: its shard and metadata; RuntimeError with the rank's reason when it has none."""
    doc = frame.json()
    if doc.get("error"):
        raise RuntimeError(f"worker rank {doc['rank']}: {doc['error']}")
    return NixlRegions.from_json(doc["regions"]), frame.arrays[1].tobytes()


class RankNixl:
    """This rank's NIXL agent, or why it has none."""

    def __init__(self, rank: int, agent: NixlRankAgent | None, error: str = "") -> None:
        self.rank = rank
        self.agent = agent
        self.error = error

    @classmethod
    def start(
        cls, kv_caches: Sequence[tuple[Any, Any]], plan: ShardPlan | None, rank: int, spec: dict[str, Any]
    ) -> RankNixl:
        """Register this rank's cache shard (the heads `plan` gives the rank; all without one)."""
        head_start = 0 if plan is None else plan.kv_head_range_of(rank)[0]
        try:
            return cls(rank, NixlRankAgent(kv_caches, head_start))
        except Exception as exc:  # ImportError, a backend that does not start, a registration refused
            log.warning("NIXL cannot start on this rank: %s", exc)
            return cls(rank, None, f"{type(exc).__name__}: {exc}")

    def info(self) -> bytes:
        """The NIXL_INFO answer."""
        if self.agent is None:
            return control(Kind.NIXL_INFO, {"rank": self.rank, "error": self.error})
        doc = {"rank": self.rank, "regions": self.agent.regions.to_json()}
        return encode(Kind.NIXL_INFO, (), [("B", json.dumps(doc).encode()), ("B", self.agent.metadata)])

    @staticmethod
    def read_answer(nixl: RankNixl | None, frame: Frame) -> bytes:
        """Run a NIXL_READ; the NIXL_DONE answer (state DONE, or another state and the reason)."""
        if nixl is None or nixl.agent is None:
            return control(Kind.NIXL_DONE, {"state": "ERR", "error": "this rank has no NIXL agent"})
        doc = frame.json()
        source = doc["source"]
        try:
            blobs = iter(frame.arrays[3:])
            ranks = [
                (NixlRegions.from_json(r), next(blobs).tobytes() if r["has_metadata"] else b"")
                for r in doc["ranks"]
            ]
            nixl.agent.load(source, ranks)
            handles = nixl.agent.post(
                [r for r, _ in ranks], frame.arrays[1].tolist(), frame.arrays[2].tolist()
            )
            try:
                state, _ = nixl.agent.wait_blocking(handles, float(doc["timeout_s"]))
            finally:
                nixl.agent.release(handles)
        except Exception as exc:  # KvTransferError, KvTransportUnavailableError, a NIXL failure
            nixl.agent.forget(source)
            return control(Kind.NIXL_DONE, {"state": "ERR", "error": f"{type(exc).__name__}: {exc}"})
        if state != "DONE":
            nixl.agent.forget(source)
        return control(Kind.NIXL_DONE, {"state": state, "error": ""})
