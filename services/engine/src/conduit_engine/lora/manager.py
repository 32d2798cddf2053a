"""Which adapters this engine serves, which are loaded (on the CPU, at most --max-cpu-loras: least recently
used first out, read again from their path when next asked for) and which hold a pool slot (at most
--max-loras, one per adapter of a step: the scheduler never mixes more in one batch).

The pool itself lives where the model does: in this process (`in_process`: slots are written here), or
in the tensor-parallel workers (the multi-process executor's `write` sends each slot write to them; each
rank reads the adapter and keeps its own shard). Either way an adapter is read and checked against the
whole model's shapes here, when it is loaded, so a refusal never reaches a worker.
"""

from __future__ import annotations

import array
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conduit_engine.errors import ModelLoadError
from conduit_engine.lora.adapter import ADAPTER_FILES, AdapterError, LoraAdapter, load_adapter
from conduit_engine.lora.pool import LoraPool, Shapes, check_adapter
from conduit_engine.models.base import CausalLM
from conduit_engine.models.source import resolve_files
from conduit_engine.ops import LoraBatch

log = logging.getLogger(__name__)

# Writes `adapter` into pool slot `slot` wherever the pool lives.
SlotWriter = Callable[[int, LoraAdapter], None]


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    loaded: bool  # its weights are in memory now (else read again from `path` when a request needs it)


def resolve_adapter(name: str, path: str, max_rank: int, download_dir: str | None) -> LoraAdapter:
    """The adapter at `path` (a folder or a Hub id), on the CPU (raises AdapterError)."""
    try:
        folder = resolve_files(path, ADAPTER_FILES, download_dir=download_dir)
    except ModelLoadError as exc:
        raise AdapterError(name, str(exc)) from exc
    return load_adapter(name, folder, max_rank)


def lora_batch(slots: list[int], query_lens: list[int], device: torch.device) -> LoraBatch | None:
    """The LoraBatch of a step whose sequence i runs pool slot slots[i] (-1: the base model) over its
    query_lens[i] rows; None when no sequence runs an adapter."""
    if all(slot < 0 for slot in slots):
        return None
    rows: list[int] = []
    spans: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for slot, length in zip(slots, query_lens, strict=True):
        rows.extend([slot] * length)
        if slot >= 0 and length:
            runs = spans.setdefault(slot, [])
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + length)
            else:
                runs.append((start, start + length))
        start += length
    # made every step: array + frombuffer costs a few microseconds, torch.tensor() of the list far more
    row_slots = (
        torch.frombuffer(array.array("i", rows), dtype=torch.int32)
        if rows
        else torch.zeros(0, dtype=torch.int32)
    )
    return LoraBatch(row_slots.to(device), tuple((slot, tuple(runs)) for slot, runs in spans.items()))


class LoraManager:
    def __init__(
        self,
        shapes: Shapes,
        write: SlotWriter,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        download_dir: str | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`shapes`: the whole model's projections (adapters are checked against them); `write`: how a
        slot is written; `device`: where a step's LoraBatch goes (in process)."""
        self.shapes = shapes
        self.write = write
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.download_dir = download_dir
        self.device = device or torch.device("cpu")
        self.pool_bytes = 0  # the pool's size where it lives here (for the start-up log)
        self._paths: dict[str, str] = {}  # served adapters: name → where it comes from
        self._ranks: dict[str, int] = {}
        self._cpu: OrderedDict[str, LoraAdapter] = OrderedDict()  # loaded, least recently used first
        self._slots: list[str | None] = [None] * max_loras  # slot → adapter written there
        self._slot_order: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))

    @classmethod
    def in_process(
        cls,
        model: CausalLM,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        download_dir: str | None = None,
    ) -> LoraManager:
        """A manager whose pool sits beside `model`'s projections in this process."""
        pool = LoraPool(model, max_loras, max_rank)
        shapes = {key: (lin.in_features, splits) for key, (lin, splits) in pool.layers.items()}
        device = model.embed_tokens.weight.device
        manager = cls(shapes, pool.write, max_loras, max_cpu_loras, max_rank, download_dir, device)
        manager.pool_bytes = pool.nbytes
        return manager

    # ----- the served set ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._paths)

    def has(self, name: str) -> bool:
        return name in self._paths

    def list(self) -> list[AdapterInfo]:
        return [AdapterInfo(n, p, self._ranks[n], n in self._cpu) for n, p in self._paths.items()]

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read and check the adapter at `path` (a folder or a Hub id) and serve it as `name`.
        Raises AdapterError (nothing changes then)."""
        if name in self._paths:
            raise AdapterError(name, f"an adapter of that name is already loaded (from {self._paths[name]})")
        adapter = self._read(name, path)
        self._paths[name] = path
        self._ranks[name] = adapter.rank
        self._keep(adapter)
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, path, adapter.rank, adapter.modules)
        return AdapterInfo(name, path, adapter.rank, True)

    def unload(self, name: str) -> None:
        if name not in self._paths:
            raise AdapterError(name, "no adapter of that name is loaded")
        del self._paths[name], self._ranks[name]
        self._cpu.pop(name, None)
        for slot, held in enumerate(self._slots):
            if held == name:
                self._slots[slot] = None
        log.info("LoRA adapter %s unloaded", name)

    def _read(self, name: str, path: str) -> LoraAdapter:
        adapter = resolve_adapter(name, path, self.max_rank, self.download_dir)
        check_adapter(adapter, self.shapes)
        return adapter

    def _keep(self, adapter: LoraAdapter) -> None:
        self._cpu[adapter.name] = adapter
        self._cpu.move_to_end(adapter.name)
        while len(self._cpu) > self.max_cpu_loras:
            evicted, _ = self._cpu.popitem(last=False)
            log.info("LoRA adapter %s evicted from memory (--max-cpu-loras %d)", evicted, self.max_cpu_loras)

    # ----- one step ---------------------------------------------------------------------------------
    def assign(self, names: list[str | None]) -> list[int]:
        """Each sequence's pool slot for its adapter (-1: the base model), writing the adapters not in a
        slot yet; [] when no sequence runs an adapter."""
        if all(n is None for n in names):
            return []
        wanted = {n for n in names if n is not None}
        assert len(wanted) <= self.max_loras, "the scheduler mixes at most --max-loras adapters"
        slot_of = {n: self._slot(n, wanted) for n in wanted}
        return [-1 if n is None else slot_of[n] for n in names]

    def batch(self, names: list[str | None], query_lens: list[int]) -> LoraBatch | None:
        """The step's LoraBatch for its sequences' adapters (None: no sequence runs one)."""
        slots = self.assign(names)
        return lora_batch(slots, query_lens, self.device) if slots else None

    def _slot(self, name: str, wanted: set[str]) -> int:
        """The pool slot holding `name`, written now if needed into the least recently used slot that no
        adapter of this step holds."""
        for slot, held in enumerate(self._slots):
            if held == name:
                self._slot_order.move_to_end(slot)
                return slot
        slot = next(s for s in self._slot_order if self._slots[s] not in wanted)
        adapter = self._cpu.get(name)
        if adapter is None:  # evicted from memory: read it again
            adapter = self._read(name, self._paths[name])
        self._keep(adapter)
        self.write(slot, adapter)
        self._slots[slot] = name
        self._slot_order.move_to_end(slot)
        return slot
