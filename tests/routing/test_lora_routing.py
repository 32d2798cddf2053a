"""LoRA adapters through the gateway over two real engines on stories260K: /v1/models lists them with their
parent, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin key) reach both engines, a request
whose model is an adapter goes to an engine that has it loaded, and, when none that is ready has, to the
least loaded one, which loads it."""

from __future__ import annotations

import httpx
import pytest

from conduit.engine.v1 import engine_pb2
from tests.engine.support.lora_factory import load_merged, make_adapter
from tests.engine.support.model_factory import greedy_with
from tests.routing.helpers import ADMIN_KEY, admin, routed, sdk
from tests.support.engine_fleet import EngineFleet
from tests.support.polling import wait_for
from tests.support.processes import require_shared
from tests.support.stories import MODEL, PROMPT, PROMPT_IDS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    model = require_shared(f"models/{MODEL}")
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "a1": make_adapter(model, root / "a1", r=8, seed=1, magnitude=1.0),
        "a2": make_adapter(model, root / "a2", r=4, seed=2, magnitude=1.0),
        "big": make_adapter(model, root / "big", r=32, seed=3),
    }
    return model, made


@pytest.fixture(scope="module")
def lora_fleet(adapters):
    model, made = adapters
    flags = ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "16"]
    per_engine = [["--lora-modules", f"a1={made['a1']}"], []]
    with EngineFleet(model, 2, flags, per_engine) as engines:
        yield engines


def reference(model, adapter, max_tokens=12) -> list[int]:
    return greedy_with(load_merged(model, adapter), list(PROMPT_IDS), max_tokens)


def served_adapters(fleet, index: int) -> list[str]:
    listed = fleet.stub(index).ListLoraAdapters(engine_pb2.ListLoraAdaptersRequest())
    return sorted(a.name for a in listed.adapters)


def lora_post(url: str, path: str, body: dict, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def generate_ids(fleet, index: int, model: str, max_tokens: int = 12) -> list[int]:
    params = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    request = engine_pb2.GenerateRequest(
        token_ids=engine_pb2.TokenIds(ids=PROMPT_IDS), sampling=params, model=model
    )
    return [t for m in fleet.stub(index).Generate(request) for t in m.token_ids]


def test_models_list_adapters_with_their_parent(lora_fleet, adapters, make_gateway):
    _, made = adapters
    gateway = make_gateway(lora_fleet.addresses)
    cards = {card.id: card for card in sdk(gateway.url).models.list().data}
    assert set(cards) == {MODEL, "a1"}
    assert (cards["a1"].parent, cards["a1"].root) == (MODEL, str(made["a1"]))
    assert cards[MODEL].parent is None
    one = httpx.get(f"{gateway.url}/v1/models/a1").json()
    assert (one["id"], one["parent"]) == ("a1", MODEL)
    # An adapter shares its base model's tokenizer and context length.
    counts = {}
    for model in (MODEL, "a1"):
        body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story"}]}
        reply = httpx.post(f"{gateway.url}/v1/messages/count_tokens", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        counts[model] = reply.json()["input_tokens"]
    assert counts["a1"] == counts[MODEL] > 0


def test_requests_for_an_adapter_go_to_the_engine_that_has_it(lora_fleet, adapters, make_gateway):
    model, made = adapters
    gateway = make_gateway(lora_fleet.addresses, routing="round_robin")
    expected = reference(model, made["a1"])
    before = routed(gateway.url, lora_fleet.addresses)
    client = sdk(gateway.url)
    for _ in range(4):
        reply = client.completions.create(model="a1", prompt=PROMPT, max_tokens=12, temperature=0)
        assert reply.model == "a1" and reply.usage.completion_tokens == 12
    after = routed(gateway.url, lora_fleet.addresses)
    assert [a - b for a, b in zip(after, before, strict=True)] == [4, 0]  # LoRA affinity
    assert generate_ids(lora_fleet, 0, "a1") == expected
    assert served_adapters(lora_fleet, 1) == []


def test_load_and_unload_reach_every_engine_with_the_admin_key(lora_fleet, adapters, make_gateway):
    model, made = adapters
    gateway = make_gateway(lora_fleet.addresses, api_keys=("api-key",))
    body = {"lora_name": "a2", "lora_path": str(made["a2"])}
    for key in (None, "api-key", "wrong"):
        refused = lora_post(gateway.url, "/v1/load_lora_adapter", body, key)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    loaded = lora_post(gateway.url, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'a2' added successfully."
    assert served_adapters(lora_fleet, 0) == ["a1", "a2"] and served_adapters(lora_fleet, 1) == ["a2"]
    expected = reference(model, made["a2"])
    assert generate_ids(lora_fleet, 0, "a2") == expected == generate_ids(lora_fleet, 1, "a2")
    api = httpx.Client(base_url=gateway.url, headers={"Authorization": "Bearer api-key"}, timeout=60)
    listed = api.get("/v1/models").json()["data"]
    assert {c["id"]: c.get("parent") for c in listed} == {MODEL: None, "a1": MODEL, "a2": MODEL}
    reply = api.post(
        "/v1/completions", json={"model": "a2", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 12

    unloaded = lora_post(gateway.url, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'a2' removed successfully."
    assert served_adapters(lora_fleet, 0) == ["a1"] and served_adapters(lora_fleet, 1) == []
    gone = api.post("/v1/completions", json={"model": "a2", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    again = lora_post(gateway.url, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"


def test_refused_loads_carry_the_engines_reason(lora_fleet, adapters, make_gateway):
    _, made = adapters
    gateway = make_gateway(lora_fleet.addresses)
    big = lora_post(gateway.url, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(made["big"])})
    assert big.status_code == 400
    error = big.json()["error"]
    assert error["param"] == "lora_path" and "rank 32 exceeds --max-lora-rank 16" in error["message"]
    missing = lora_post(gateway.url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    base = lora_post(gateway.url, "/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": str(made["a2"])})
    assert base.status_code == 400 and base.json()["error"]["param"] == "lora_name"
    assert served_adapters(lora_fleet, 1) == []


def test_without_a_ready_engine_holding_it_the_least_loaded_one_loads_the_adapter(
    lora_fleet, adapters, make_gateway
):
    model, made = adapters
    gateway = make_gateway(lora_fleet.addresses)
    holder, other = lora_fleet.addresses
    with admin(gateway.url) as client:
        assert client.post(f"/nodes/{holder}/drain").status_code == 200
        try:
            reply = sdk(gateway.url).completions.create(
                model="a1", prompt=PROMPT, max_tokens=12, temperature=0
            )
            assert reply.usage.completion_tokens == 12
            assert served_adapters(lora_fleet, 1) == ["a1"]
            assert generate_ids(lora_fleet, 1, "a1") == reference(model, made["a1"])
            assert routed(gateway.url, [other])[0] >= 1
        finally:
            assert client.post(f"/nodes/{holder}/resume").status_code == 200
    # Clean up for the other tests: engine 1 drops the copy.
    lora_fleet.stub(1).UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name="a1"))
    wait_for(lambda: served_adapters(lora_fleet, 1) == [], "engine 1 to drop a1")
