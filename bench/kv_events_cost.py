"""What producing KV cache events (SubscribeKvEvents) costs the engine's step loop, at batch 64.

    .venv/bin/python bench/kv_events_cost.py [--requests 64] [--repeats 3] [--num-threads 1]

Two engines on stories260K serve the same requests in lockstep, one step each in turn: one with no event
log (the block manager records nothing), one recording every stored and removed block and publishing a
batch after each step to one live subscriber (an asyncio loop in another thread that reads the batches, as
the gRPC service does). Per step, the second engine's step time minus the first's is one paired sample;
the median of all samples is the cost, printed in µs per step and as a share of the step (interleaving
step by step keeps other processes' noise out of the difference).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from common import request_set, stories_path
from engine_throughput import make_engine, submit, warm

from conduit_engine.config import ParallelConfig


def subscribe(engine, loop: asyncio.AbstractEventLoop) -> list[int]:
    """Register one subscriber on `loop` that counts the events it reads; returns the counter."""
    counted = [0]

    async def run_now(fn):
        return fn()  # the bench's main thread is the engine thread and waits for this

    async def follow() -> None:
        _, batches = await engine.kv_events.subscribe(run_now)
        async for batch in batches:
            counted[0] += len(batch.events)

    ready = threading.Event()

    async def start() -> None:
        asyncio.ensure_future(follow())
        await asyncio.sleep(0.05)
        ready.set()

    asyncio.run_coroutine_threadsafe(start(), loop)
    ready.wait()
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--no-subscriber", action="store_true", help="record and publish to nobody")
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    requests = request_set(args.requests, 512, prompt_range=(16, 160), output_range=(32, 160))
    differences: list[float] = []
    plain: list[float] = []
    steps = events = 0
    for _ in range(args.repeats):
        engines = {
            recorded: warm(
                make_engine(stories_path(), args.max_num_seqs, ParallelConfig(), args.num_threads, "auto", 1)
            )
            for recorded in (False, True)
        }
        engines[False].block_manager.events = None  # records nothing
        counted = [0] if args.no_subscriber else subscribe(engines[True], loop)
        for engine in engines.values():
            submit(engine, requests)
        order = [False, True]
        while engines[False].has_work():
            order.reverse()
            took = {}
            for recorded in order:
                engine = engines[recorded]
                t0 = time.perf_counter()
                engine.step()
                if recorded:
                    engine.kv_events.publish()  # what the loop thread does after each step
                took[recorded] = time.perf_counter() - t0
            differences.append(took[True] - took[False])
            plain.append(took[False])
            steps += 1
        time.sleep(0.1)
        events += counted[0]
        engines[True].kv_events.close()  # ends the subscriber's stream
        for engine in engines.values():
            engine.shutdown()
    extra, base = statistics.median(differences), statistics.median(plain)
    print(
        f"stories260K, batch {args.max_num_seqs}: {args.requests} requests x {args.repeats} runs, "
        f"{steps // args.repeats} steps and {events // args.repeats} events read by the subscriber per "
        f"run | "
        f"median step {1e6 * base:.0f} us without events; recording + publishing adds "
        f"{1e6 * extra:.1f} us/step (median of paired steps): {100 * extra / base:+.2f}% of the step"
    )


if __name__ == "__main__":
    main()
