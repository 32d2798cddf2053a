"""What producing KV cache events (SubscribeKvEvents) costs the engine's step loop, at batch 64.

    .venv/bin/python bench/kv_events_cost.py [--requests 64] [--repeats 3] [--num-threads 1]

Three engines on stories260K serve the same requests in lockstep, one step each in turn: one with no event
log (the block manager records nothing), and two recording every stored and removed block for one live
subscriber each (an asyncio loop in another thread that reads the batches, as the gRPC service does): one
publishing a batch only after each step (the loop before it published a step's evictions mid-step), one
as the engine runs now (mid-step, before the model, and after the step). Per step, a recording engine's
step time minus the plain one's is one paired sample; the median of all samples is the cost, printed in
µs per step and as a share of the step (interleaving step by step keeps other processes' noise out of the
difference), so the two recording rows are the before and after of the mid-step batch, in one run.
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
    variants = ("none", "after step", "mid + after step")
    extra: dict[str, list[float]] = {name: [] for name in variants[1:]}
    plain: list[float] = []
    steps = events = 0
    for _ in range(args.repeats):
        engines = {
            name: warm(
                make_engine(stories_path(), args.max_num_seqs, ParallelConfig(), args.num_threads, "auto", 1)
            )
            for name in variants
        }
        engines["none"].block_manager.events = None  # records nothing
        in_step = suppress_mid_step_publish(engines["after step"])  # the loop before the mid-step batch
        counted = {name: [0] if args.no_subscriber else subscribe(engines[name], loop) for name in extra}
        for engine in engines.values():
            submit(engine, requests)
        order = list(variants)
        while engines["none"].has_work():
            order.reverse()
            took = {}
            for name in order:
                engine = engines[name]
                t0 = time.perf_counter()
                in_step[0] = name == "after step"
                engine.step()
                in_step[0] = False
                if name != "none":
                    engine.kv_events.publish()  # what the loop thread does after each step
                took[name] = time.perf_counter() - t0
            for name in extra:
                extra[name].append(took[name] - took["none"])
            plain.append(took["none"])
            steps += 1
        time.sleep(0.1)
        events += counted["mid + after step"][0]
        for name in extra:
            engines[name].kv_events.close()  # ends the subscriber's stream
        for engine in engines.values():
            engine.shutdown()
    base = statistics.median(plain)
    print(
        f"stories260K, batch {args.max_num_seqs}: {args.requests} requests x {args.repeats} runs, "
        f"{steps // args.repeats} steps and {events // args.repeats} events read by a subscriber per run | "
        f"median step {1e6 * base:.0f} us without events"
    )
    for name, samples in extra.items():
        cost = statistics.median(samples)
        print(
            f"  recording + publishing {name}: {1e6 * cost:+.1f} us/step (median of paired steps), "
            f"{100 * cost / base:+.2f}% of the step"
        )


def suppress_mid_step_publish(engine) -> list[bool]:
    """Make `engine` publish only when the bench calls it after a step (the loop before the engine
    published a step's evictions mid-step); returns the flag the bench sets around `engine.step()`."""
    in_step = [False]
    publish = engine.kv_events.publish

    def after_step_only() -> None:
        if not in_step[0]:
            publish()

    engine.kv_events.publish = after_step_only
    return in_step


if __name__ == "__main__":
    main()
