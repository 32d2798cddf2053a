"""asyncio front of the engine: `generate()` is an async iterator of outputs; the step loop runs in a thread.

Requests and aborts cross into the loop thread through a command queue applied between steps, so the
synchronous engine is only ever touched by one thread. Outputs cross back in one batch per step; a
reader that falls behind gets the outputs waiting for it merged into one per choice (as vLLM's output
collector does), so a slow consumer costs one message per read, not one per token.

Prompts are tokenized (and chat templates rendered) in a small thread pool, never on the loop thread:
a long prompt delays neither another request's admission nor the running streams. The byte bound of
admission refuses a text too long for the context before it reaches the pool.

The decode side of a disaggregated request pulls its prompt's KV on the event loop (a task per pull,
through `KvPuller`) between its admission and its first step; the engine thread is told when the pull
ended. Aborting such a request cancels its pull; the engine frees the pull's blocks only once the pull
has stopped writing into them. The loop thread ends expired KV transfer leases between steps.

A runner whose worker process failed (WorkerFailedError from a step, or a worker that died while the
engine idled) stops the engine for good: every live request ends with FinishReason.ERROR, new ones are
refused, and `on_fatal` tells the server, which stops the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from conduit_common.engine_dialer import PLAINTEXT, EngineDialer
from conduit_engine.engine.llm_engine import EngineStats, LLMEngine
from conduit_engine.engine.observer import clock
from conduit_engine.engine.request import GenerationRequest, RequestOutput
from conduit_engine.errors import EngineUnavailableError, WorkerFailedError
from conduit_engine.kv_transfer.consumer import PendingPull
from conduit_engine.kv_transfer.puller import KvPuller
from conduit_engine.kv_transfer.transport import KvPullResult
from conduit_engine.telemetry.tracing import end_kv_transfer, kv_transfer_span, span_metadata

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    open_choices: int


class AsyncEngine:
    """Owns the loop thread that steps `core`; the only object that touches `core` after start."""

    def __init__(
        self,
        core: LLMEngine,
        on_fatal: Callable[[str], None] | None = None,
        max_message_bytes: int | None = None,
        dialer: EngineDialer = PLAINTEXT,
    ) -> None:
        """`on_fatal(reason)` is called once, on the loop thread, when the model can no longer run.
        `max_message_bytes` and `dialer`: how KV pulls reach other engines (gRPC limit, TLS, token)."""
        self.core = core
        self._on_fatal = on_fatal
        self.failure: str | None = None
        timeout = core.config.disaggregation.pull_timeout_seconds
        self._puller = KvPuller(core.kv_store, timeout, max_message_bytes, dialer, core.kv_transports)
        self._pulls: dict[str, asyncio.Task[None]] = {}  # request id → its running pull (event loop)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        # Outputs delivered to each event loop and not yet flushed into its streams' queues.
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        self._stopping = False
        self._tokenizers = concurrent.futures.ThreadPoolExecutor(
            core.config.scheduler.tokenizer_threads, thread_name_prefix="conduit-tokenize"
        )
        self._thread = threading.Thread(target=self._run, name="conduit-engine-loop", daemon=True)
        self._draining = False
        core.on_executor_failure(self._wakeup.set)  # a worker dying while idle wakes the loop
        self._thread.start()

    # ----- public API --------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        self._draining = True

    def migrate_all(self) -> None:
        """End every live request with FinishReason.MIGRATE (the drain's time is up: callers continue them
        on other engines); their streams end once they have read those outputs."""
        self._submit(lambda: self._deliver(self.core.migrate_all()))

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def pending_commands(self) -> int:
        """Requests, aborts and reads submitted but not yet applied by the loop thread."""
        return self._commands.qsize()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Submit `req` and yield its outputs until every choice has finished.

        Raises the engine's admission errors (see `admission`) before the first output; refuses every
        request while draining. Leaving the iterator early (client cancelled, GeneratorExit) aborts the
        request, which frees its blocks at the next step. A request that fails inside the engine ends
        with FinishReason.ERROR outputs, not an exception.
        """
        if self.failure is not None:
            raise EngineUnavailableError(f"the engine has stopped: {self.failure}")
        if self._draining or self._stopping:
            raise EngineUnavailableError("the engine is draining and accepts no new requests")
        if req.arrival_time is None:
            req.arrival_time = clock()  # queue and first-token times count from here
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), open_choices=req.num_choices)
        admitted: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                if self.failure is not None:
                    raise EngineUnavailableError(f"the engine has stopped: {self.failure}")
                with self._lock:
                    self.core.add_request(req, structure, prompt)
                    self._streams[req.request_id] = stream
                pull = self.core.pending_pull(req.request_id)
                if pull is not None:
                    # Started even if the caller is gone by then: only the pull's end frees its blocks.
                    loop.call_soon_threadsafe(self._start_pull, pull)
                loop.call_soon_threadsafe(_set_result, admitted, None)
            except BaseException as exc:
                loop.call_soon_threadsafe(_set_exception, admitted, exc)

        prompt = await self.off_loop(self.core.admission.prompt_token_ids, req)
        # A constrained request waits for its grammar here, off the step loop, holding no blocks.
        structure = None
        if req.params.structured is not None:
            structure = await self.core.compile_structure(req.params.structured)
        self._submit(add)
        finished = False
        try:
            await admitted
            while True:
                for item in _coalesce(await stream.queue.get(), stream.queue):
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finished:
                        stream.open_choices -= 1
                        if stream.open_choices == 0:
                            finished = True
                            return
        finally:
            if not finished:
                # Only this call's own request: a duplicate refused at admission (or still waiting for
                # it) shares an id with a live request of another caller, which it must never end.
                self._abort_stream(req.request_id, stream)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the tokenizer pool (tokenizing, rendering a chat template, detokenizing)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, *args)

    async def abort(self, request_id: str) -> bool:
        """Abort a live request; True if it was live."""
        with self._lock:
            live = request_id in self._streams
        if live:
            self.abort_nowait(request_id)
        return live

    def abort_nowait(self, request_id: str) -> None:
        pull = self._pulls.get(request_id)
        if pull is not None:
            pull.cancel()  # the engine frees its blocks when the pull task reports the end
        self._submit(lambda: self._deliver(self.core.abort(request_id)))

    def _owns(self, request_id: str, stream: _Stream) -> bool:
        with self._lock:
            return self._streams.get(request_id) is stream

    def _abort_stream(self, request_id: str, stream: _Stream) -> None:
        """Abort `request_id` if `stream` is the one it was admitted with (else: a refused duplicate, or
        a request that already ended, and there is nothing of this caller's to stop)."""
        if self._owns(request_id, stream):
            pull = self._pulls.get(request_id)
            if pull is not None:
                pull.cancel()  # the engine frees its blocks when the pull task reports the end

        def abort() -> None:
            # Checked again on the loop thread: an admission still queued when the caller left runs first.
            if self._owns(request_id, stream):
                self._deliver(self.core.abort(request_id))

        self._submit(abort)

    def _start_pull(self, pending: PendingPull) -> None:
        task = asyncio.ensure_future(self._pull(pending))
        self._pulls[pending.request_id] = task

    async def _pull(self, pending: PendingPull) -> None:
        """Run one pull and tell the engine thread how it ended (a failure or a cancel: None)."""
        result: KvPullResult | None = None
        try:
            if not pending.orphaned:  # set by the engine thread if the request already ended
                result = await self._traced_pull(pending)
        except asyncio.CancelledError:
            pass  # aborted: the request is ending; nothing writes into its blocks any more
        finally:
            self._pulls.pop(pending.request_id, None)
            self._submit(lambda: self.core.finish_pull(pending.request_id, result))

    async def _traced_pull(self, pending: PendingPull) -> KvPullResult | None:
        """The pull inside the request's `engine.kv_transfer` span, whose context goes with the pull."""
        spec = pending.spec
        with kv_transfer_span(
            pending.trace_context,
            request_id=pending.request_id,
            transfer_id=spec.transfer_id,
            peer=spec.source_address,
            num_blocks=spec.num_blocks,
        ) as span:
            result = await self._puller.pull(spec, pending.dest_block_ids, span_metadata(span))
            end_kv_transfer(span, *((result.num_blocks, result.num_bytes) if result else (None, None)))
        return result

    @property
    def kv_pulls_by_transport(self) -> dict[str, int]:
        """Pulls completed since start, by transport (read on the event loop that runs them)."""
        return dict(self._puller.pulls_by_transport)

    async def close_transport(self) -> None:
        """Close the KV transport's channels (at shutdown, on the loop that used them)."""
        tasks = list(self._pulls.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._puller.close()

    async def run_sync(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps (for reads that must not race a step)."""
        return await asyncio.wrap_future(self.call_soon(fn))

    def call_soon(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn` on the engine thread between steps; any thread may wait for the future's result.

        `fn` runs even if the future was cancelled meanwhile (a command submitted is a command run).
        After shutdown nothing runs it: wait with a timeout.
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def call() -> None:
            try:
                result = fn()
            except BaseException as exc:
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)
                return
            if future.set_running_or_notify_cancel():
                future.set_result(result)

        self._submit(call)
        return future

    @property
    def running(self) -> bool:
        """Whether the loop thread still runs commands (false once shutdown began)."""
        return not self._stopping and self._thread.is_alive()

    async def stats(self) -> EngineStats:
        return await self.run_sync(self.core.stats)

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
        self.core.kv_events.close()
        self.core.shutdown()

    # ----- loop thread -------------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopping:
            self._drain_commands()
            self.core.expire_kv_transfers()
            self.core.kv_events.publish()  # what commands (aborts, pulls, expiries) changed
            if self.failure is None and (failure := self.core.executor_failure()) is not None:
                self._stop_on_failure(failure)
            if self.failure is not None or not self.core.has_work():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            self._step()

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except WorkerFailedError as exc:
            self._stop_on_failure(str(exc))
            return
        except Exception as exc:
            # A bug or a device fault, never a bad request (admission rules those out): every live
            # request ends with FinishReason.ERROR and the loop goes on serving new ones.
            log.exception("engine step failed; ending the live requests with an error")
            outputs = self.core.fail_all(f"the engine step failed: {type(exc).__name__}")
        # Events first: a client that reads its final output and sends its next turn at once should find
        # that output's blocks in the gateway's index.
        self.core.kv_events.publish()
        self._deliver(outputs)
        if not self.core.has_work():
            self._check_integrity()

    def _stop_on_failure(self, reason: str) -> None:
        """The model is gone: fail every live request, refuse new ones, tell the server (once)."""
        log.error("the model cannot run any more (%s): ending every live request with an error", reason)
        self.failure = reason
        self._deliver(self.core.fail_all(f"the engine failed: {reason}"))
        self.core.kv_events.clear()  # nothing can be served from this cache any more
        if self._on_fatal is not None:
            self._on_fatal(reason)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams' event loops. A loop is woken once for everything delivered
        until it runs its flush: while it is busy, later steps' outputs join the same batch."""
        wake: list[asyncio.AbstractEventLoop] = []
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    pending = self._pending.get(stream.loop)
                    if pending is None:
                        pending = self._pending[stream.loop] = []
                        wake.append(stream.loop)
                    pending.append((stream, out))
            for request_id in {out.request_id for out in outputs if out.finished}:
                if not self.core.has_request(request_id):
                    self._streams.pop(request_id, None)
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._flush, loop)
            except RuntimeError:  # that loop has closed: nobody reads its streams any more
                with self._lock:
                    self._pending.pop(loop, None)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`: put every output delivered for it into its stream's queue."""
        with self._lock:
            items = self._pending.pop(loop, [])
        for stream, out in items:
            stream.queue.put_nowait(out)

    def _check_integrity(self) -> None:
        # Idle: every block must be free or cached; a violation is a bug worth failing loudly in logs.
        try:
            self.core.check_integrity()
        except AssertionError as exc:
            log.error("KV cache integrity check failed: %s", exc)


def _coalesce(
    first: RequestOutput | BaseException, waiting: asyncio.Queue[RequestOutput | BaseException]
) -> list[RequestOutput | BaseException]:
    """`first` and every output already waiting behind it, merged into one output per choice (each
    choice's tokens in order). An exception ends the batch, after what came before it; an output that
    reports an error stays a message of its own, after its choice's earlier tokens."""
    batch: list[RequestOutput | BaseException] = []
    merging: dict[int, int] = {}  # choice → position in `batch` of its output that later tokens join
    item = first
    while True:
        if isinstance(item, BaseException):
            batch.append(item)
            return batch
        at = merging.get(item.index)
        if at is not None and item.error is None:
            batch[at] = batch[at].merged_with(item)  # type: ignore[union-attr]
        else:
            if item.error is None:
                merging[item.index] = len(batch)
            batch.append(item)
        if waiting.empty():
            return batch
        item = waiting.get_nowait()


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
