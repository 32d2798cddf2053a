"""A model-free stand-in for the engine's step loop, for scheduler and block-manager tests (no torch).

`SimEngine` drives the real `Scheduler` and `BlockManager` exactly as `LLMEngine.step()` does
(schedule → run → advance → append/finish), but the "model" is a pure function of the
token prefix, and the "KV cache" is a dict from slot to the fingerprint of the prefix whose last
token was written there. Every step checks what a real paged-attention model would rely on:

- a sequence only writes into blocks it owns alone (a shared, cached block is never overwritten);
- every slot a sequence reads (positions 0..end, or with a sliding window w the positions from
  start - w + 1 on, which its chunk's first query sees) holds exactly that sequence's prefix;
- with a window, a sequence never holds more blocks than `blocks_for_sequence` promises admission;
- no slot is written twice in one step; the block manager's integrity holds after the step.

So a scheduling or caching bug that would make a real model read wrong KV fails here as an
assertion, and outputs are comparable across runs: the next token depends only on the prefix.

Disaggregation, through the engine's own `KvProducer` and `KvConsumer`: a request added with
`produce=True` ends each choice at its first token (KV_HANDOFF, unless it reached max_tokens) with the
prompt blocks pinned in the engine's `KvTransferRegistry`; `consume` on another SimEngine plans a pull,
copies the source's slots for transfer blocks [start_block, total) (the transport), commits and decodes
on, or recomputes when the source no longer has the transfer. `start_consume` / `end_pull` split that in
two, so a request can be aborted while its pull runs. Every step also checks that each pinned block still
holds what it held when pinned (neither freed nor reused) and that the registry's pins are exactly the
BlockManager's; a pull's blocks stay accounted to their sequence until the pull ends.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from conduit_engine.config import SchedulerConfig
from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.scheduler import Scheduler
from conduit_engine.core.sequence import FinishReason, Sequence
from conduit_engine.kv_transfer.consumer import KvConsumer, PendingPull
from conduit_engine.kv_transfer.errors import KvTransferNotFoundError
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.params import KvHandleRef
from conduit_engine.kv_transfer.producer import KvProducer
from conduit_engine.kv_transfer.registry import KvTransfer, KvTransferRegistry
from conduit_engine.kv_transfer.transport import KvPullResult
from conduit_engine.sampling_params import SamplingParams

VOCAB = 97


def prefix_fingerprint(tokens: list[int]) -> int:
    return hash(tuple(tokens))


def next_token(tokens: list[int]) -> int:
    """The simulated model: a deterministic function of the whole prefix (like greedy decoding)."""
    return prefix_fingerprint(tokens) % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What an uninterrupted run produces."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@dataclass
class SimRequest:
    """A request's choices and, on the prefill side, its transfer (what KvProducer reads and writes)."""

    seqs: list[Sequence]
    kv_transfer: KvTransfer | None = None


@dataclass
class StepRecord:
    advanced: dict[str, int] = field(default_factory=dict)  # request id → tokens computed this step
    sampled: dict[str, int] = field(default_factory=dict)  # request id → token appended this step
    preempted: list[str] = field(default_factory=list)


class SimEngine:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_lease_seconds: float = 30.0,
        clock: Callable[[], float] = time.time,
        sliding_window: int | None = None,
        queued_hold_fraction: float = 0.5,  # SchedulerConfig's default
    ) -> None:
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching, sliding_window)
        self.sliding_window = sliding_window
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_held = 0  # the most blocks one sequence held at once, over the run
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                queued_hold_fraction=queued_hold_fraction,
            ),
            self.block_manager,
        )
        self.block_size = block_size
        self.kv: dict[int, int] = {}  # slot → fingerprint of the prefix ending at the token stored there
        self.seqs: dict[str, Sequence] = {}
        self.streams: dict[str, list[int]] = {}  # what a client would have received, in order
        self.steps: list[StepRecord] = []
        self._arrivals = itertools.count()
        self.registry = KvTransferRegistry(self.block_manager, kv_lease_seconds, clock)
        self.producer = KvProducer(self.registry)
        # One "element" per slot: a block's payload is 8 * block_size bytes in the counters.
        self.layout = KvLayoutSpec("sim", "float32", block_size, 1, 1, 1)
        self.consumer = KvConsumer(self.block_manager, self.layout)
        self.producing: dict[str, SimRequest] = {}  # choice name → its produce request
        self.handoffs: dict[str, KvTransfer] = {}  # request id → the transfer its prefill produced
        self.pinned_kv: dict[str, dict[int, int]] = {}  # transfer id → slot → content when pinned

    # ----- requests ----------------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        priority: int = 0,
        n: int = 1,
        produce: bool = False,
    ) -> list[Sequence]:
        """Queue a request; choices after the first are named `<request_id>/<index>` (as siblings).

        With `produce` every choice ends at its first token (KV_HANDOFF); the first choice's prompt
        blocks are pinned under a transfer in `handoffs[request_id]`."""
        seqs = self._choices(request_id, prompt, max_tokens, n, list(range(n)), priority)
        request = SimRequest(seqs)
        for seq in seqs:
            if produce:
                self.producing[seq.request_id] = request
            self.scheduler.add(seq)
        return seqs

    def _choices(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        n: int,
        indices: list[int],
        priority: int = 0,
    ) -> list[Sequence]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)
        arrival = next(self._arrivals)
        seqs: list[Sequence] = []
        for index in indices:
            name = request_id if index == 0 else f"{request_id}/{index}"
            seq = Sequence(
                name,
                list(prompt),
                params,
                index=index,
                priority=priority,
                arrival=arrival,
                parent=seqs[0] if seqs else None,
            )
            seqs.append(seq)
            self.seqs[name] = seq
            self.streams[name] = []
        return seqs

    def consume(
        self, request_id: str, prompt: list[int], first_tokens: list[int], max_tokens: int, source: SimEngine
    ) -> str:
        """Decode side of `source.handoffs[request_id]`: the first choice pulls the prompt's KV (or, when
        the source no longer has it, recomputes); later choices share its prompt through the prefix cache
        like colocated siblings. Streams start after the first token. Returns "pulled" or "recompute"."""
        self.start_consume(request_id, prompt, first_tokens, max_tokens, source)
        return self.end_pull(request_id, source)

    def start_consume(
        self,
        request_id: str,
        prompt: list[int],
        first_tokens: list[int],
        max_tokens: int,
        source: SimEngine,
        indices: list[int] | None = None,
    ) -> PendingPull:
        """Admit the decode side and plan its pull (choices `indices`, default 0..len-1); not queued yet."""
        indices = indices if indices is not None else list(range(len(first_tokens)))
        n = max(indices) + 1
        seqs = self._choices(request_id, prompt, max_tokens, n, indices)
        for seq, token in zip(seqs, first_tokens, strict=True):
            seq.append_token(token)
        transfer = source.handoffs[request_id]
        handle = KvHandleRef(transfer.transfer_id, "sim", len(prompt), self.layout.fingerprint)
        pending = self.consumer.start(request_id, handle, seqs)
        self.check_invariants()
        return pending

    def end_pull(self, request_id: str, source: SimEngine) -> str:
        """The transport: copy the slots of transfer blocks [start_block, total) into the plan's blocks,
        then let the consumer commit (or rewind, when the source no longer has the transfer) and queue."""
        pending = self.consumer.pending(request_id)
        assert pending is not None
        outcome, result = "recompute", None
        transfer_id = pending.spec.transfer_id
        try:
            transfer = source.registry.start_pull(transfer_id)
        except KvTransferNotFoundError:
            transfer = None
        if transfer is not None:
            bs = self.block_size
            blocks = zip(transfer.block_ids[pending.spec.start_block :], pending.dest_block_ids, strict=True)
            for src, dst in blocks:
                for offset in range(bs):
                    if src * bs + offset in source.kv:
                        self.kv[dst * bs + offset] = source.kv[src * bs + offset]
            source.registry.finish_pull(transfer_id, completed=True)
            outcome = "pulled"
            result = KvPullResult(pending.spec.num_blocks, pending.spec.num_blocks * self.layout.block_bytes)
        for seq in self.consumer.finish(request_id, result):
            self.scheduler.add(seq)
        self.check_invariants()
        return outcome

    def abort_pulling(self, request_id: str) -> None:
        """Abort a request whose pull runs: its choices end now, its blocks stay held until `end_pull`."""
        held = self.consumer.orphan(request_id)
        assert held is not None
        for seq in self.seqs.values():
            if seq.request_id.split("/")[0] == request_id and not seq.is_finished:
                seq.finish(FinishReason.ABORT)
                if seq is not held:
                    self.scheduler.finish(seq)
        self.check_invariants()

    def abort(self, request_id: str) -> None:
        seq = self.seqs[request_id]
        if not seq.is_finished:
            seq.finish(FinishReason.ABORT)
            self.scheduler.finish(seq)

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs.values() if not s.is_finished]

    # ----- the step --------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        self.registry.expire_due()  # as the engine loop does between steps
        out = self.scheduler.schedule()
        record = StepRecord(preempted=[s.request_id for s in out.preempted])
        written: set[int] = set()
        samplers: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            assert item.num_new_tokens > 0, f"{seq.request_id} scheduled for no tokens"
            assert end <= seq.num_tokens, f"{seq.request_id} scheduled past its last token"
            assert len(seq.block_table) * self.block_size >= end, f"{seq.request_id} has too few blocks"
            for pos in range(start, end):
                block_id = seq.block_table[pos // self.block_size]
                owners = self.block_manager.blocks[block_id].ref_count
                assert owners == 1, f"{seq.request_id} writes position {pos} into shared block {block_id}"
                slot = block_id * self.block_size + pos % self.block_size
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.kv[slot] = prefix_fingerprint(seq.token_ids[: pos + 1])
            record.advanced[seq.request_id] = item.num_new_tokens
            if item.samples:
                samplers.append(seq)
        # Attention reads every earlier position (in the window): all of it must be this sequence's prefix.
        for item in out.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            self._check_blocks_held(seq)
            first = 0 if self.sliding_window is None else max(0, start - self.sliding_window + 1)
            for pos in range(first, end):
                slot = seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
                assert self.kv.get(slot) == prefix_fingerprint(seq.token_ids[: pos + 1]), (
                    f"{seq.request_id} would read wrong KV at position {pos}"
                )
        for item in out.scheduled:
            self.scheduler.advance(item.seq, item.num_new_tokens)
        for seq in samplers:
            token = next_token(seq.token_ids)
            seq.append_token(token)
            self.streams[seq.request_id].append(token)
            record.sampled[seq.request_id] = token
            self._finish_if_done(seq)
        self.check_invariants()
        self.steps.append(record)
        return record

    def _finish_if_done(self, seq: Sequence) -> None:
        if seq.num_output_tokens >= seq.params.max_tokens:
            seq.finish(FinishReason.LENGTH)  # the stop rules, before the producer (as in the engine)
        request = self.producing.get(seq.request_id)
        if request is not None:
            produced = request.kv_transfer is None
            self.producer.after_first_token(request, seq)
            if produced and request.kv_transfer is not None:
                self._record_pins(seq, request.kv_transfer)
        if seq.is_finished:
            self.scheduler.finish(seq)
        if request is not None and all(s.is_finished for s in request.seqs):
            self.producer.request_ended(request, completed=True)

    def _record_pins(self, seq: Sequence, transfer: KvTransfer) -> None:
        """What each pinned slot holds, to check later that nothing overwrote it."""
        self.handoffs[seq.request_id.split("/")[0]] = transfer
        bs = self.block_size
        self.pinned_kv[transfer.transfer_id] = {
            seq.block_table[p // bs] * bs + p % bs: self.kv[seq.block_table[p // bs] * bs + p % bs]
            for p in range(seq.num_prompt_tokens)
        }

    def check_invariants(self) -> None:
        """Ref counts match the live sequences (those a pull writes into included) plus the pins; pinned
        blocks hold what they held."""
        live = [s for s in self.live if s.block_table]
        live += [s for s in self.consumer.held_sequences() if s not in live]
        self.block_manager.check_integrity(live)
        self.registry.check_integrity()
        stats = self.block_manager.stats()
        assert stats.used + stats.free == stats.total
        for transfer_id in self.registry.transfer_ids():
            for slot, content in self.pinned_kv[transfer_id].items():
                assert self.kv.get(slot) == content, f"pinned slot {slot} of {transfer_id} was overwritten"

    def _check_blocks_held(self, seq: Sequence) -> None:
        held = len(seq.block_table) - seq.num_released_blocks
        self.max_blocks_held = max(self.max_blocks_held, held)
        promised = self.block_manager.blocks_for_sequence(
            seq.num_prompt_tokens + seq.params.max_tokens,
            self.max_num_batched_tokens,  # type: ignore[operator]
        )
        assert held <= promised, f"{seq.request_id} holds {held} blocks, admission planned for {promised}"

    def run(self, max_steps: int = 10_000) -> list[StepRecord]:
        start = len(self.steps)
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                break
            self.step()
        assert not self.scheduler.has_work(), "the scheduler did not finish its work"
        # Only pinned transfers may still hold blocks.
        assert self.block_manager.stats().used == self.registry.num_pinned_blocks
        return self.steps[start:]
