"""Moving a running stream to another engine when its engine fails (request migration).

A `MigratingStream` wraps one prompt's EngineStream and keeps what the client has received of each choice:
its tokens, its text, whether it has finished. When the engine fails mid-stream, it sends the same request
with a `Continuation` of the unfinished choices to another engine of the model and reads on from there:

- the stream breaks (UNAVAILABLE) or the engine reports an internal error (INTERNAL, UNKNOWN, DATA_LOSS,
  CANCELLED by the server, or a choice ending FINISH_REASON_ERROR);
- the engine is lost while the stream is open (its health watch broke, or another stream on it did:
  `StreamLost`), which also ends a read waiting on a hung engine;
- a draining engine hands its choices back (FINISH_REASON_MIGRATE, then the end of the stream).

The engine replays the continued tokens as output (engine/continuation.py), so the client reads one stream:
no error, no repeated or missing token; a greedy or seeded choice goes on exactly as it would have, and an
unseeded one as a valid sample. Usage stays one total: the prompt and cached tokens the first engine
reported, and the completion tokens the current engine counts (the continued choices' tokens included)
plus those of the choices that had finished before it took over.

A request moves at most `limit` times, all its prompts together (`--migration-limit`); past that, or when
no other engine takes the continuation, the client gets the error it would have got without migration.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from prometheus_client import Histogram

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import OpenAIError
from conduit_gateway.handlers.choices import ending_error
from conduit_gateway.handlers.streams import EngineStream, OpenOne, StreamLost
from conduit_gateway.routing.generate_mux import Push, Relayed
from conduit_gateway.routing.node import EngineNode

log = logging.getLogger(__name__)

# Statuses of a stream that broke mid-way through the engine's fault (not the client's or the request's).
MIGRATABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.CANCELLED,
    }
)

# Choice endings that hand the choice back rather than finish it, and the migration reason each one is.
_HANDED_BACK = {
    engine_pb2.FINISH_REASON_MIGRATE: "drain",
    engine_pb2.FINISH_REASON_ERROR: "engine_error",
}

# Opens a continuation: (prompt index, request, nodes not to use) → an open stream.
Reopen = Callable[[int, engine_pb2.GenerateRequest, Sequence[EngineNode]], Awaitable[EngineStream]]


@dataclass(frozen=True, slots=True)
class Migration:
    """One move of a prompt's stream, as logged, counted and added to the request's trace."""

    request_id: str
    prompt_index: int
    reason: str  # unavailable (the stream broke or its engine was lost) | engine_error | drain
    source: str  # the engine it left
    target: str  # the engine that continues it
    choices: tuple[int, ...]  # the choices continued
    tokens: int  # the tokens those choices had generated


class Migrations:
    """One request's migrations: how many are left, where a continuation goes, who hears of each."""

    def __init__(self, limit: int, reopen: Reopen, on_migration: Callable[[Migration], None]) -> None:
        self.remaining = limit
        self.reopen = reopen
        self.on_migration = on_migration

    def take(self) -> bool:
        """Use one migration of the request's budget; False when none is left."""
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True


def migrating(open_one: OpenOne, migrations: Migrations) -> OpenOne:
    """`open_one`, with each stream it opens continued elsewhere when its engine fails."""

    async def open_migrating(prompt_index: int, request: engine_pb2.GenerateRequest) -> MigratingStream:
        return MigratingStream(request, await open_one(prompt_index, request), migrations)

    return open_migrating


@dataclass(slots=True)
class _Received:
    """What the client has of one choice."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Failure:
    """Why the stream must move, and what the client gets if it cannot."""

    reason: str
    error: OpenAIError | grpc.aio.AioRpcError


class MigratingStream:
    """One prompt's stream that survives its engine: an EngineStream over the engines it moves across."""

    def __init__(
        self, request: engine_pb2.GenerateRequest, stream: EngineStream, migrations: Migrations
    ) -> None:
        self.prompt_index = stream.prompt_index
        self._request = request
        self._stream = stream
        self._migrations = migrations
        self._n = max(1, request.sampling.n)
        self._received: dict[int, _Received] = {}
        self._finished: set[int] = set()
        self._handed_back: _Failure | None = None  # a choice the engine handed back, moved at stream end
        self._usage = engine_pb2.Usage()  # the first engine's prompt and cached tokens, once moved
        # The first engine's latest message, until it moves (its usage is read then: a field read per
        # message costs more than keeping the message).
        self._latest: engine_pb2.GenerateResponse | None = None
        self._moved = False
        self._carried = 0  # completion tokens of choices finished before the current engine took over
        self._token_gaps: Histogram | None = None
        self._aborted = False  # stopped on purpose (the client left): it ends where it is, never moves
        self.first = self._relay(stream.first)

    @property
    def token_gaps(self) -> Histogram | None:
        return self._token_gaps

    @token_gaps.setter
    def token_gaps(self, histogram: Histogram | None) -> None:
        self._token_gaps = histogram
        self._stream.token_gaps = histogram  # type: ignore[misc]  # PromptStream's field

    async def read(self) -> engine_pb2.GenerateResponse | None:
        """The next message, from whichever engine serves the stream now; None at the end."""
        # A stream the engine has handed back moves for that reason even when its call then breaks
        # rather than ends (a draining engine stops its server: the call, or the node's health watch,
        # may break before the stream's end is read).
        try:
            message = await self._stream.read()
        except StreamLost as exc:
            failure = self._handed_back or _Failure("unavailable", exc)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in MIGRATABLE:
                raise
            failure = self._handed_back or _Failure(
                "unavailable" if exc.code() == grpc.StatusCode.UNAVAILABLE else "engine_error", exc
            )
        else:
            if message is not None:
                return self._relay(message)
            if not self._unfinished() or self._aborted:
                return None
            failure = self._handed_back or _Failure(
                "engine_error",
                OpenAIError(
                    502,
                    "The engine ended the stream before every choice finished.",
                    type="server_error",
                    code="engine_error",
                ),
            )
        if not self._unfinished():
            # Every choice had finished when the stream broke (between its last message and its end):
            # nothing is left to continue, and a continuation without choices would be a fresh request.
            return None
        if self._aborted:
            raise failure.error
        await self._move(failure)
        return self._relay(self._stream.first)

    def ready(self) -> list[engine_pb2.GenerateResponse]:
        """What the current engine's stream has ready, relayed (a failure is met by the next `read`)."""
        return [self._relay(message) for message in self._stream.ready()]

    def push_to(self, push: Push | None) -> bool:
        """Push the current engine's messages, relayed (a stream continued elsewhere is read again)."""
        return self._stream.push_to(None if push is None else Relayed(push, self._relay, self._relay_tokens))

    async def abort(self) -> None:
        self._aborted = True
        await self._stream.abort()

    def close(self) -> None:
        self._stream.close()

    def _unfinished(self) -> list[int]:
        return [index for index in range(self._n) if index not in self._finished]

    def _relay_tokens(
        self, message: engine_pb2.GenerateResponse, token_ids: Sequence[int], text: str
    ) -> None:
        """`_relay` of a message that only adds tokens (not a choice's last)."""
        if self._moved:
            self._relay(message)  # its usage is rewritten
            return
        self._record(message.index, token_ids, text)
        self._latest = message

    def _record(self, index: int, token_ids: Sequence[int], text: str) -> None:
        received = self._received.get(index)
        if received is None:
            received = self._received[index] = _Received()
        if len(token_ids) == 1:
            received.token_ids.append(token_ids[0])  # the common message: half an extend's cost
        else:
            received.token_ids.extend(token_ids)
        received.texts.append(text)

    def _relay(self, message: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        """Record what the client gets of `message`; a handed-back choice is relayed as not finished."""
        index = message.index
        self._record(index, message.token_ids, message.text)
        if message.finished:
            reason = _HANDED_BACK.get(message.finish_reason)
            if reason is None:
                self._finished.add(index)
            else:
                error = ending_error(message.finish_reason, index)
                assert error is not None
                self._handed_back = self._handed_back or _Failure(reason, error)
                message.finished = False
                message.finish_reason = engine_pb2.FINISH_REASON_UNSPECIFIED
        if self._moved:
            completion = message.usage.completion_tokens + self._carried
            message.usage.CopyFrom(self._usage)
            message.usage.completion_tokens = completion
        else:
            self._latest = message  # its usage's prompt and cached tokens are taken when it moves
        return message

    async def _move(self, failure: _Failure) -> None:
        """Continue the unfinished choices on another engine, or raise what the client gets instead."""
        if not self._moved:
            latest = self._latest.usage if self._latest is not None else engine_pb2.Usage()
            self._usage = engine_pb2.Usage(
                prompt_tokens=latest.prompt_tokens, cached_tokens=latest.cached_tokens
            )
        old = self._stream
        source = getattr(old, "node", None)
        old.close()
        choices = self._unfinished()
        if not self._migrations.take():
            log.warning(
                "request %s: %s mid-stream, past the migration limit",
                self._request.request_id,
                failure.reason,
            )
            raise failure.error
        request = continuation_request(self._request, {index: self._received.get(index) for index in choices})
        try:
            self._stream = await self._migrations.reopen(
                self.prompt_index, request, [source] if source else []
            )
        except (OpenAIError, grpc.aio.AioRpcError) as exc:
            log.warning(
                "request %s: %s mid-stream and no engine took it over: %s",
                self._request.request_id,
                failure.reason,
                exc,
            )
            raise failure.error from None
        self._stream.token_gaps = self._token_gaps  # type: ignore[misc]
        self._carried = sum(len(self._received[index].token_ids) for index in self._finished)
        self._moved = True
        self._handed_back = None
        target = getattr(self._stream, "node", None)
        self._migrations.on_migration(
            Migration(
                request_id=self._request.request_id,
                prompt_index=self.prompt_index,
                reason=failure.reason,
                source=source.address if source is not None else "",
                target=target.address if target is not None else "",
                choices=tuple(choices),
                tokens=sum(len(request_choice.token_ids) for request_choice in request.continuation.choices),
            )
        )


def continuation_request(
    request: engine_pb2.GenerateRequest, choices: dict[int, _Received | None]
) -> engine_pb2.GenerateRequest:
    """`request` continuing `choices` (index → what the client has of it; None: nothing yet)."""
    if not choices:
        # Without choices the continuation field stays unset and the engine would start afresh.
        raise ValueError("a continuation needs at least one choice")
    continued = engine_pb2.GenerateRequest()
    continued.CopyFrom(request)
    continued.sampling.ClearField("prompt_logprobs")  # the client has them from the first engine
    for index, received in choices.items():
        continued.continuation.choices.append(
            engine_pb2.ContinuedChoice(
                index=index,
                token_ids=received.token_ids if received else (),
                text="".join(received.texts) if received else "",
            )
        )
    return continued
