"""Several real engines on 127.0.0.1 for routing tests and benchmarks: started together, read over gRPC
(GetLoad, Tokenize), and killed and restarted on the same port."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.support.health import engine_serving
from tests.support.processes import ENGINE_START_TIMEOUT_S, ManagedProcess, free_port

__all__ = ["EngineFleet"]


class EngineFleet:
    """`count` engines on `model` with the same extra flags, plus engine i's own flags `per_engine[i]`
    (e.g. its --role); index i is always the engine on `ports[i]`."""

    def __init__(
        self,
        model: str | Path,
        count: int,
        extra_args: Sequence[str] = (),
        per_engine: Sequence[Sequence[str]] | None = None,
    ) -> None:
        self.model = str(model)
        self.extra_args = list(extra_args)
        self.per_engine = [list(args) for args in per_engine] if per_engine is not None else [[]] * count
        if len(self.per_engine) != count:
            raise ValueError(
                f"per_engine: {count} engines need {count} flag lists, got {len(self.per_engine)}"
            )
        self.ports: list[int] = []
        while len(self.ports) < count:  # free_port may hand out a port it handed out a moment ago
            port = free_port()
            if port not in self.ports:
                self.ports.append(port)
        self.engines: list[ManagedProcess] = []
        self._channels: dict[int, grpc.Channel] = {}
        try:
            # Launch all, then wait: the engines load their models in parallel.
            self.engines = [self._launch(index) for index in range(count)]
            for engine in self.engines:
                engine.wait_ready(
                    lambda engine=engine: engine_serving(engine.address), ENGINE_START_TIMEOUT_S
                )
        except BaseException:
            self.stop()
            raise

    def _launch(self, index: int) -> ManagedProcess:
        args = [
            sys.executable,
            "-m",
            "conduit_engine.entrypoints.cli",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
        ]
        port = self.ports[index]
        args += ["--port", str(port), *self.extra_args, *self.per_engine[index]]
        return ManagedProcess("engine", args, port)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def index_of(self, address: str) -> int:
        return self.addresses.index(address)

    def stub(self, index: int) -> engine_pb2_grpc.EngineStub:
        channel = self._channels.get(index)
        if channel is None:
            channel = self._channels[index] = grpc.insecure_channel(self.addresses[index])
        return engine_pb2_grpc.EngineStub(channel)

    def load(self, index: int) -> engine_pb2.GetLoadResponse:
        return self.stub(index).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)

    def finished(self) -> list[int]:
        """Requests each engine has completed since it started."""
        return [self.load(index).finished_requests for index in range(len(self.ports))]

    def token_ids(self, text: str) -> list[int]:
        return list(self.stub(0).Tokenize(engine_pb2.TokenizeRequest(text=text), timeout=10).token_ids)

    def kill(self, index: int) -> None:
        """SIGKILL: no drain, no goodbye; open streams break."""
        self.engines[index].kill()
        self._drop_channel(index)

    def pause(self, index: int) -> None:
        """SIGSTOP: the engine keeps its connections but does nothing (fault injection: a stream that
        stays open however fast the machine is)."""
        self.engines[index].process.send_signal(signal.SIGSTOP)

    def resume(self, index: int) -> None:
        self.engines[index].process.send_signal(signal.SIGCONT)

    def restart(self, index: int) -> None:
        """Start engine `index` again on its port (after kill) and wait until it is SERVING."""
        self.engines[index].stop()
        self._drop_channel(index)
        address = self.addresses[index]
        deadline = time.monotonic() + 30
        while True:
            engine = self._launch(index)
            try:
                engine.wait_ready(lambda: engine_serving(address), ENGINE_START_TIMEOUT_S)
                break
            except Exception:
                # The port can take a moment to be bindable again after the old process died.
                engine.stop()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.engines[index] = engine

    def _drop_channel(self, index: int) -> None:
        channel = self._channels.pop(index, None)
        if channel is not None:
            channel.close()

    def stop(self) -> None:
        for index in list(self._channels):
            self._drop_channel(index)
        for engine in self.engines:
            engine.stop()

    def __enter__(self) -> EngineFleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
