"""The executor when the model runs in worker processes (worker/worker_process.py).

Each step: build the StepBatch on the host (as the in-process executor does), build the grammar bitmask
from the constrained sequences, encode both into one STEP frame, send it to every worker, wait for rank
0's RESULT (or any worker's failure), and hand the sampled tokens back per sequence. KV transfer
commands go through the same ordered pipes, under the same lock, so they never interleave with a step.

`BroadcastStats` measures what the split costs per step: encoding, the pipes (the engine's wait minus
rank 0's own time), rank 0's decoding, decoding the answer.

Speculative decoding's draft model (method draft_model) runs whole in this process (`draft`, set by
executor/factory.py): it fills the proposals before the step is built, and they travel in the STEP frame
as any proposal does; the workers only verify.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conduit_engine.config import EngineConfig
from conduit_engine.core.scheduler_output import SchedulerOutput
from conduit_engine.errors import ModelLoadError, WorkerFailedError
from conduit_engine.executor.draft_steps import propose_with_draft
from conduit_engine.executor.step_batch import SeqStepResult, build_step, collect_results, mask_rows
from conduit_engine.executor.worker_group import WorkerGroup
from conduit_engine.lora.adapter import LoraAdapter
from conduit_engine.lora.manager import LoraManager
from conduit_engine.lora.pool import full_shapes
from conduit_engine.models.facts import ModelFacts
from conduit_engine.models.sharding import ShardPlan, check_tensor_parallel
from conduit_engine.structured.batch_mask import SequenceMasks
from conduit_engine.worker.draft_runner import DraftRunner
from conduit_engine.worker.kv_cache import size_kv_cache
from conduit_engine.worker.step_codec import decode_result, encode_step
from conduit_engine.worker.wire import Frame, Kind, as_array, control, encode

if TYPE_CHECKING:
    from conduit_engine.executor.nixl_workers import WorkerNixlEndpoint

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BroadcastStats:
    """Sums over the steps so far, in nanoseconds (frame_bytes: bytes of the STEP frames)."""

    steps: int = 0
    frame_bytes: int = 0
    encode_ns: int = 0
    pipes_ns: int = 0
    worker_decode_ns: int = 0
    answer_decode_ns: int = 0

    @property
    def per_step_us(self) -> float:
        total = self.encode_ns + self.pipes_ns + self.worker_decode_ns + self.answer_decode_ns
        return total / max(1, self.steps) / 1e3

    def describe(self) -> str:
        n = max(1, self.steps)

        def us(ns: int) -> str:
            return f"{ns / n / 1e3:.0f}"

        return (
            f"{self.per_step_us:.0f} us per step over {self.steps} steps (encode {us(self.encode_ns)}, "
            f"pipes {us(self.pipes_ns)}, worker decode {us(self.worker_decode_ns)}, "
            f"answer decode {us(self.answer_decode_ns)}); STEP frames {self.frame_bytes / n:.0f} bytes"
        )


class MultiprocExecutor:
    multi_pass = False  # a worker step carries one forward pass

    def __init__(
        self, group: WorkerGroup, block_size: int, eos_token_ids: tuple[int, ...], vocab_size: int
    ) -> None:
        self.group = group
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.stats = BroadcastStats()
        self._masks = SequenceMasks(vocab_size, "cpu")
        self._lock = threading.Lock()  # one command at a time on the ordered pipes
        self.lora: LoraManager | None = None  # with --enable-lora: its pools live in the workers
        self._download_dir: str | None = None
        self.draft: DraftRunner | None = None  # method draft_model: the draft, in this process

    def write_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Every rank reads `adapter` from its path, keeps its shard and writes it into `slot`."""
        spec = {"slot": slot, "name": adapter.name, "path": adapter.path, "download_dir": self._download_dir}
        with self._lock:
            self.group.send(control(Kind.LORA_WRITE, spec))
            self.group.expect(Kind.DONE)

    def execute(self, out: SchedulerOutput) -> list[SeqStepResult]:
        if self.draft is not None:
            propose_with_draft(out, self.block_size, self.draft.greedy)
        batch, sampling_seqs = build_step(out, self.block_size, self.eos_token_ids)
        if self.lora is not None:  # slot writes first: they take the pipes themselves
            batch.lora_slots = self.lora.assign([item.seq.lora_name for item in out.scheduled])
        bitmask = self._masks.build(mask_rows(out, sampling_seqs))
        with self._lock:
            started = time.perf_counter_ns()
            frame = encode_step(batch, bitmask)
            encoded = time.perf_counter_ns()
            self.group.send(frame)
            answer = self.group.expect(Kind.RESULT)[0]
            answered = time.perf_counter_ns()
        step, timings = decode_result(answer)
        stats = self.stats
        stats.steps += 1
        stats.frame_bytes += len(frame)
        stats.encode_ns += encoded - started
        stats.pipes_ns += answered - encoded - timings.busy_ns
        stats.worker_decode_ns += timings.decode_ns
        stats.answer_decode_ns += time.perf_counter_ns() - answered
        return collect_results(out, batch, sampling_seqs, step)

    def gather_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        with self._lock:
            self.group.send(encode(Kind.GATHER_KV, (), [as_array("q", block_ids)]))
            return self.group.expect(Kind.KV_DATA)[0].arrays[0].tobytes()

    def gather_kv_blocks_into(self, block_ids: Sequence[int], out: memoryview) -> None:
        # The ranks' shards are assembled in worker 0's reply; one copy from it into `out`.
        with self._lock:
            self.group.send(encode(Kind.GATHER_KV, (), [as_array("q", block_ids)]))
            out[:] = memoryview(self.group.expect(Kind.KV_DATA)[0].arrays[0]).cast("B")

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        with self._lock:
            self.group.send(encode(Kind.SCATTER_KV, (), [as_array("q", block_ids), ("B", data)]))
            self.group.expect(Kind.DONE)

    def start_nixl(self, timeout_s: float) -> WorkerNixlEndpoint:
        """A NIXL agent in each worker over its KV shard (--kv-transport nixl); raises when one cannot."""
        from conduit_engine.executor.nixl_workers import WorkerNixlEndpoint

        return WorkerNixlEndpoint(self, timeout_s)

    def ask_every_rank(self, frame: bytes, answer: Kind) -> list[Frame]:
        """Send `frame` to every worker and wait for each rank's `answer` frame (rank order): the NIXL
        commands, which each rank answers for its own agent (worker/nixl_rank.py)."""
        with self._lock:
            self.group.send(frame)
            replies = self.group.expect(answer, range(self.group.world_size))
        return [replies[rank] for rank in range(self.group.world_size)]

    def failure(self) -> str | None:
        return self.group.failure

    def on_failure(self, listener: Callable[[], None]) -> None:
        self.group.on_failure(listener)

    def shutdown(self) -> None:
        self.group.shutdown()


def start_multiproc(
    config: EngineConfig, facts: ModelFacts, workers: WorkerGroup | None
) -> tuple[MultiprocExecutor, int]:
    """The executor over `workers` (spawned here when None) with the model loaded and the KV caches
    allocated, and its number of KV blocks. Raises ModelLoadError; no worker survives a failed start."""
    try:
        check_tensor_parallel(facts.arch, config.parallel.tensor_parallel_size)
        check_devices(config)
        if workers is None:
            workers = WorkerGroup(config.parallel.tensor_parallel_size)
        num_blocks = start_workers(workers, config, facts)
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    torch.set_num_threads(1)  # this process only schedules, detokenizes and encodes steps
    executor = MultiprocExecutor(workers, config.cache.block_size, facts.eos_token_ids, facts.arch.vocab_size)
    if config.lora.enable_lora:
        try:
            executor.lora = _remote_lora(config, facts, executor)
        except BaseException:
            workers.shutdown()
            raise
    return executor, num_blocks


def _remote_lora(config: EngineConfig, facts: ModelFacts, executor: MultiprocExecutor) -> LoraManager:
    """The adapters of an engine whose pools live in the workers, with --lora-modules loaded (read and
    checked here; each rank reads its shard when a slot is first written)."""
    from conduit_engine.errors import InvalidRequestError

    lc = config.lora
    executor._download_dir = config.model.download_dir
    manager = LoraManager(
        full_shapes(facts.arch),
        executor.write_lora,
        lc.max_loras,
        lc.cpu_loras,
        lc.max_lora_rank,
        config.model.download_dir,
    )
    for name, path in lc.lora_modules:
        try:
            manager.load(name, path)
        except InvalidRequestError as exc:
            raise ModelLoadError(f"--lora-modules {name}={path}: {exc}") from exc
    return manager


def start_workers(group: WorkerGroup, config: EngineConfig, facts: ModelFacts) -> int:
    """Load the model into the workers and allocate their KV caches; returns the number of KV blocks.
    A worker that cannot load raises ModelLoadError with its reason."""
    ranks = range(group.world_size)
    init = {
        "folder": str(facts.folder),
        "device": config.model.device,
        "cpu_kernels": config.model.cpu_kernels,
        "quantization": config.model.quantization,
        "quantize_lm_head": config.model.quantize_lm_head,
        "dtype": facts.dtype,
        "max_model_len": facts.max_model_len,
        "seed": config.model.seed,
        "num_threads": config.model.num_threads,
        "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        "log_format": config.telemetry.log_format,
    }
    try:
        group.send(control(Kind.INIT, init))
        loaded = [frame.json() for frame in group.expect(Kind.LOADED, ranks).values()]
        for report in loaded:
            log.info("worker rank %d runs on %s", report["rank"], report["ops"])
        local = facts.arch
        if group.world_size > 1:
            local = ShardPlan.of(facts.arch, group.world_size, 0).local_config(facts.arch)
        free = [report["free_bytes"] for report in loaded]
        num_blocks = size_kv_cache(config, facts, local, group.world_size, free)
        allocate = {
            "num_blocks": num_blocks,
            "block_size": config.cache.block_size,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "use_cuda_graphs": not config.enforce_eager,
            "kv_cache_dtype": config.cache.kv_cache_dtype,
        }
        if config.lora.enable_lora:
            allocate["lora"] = {"max_loras": config.lora.max_loras, "max_rank": config.lora.max_lora_rank}
        group.send(control(Kind.ALLOCATE, allocate))
        group.expect(Kind.READY, ranks)
    except WorkerFailedError as exc:
        raise ModelLoadError(str(exc)) from exc
    return num_blocks


def check_devices(config: EngineConfig) -> None:
    """On CUDA every rank needs its own GPU."""
    size = config.parallel.tensor_parallel_size
    if config.model.device == "cuda" and torch.cuda.device_count() < size:
        raise ModelLoadError(
            f"--tensor-parallel-size {size} needs {size} GPUs, found {torch.cuda.device_count()}"
        )
