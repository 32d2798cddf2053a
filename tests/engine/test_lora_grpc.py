"""LoRA adapters through the Engine gRPC API of a real server on stories260K: a request's model names its
adapter, adapters load and unload at run time, refusals carry the status and the reason."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.config import LoraConfig
from tests.engine.support.lora_factory import load_merged, make_adapter
from tests.engine.support.model_factory import greedy_with, load_hf
from tests.engine.support.server_thread import ServerThread, engine_config
from tests.support.stories import PROMPT_IDS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adapters(stories_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": make_adapter(stories_path, root / "a1", r=8, seed=1, magnitude=1.0),
        "a2": make_adapter(
            stories_path, root / "a2", r=4, seed=2, magnitude=1.0, targets=["q_proj", "v_proj"]
        ),
        "big": make_adapter(stories_path, root / "big", r=16, seed=3),
        "dora": make_adapter(stories_path, root / "dora", r=4, seed=4, use_dora=True),
    }


@pytest.fixture(scope="module")
def server(stories_path, adapters):
    config = dataclasses.replace(
        engine_config(stories_path),
        lora=LoraConfig(
            enable_lora=True, lora_modules=(("a1", str(adapters["a1"])),), max_loras=2, max_lora_rank=8
        ),
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    return server.stub()


def generate(stub, model: str | None, max_tokens: int = 24, **sampling) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for key, value in sampling.items():
        setattr(params, key, value)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT_IDS), sampling=params)
    if model is not None:
        req.model = model
    return [t for m in stub.Generate(req) for t in m.token_ids]


def test_a_request_whose_model_is_an_adapter_runs_it(stub, stories_path, adapters):
    base = greedy_with(load_hf(stories_path), list(PROMPT_IDS), 24)
    assert generate(stub, None) == base
    assert generate(stub, "stories260K") == base
    merged = greedy_with(load_merged(stories_path, adapters["a1"]), list(PROMPT_IDS), 24)
    assert merged != base
    assert generate(stub, "a1") == merged
    listed = stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())
    assert [(a.name, a.rank, a.parent) for a in listed.adapters] == [("a1", 8, "stories260K")]
    assert listed.max_loras == 2
    assert list(stub.GetLoad(pb.GetLoadRequest()).lora_adapters) == ["a1"]


def test_an_unknown_model_is_not_found_and_names_the_adapters(stub):
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, "nope")
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "'nope' is not served here" in err.value.details() and "a1" in err.value.details()


def test_load_generate_and_unload_at_run_time(stub, stories_path, adapters):
    loaded = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="a2", lora_path=str(adapters["a2"])))
    assert (loaded.adapter.name, loaded.adapter.rank, loaded.adapter.parent) == ("a2", 4, "stories260K")
    merged = greedy_with(load_merged(stories_path, adapters["a2"]), list(PROMPT_IDS), 24)
    assert generate(stub, "a2") == merged
    # Seeded sampling under an adapter repeats.
    sampled = [generate(stub, "a2", temperature=1.0, seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="a2"))
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, "a2")
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="a2"))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "no LoRA adapter 'a2' is loaded" in err.value.details()


@pytest.mark.parametrize(
    ("name", "path_key", "code", "message"),
    [
        (
            "a1",
            "a2",
            grpc.StatusCode.INVALID_ARGUMENT,
            "lora_path: adapter 'a1': an adapter of that name is already",
        ),
        ("big", "big", grpc.StatusCode.INVALID_ARGUMENT, "rank 16 exceeds --max-lora-rank 8"),
        ("dora", "dora", grpc.StatusCode.INVALID_ARGUMENT, "DoRA (use_dora: true) is not supported"),
        ("", "a2", grpc.StatusCode.INVALID_ARGUMENT, "lora_name: must not be empty"),
        ("x", None, grpc.StatusCode.INVALID_ARGUMENT, "does not exist (and it is not a Hub id"),
    ],
)
def test_refused_loads_say_why(stub, adapters, name, path_key, code, message):
    path = str(adapters[path_key]) if path_key else "/no/such/folder"
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path))
    assert err.value.code() is code
    assert message in err.value.details()
    assert [a.name for a in stub.ListLoraAdapters(pb.ListLoraAdaptersRequest()).adapters] == ["a1"]


def test_an_engine_without_lora_refuses_loads(stories_path, adapters):
    srv = ServerThread(engine_config(stories_path)).start()
    try:
        stub = srv.stub()
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="a1", lora_path=str(adapters["a1"])))
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "--enable-lora" in err.value.details()
        assert not stub.ListLoraAdapters(pb.ListLoraAdaptersRequest()).adapters
    finally:
        srv.stop()
