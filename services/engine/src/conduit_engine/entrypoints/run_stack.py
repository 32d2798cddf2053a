"""`make run`: start the engine and the gateway as processes, print how to call them; Ctrl-C stops both.

Without --model it serves DEFAULT_MODEL, a small chat model from the Hugging Face Hub (downloaded once
into the Hub cache), and when that cannot be had (offline and not cached, or the Hub unreachable) the
random demo model, saying why.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# The launcher speaks no gRPC: a process that has started gRPC's threads must not fork children
# (subprocess with preexec_fn forks), so readiness is read from the gateway's /health, which is 200
# once an engine behind it is SERVING.
_ENGINE_LOAD_TIMEOUT_S = 600.0
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # Llama architecture, 135M parameters, Apache-2.0
DEMO_DIR = ".models/demo-llama"


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc, name in zip(procs, ("engine", "gateway"), strict=False):
            if proc.poll() is not None:
                raise SystemExit(f"the {name} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the engine did not become SERVING in time")


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


def _spawn(executable: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(Path(sys.executable).parent / executable), *args], preexec_fn=_die_with_parent
    )


def _python_module(*args: str) -> subprocess.CompletedProcess[str]:
    """This interpreter running `-m args...`; stdout captured, stderr (progress bars) passed through."""
    return subprocess.run([sys.executable, "-m", *args], stdout=subprocess.PIPE, text=True, check=False)


def fetch(model: str) -> str | None:
    """Download a Hub id before the engine starts (its progress shows here, and the engine's load
    timeout does not run during it); None when it is available, else why not. It runs in a child
    process: this one must not start threads before it forks the engine and the gateway."""
    fetched = _python_module("conduit_engine.models.source", model)
    if fetched.returncode == 0:
        return None
    return fetched.stdout.strip() or f"fetching it failed with status {fetched.returncode}"


def choose_model(demo_dir: str) -> tuple[str, str | None]:
    """(model to serve, why it is not DEFAULT_MODEL or None)."""
    reason = fetch(DEFAULT_MODEL)
    if reason is None:
        return DEFAULT_MODEL, None
    made = _python_module("conduit_engine.models.demo_model", demo_dir)
    if made.returncode != 0:
        raise SystemExit(f"cannot serve {DEFAULT_MODEL} ({reason}) nor write the demo model to {demo_dir}")
    return demo_dir, reason


def _served_name(model: str) -> str:
    """What the engine serves `model` as: a folder's name, or the Hub id itself."""
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


def _banner(model: str, engine_port: int, gateway_port: int) -> str:
    name = _served_name(model)
    base = f"http://127.0.0.1:{gateway_port}/v1"
    return f"""
Conduit is serving {name!r}.
  engine (gRPC):   127.0.0.1:{engine_port}   gateway (OpenAI HTTP): {base}

  curl {base}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='none'); \\
print(c.completions.create(model='{name}', prompt='Once upon a time', max_tokens=32).choices[0].text)"

Ctrl-C stops both."""


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the children (they drain), the gateway first; SIGKILL what outlives the drain."""
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


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run the Conduit engine and gateway together.")
    parser.add_argument("--model", help=f"a model folder or Hub id (default: {DEFAULT_MODEL}, else the demo)")
    parser.add_argument("--demo-dir", default=DEMO_DIR, help="where the random demo model is written")
    parser.add_argument("--engine-port", type=int, default=50051)
    parser.add_argument("--gateway-port", type=int, default=8000)
    return parser.parse_args()


def main() -> None:
    args = _parse_args()
    if args.model is None:
        args.model, reason = choose_model(args.demo_dir)
        if reason is not None:
            print(
                f"{DEFAULT_MODEL} is not available: {reason}\n"
                f"Serving the random demo model from {args.model} instead: its text is meaningless.",
                flush=True,
            )
    elif not Path(args.model).is_dir() and (reason := fetch(args.model)) is not None:
        raise SystemExit(f"cannot serve {args.model}: {reason}")
    # SIGTERM (e.g. from a supervisor) must stop the children too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    engine_address = f"127.0.0.1:{args.engine_port}"
    procs = [
        _spawn(
            "conduit-engine", "--model", args.model, "--host", "127.0.0.1", "--port", str(args.engine_port)
        )
    ]
    try:
        procs.append(
            _spawn(
                "conduit-gateway",
                "--engine",
                engine_address,
                "--host",
                "127.0.0.1",
                "--port",
                str(args.gateway_port),
            )
        )
        _wait_healthy(f"http://127.0.0.1:{args.gateway_port}/health", procs, _ENGINE_LOAD_TIMEOUT_S)
        print(_banner(args.model, args.engine_port, args.gateway_port), flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        _stop(procs)
    os._exit(0)


if __name__ == "__main__":
    main()
