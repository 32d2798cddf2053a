"""What the engine reports about its own work: one `StepRecord` per step and one `RequestRecord` per
request that ends, handed to the attached `EngineObserver`s on the engine thread.

Plain Python: no torch, no Prometheus, no OpenTelemetry; the service layer (`conduit_engine.telemetry`)
turns records into metrics and spans. Without an observer the engine builds no records at all. With one,
the work per sampled token is `StepRecord.token`: two reads, two writes and a counter; everything else
is per step or per request. Times are `clock()` (time.monotonic) seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from conduit_engine.core.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from conduit_engine.core.scheduler_output import SchedulerOutput
    from conduit_engine.engine.request_state import RequestState

clock = time.monotonic

# When a request's choices end differently, the request counts under the first of these its choices have.
_REQUEST_REASON_ORDER = (
    FinishReason.ERROR,
    FinishReason.ABORT,
    FinishReason.MIGRATE,
    FinishReason.LENGTH,
    FinishReason.KV_HANDOFF,
    FinishReason.STOP,
)


class StepTimer:
    """The clock of one step: how long its forward passes took (the scheduler plans decode bursts by it),
    and, only while an observer is attached, its StepRecord, handed to the observers when it ends."""

    __slots__ = ("_observers", "_started", "_ran", "record")

    def __init__(self, observers: list[EngineObserver]) -> None:
        self._observers = observers
        self._started = clock() if observers else 0.0
        self._ran = 0.0
        self.record: StepRecord | None = None

    def scheduled(self, scheduled: SchedulerOutput, requests: dict[str, RequestState]) -> None:
        """The step was scheduled; the model runs next."""
        if self._observers:
            self.record = StepRecord.begin(self._started, scheduled, requests)
        self._ran = clock()

    def executed(self, scheduled: SchedulerOutput) -> float:
        """The model ran: the seconds its passes took (with their sampling)."""
        now = clock()
        record = self.record
        if record is not None:
            record.num_tokens += (scheduled.num_passes - 1) * len(scheduled.scheduled)  # later passes
            record.sampled_at = now
        return now - self._ran

    def finish(self) -> None:
        """The step's outputs are ready: report it."""
        record = self.record
        if record is None:
            return
        record.finished = clock()
        for observer in self._observers:
            observer.on_step(record)


@dataclass(slots=True)
class StepRecord:
    """One engine step: its timing, its batch, and the latencies of the tokens it produced."""

    started: float  # before scheduling
    phase: str  # "prefill" when the step computed any prompt (or recomputed) token, else "decode"
    num_seqs: int  # sequences in the batch
    num_tokens: int  # tokens whose KV the step computed
    num_preemptions: int
    queue_times: list[float]  # arrival → first scheduled, of the requests scheduled for the first time
    sampled_at: float = 0.0  # when the model's outputs were ready: the time of this step's tokens
    finished: float = 0.0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0  # prompts of the requests whose first token came in this step
    first_token_times: list[float] = field(default_factory=list)  # arrival → first token (TTFT)
    # Time of the choice's previous token → tokens whose previous token came then (one entry per step
    # those tokens' previous tokens came from; usually one).
    _previous_tokens: dict[float, int] = field(default_factory=dict)

    @classmethod
    def begin(
        cls, started: float, scheduled: SchedulerOutput, requests: dict[str, RequestState]
    ) -> StepRecord:
        """The record of the step that runs `scheduled`; notes when newly admitted requests left the queue."""
        record = cls(
            started=started,
            phase="prefill" if scheduled.num_prefill_tokens else "decode",
            num_seqs=len(scheduled.scheduled),
            num_tokens=scheduled.num_tokens,
            num_preemptions=len(scheduled.preempted),
            queue_times=[],
        )
        for seq in scheduled.admitted:
            req = requests.get(seq.request_id)
            if req is not None and req.first_scheduled is None:
                req.first_scheduled = started
                record.queue_times.append(started - req.arrival)
        return record

    def token(self, req: RequestState, seq: Sequence) -> None:
        """`seq` of `req` got a token in this step (called once per sampled token)."""
        self.num_generated_tokens += 1
        previous = req.token_times[seq.index]
        req.token_times[seq.index] = self.sampled_at
        if previous:
            self._previous_tokens[previous] = self._previous_tokens.get(previous, 0) + 1
        elif req.first_token is None:
            req.first_token = self.sampled_at
            self.first_token_times.append(self.sampled_at - req.arrival)
            self.num_prompt_tokens += len(req.prompt_token_ids)

    @property
    def duration(self) -> float:
        return self.finished - self.started

    @property
    def token_gaps(self) -> list[tuple[float, int]]:
        """(inter-token latency in seconds, number of tokens) of the tokens after each choice's first."""
        return [(self.sampled_at - previous, count) for previous, count in self._previous_tokens.items()]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A request that ended (finished, aborted or failed), with the times of its phases."""

    request_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int  # all choices
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_preemptions: int
    arrival: float
    first_scheduled: float | None  # None: it never left the queue
    first_token: float | None  # None: no token came
    finished: float
    trace_context: object | None  # GenerationRequest.trace_context, untouched

    @property
    def stage(self) -> str:
        """Where the request was when it ended: queued, prefill or decode."""
        if self.first_scheduled is None:
            return "queued"
        return "prefill" if self.first_token is None else "decode"


def request_record(req: RequestState, reason: FinishReason | None, finished: float) -> RequestRecord:
    """The record of `req`, ending now (`finished`); `reason` overrides its choices' own (abort, error)."""
    if reason is None:
        reasons = {s.finish_reason for s in req.seqs}
        reason = next((r for r in _REQUEST_REASON_ORDER if r in reasons), FinishReason.STOP)
    usage = req.usage()
    return RequestRecord(
        request_id=req.request_id,
        finish_reason=reason,
        num_prompt_tokens=usage.prompt_tokens,
        num_generated_tokens=usage.completion_tokens,
        num_cached_tokens=usage.cached_tokens,
        num_preemptions=sum(s.num_preemptions for s in req.seqs),
        arrival=req.arrival,
        first_scheduled=req.first_scheduled,
        first_token=req.first_token,
        finished=finished,
        trace_context=req.trace_context,
    )


class EngineObserver(Protocol):
    """Receives the engine's records on the engine thread, between steps: it must be quick and not raise."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_request_end(self, record: RequestRecord) -> None: ...
