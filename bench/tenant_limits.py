"""Tenant limits under attack: tokens a rate-limited key gets generated against what it is charged.

    .venv/bin/python bench/tenant_limits.py

The real engine on stories260K (one sequence at a time) behind the real gateway app with a keys file;
the rate limits' clock stands still, so a key's charge is read exactly from its x-ratelimit headers.
Each attack prints its outcome (HTTP status), the tokens the engine generated for it (its Prometheus
counter) and the tokens the key was charged:

- `n=100`: one completion with n=100, max_tokens=400 on a 200-TPM key;
- `50x20`: 50 prompts x n=20, max_tokens=50 on a 200-TPM key;
- `leave`: 3 prompts x max_tokens=500 (the last two queued behind the first), the client leaving once the
  engine has sampled a token of it, on a 100000-TPM key;
- `stop`: a streamed completion with max_tokens=500 whose client closes the stream after 2 chunks (a
  user pressing stop), on a 100000-TPM key;
- `too long` / `invalid`: a prompt longer than the context (the engine refuses it) and a request the
  gateway's validation refuses, on a 10-RPM key: the requests each cost the key (0: it was free).

"charged" is the bucket's capacity less its level, so a debt shows in full (the headers stop at 0).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

import httpx  # noqa: E402

from bench.common import stories_path  # noqa: E402
from tests.support.clock import ManualClock  # noqa: E402
from tests.support.gateway_thread import GatewayThread  # noqa: E402
from tests.support.processes import free_port, start_engine  # noqa: E402
from tests.support.prometheus import scrape  # noqa: E402

MODEL = "stories260K"
PROMPT = "Once upon a time"
KEYS = [
    {"name": "n100", "key": "sk-n100", "limits": {"tokens_per_minute": 200}},
    {"name": "wide", "key": "sk-wide", "limits": {"tokens_per_minute": 200}},
    {"name": "leave", "key": "sk-leave", "limits": {"tokens_per_minute": 100_000}},
    {"name": "stop", "key": "sk-stop", "limits": {"tokens_per_minute": 100_000}},
    {"name": "refused", "key": "sk-refused", "limits": {"requests_per_minute": 10}},
]


class Stack:
    def __init__(self, gateway: GatewayThread, metrics_port: int) -> None:
        self.gateway = gateway
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def generated(self) -> int:
        return int(scrape(self.metrics_url).value("conduit_engine_generation_tokens_total"))

    def idle(self) -> bool:
        metrics = scrape(self.metrics_url)
        return (
            metrics.value("conduit_engine_requests_running")
            + metrics.value("conduit_engine_requests_waiting")
            == 0
        )

    def headers(self, name: str) -> dict[str, str]:
        key = next(key for key in self.gateway.ctx.api_keys.keys if key.name == name)
        return self.gateway.ctx.rate_limiter.headers(key)

    def charged(self, name: str) -> int:
        """Capacity less the bucket's level (read inside: the headers stop at 0, a debt goes below)."""
        self.headers(name)  # refills the bucket
        bucket = self.gateway.ctx.rate_limiter._buckets[name].tokens
        return round(bucket.capacity - bucket.level)

    def settle(self) -> None:
        for _ in range(400):
            drains = getattr(self.gateway.ctx, "drains", ())  # left requests still being read to the end
            if self.gateway.ctx.limiter.active == 0 and not drains and self.idle():
                return
            time.sleep(0.025)


def post(stack: Stack, key: str, body: dict) -> int:
    response = httpx.post(
        f"{stack.gateway.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )
    return response.status_code


async def leave_while_generating(stack: Stack, body: dict) -> None:
    start = stack.generated()
    async with httpx.AsyncClient(base_url=stack.gateway.url, timeout=300) as client:
        request = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-leave"})
        )
        while stack.generated() == start and not request.done():
            await asyncio.sleep(0.005)
        request.cancel()
        try:
            await request
        except asyncio.CancelledError:
            pass


def stop_after(stack: Stack, body: dict, chunks: int) -> str:
    """Stream `body` and close the stream after `chunks` data events."""
    seen = 0
    with httpx.Client(base_url=stack.gateway.url, timeout=300) as client:
        headers = {"Authorization": "Bearer sk-stop"}
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            for line in response.iter_lines():
                seen += line.startswith("data: {")
                if seen == chunks:
                    break
    return "stopped"


def attack(stack: Stack, label: str, name: str, run) -> None:
    before = stack.generated()
    status = run()
    stack.settle()
    made = stack.generated() - before
    print(f"{label:8s} status={status!s:9s} generated={made:6d} charged={stack.charged(name):6d}")


def main() -> None:
    metrics_port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "keys.json"
        path.write_text(json.dumps(KEYS))
        engine_args = ("--max-num-seqs", "1", "--metrics-port", str(metrics_port))
        with (
            start_engine(stories_path(), *engine_args) as engine,
            GatewayThread([engine.address], clock=ManualClock(0.0), api_keys_file=str(path)) as gateway,
        ):
            stack = Stack(gateway, metrics_port)
            big = {"model": MODEL, "prompt": PROMPT, "n": 100, "max_tokens": 400, "ignore_eos": True}
            attack(stack, "n=100", "n100", lambda: post(stack, "sk-n100", big))
            wide = {"model": MODEL, "prompt": [PROMPT] * 50, "n": 20, "max_tokens": 50, "ignore_eos": True}
            attack(stack, "50x20", "wide", lambda: post(stack, "sk-wide", wide))
            queued = {"model": MODEL, "prompt": [PROMPT] * 3, "max_tokens": 500, "ignore_eos": True}
            attack(
                stack, "leave", "leave", lambda: asyncio.run(leave_while_generating(stack, queued)) or "left"
            )
            streamed = {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 500,
                "ignore_eos": True,
                "stream": True,
            }
            attack(stack, "stop", "stop", lambda: stop_after(stack, streamed, 2))
            for label, body in (
                ("too long", {"model": MODEL, "prompt": PROMPT * 200, "max_tokens": 4}),
                ("invalid", {"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}),
            ):
                before = int(stack.headers("refused")["x-ratelimit-remaining-requests"])
                status = post(stack, "sk-refused", body)
                left = int(stack.headers("refused")["x-ratelimit-remaining-requests"])
                cost = before - left
                print(f"{label:8s} status={status}       requests it cost of the key's 10 per minute: {cost}")


if __name__ == "__main__":
    main()
