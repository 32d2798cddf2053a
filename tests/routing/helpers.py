"""Shared pieces of the routing tests: the model name, the admin key, clients and views of a gateway."""

from __future__ import annotations

import httpx
import openai

from tests.support.stories import MODEL

ADMIN_KEY = "admin-secret"
# Two sequences per batch: a few concurrent requests already leave some waiting, not started.
ENGINE_ARGS = ("--max-num-seqs", "2")


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/admin", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def nodes(url: str) -> dict[str, dict]:
    """address → the node as GET /admin/nodes shows it."""
    with admin(url) as client:
        response = client.get("/nodes")
    assert response.status_code == 200, response.text
    return {node["address"]: node for node in response.json()["nodes"]}


def routed(url: str, addresses: list[str]) -> list[int]:
    """Requests the gateway has sent to each address (0 for one not in its pool)."""
    view = nodes(url)
    return [view[address]["routed"] if address in view else 0 for address in addresses]


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 2):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)


def deltas(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]
