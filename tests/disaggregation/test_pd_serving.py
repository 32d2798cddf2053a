"""Disaggregated serving through the gateway matches colocated serving, response for response.

Real engines (stories260K) with roles behind in-process gateways, driven with the openai SDK: more than
twenty requests (completions and chat, streamed and not, n = 2, logprobs, stop strings, seeded sampling,
echo, several prompts, prompt logprobs, a grammar) give the same JSON through a prefill/decode gateway
as through a gateway on one colocated engine, in three topologies (1P+1D, 1P+2D, 2P+1D), with every
engine of each pool used and every engine holding nothing afterwards. Also: the decode engine's prefix
cache saves pulls (and says so in GetLoad), a `both` engine serves either side, and GetModelInfo
reports each engine's role, layout and address.
"""

from __future__ import annotations

from typing import Any

import pytest

from conduit.engine.v1 import engine_pb2
from tests.disaggregation.conftest import BOTH, D1, D2, OTHER_LAYOUT, P1, P2
from tests.disaggregation.helpers import admin, load, model_info, sdk, wait_idle
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration

MESSAGES = [
    {"role": "system", "content": "You tell stories."},
    {"role": "user", "content": "Tell me a story"},
]
LONG = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
SEEDED = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}

# (name, endpoint, arguments): each is sent through both gateways; the responses must be equal.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("greedy", "completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}),
    ("dog", "completions", {"prompt": "The dog", "max_tokens": 30, "temperature": 0}),
    ("names", "completions", {"prompt": "Lily and Ben", "max_tokens": 30, "temperature": 0}),
    ("bos", "completions", {"prompt": [1], "max_tokens": 62, "temperature": 0}),
    ("long-prompt", "completions", {"prompt": LONG, "max_tokens": 30, "temperature": 0}),
    ("stop", "completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": [" Lily"]}),
    (
        "stop-at-first",
        "completions",
        {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": [", th"]},
    ),
    (
        "stop-included",
        "completions",
        {
            "prompt": PROMPT,
            "max_tokens": 40,
            "temperature": 0,
            "stop": ["."],
            "extra_body": {"include_stop_str_in_output": True},
        },
    ),
    ("n2-seeded", "completions", {"prompt": PROMPT, "max_tokens": 16, "n": 2, **SEEDED}),
    ("seeded", "completions", {"prompt": "The cat", "max_tokens": 30, **SEEDED}),
    ("logprobs", "completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2}),
    ("one-token", "completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}),
    ("two-prompts", "completions", {"prompt": [PROMPT, "The dog"], "max_tokens": 12, "temperature": 0}),
    ("echo", "completions", {"prompt": "The bird", "max_tokens": 10, "temperature": 0, "echo": True}),
    (
        "penalties",
        "completions",
        {"prompt": LONG, "max_tokens": 24, "frequency_penalty": 0.5, "presence_penalty": 0.3, **SEEDED},
    ),
    (
        "min-tokens",
        "completions",
        {"prompt": "The end.", "max_tokens": 20, "temperature": 0, "extra_body": {"min_tokens": 10}},
    ),
    (
        "prompt-logprobs",
        "completions",
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "extra_body": {"prompt_logprobs": 2}},
    ),
    (
        "regex",
        "completions",
        {
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": r"(, there was a [a-z]+)\."}},
        },
    ),
    ("stream", "completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": True}),
    (
        "stream-n2-usage",
        "completions",
        {
            "prompt": "Lily",
            "max_tokens": 12,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            **SEEDED,
        },
    ),
    ("chat", "chat", {"messages": MESSAGES, "max_tokens": 48, "temperature": 0}),
    ("chat-n2-seeded", "chat", {"messages": MESSAGES, "max_tokens": 16, "n": 2, **SEEDED}),
    (
        "chat-logprobs",
        "chat",
        {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    ),
    ("chat-length", "chat", {"messages": MESSAGES, "max_completion_tokens": 3, "temperature": 0}),
    ("chat-stop", "chat", {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "stop": ["."]}),
    (
        "chat-stream-usage",
        "chat",
        {
            "messages": MESSAGES,
            "max_tokens": 20,
            "stream": True,
            "stream_options": {"include_usage": True},
            **SEEDED,
        },
    ),
]
TOPOLOGIES = {"1P+1D": ([P1], [D1]), "1P+2D": ([P1], [D1, D2]), "2P+1D": ([P1, P2], [D1])}


def request(url: str, endpoint: str, arguments: dict[str, Any]) -> Any:
    """The response as comparable JSON: ids and times dropped, cached tokens apart (they depend on what
    each engine's prefix cache happens to hold; test_cached_tokens_come_from_the_prefill_engine)."""
    with sdk(url) as client:
        api = client.chat.completions if endpoint == "chat" else client.completions
        result = api.create(model=MODEL, **arguments)
        if arguments.get("stream"):
            return _by_choice([_comparable(chunk.model_dump()) for chunk in result])
        return _comparable(result.model_dump())


def _by_choice(chunks: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    """Streamed chunks per choice, in order (how choices interleave depends on batching), and the usage
    chunk."""
    grouped: dict[Any, list[dict[str, Any]]] = {}
    for chunk in chunks:
        key = chunk["choices"][0]["index"] if chunk["choices"] else "usage"
        grouped.setdefault(key, []).append(chunk)
    return grouped


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    body = {key: value for key, value in body.items() if key not in ("id", "created")}
    if body.get("usage"):
        body["usage"] = {key: value for key, value in body["usage"].items() if key != "prompt_tokens_details"}
    return body


@pytest.fixture(scope="module")
def colocated(make_module_gateway):
    """Every case's response from the `both` engine alone (the reference)."""
    gateway = make_module_gateway(engines=[BOTH])
    return {name: request(gateway.url, endpoint, arguments) for name, endpoint, arguments in CASES}


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_every_case_matches_colocated_serving(fleet, make_gateway, colocated, topology):
    prefill, decode = TOPOLOGIES[topology]
    gateway = make_gateway(prefill=prefill, decode=decode)
    before = {i: load(fleet.addresses[i]).finished_requests for i in (*prefill, *decode)}
    for name, endpoint, arguments in CASES:
        assert request(gateway.url, endpoint, arguments) == colocated[name], name
    wait_idle(fleet)
    # Round robin within each pool: every engine of the topology served some of the requests.
    for index in (*prefill, *decode):
        assert load(fleet.addresses[index]).finished_requests > before[index], fleet.addresses[index]
    with admin(gateway.url) as client:
        views = {node["address"]: node for node in client.get("/nodes").json()["nodes"]}
    assert {views[fleet.addresses[i]]["role"] for i in prefill} == {"prefill"}
    assert {views[fleet.addresses[i]]["role"] for i in decode} == {"decode"}


def test_cached_tokens_come_from_the_prefill_engine(make_gateway):
    gateway = make_gateway(prefill=[P1], decode=[D1])
    colocated = make_gateway(engines=[BOTH])
    prompt = [1, *range(260, 300)]  # two full blocks and a partial one
    for url in (gateway.url, colocated.url):
        with sdk(url) as client:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 32
        assert (again.usage.prompt_tokens, again.usage.completion_tokens) == (41, 4)


def test_blocks_in_the_decode_prefix_cache_are_not_pulled(fleet, make_gateway):
    gateway = make_gateway(prefill=[P1], decode=[D1])
    block = model_info(fleet.addresses[D1]).kv_layout
    block_bytes = 2 * block.num_layers * block.block_size * block.num_kv_heads * block.head_dim * 4
    shared = [1, *range(400, 447)]  # three full blocks no other test sends
    with sdk(gateway.url) as client:
        before = load(fleet.addresses[D1])
        client.completions.create(model=MODEL, prompt=[*shared, 5, 6], max_tokens=4, temperature=0)
        middle = load(fleet.addresses[D1])
        client.completions.create(model=MODEL, prompt=[*shared, 7, 8, 9], max_tokens=4, temperature=0)
        after = load(fleet.addresses[D1])
    assert (
        middle.kv_bytes_pulled - before.kv_bytes_pulled,
        middle.kv_bytes_saved - before.kv_bytes_saved,
    ) == (
        4 * block_bytes,
        0,
    )
    # The second prompt shares three full blocks with the first: only its fourth block is pulled.
    assert (after.kv_bytes_pulled - middle.kv_bytes_pulled, after.kv_bytes_saved - middle.kv_bytes_saved) == (
        block_bytes,
        3 * block_bytes,
    )
    wait_idle(fleet, [P1, D1])


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_both_engine_serves_either_side(fleet, make_gateway, colocated, side):
    pair = {"prefill": [BOTH], "decode": [D2]} if side == "prefill" else {"prefill": [P2], "decode": [BOTH]}
    gateway = make_gateway(**pair)
    for name, endpoint, arguments in CASES[:6]:
        assert request(gateway.url, endpoint, arguments) == colocated[name], name
    wait_idle(fleet, [BOTH, D2, P2])


def test_model_info_reports_role_layout_and_address(fleet):
    infos = [model_info(address) for address in fleet.addresses]
    assert [info.role for info in infos] == [
        engine_pb2.ENGINE_ROLE_PREFILL,
        engine_pb2.ENGINE_ROLE_PREFILL,
        engine_pb2.ENGINE_ROLE_DECODE,
        engine_pb2.ENGINE_ROLE_DECODE,
        engine_pb2.ENGINE_ROLE_BOTH,
        engine_pb2.ENGINE_ROLE_DECODE,
    ]
    assert [info.advertise_address for info in infos] == fleet.addresses
    layout = infos[P1].kv_layout
    assert (layout.model, layout.dtype, layout.block_size, layout.num_layers) == (MODEL, "float32", 16, 5)
    assert (layout.num_kv_heads, layout.head_dim, len(layout.fingerprint)) == (4, 8, 64)
    assert {info.kv_layout.fingerprint for info in infos[:OTHER_LAYOUT]} == {layout.fingerprint}
    assert infos[OTHER_LAYOUT].kv_layout.block_size == 32
    assert infos[OTHER_LAYOUT].kv_layout.fingerprint != layout.fingerprint
