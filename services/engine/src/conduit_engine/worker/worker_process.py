"""A worker process: one tensor-parallel rank of the model, driven by the engine over two pipes.

Life of a worker (the engine spawns it, parallel/worker_group.py): INIT (what to load) → join the
torch.distributed group, load this rank's shard (only its slices are read) → LOADED (memory left) →
ALLOCATE → this rank's KV cache, CUDA graphs on CUDA → READY → then every STEP, GATHER_KV and
SCATTER_KV frame in order until SHUTDOWN. Only rank 0 answers (RESULT, KV_DATA, DONE), except for the
NIXL commands, which every rank answers for its own agent (nixl_rank.py); any rank that fails sends ERROR
with the exception and exits non-zero.

A worker never outlives the engine: a watchdog thread waits on the parent's sentinel (a pipe the
engine holds open) and ends the process the moment the engine is gone, even while the main thread is
blocked in a collective. SIGINT is ignored: the engine decides when its workers stop.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from conduit_common import logs
from conduit_engine.layers.collectives import Communicator
from conduit_engine.lora.adapter import shard_adapter
from conduit_engine.lora.manager import resolve_adapter
from conduit_engine.lora.pool import LoraPool
from conduit_engine.models.architectures import read_arch_config
from conduit_engine.models.loader import DTYPES, load_model
from conduit_engine.models.quantization import plan_quantization
from conduit_engine.models.sharding import ModelShard, ShardPlan
from conduit_engine.models.source import quiet_progress_bars
from conduit_engine.ops import get_ops
from conduit_engine.worker.comm import TorchDistributed, backend_for
from conduit_engine.worker.loading import free_device_bytes, set_cpu_threads
from conduit_engine.worker.model_runner import ModelRunner
from conduit_engine.worker.nixl_rank import EVERY_RANK_ANSWERS, RankNixl
from conduit_engine.worker.step_codec import RankTimings, decode_step, encode_result
from conduit_engine.worker.wire import Frame, Kind, control, decode, encode, receive

log = logging.getLogger("conduit_engine.worker")


def worker_main(
    rank: int, world_size: int, commands: Connection, replies: Connection, store_path: str
) -> None:
    """Entry point of a spawned worker process (never returns: the process exits here)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        init = _control(commands)
        logs.configure(init["log_level"], init["log_format"], prefix=f"worker rank {rank}: ")
        if init["log_format"] == "json":
            quiet_progress_bars()
        worker = Worker(rank, world_size, init, store_path)
        replies.send_bytes(control(Kind.LOADED, worker.memory_report()))
        worker.allocate(_control(commands))
        replies.send_bytes(control(Kind.READY, {}))
        worker.serve(commands, replies)
    except EOFError:
        os._exit(1)  # the engine closed its end: it is gone or gave up on this worker
    except BaseException as exc:
        log.exception("worker rank %d failed", rank)
        try:
            replies.send_bytes(control(Kind.ERROR, {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)  # no interpreter teardown: gloo/NCCL threads may still hold the group


def _own_device(device: str, rank: int) -> torch.device:
    """The CPU, or on CUDA this rank's GPU as the only one the process sees (before CUDA initialises):
    torch and CuPy (the kernels' launcher) then agree that it is device 0."""
    if device != "cuda":
        return torch.device("cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(rank + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank]
    own = torch.device("cuda", 0)
    torch.cuda.set_device(own)
    return own


def _control(commands: Connection) -> Any:
    """The next start-up command's document; SHUTDOWN (the engine gave up starting) ends the process."""
    frame = receive(commands)
    if frame.kind is Kind.SHUTDOWN:
        os._exit(0)
    return frame.json()


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="conduit-worker-watchdog", daemon=True).start()


class Worker:
    def __init__(self, rank: int, world_size: int, init: dict[str, Any], store_path: str) -> None:
        self.rank = rank
        self.init = init
        self.device = _own_device(init["device"], rank)
        arch = read_arch_config(Path(init["folder"]))
        self.comm: Communicator | None = None
        shard = None
        self.plan: ShardPlan | None = None
        if world_size > 1:
            self.comm = TorchDistributed(backend_for(self.device), store_path, rank, world_size, self.device)
            self.plan = ShardPlan.of(arch, world_size, rank)
            shard = ModelShard(self.plan, self.comm)
        torch.manual_seed(init["seed"])
        started = time.monotonic()
        self.dtype = DTYPES[init["dtype"]]
        self.model = load_model(
            Path(init["folder"]),
            arch,
            get_ops(init["device"], init["cpu_kernels"]),  # each worker builds or loads kernels/cpu
            self.dtype,
            str(self.device),
            init["max_model_len"],
            shard,
            plan_quantization(Path(init["folder"]), init["quantization"], init["quantize_lm_head"]),
        )
        set_cpu_threads(init["num_threads"], self.model, world_size)
        params = sum(p.numel() for p in self.model.parameters())
        log.info(
            "loaded shard %d/%d (%.1fM parameters) in %.1f s",
            rank,
            world_size,
            params / 1e6,
            time.monotonic() - started,
        )
        self.runner: ModelRunner | None = None
        self.lora_pool: LoraPool | None = None
        self.nixl: RankNixl | None = None  # --kv-transport nixl: this rank's agent

    def memory_report(self) -> dict[str, Any]:
        """Device memory left after loading (CUDA; None on the CPU), for sizing the KV cache, and how
        this rank's shard runs (`CausalLM.describe_ops`), for the engine's log."""
        free = free_device_bytes(self.device)
        return {"rank": self.rank, "free_bytes": free, "ops": self.model.describe_ops()}

    def allocate(self, spec: dict[str, Any]) -> None:
        lora = spec.get("lora")
        if lora is not None:  # the adapter pool first: the KV cache comes after it
            self.lora_pool = LoraPool(self.model, lora["max_loras"], lora["max_rank"])
        self.runner = ModelRunner(
            self.model,
            spec["num_blocks"],
            spec["block_size"],
            self.dtype,
            self.device,
            samples=self.rank == 0,
            max_num_seqs=spec["max_num_seqs"],
            max_model_len=self.init["max_model_len"],
            use_cuda_graphs=spec["use_cuda_graphs"],
            kv_cache_dtype=spec["kv_cache_dtype"],
        )

    def serve(self, commands: Connection, replies: Connection) -> None:
        """Run every command in order until SHUTDOWN."""
        while True:
            data = commands.recv_bytes()
            received = time.perf_counter_ns()
            frame = decode(bytearray(data))
            if frame.kind is Kind.SHUTDOWN:
                return
            answer = self._handle(frame, received)
            if answer is not None and (self.rank == 0 or frame.kind in EVERY_RANK_ANSWERS):
                replies.send_bytes(answer)

    def _handle(self, frame: Frame, received: int) -> bytes | None:
        assert self.runner is not None
        if frame.kind is Kind.STEP:
            batch, bitmask = decode_step(frame, self.device)
            decoded = time.perf_counter_ns()
            out = self.runner.run(batch, bitmask)
            if out is None:
                return None
            return encode_result(out, RankTimings(decoded - received, time.perf_counter_ns() - received))
        if frame.kind is Kind.GATHER_KV:
            return self._gather_kv(frame.arrays[0].tolist())
        if frame.kind is Kind.SCATTER_KV:
            self._scatter_kv(frame.arrays[0].tolist(), frame.arrays[1])
            return encode(Kind.DONE)
        if frame.kind is Kind.LORA_WRITE:
            self._write_lora(frame.json())
            return encode(Kind.DONE)
        if frame.kind is Kind.NIXL_START:
            self.nixl = RankNixl.start(self.runner.kv_caches, self.plan, self.rank, frame.json())
            return self.nixl.info()
        if frame.kind is Kind.NIXL_READ:
            return RankNixl.read_answer(self.nixl, frame)
        raise ValueError(f"unexpected command {frame.kind.name}")

    def _write_lora(self, spec: dict[str, Any]) -> None:
        """Read the adapter (checked by the engine when it was loaded), keep this rank's shard of it, and
        write it into its slot."""
        assert self.lora_pool is not None, "LORA_WRITE without a LoRA pool"
        adapter = resolve_adapter(spec["name"], spec["path"], self.lora_pool.max_rank, spec["download_dir"])
        if self.plan is not None:
            adapter = shard_adapter(adapter, self.plan)
        self.lora_pool.check(adapter)
        self.lora_pool.write(spec["slot"], adapter)

    def _gather_kv(self, block_ids: list[int]) -> bytes | None:
        assert self.runner is not None
        local = self.runner.gather_kv_blocks(block_ids)
        if self.comm is not None and self.plan is not None:
            parts = self.comm.gather(local)
            if parts is None:
                return None
            # Replicated KV heads are taken once, from the first rank holding each.
            local = torch.cat([parts[r] for r in self.plan.kv_owner_ranks()], dim=4)
        payload = local.cpu().contiguous().view(torch.uint8).numpy()
        return encode(Kind.KV_DATA, (), [("B", payload)])

    def _scatter_kv(self, block_ids: list[int], payload: Any) -> None:
        assert self.runner is not None
        first = self.runner.kv_caches[0][0]
        full_heads = first.shape[2] if self.plan is None else self.plan.num_kv_heads
        shape = (len(self.runner.kv_caches), 2, len(block_ids), first.shape[1], full_heads, first.shape[3])
        full = torch.from_numpy(payload).view(first.dtype).view(shape)
        if self.plan is not None:
            start, stop = self.plan.kv_head_range_of(self.rank)
            full = full[:, :, :, :, start:stop]
        self.runner.scatter_kv_blocks(block_ids, full)
