"""A sequence: one choice of one request, with its token ids, progress counters and block table.

Plain Python: no torch. The scheduler moves sequences between states; the block manager fills
`block_table`; the model runner reads `token_ids[num_computed_tokens:]` for the next step.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conduit_engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the core stays free of torch and of the grammar backend
    from conduit_engine.structured.state import GrammarState

_seq_counter = itertools.count()

# A block_table entry whose block was given back because it lies wholly before the sliding window of
# every query the sequence will still make (models whose every layer attends through the same window).
# Entries keep their positions: entry i always stands for tokens [i * block_size, (i + 1) * block_size).
RELEASED_BLOCK = -1


def lora_prefix_root(name: str, generation: int) -> bytes:
    """The prefix-cache root of adapter `name` as loaded the `generation`-th time (a name unloaded and
    loaded again, possibly with other weights, never finds the blocks of its previous load)."""
    return hashlib.sha256(f"lora\0{name}\0{generation}".encode()).digest()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    KV_HANDOFF = "kv_handoff"  # prefill side of a disaggregated request: a decode engine continues it
    MIGRATE = "migrate"  # the engine is draining: the caller continues the choice on another engine


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # choice index within the request (n > 1)
    priority: int = 0  # lower runs first
    arrival: int = 0  # admission tiebreak: first come, first served
    seed: int | None = None  # effective seed of this choice (request seed + index)
    parent: Sequence | None = None  # sibling whose prompt prefill this one waits for (n > 1)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    token_ids: list[int] = field(init=False)
    block_table: list[int] = field(default_factory=list)  # may start with RELEASED_BLOCK entries
    num_released_blocks: int = 0  # leading block_table entries that are RELEASED_BLOCK
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_pulled_tokens: int = 0  # prompt tokens whose KV was pulled from a prefill engine (disaggregation)
    num_draft_computed: int = 0  # tokens whose KV the draft model (speculative decoding) has computed
    was_admitted: bool = False
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None
    grammar: GrammarState | None = None  # the output structure's matcher, when the request has one
    lora_name: str | None = None  # the LoRA adapter it runs (None: the base model)
    # The parent hash of its first prefix-cache block: None for the base model, else one per adapter load
    # (lora_prefix_root), so no adapter's KV is ever served to another or to the base model.
    lora_root: bytes | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
