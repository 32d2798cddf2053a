"""One admitted request inside the engine: its choices (sequences), their detokenizers, how their new
tokens become `RequestOutput`s (usage, prompt ids and prompt logprobs on the request's first output), and
the times its observers report (`observer.StepRecord` fills them only while an observer is attached)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conduit_engine.core.sequence import Sequence
from conduit_engine.engine.detokenizer import IncrementalDetokenizer
from conduit_engine.engine.request import RequestOutput, Usage
from conduit_engine.kv_transfer.registry import KvTransfer
from conduit_engine.sampling.token_logprobs import TokenLogprobs


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]  # one per choice this engine runs, by choice index (the decode side may skip some)
    detokenizers: dict[int, IncrementalDetokenizer]  # choice index → its text so far
    sent_first: bool = False
    kv_produce: bool = False  # prefill side of a disaggregated request: choices end at their first token
    kv_transfer: KvTransfer | None = None  # the prompt's KV pinned for a decode engine (kv_produce)
    # Prompt logprobs computed so far (choice 0 computes them for all); sent on the first output.
    pending_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    arrival: float = 0.0  # observer.clock() when the request reached the engine
    trace_context: object | None = None  # GenerationRequest.trace_context, for the request's spans
    first_scheduled: float | None = None
    first_token: float | None = None
    # Choice index → its latest token's time (0.0: none yet); the decode side may run only some choices.
    token_times: dict[int, float] = field(init=False)

    def __post_init__(self) -> None:
        self.token_times = dict.fromkeys((seq.index for seq in self.seqs), 0.0)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=sum(s.num_output_tokens for s in self.seqs),
            cached_tokens=self.seqs[0].num_cached_tokens,
        )

    def output(
        self,
        seq: Sequence,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprobs],
        error: str | None = None,
        kv_transfer: KvTransfer | None = None,
    ) -> RequestOutput:
        """The output of `seq`'s new tokens (final when the sequence has finished)."""
        finished = seq.is_finished
        out = RequestOutput(
            request_id=self.request_id,
            index=seq.index,
            text=text,
            token_ids=token_ids,
            usage=self.usage(),
            logprobs=logprobs,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_string=seq.stop_string if finished else None,
            stop_token_id=seq.stop_token_id if finished else None,
            error=error,
            kv_transfer=kv_transfer,
        )
        if not self.sent_first:
            self.sent_first = True
            out.prompt_token_ids = self.prompt_token_ids
            if seq.params.prompt_logprobs is not None:
                out.prompt_logprobs = list(self.pending_prompt_logprobs)
        return out
