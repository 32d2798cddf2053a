"""`conduit-gateway --workers 2`, the real processes: requests spread over both workers, the admin API
and /metrics cover both, a key's limits hold for the pair, SIGTERM drains both, a killed worker returns.

Each request goes on a fresh connection, so the kernel's SO_REUSEPORT hash places each anew; the
worker that answered is the response's X-Conduit-Worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading

import httpx
import pytest

from tests.gateway.conftest import MODEL
from tests.support.fake_engine import FakeEngine, Script
from tests.support.polling import wait_for
from tests.support.proc_tree import children, command_line, is_running
from tests.support.processes import ManagedProcess, ProcessStartError, start_gateway
from tests.support.prometheus import scrape

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": "Bearer admin-sekret"}
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 2}


def complete(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=BODY, headers=headers, timeout=30)


def start_workers(engines: str, *args: str, healthy: bool = True) -> ManagedProcess:
    """`start_gateway` with --workers 2, once both workers answer (it waits for one)."""
    gateway = start_gateway(engines, "--workers", "2", *args, wait_healthy=healthy)
    seen: set[str] = set()

    def both_answer() -> bool:
        with contextlib.suppress(httpx.TransportError):
            seen.add(httpx.get(f"{gateway.url}/health", timeout=5).headers["x-conduit-worker"])
        return seen == {"0", "1"}

    try:
        wait_for(both_answer, "both workers to answer", attempts=1200, delay_s=0.05)
    except BaseException:
        gateway.stop()
        raise
    return gateway


def workers_of(process_pid: int) -> list[int]:
    """The supervisor's worker processes (not multiprocessing's resource tracker)."""
    return [pid for pid in children(process_pid) if "spawn_main" in command_line(pid)]


def test_requests_land_on_both_workers_and_metrics_are_their_sum(fake):
    with start_workers(fake.address) as gateway:
        answers = [complete(gateway.url) for _ in range(24)]
        assert [answer.status_code for answer in answers] == [200] * 24
        assert {answer.headers["x-conduit-worker"] for answer in answers} == {"0", "1"}
        assert {answer.json()["choices"][0]["text"] for answer in answers} == {"Once upon"}
        metrics = scrape(f"{gateway.url}/metrics")
        assert metrics.value("conduit_gateway_workers") == 2
        total = metrics.value(
            "conduit_gateway_requests_total", route="/v1/completions", method="POST", status="200"
        )
        assert total == 24
        assert metrics.value("conduit_gateway_completion_tokens_total") == 48
        assert metrics.value("conduit_gateway_node_routed_total", node=fake.address) == 24
        # Every worker watches the engine's health: it is up once, not twice.
        assert metrics.value("conduit_gateway_engine_up", engine=fake.address) == 1


def test_one_worker_is_one_process_with_no_worker_header(fake):
    with start_gateway(fake.address) as gateway:
        answer = complete(gateway.url)
        assert answer.status_code == 200 and "x-conduit-worker" not in answer.headers
        assert workers_of(gateway.process.pid) == []


def test_a_node_added_through_the_admin_api_is_used_by_every_worker():
    with (
        FakeEngine(MODEL) as engine,
        start_workers("127.0.0.1:1", "--admin-key", "admin-sekret", healthy=False) as gateway,
    ):
        # The static engine never answers; the one the admin API adds does.
        added = httpx.post(f"{gateway.url}/admin/nodes", json={"address": engine.address}, headers=ADMIN)
        assert added.status_code == 201, added.text
        served: dict[str, int] = {}

        def both_serve() -> bool:
            answer = complete(gateway.url)
            if answer.status_code == 200:
                served[answer.headers["x-conduit-worker"]] = (
                    served.get(answer.headers["x-conduit-worker"], 0) + 1
                )
            return set(served) == {"0", "1"}

        wait_for(both_serve, "both workers serving through the added node", attempts=200, delay_s=0.05)
        again = httpx.post(f"{gateway.url}/admin/nodes", json={"address": engine.address}, headers=ADMIN)
        assert again.status_code == 409 and again.json()["error"]["code"] == "node_exists"

        def states() -> dict[str, str]:
            found: dict[str, str] = {}
            for _ in range(40):
                answer = httpx.get(f"{gateway.url}/admin/nodes/{engine.address}", headers=ADMIN)
                found[answer.headers["x-conduit-worker"]] = answer.json()["state"]
                if len(found) == 2:
                    break
            return found

        drained = httpx.post(f"{gateway.url}/admin/nodes/{engine.address}/drain", headers=ADMIN)
        assert drained.status_code == 200 and drained.json()["state"] == "draining"
        assert states() == {"0": "draining", "1": "draining"}  # each caught up before it answered
        draining = [complete(gateway.url) for _ in range(6)]
        assert [answer.status_code for answer in draining] == [503] * 6
        resumed = httpx.post(f"{gateway.url}/admin/nodes/{engine.address}/resume", headers=ADMIN)
        assert resumed.status_code == 200
        assert states() == {"0": "serving", "1": "serving"}

        removed = httpx.delete(f"{gateway.url}/admin/nodes/{engine.address}", headers=ADMIN)
        assert removed.status_code == 200
        listed: dict[str, list[str]] = {}

        def both_forgot() -> bool:
            answer = httpx.get(f"{gateway.url}/admin/nodes", headers=ADMIN)
            listed[answer.headers["x-conduit-worker"]] = [n["address"] for n in answer.json()["nodes"]]
            return set(listed) == {"0", "1"} and all(engine.address not in v for v in listed.values())

        wait_for(both_forgot, "both workers listing the node as gone", attempts=200, delay_s=0.05)
        assert listed == {"0": ["127.0.0.1:1"], "1": ["127.0.0.1:1"]}


def test_a_keys_requests_per_minute_hold_across_workers(fake, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"keys": [{"name": "team", "key": "sk-team", "limits": {"requests_per_minute": 4}}]})
    )
    with start_workers(fake.address, "--api-keys-file", str(keys)) as gateway:
        answers = [complete(gateway.url, {"Authorization": "Bearer sk-team"}) for _ in range(12)]
        codes = [answer.status_code for answer in answers]
        # 4 in all, not 4 per worker (the bucket refills one request per 15 s).
        assert codes.count(200) == 4 and codes.count(429) == 8, codes
        assert {answer.headers["x-conduit-worker"] for answer in answers} == {"0", "1"}
        refused = next(answer for answer in answers if answer.status_code == 429)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["x-ratelimit-limit-requests"] == "4"


def test_a_keys_concurrent_requests_hold_across_workers(fake, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"keys": [{"name": "team", "key": "sk-team", "limits": {"max_concurrent_requests": 1}}]})
    )
    fake.reset(Script(hold_after=1))
    headers = {"Authorization": "Bearer sk-team"}
    with start_workers(fake.address, "--api-keys-file", str(keys)) as gateway:
        held = Stream(gateway.url, headers)
        wait_for(lambda: held.worker is not None, "the first stream to start")
        refused = [complete(gateway.url, headers) for _ in range(12)]
        assert [answer.status_code for answer in refused] == [429] * 12
        assert {answer.headers["x-conduit-worker"] for answer in refused} == {"0", "1"}
        fake.release()
        held.join()
        assert held.done


class Stream(threading.Thread):
    """A streamed completion read to its end in a thread; `worker` is set once it started."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.headers = url, headers or {}
        self.worker: str | None = None
        self.text = ""
        self.done = False
        self.start()

    def run(self) -> None:
        body = {**BODY, "max_tokens": 4, "stream": True}
        with httpx.stream(
            "POST", f"{self.url}/v1/completions", json=body, headers=self.headers, timeout=60
        ) as r:
            self.worker = r.headers.get("x-conduit-worker")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.text += json.loads(line[6:])["choices"][0]["text"]


def test_sigterm_drains_both_workers_and_the_supervisor_exits_0(fake):
    fake.reset(Script(hold_after=2))
    gateway = start_workers(fake.address, "--shutdown-grace", "30")
    try:
        streams: list[Stream] = []

        def one_held_on_each() -> bool:
            if any(s.worker is None for s in streams):
                return False  # one still connecting
            if {s.worker for s in streams} == {"0", "1"}:
                return True
            streams.append(Stream(gateway.url))
            return False

        wait_for(one_held_on_each, "a held stream on each worker", attempts=400, delay_s=0.05)
        workers = workers_of(gateway.process.pid)
        assert len(workers) == 2
        gateway.process.send_signal(signal.SIGTERM)
        # Draining: no new connection is accepted, and the held streams are still open.
        wait_for(lambda: _refused(gateway.url), "the workers to stop accepting")
        assert gateway.process.poll() is None and not any(s.done for s in streams)
        fake.release()
        for stream in streams:
            stream.join(timeout=60)
        assert all(s.done and s.text == "Once upon a time" for s in streams)
        assert gateway.process.wait(timeout=60) == 0
        assert not any(is_running(pid) for pid in workers)
    finally:
        fake.release()
        gateway.stop()


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


def test_a_killed_worker_is_started_again(fake):
    with start_workers(fake.address) as gateway:
        before = workers_of(gateway.process.pid)
        assert len(before) == 2
        os.kill(before[0], signal.SIGKILL)
        wait_for(
            lambda: len(set(workers_of(gateway.process.pid)) - set(before)) == 1,
            "a new worker",
            attempts=400,
            delay_s=0.05,
        )
        seen: set[str] = set()

        def both_answer() -> bool:
            answer = complete(gateway.url)
            assert answer.status_code == 200
            seen.add(answer.headers["x-conduit-worker"])
            return seen == {"0", "1"}

        wait_for(both_answer, "both workers answering", attempts=400, delay_s=0.05)
        assert gateway.process.poll() is None


def test_a_worker_that_cannot_start_stops_the_supervisor_with_its_reason(fake):
    # The fake engine states no role: as a static prefill engine it is refused when a worker starts.
    with FakeEngine(MODEL) as decode:
        with pytest.raises(ProcessStartError) as failed:
            start_gateway(
                "", "--prefill-engine", fake.address, "--decode-engine", decode.address, "--workers", "2"
            )
    output = str(failed.value)
    assert "gateway exited with code 1" in output
    assert f"prefill_engine: {fake.address} refused" in output
    assert "before it started serving; stopping the others" in output


def test_sighup_reaches_every_worker(fake, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "old", "key": "sk-old"}]}))
    with start_workers(fake.address, "--api-keys-file", str(keys)) as gateway:
        keys.write_text(json.dumps({"keys": [{"name": "new", "key": "sk-new"}]}))
        gateway.process.send_signal(signal.SIGHUP)
        seen: set[str] = set()

        def both_take_the_new_key() -> bool:
            answer = complete(gateway.url, {"Authorization": "Bearer sk-new"})
            if answer.status_code == 200:
                seen.add(answer.headers["x-conduit-worker"])
            return seen == {"0", "1"}

        wait_for(both_take_the_new_key, "both workers to accept the new key", attempts=400, delay_s=0.05)
        # Until both workers have answered (which one a connection reaches is the kernel's choice),
        # every answer to the old key is a 401.
        refused: set[str] = set()

        def both_refuse_the_old_key() -> bool:
            answer = complete(gateway.url, {"Authorization": "Bearer sk-old"})
            assert answer.status_code == 401
            refused.add(answer.headers["x-conduit-worker"])
            return refused == {"0", "1"}

        wait_for(both_refuse_the_old_key, "both workers to refuse the old key", attempts=400, delay_s=0.01)
