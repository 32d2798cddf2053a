"""The interface of tool-call parsers, what they produce, and their registry.

A tool-call parser splits a choice's (content) text into plain content and tool calls, streamed: a call
is announced once with its index, id and name, then its arguments follow in fragments. A subclass with
a `name` is registered by being defined and becomes a `--tool-call-parser` value.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from conduit_gateway.parsers.registry import ParserRegistry

REGISTRY: ParserRegistry[type[ToolCallParser]] = ParserRegistry(
    "conduit_gateway.parsers.tool_calls", "tool_call_parser"
)


@dataclass(slots=True)
class ToolCallDelta:
    """Part of one call: the first delta of a call has `id` and `name`, later ones argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedText:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(ABC):
    """One choice's content/tool-call split; feed it the text deltas, then call finish() once."""

    name: ClassVar[str | None] = None
    # The format's markers are special tokens: the engine must keep special tokens in the text.
    needs_special_tokens: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name is not None:
            REGISTRY.add(cls.name, cls)

    @abstractmethod
    def feed(self, text: str) -> ParsedText:
        """Parse the next delta; text that may still start a call is held back."""

    @abstractmethod
    def finish(self) -> ParsedText:
        """Release what is held back: the output ended."""

    def new_call_id(self) -> str:
        """The id of a new call, as OpenAI shapes them."""
        return f"call_{uuid.uuid4().hex[:24]}"
