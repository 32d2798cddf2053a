"""The prefill side inside the engine loop: a produce request ends each choice at its first token and hands
the prompt's KV to a decode engine.

Plain Python: no torch. The first choice to sample (choice 0: its siblings wait for its prompt) pins the
prompt's blocks in the registry before the scheduler frees them, whatever its stop rules said: siblings may
still continue. Every choice its stop rules leave running then ends with KV_HANDOFF, and its final output
carries the transfer. Siblings reuse the prompt's full blocks from the prefix cache (the pins keep them)
and sample their first token with their own seed, exactly as when the whole request runs here. When the
request ends with no choice handed off (every one stopped at its first token), or is aborted or fails, the
transfer is released at once: nobody will pull it.
"""

from __future__ import annotations

from typing import Protocol

from conduit_engine.core.sequence import FinishReason, Sequence
from conduit_engine.kv_transfer.registry import KvTransfer, KvTransferRegistry


class ProducingRequest(Protocol):
    """What the producer reads and writes of a request (RequestState in the engine)."""

    seqs: list[Sequence]
    kv_transfer: KvTransfer | None  # set at the first choice's first token


class KvProducer:
    """Produce requests' transfers, over the engine's registry."""

    def __init__(self, registry: KvTransferRegistry) -> None:
        self.registry = registry

    def after_first_token(self, req: ProducingRequest, seq: Sequence) -> KvTransfer | None:
        """Call once `seq`'s first token went through its stop rules, before the scheduler frees it.

        Returns the transfer `seq`'s final output carries: set when the choice ended with KV_HANDOFF,
        None when its stop rules ended it.
        """
        if req.kv_transfer is None:
            prompt = seq.prompt_token_ids
            blocks = seq.block_table[: self.registry.block_manager.blocks_needed(len(prompt))]
            req.kv_transfer = self.registry.produce(blocks, prompt, seq.lora_name, seq.lora_root)
        if seq.is_finished:
            return None
        seq.finish(FinishReason.KV_HANDOFF)
        return req.kv_transfer

    def request_ended(self, req: ProducingRequest, completed: bool) -> None:
        """Release the request's transfer unless a choice handed it off and the request completed (an
        aborted or failed prefill is never continued)."""
        transfer = req.kv_transfer
        if transfer is None:
            return
        handed_off = any(seq.finish_reason is FinishReason.KV_HANDOFF for seq in req.seqs)
        if not (completed and handed_off):
            self.registry.release(transfer.transfer_id)
