"""`make run`: start the engine and the gateway as processes, print how to call them; Ctrl-C stops both."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _wait_serving(address: str, proc: subprocess.Popen[bytes], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the engine exited with code {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit("the engine did not become SERVING in time")


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the gateway did not become healthy in time")


# Resolved here, in the parent: the child between fork and exec must not import anything (other threads
# of this process may hold the import lock at fork time).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in each child before exec: on Linux, SIGTERM it if the launcher dies, even by SIGKILL."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the Conduit engine and gateway together.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine-port", type=int, default=50051)
    parser.add_argument("--gateway-port", type=int, default=8000)
    args = parser.parse_args()
    # SIGTERM (e.g. from a supervisor) must stop the children too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    bin_dir = Path(sys.executable).parent
    engine = subprocess.Popen(
        [
            str(bin_dir / "conduit-engine"),
            "--model",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(args.engine_port),
        ],
        preexec_fn=_die_with_parent,
    )
    procs = [engine]
    try:
        _wait_serving(f"127.0.0.1:{args.engine_port}", engine)
        gateway = subprocess.Popen(
            [
                str(bin_dir / "conduit-gateway"),
                "--engine",
                f"127.0.0.1:{args.engine_port}",
                "--host",
                "127.0.0.1",
                "--port",
                str(args.gateway_port),
            ],
            preexec_fn=_die_with_parent,
        )
        procs.append(gateway)
        _wait_http(f"http://127.0.0.1:{args.gateway_port}/health", gateway)
        name = Path(args.model).resolve().name
        base = f"http://127.0.0.1:{args.gateway_port}/v1"
        print(
            f"""
Conduit is serving {name!r}.
  engine (gRPC):   127.0.0.1:{args.engine_port}   gateway (OpenAI HTTP): {base}

  curl {base}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='none'); \\
print(c.completions.create(model='{name}', prompt='Once upon a time', max_tokens=32).choices[0].text)"

Ctrl-C stops both.""",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=35)
            except subprocess.TimeoutExpired:
                p.kill()
    os._exit(0)


if __name__ == "__main__":
    main()
