"""The engine's process: the gRPC service, its lifecycle, the CLI."""
