"""The draft model of speculative decoding (method draft_model): a smaller model of the target's
vocabulary with a KV cache of its own, proposing k tokens per sequence in k batched greedy passes.

Its cache has the target's blocks (the same ids, the same block size): a sequence's block table serves
both, so the scheduler's reservations and frees cover the draft's KV too. What the draft has computed of
a sequence is tracked on the host (`Sequence.num_draft_computed`): the first pass of a proposal catches up
from there to the sequence's last token (a prefill of the prompt the first time, one or two tokens after
a speculative step, more after steps that did not speculate), the next k - 1 passes decode one proposed
token each. Greedy proposals are deterministic, so verifying them is exact rejection sampling
(executor/step_batch.verify) and the output stays the target's.
"""

from __future__ import annotations

import torch

from conduit_engine.models.base import CausalLM
from conduit_engine.worker.model_runner import ModelRunner
from conduit_engine.worker.step_inputs import StepBatch


class DraftRunner:
    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: str
    ) -> None:
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, device)

    @torch.inference_mode()
    def greedy(self, batch: StepBatch) -> list[int]:
        """One pass of `batch` through the draft (writing its KV): the argmax at each logits row."""
        runner = self.runner
        input_ids, positions, meta = runner._tensors(batch)
        hidden = runner._forward(input_ids, positions, meta)
        rows = torch.as_tensor(batch.logits_rows, dtype=torch.int64, device=runner.device)
        logits = runner.model.compute_logits(hidden.index_select(0, rows))
        assert logits is not None  # the draft runs whole, in this process
        return logits.argmax(dim=-1).tolist()
