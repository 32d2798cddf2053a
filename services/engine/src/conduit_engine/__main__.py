"""`python -m conduit_engine`: the engine's CLI (the `conduit-engine` command)."""

from conduit_engine.entrypoints.cli import main

main()
