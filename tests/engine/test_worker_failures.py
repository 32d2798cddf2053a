"""Worker failures with real processes: `conduit-engine --tensor-parallel-size 2` on stories260K.

A worker that is SIGKILLed mid-stream, one that raises inside a step (a fault injected through a
sitecustomize module on the workers' PYTHONPATH) and one that dies while the engine idles each turn
the engine NOT_SERVING, end the live requests with FINISH_REASON_ERROR (an error event through the
gateway), and make the engine exit with status 3; no process of the engine's tree survives it. A
SIGKILLed engine takes its workers with it. A size that does not divide the model's heads fails at
start (status 2) naming config.json's fields, leaving no worker behind. A SIGTERMed engine drains and
stops its workers (status 0).
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc
from tests.gateway.sse import parse_events
from tests.support.health import NOT_SERVING, SERVING
from tests.support.polling import wait_for
from tests.support.proc_tree import command_line, descendants, is_running
from tests.support.processes import ManagedProcess, free_port, start_engine, start_gateway
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

TP2 = ("--tensor-parallel-size", "2", "--kv-cache-blocks", "64")
WORKER_FAILED_EXIT = 3
EXIT_BOUND_S = 30  # a hang guard, not a latency check


class HealthWatch:
    """grpc.health.v1 Watch of the whole server: every status it streams until the server goes away."""

    def __init__(self, address: str) -> None:
        self.statuses: list[int] = []
        self._channel = grpc.insecure_channel(address)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service="")
        )
        threading.Thread(target=self._read, daemon=True).start()
        wait_for(lambda: SERVING in self.statuses, "the first health status")

    def _read(self) -> None:
        try:
            for reply in self._call:
                self.statuses.append(reply.status)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def workers_of(engine: ManagedProcess) -> list[int]:
    return [pid for pid in descendants(engine.process.pid) if "spawn_main" in command_line(pid)]


def assert_tree_gone(pids: list[int]) -> None:
    wait_for(lambda: not any(is_running(pid) for pid in pids), f"processes {pids} to end")


def long_request(n: int = 1) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text="Once upon a time",
        sampling=pb.SamplingParams(max_tokens=480, temperature=0, ignore_eos=True, n=n),
    )


def test_workers_are_fresh_processes_without_grpc_and_stop_with_the_engine(stories_path):
    engine = start_engine(stories_path, *TP2)
    try:
        tree = descendants(engine.process.pid)
        workers = workers_of(engine)
        assert len(workers) == 2
        for pid in workers:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "cygrpc" not in maps and "torch" in maps  # spawned (exec), not forked from gRPC's process
        assert "cygrpc" in Path(f"/proc/{engine.process.pid}/maps").read_text()
    finally:
        assert engine.stop() == 0  # SIGTERM: drain, then the workers are told to exit
    assert "worker processes stopped: exit codes [0, 0]" in engine.output_tail()
    assert_tree_gone(tree)


def test_a_killed_worker_ends_the_stream_with_an_error_event_and_stops_the_engine(stories_path):
    engine = start_engine(stories_path, *TP2)
    gateway = start_gateway(engine.address)
    try:
        tree = descendants(engine.process.pid)
        workers = workers_of(engine)
        watch = HealthWatch(engine.address)
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 480,
            "temperature": 0,
            "stream": True,
        }
        body["ignore_eos"] = True
        text = ""
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for chunk in response.iter_text():
                    if not text:  # the stream has started: now a worker dies
                        os.kill(workers[1], signal.SIGKILL)
                    text += chunk
        events = parse_events(text)
        *chunks, error, done = events
        assert done == "[DONE]"
        assert error["error"]["code"] == "engine_error" and error["error"]["type"] == "server_error"
        assert 1 <= len(chunks) < 480
        assert engine.process.wait(timeout=EXIT_BOUND_S) == WORKER_FAILED_EXIT
        wait_for(lambda: NOT_SERVING in watch.statuses, "NOT_SERVING")
        assert watch.statuses[: watch.statuses.index(NOT_SERVING) + 1] == [SERVING, NOT_SERVING]
        assert "was killed by SIGKILL" in engine.output_tail()
        assert_tree_gone(tree)
        watch.close()
    finally:
        gateway.stop()
        engine.stop()


FAULT = textwrap.dedent(
    '''
    """Fault injection for tests/engine/test_worker_failures.py: a worker rank raises on its Nth step."""
    import os

    if "CONDUIT_TEST_FAIL_RANK" in os.environ:
        from conduit_engine.worker import worker_process as _worker

        _rank = int(os.environ["CONDUIT_TEST_FAIL_RANK"])
        _fail_at = int(os.environ["CONDUIT_TEST_FAIL_AT_STEP"])
        _original = _worker.Worker._handle
        _steps = [0]

        def _handle(self, frame, received):
            if self.rank == _rank and frame.kind is _worker.Kind.STEP:
                _steps[0] += 1
                if _steps[0] == _fail_at:
                    raise RuntimeError(f"injected fault in worker rank {self.rank}")
            return _original(self, frame, received)

        _worker.Worker._handle = _handle
    '''
)


def test_a_raising_worker_ends_every_choice_with_its_error(stories_path, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    # Warm-up takes two steps; the fault hits the fourth step of the request.
    env = {"PYTHONPATH": str(tmp_path), "CONDUIT_TEST_FAIL_RANK": "1", "CONDUIT_TEST_FAIL_AT_STEP": "6"}
    engine = start_engine(stories_path, *TP2, env=env)
    try:
        tree = descendants(engine.process.pid)
        stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(engine.address))
        messages = list(stub.Generate(long_request(n=2), timeout=60))
        finals = [m for m in messages if m.finished]
        assert sorted(m.index for m in finals) == [0, 1]
        assert {m.finish_reason for m in finals} == {pb.FINISH_REASON_ERROR}
        assert {m.error for m in finals} == {
            "the engine failed: worker rank 1 failed: RuntimeError: injected fault in worker rank 1"
        }
        # Three steps went through: the first sampled choice 0 (choice 1 waits for its prompt), the
        # next two sampled both; the fourth failed.
        assert sum(len(m.token_ids) for m in messages) == 5
        assert engine.process.wait(timeout=EXIT_BOUND_S) == WORKER_FAILED_EXIT
        assert "RuntimeError: injected fault in worker rank 1" in engine.output_tail(20000)
        assert_tree_gone(tree)
    finally:
        engine.stop()


def test_a_worker_dying_while_idle_stops_the_engine(stories_path):
    engine = start_engine(stories_path, *TP2)
    try:
        tree = descendants(engine.process.pid)
        watch = HealthWatch(engine.address)
        os.kill(workers_of(engine)[0], signal.SIGKILL)
        assert engine.process.wait(timeout=EXIT_BOUND_S) == WORKER_FAILED_EXIT
        assert watch.statuses == [SERVING, NOT_SERVING]
        assert "worker rank 0" in engine.output_tail() and "was killed by SIGKILL" in engine.output_tail()
        assert_tree_gone(tree)
        watch.close()
    finally:
        engine.stop()


def test_a_killed_engine_takes_its_workers_with_it(stories_path):
    engine = start_engine(stories_path, *TP2)
    tree = descendants(engine.process.pid)
    assert len(workers_of(engine)) == 2
    engine.process.kill()
    engine.process.wait(timeout=EXIT_BOUND_S)
    assert_tree_gone(tree)
    engine.stop()


def spawned_workers_tagged(tag: str) -> set[int]:
    """Running worker processes whose environment carries CONDUIT_TEST_TAG=`tag` (workers inherit their
    engine's environment, so this finds one engine's workers and no other test's, whoever their parent
    is now)."""
    marker = f"CONDUIT_TEST_TAG={tag}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and "spawn_main" in command_line(int(entry.name)):
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0") and is_running(int(entry.name)):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def test_a_size_that_does_not_divide_the_heads_fails_at_start(stories_path):
    tag = uuid.uuid4().hex
    args = [
        sys.executable,
        "-m",
        "conduit_engine.entrypoints.cli",
        "--model",
        str(stories_path),
        "--host",
        "127.0.0.1",
    ]
    port = free_port()
    engine = ManagedProcess(
        "engine",
        [*args, "--port", str(port), "--tensor-parallel-size", "3"],
        port,
        env={"CONDUIT_TEST_TAG": tag},
    )
    try:
        assert engine.process.wait(timeout=120) == 2
        output = engine.output_tail()
        assert (
            "cannot load the model: --tensor-parallel-size 3 does not fit the model's config.json: "
            "num_attention_heads (8) must be divisible by it" in output
        )
        # The workers were spawned before the model was read: they were stopped (or, still starting,
        # killed) and reaped.
        assert "started 3 worker process(es)" in output and "worker processes stopped: exit codes" in output
        assert spawned_workers_tagged(tag) == set()
    finally:
        engine.stop()
