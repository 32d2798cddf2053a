"""Continuous (iteration-level) batching: which sequences advance by how many tokens this step.

Plain Python: no torch. The scheduler decides how many tokens each sequence computes in a step and
reserves their KV slots: its share of the step's token budget, and for a step of pure decodes possibly
several forward passes back to back (a decode burst, `decode_bursts.py`: `SchedulerOutput.num_passes`).
Each step has a token budget. Running sequences go first (decodes and the
rest of chunked prefills), then waiting sequences are admitted in (priority, arrival) order while
the budget, the batch size and the cache allow. When the cache runs out of blocks, the running
sequence with the lowest priority (latest admitted among equals) is preempted: its blocks are freed
and it is recomputed later, reusing whatever prefix is still cached.

A sequence queued for the first time holds its cached prefix while it waits (`BlockManager.hold_prefix`),
all waiting sequences together at most `queued_hold_fraction` of the cache; the rest is only moved to the
back of the eviction order. Holds give way before anything else: when a step lacks blocks, the holds of
the waiting sequences last in line are released before a running sequence is preempted or the head of
the queue is left waiting.
"""

from __future__ import annotations

import heapq

from conduit_engine.config import SchedulerConfig
from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.decode_bursts import DecodeBursts
from conduit_engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from conduit_engine.core.sequence import Sequence, SequenceStatus
from conduit_engine.core.spec_decode import SpecDecode
from conduit_engine.speculation.config import SpeculativeConfig


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int = 1 << 62,
        multi_pass: bool = True,
        speculative: SpeculativeConfig | None = None,
        max_loras: int = 0,
    ) -> None:
        """`multi_pass`: whether the executor runs several forward passes in one step (decode bursts);
        `speculative`: speculative decoding's configuration (None: off).
        `max_loras` (> 0 with LoRA enabled): the running sequences use at most that many adapters, so
        every batch fits the adapter pool's slots; a waiting sequence of another adapter waits."""
        self.config = config
        self.max_loras = max_loras
        self.block_manager = block_manager
        max_passes = config.max_decode_steps if multi_pass else 1
        self.bursts = DecodeBursts(block_manager, max_passes, config.decode_burst_ms / 1000, max_model_len)
        self.spec = None if speculative is None else SpecDecode(speculative, block_manager, max_model_len)
        self._waiting: list[tuple[int, int, int, Sequence]] = []  # heap of (priority, arrival, id, seq)
        self.hold_budget = int(config.queued_hold_fraction * block_manager.num_blocks)
        self.running: list[Sequence] = []  # admission order

    # ----- queue -----------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def waiting(self) -> list[Sequence]:
        return [entry[3] for entry in sorted(self._waiting)]

    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue `seq`. On its first queueing it holds its cached prefix (within the budget); a preempted
        one does not: `free` left its blocks at the back of the eviction order."""
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq.seq_id, seq))
        if not seq.was_admitted and not seq.block_table:
            self.block_manager.hold_prefix(seq, self.hold_budget)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (abort/finish) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            entries = [e for e in self._waiting if e[3] is not seq]
            if len(entries) != len(self._waiting):
                self._waiting = entries
                heapq.heapify(self._waiting)
        self.block_manager.free(seq)
        if self.spec is not None:
            self.spec.forget(seq)

    # ----- one step --------------------------------------------------------------------------------
    def _pure_decode(self) -> bool:
        """Whether this step will likely decode only: every running sequence has one token to compute
        and nobody waiting can be admitted (the engine measures such steps for the speculation gate)."""
        admitting = self._waiting and len(self.running) < self.config.max_num_seqs
        return not admitting and all(seq.num_uncomputed_tokens == 1 for seq in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        speculate = self.spec is not None and self.spec.allow(len(self.running), self._pure_decode())

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._may_split(seq, num_new):
                continue
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                if self._release_a_hold():
                    continue
                victim = self._pick_victim()
                self._preempt(victim, out)
                if victim.seq_id in scheduled_ids:
                    budget += self._unschedule(victim, out, scheduled_ids)
                if victim is seq:
                    break
            else:
                budget -= num_new
                spec, num_draft = (
                    ((), 0)
                    if self.spec is None or not speculate or num_new != 1
                    else self.spec.propose(seq, budget, len(self.running))
                )
                out.scheduled.append(ScheduledSeq(seq, num_new, spec, num_draft))
                scheduled_ids.add(seq.seq_id)
                budget -= len(spec) + num_draft

        if not out.preempted:
            self._admit(out, budget)
        out.num_passes = self.bursts.plan(out)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        deferred: list[tuple[int, int, int, Sequence]] = []
        adapters = {s.lora_name for s in self.running if s.lora_name is not None}
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            entry = self._waiting[0]
            seq = entry[3]
            if seq.parent is not None and not _prompt_computed(seq.parent):
                # n > 1: wait until the first choice has computed (and cached) the shared prompt.
                deferred.append(heapq.heappop(self._waiting))
                continue
            lora = seq.lora_name
            if lora is not None and lora not in adapters and len(adapters) >= self.max_loras > 0:
                deferred.append(heapq.heappop(self._waiting))  # its adapter waits for a free slot
                continue
            if not seq.block_table:
                self.block_manager.allocate_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._may_split(seq, num_new) or not self._reserve(seq, seq.num_computed_tokens + num_new):
                self.block_manager.free(seq)
                if not seq.was_admitted:
                    self.block_manager.hold_prefix(seq, self.hold_budget)  # what it took, held again
                break
            heapq.heappop(self._waiting)
            if not seq.was_admitted:
                # Only the first admission counts: a recompute after preemption is not a new prompt.
                # Tokens pulled from a prefill engine were computed there, not served by this cache.
                seq.num_cached_tokens = seq.num_computed_tokens - seq.num_pulled_tokens
                self.block_manager.record_prefix_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
                out.admitted.append(seq)
            seq.status = SequenceStatus.RUNNING
            seq.was_admitted = True
            if lora is not None:
                adapters.add(lora)
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        for entry in deferred:
            heapq.heappush(self._waiting, entry)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Slots for a waiting `seq` to reach `num_tokens`, releasing other waiting sequences' holds
        (last in line first) while the cache lacks blocks."""
        while not self.block_manager.ensure_slots(seq, num_tokens):
            if not self._release_a_hold():
                return False
        return True

    def _release_a_hold(self) -> bool:
        """Release the held prefix of the waiting sequence last in line that holds one; False if none."""
        if not self.block_manager.num_held_blocks:
            return False
        for entry in sorted(self._waiting, reverse=True):
            if self.block_manager.release_hold(entry[3]):
                return True
        return False

    def _may_split(self, seq: Sequence, num_new: int) -> bool:
        """Whether `seq` may advance by `num_new` of its uncomputed tokens this step.

        Without chunked prefill a prefill runs whole, except one longer than a whole step's budget
        (a long prompt, or prompt + output recomputed after preemption): waiting for a step that can
        hold it would wait forever, so it is split like a chunked prefill.
        """
        return (
            self.config.enable_chunked_prefill
            or num_new == seq.num_uncomputed_tokens
            or seq.num_uncomputed_tokens > self.config.max_num_batched_tokens
        )

    def _pick_victim(self) -> Sequence:
        # Lowest priority first (largest value); among equals the most recently admitted.
        return max(reversed(self.running), key=lambda s: s.priority)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def _unschedule(self, seq: Sequence, out: SchedulerOutput, scheduled_ids: set[int]) -> int:
        for i, item in enumerate(out.scheduled):
            if item.seq is seq:
                del out.scheduled[i]
                scheduled_ids.discard(seq.seq_id)
                return item.num_query_tokens
        return 0

    # ----- after the model ran ---------------------------------------------------------------------
    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """The step `out` ran in `seconds` (its forward passes with their sampling): burst planning."""
        self.bursts.observe(out, seconds, out.num_passes)

    def advance(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` more of `seq`'s tokens have their KV in the cache: publish newly full blocks to the
        prefix cache and give back the blocks that left a sliding window. The engine's update loop calls
        it as it accepts tokens (a burst's sequences advance one token at a time, up to their stop)."""
        seq.num_computed_tokens += num_tokens
        self.block_manager.commit_computed_blocks(seq)
        self.block_manager.release_outside_window(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence (status already set) and free its blocks."""
        self.remove(seq)


def _prompt_computed(seq: Sequence) -> bool:
    return seq.is_finished or seq.num_computed_tokens >= seq.num_prompt_tokens
