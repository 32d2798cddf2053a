"""Shared pieces of the disaggregation tests: clients, engine loads, and waiting for engines to be idle."""

from __future__ import annotations

import grpc
import httpx
import openai

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.support.engine_fleet import EngineFleet
from tests.support.polling import wait_for

ADMIN_KEY = "admin-secret"


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/admin", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def load(address: str) -> engine_pb2.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)


def model_info(address: str) -> engine_pb2.GetModelInfoResponse:
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)


def holds_nothing(address: str) -> bool:
    reply = load(address)
    return (reply.kv_blocks_used, reply.kv_transfers_pending, reply.running_requests) == (0, 0, 0)


def wait_idle(fleet: EngineFleet, indices: list[int] | None = None) -> None:
    """Every engine (of `indices`) holds no KV block, no pending transfer and no request."""
    for index in indices if indices is not None else range(len(fleet.addresses)):
        address = fleet.addresses[index]
        wait_for(lambda address=address: holds_nothing(address), f"engine {address} to hold nothing")
