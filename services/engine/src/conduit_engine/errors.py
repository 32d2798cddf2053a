"""Domain errors; the gRPC layer maps each class to one status code in one place."""

from __future__ import annotations


class EngineError(Exception):
    """Base of errors the engine reports to callers."""


class InvalidRequestError(EngineError, ValueError):
    """A request parameter is wrong (→ INVALID_ARGUMENT). `field` names the parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFullError(EngineError):
    """The waiting queue is at its bound (→ RESOURCE_EXHAUSTED)."""


class EngineUnavailableError(EngineError):
    """The engine is not ready or is draining (→ UNAVAILABLE)."""


class DuplicateRequestError(InvalidRequestError):
    """A live request already has this id (→ INVALID_ARGUMENT)."""


class ModelLoadError(EngineError):
    """A checkpoint folder cannot be loaded (missing file, unsupported architecture, bad config)."""


class WorkerFailedError(EngineError):
    """A worker process died or raised: its shard of the model is gone, so the engine must stop."""


class NotFoundError(EngineError):
    """The call names something this engine does not have, such as a LoRA adapter (→ NOT_FOUND)."""


class FailedPreconditionError(EngineError):
    """The call cannot run in the engine's present state (→ FAILED_PRECONDITION): LoRA not enabled, an
    adapter unloaded while requests of it are in flight."""
