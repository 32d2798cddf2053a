"""One streamed request to an OpenAI-compatible server, timed token by token.

Works with /v1/completions and /v1/chat/completions as Conduit's gateway, llama.cpp's llama-server and
vLLM serve them. Times are taken when each Server-Sent Event is read: TTFT at the first event that carries
text, one inter-token gap per later event that carries text. Output tokens come from the usage the server
reports (`stream_options.include_usage`), else from the number of text events.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.loadgen.workload import RequestSpec

ENDPOINTS = ("completions", "chat")


@dataclass
class RequestRecord:
    """What one request did; times in seconds, `start` relative to the run's start."""

    start: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_reported: bool = False
    planned_prompt_tokens: int | None = None
    planned_output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Target:
    """Where and how to send: the server's base URL (without /v1), the model name, the API flavour."""

    base_url: str
    model: str
    endpoint: str = "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def event_text(event: dict[str, Any]) -> str:
    """The text an SSE event carries, for either endpoint ('' for usage-only or role-only events)."""
    parts = []
    for choice in event.get("choices") or []:
        if "delta" in choice:
            parts.append((choice["delta"] or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


class _StreamTimer:
    """Turns the events of one stream into a RequestRecord."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.sent = time.perf_counter()
        self.last: float | None = None
        self.text_events = 0

    def on_event(self, event: dict[str, Any]) -> None:
        if "error" in event:
            raise _ServerError(f"error event: {json.dumps(event['error'])[:300]}")
        usage = event.get("usage")
        if usage:
            self.record.usage_reported = True
            self.record.prompt_tokens = usage.get("prompt_tokens")
            self.record.output_tokens = usage.get("completion_tokens") or 0
        if not event_text(event):
            return
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft = now - self.sent
        else:
            self.record.itl.append(now - self.last)
        self.last = now
        self.text_events += 1

    def finish(self) -> None:
        self.record.e2e = time.perf_counter() - self.sent
        if not self.record.usage_reported:
            self.record.output_tokens = self.text_events
        self.record.ok = self.text_events > 0 or self.record.output_tokens > 0
        if not self.record.ok:
            self.record.error = "the stream ended without any output"


class _ServerError(Exception):
    pass


async def send_request(client: httpx.AsyncClient, target: Target, spec: RequestSpec) -> RequestRecord:
    """Stream one request; never raises for the server's or the network's faults (they go in .error)."""
    record = RequestRecord(planned_prompt_tokens=spec.prompt_tokens, planned_output_tokens=spec.max_tokens)
    timer = _StreamTimer(record)
    try:
        async with client.stream(
            "POST", target.path, json=target.body(spec), headers=target.headers()
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                timer.on_event(json.loads(data))
        timer.finish()
    except (httpx.HTTPError, _ServerError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:400]
        record.ok = False
    return record
