"""`python -m conduit_engine.entrypoints.pre_stop`: the engine pod's preStop hook.

It sends SIGUSR1 to the engine (PID 1 of its container: `conduit-engine` is the image's entrypoint), whose
health then says NOT_SERVING: the gateways stop routing new requests to it while its running streams go
on. It then waits `--sleep` seconds, for Envoy and every gateway to see that, before Kubernetes sends
SIGTERM, which starts the drain (`--drain-seconds`: running streams may finish, then the rest are handed
back to the gateway, which continues them on another engine). So a pod's
`terminationGracePeriodSeconds` must cover sleep + drain, with a margin for the hand-back.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="conduit-engine-pre-stop", description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, default=1, help="the engine's process id (default 1)")
    parser.add_argument("--sleep", type=float, default=10.0, help="seconds to wait after the signal")
    args = parser.parse_args(argv)
    if args.sleep < 0:
        parser.error(f"--sleep must be >= 0, got {args.sleep}")
    try:
        os.kill(args.pid, signal.SIGUSR1)
    except ProcessLookupError:
        print(f"pre-stop: no process {args.pid} (the engine has already exited)", file=sys.stderr)
        return
    time.sleep(args.sleep)


if __name__ == "__main__":
    main()
