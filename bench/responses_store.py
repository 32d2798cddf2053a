"""What a stored response costs in the Redis response store: round trips and bytes per request, for
foreground (streamed or not), chained and background responses, on the real engine (stories260K) and a
real redis-server, measured by the store's own counters and Redis's MEMORY USAGE.

    .venv/bin/python bench/responses_store.py [--tokens 16,64,256]

Greedy, ignore_eos, so every request generates exactly the asked tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import openai
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.gateway_thread import GatewayThread
from tests.support.processes import require_shared, start_engine
from tests.support.redis_server import start_redis

MODEL = "stories260K"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,64,256")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    with (
        start_redis() as server,
        start_engine(require_shared(f"models/{MODEL}"), "--max-model-len", "512") as engine,
        GatewayThread([engine.address], response_store=f"redis://127.0.0.1:{server.port}/0") as gateway,
        # A second replica follows background runs, so its reads do not count as the first one's cost.
        GatewayThread([engine.address], response_store=f"redis://127.0.0.1:{server.port}/0") as follower,
    ):
        store = gateway.app.state.responses.store
        keys = redis.Redis(port=server.port)
        sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        other = openai.OpenAI(base_url=f"{follower.url}/v1", api_key="unused", max_retries=0)
        head = f"{'request':<34}{'tokens':>7}{'round trips':>13}{'bytes sent':>12}"
        print(f"{head}{'record B':>10}{'events B':>10}")
        for tokens in token_counts:
            common = {"model": MODEL, "temperature": 0, "max_output_tokens": tokens}
            common["extra_body"] = {"ignore_eos": True}
            for label, kwargs in (
                ("foreground, not streamed", {}),
                ("foreground, streamed", {"stream": True}),
                ("foreground, store: false", {"store": False}),
                ("background (events kept)", {"background": True}),
            ):
                trips, sent = store.round_trips, store.bytes_written
                response = sdk.responses.create(input="Tell me a story", **kwargs, **common)
                if kwargs.get("stream"):
                    response = list(response)[-1].response
                if kwargs.get("background"):
                    events = list(other.responses.retrieve(response.id, stream=True))
                    assert events[-1].type in ("response.completed", "response.incomplete")
                record = keys.memory_usage(f"conduit:responses:resp:{response.id}") or 0
                stream = keys.memory_usage(f"conduit:responses:events:{response.id}") or 0
                print(
                    f"{label:<34}{tokens:>7}{store.round_trips - trips:>13}{store.bytes_written - sent:>12}"
                    f"{record:>10}{stream:>10}"
                )
            short = {**common, "max_output_tokens": min(tokens, 64)}
            first = sdk.responses.create(input="Tell me a story", **short)
            trips, sent = store.round_trips, store.bytes_written
            sdk.responses.create(input="And then?", previous_response_id=first.id, **short)
            label, used = "chained (previous_response_id)", store.round_trips - trips
            print(f"{label:<34}{min(tokens, 64):>7}{used:>13}{store.bytes_written - sent:>12}")
        keys.close()


if __name__ == "__main__":
    main()
