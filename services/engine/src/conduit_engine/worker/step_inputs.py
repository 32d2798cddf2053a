"""What a ModelRunner takes and answers for one step: flat integer lists (no tensors, no request objects),
so that the same step runs in this process or crosses a pipe to worker processes (`step_codec`).
Plain Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from conduit_engine.sampling.plan import SamplingPlan

if TYPE_CHECKING:
    from conduit_engine.sampling.logprobs import TokenLogprobs


class PromptSpan(NamedTuple):
    """Prompt logprobs asked for in this step: hidden rows [row, row + len(targets)) predict `targets`."""

    item: int  # index into SchedulerOutput.scheduled
    row: int
    k: int
    targets: list[int]


@dataclass(slots=True)
class StepBatch:
    """A step's model inputs. block_tables is row-major [num_seqs, table_width], padded with 0."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[int]
    table_width: int
    logits_rows: list[int]  # hidden rows to sample from, one per sampled sequence
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    sampling: SamplingPlan | None = None  # None when no sequence samples this step
    lora_slots: list[int] = field(
        default_factory=list
    )  # per sequence, its adapter's pool slot (-1: none); [] for none

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class StepOutput(NamedTuple):
    """The sampling rank's answer: a token (and its logprobs, if asked) per logits row, and the
    logprobs of each prompt span."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[list[TokenLogprobs]]
