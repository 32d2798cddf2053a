"""Charging a request the client left exactly what the engine generated for it.

When a client leaves mid-stream (it closed the connection, pressed stop), its prompts' engine requests may
still be generating, and the gateway has not read what they generated since its last read. Rather than
cancel those calls (and charge each unfinished prompt its worst case), the request's end hands its open
streams to a background task: for each prompt whose choices have not all finished it sends the engine's
Abort for that prompt's request and reads the stream to its end, where each unfinished choice ends with
FINISH_REASON_ABORT and the engine's final usage. A prompt read to its end is charged that usage: every
token the engine generated, and no more. When the Abort fails, the stream breaks, the drain takes longer
than DRAIN_TIMEOUT_S or the gateway shuts down meanwhile, that prompt keeps its worst-case charge
(handlers/usage_bound.py). The streams close (giving back their nodes' slots) when the drain ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from conduit_gateway.handlers.choices import UsageTotals
from conduit_gateway.handlers.streams import EngineStream, PromptStream, Unread
from conduit_gateway.handlers.usage_bound import TokenBound

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 2.0

Drains = set[asyncio.Task[None]]


def drain_later(
    drains: Drains,
    streams: Sequence[EngineStream],
    unread: Unread,
    usage: UsageTotals,
    bound: TokenBound,
    on_end: Callable[[], None],
    opening: Sequence[asyncio.Task[PromptStream | None]] = (),
    on_opened: Callable[[EngineStream], None] | None = None,
) -> None:
    """Drain `streams` in a background task kept in `drains`; when it ends (or is cancelled, even before
    it started) the streams close and `on_end` runs (the handler settles the key's charge there).
    `opening`: prompts the client left while they opened (streams.open_stream), each finishing into a
    stream to drain as well (`on_opened` is told of it first: the prompt is then charged), or None."""
    streams = list(streams)
    task = asyncio.get_running_loop().create_task(
        _drain_all(streams, opening, on_opened, unread, usage, bound)
    )
    drains.add(task)

    def ended(task: asyncio.Task[None]) -> None:
        try:
            for late in opening:
                if not late.done():
                    late.cancel()  # it gives up its call itself
                elif not late.cancelled() and late.exception() is None and late.result() not in streams:
                    result = late.result()
                    if result is not None:
                        result.close()
            for stream in streams:
                stream.close()
            if not task.cancelled() and task.exception() is not None:
                log.error("draining left streams failed", exc_info=task.exception())
            on_end()
        finally:
            # Last: a drain counts as in flight until its request is charged (what `drains` being empty
            # tells a shutdown, or a test reading the charge from another thread).
            drains.discard(task)

    task.add_done_callback(ended)


async def cancel_drains(drains: Drains) -> None:
    """Gateway shutdown: stop the drains in flight (their unfinished prompts keep the worst case)."""
    tasks = list(drains)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _drain_all(
    streams: list[EngineStream],
    opening: Sequence[asyncio.Task[PromptStream | None]],
    on_opened: Callable[[EngineStream], None] | None,
    unread: Unread,
    usage: UsageTotals,
    bound: TokenBound,
) -> None:
    if opening:
        for late in await asyncio.gather(*opening, return_exceptions=True):
            if isinstance(late, PromptStream):
                if on_opened is not None:
                    on_opened(late)
                # Its first message may be its last (the engine merges the outputs waiting for a slow
                # reader: a token, then the end the Abort made): the drain reads only what follows it.
                usage.update(late.prompt_index, late.first.usage)
                streams.append(late)
    await drain(streams, unread, usage, bound)


async def drain(
    streams: Sequence[EngineStream],
    unread: Unread,
    usage: UsageTotals,
    bound: TokenBound,
    timeout_s: float = DRAIN_TIMEOUT_S,
) -> None:
    """Abort each unfinished prompt's request and read its stream to the end, counting its usage; a
    prompt read to its end is marked ended in `bound` (charged its usage)."""
    for prompt_index, message in unread:  # read from the engine before the client left, not yet counted
        usage.update(prompt_index, message.usage)
    left = [stream for stream in streams if not bound.done(stream.prompt_index)]
    if not left:
        return
    try:
        await asyncio.wait_for(
            asyncio.gather(*(_drain_one(stream, usage, bound) for stream in left)), timeout_s
        )
    except TimeoutError:
        log.warning(
            "draining %d left stream(s) took over %.1fs: they keep the worst case", len(left), timeout_s
        )
        return
    drained = sum(bound.done(stream.prompt_index) for stream in left)
    log.info("the client left: %d of %d running prompt(s) aborted and read to their end", drained, len(left))


async def _drain_one(stream: EngineStream, usage: UsageTotals, bound: TokenBound) -> None:
    try:
        await stream.abort()
        while (message := await stream.read()) is not None:
            usage.update(stream.prompt_index, message.usage)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the drain timed out, or the gateway is stopping
        log.warning(
            "prompt %d left unfinished could not be drained: its call was cancelled", stream.prompt_index
        )
        return
    except Exception as exc:  # the prompt keeps its worst case
        log.warning("prompt %d left unfinished could not be drained: %r", stream.prompt_index, exc)
        return
    bound.ended(stream.prompt_index)
