"""The interface of reasoning parsers, their registry, and the think-tag format both built-in ones use.

A reasoning parser splits a choice's streamed text into reasoning and content. A subclass with a `name`
is registered by being defined and becomes a `--reasoning-parser` value.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

from conduit_gateway.parsers.markers import partial_marker_start
from conduit_gateway.parsers.registry import ParserRegistry

REGISTRY: ParserRegistry[type[ReasoningParser]] = ParserRegistry(
    "conduit_gateway.parsers.reasoning", "reasoning_parser"
)


class ReasoningSplit(NamedTuple):
    reasoning: str
    content: str


class ReasoningParser(ABC):
    """One choice's reasoning/content split; feed it the text deltas, then call finish() once."""

    name: ClassVar[str | None] = None
    # The text that ends the reasoning: structured outputs apply only after it (structured_after).
    end_tag: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name is not None:
            REGISTRY.add(cls.name, cls)

    @abstractmethod
    def feed(self, text: str) -> ReasoningSplit:
        """Split the next delta; text that may still be part of a tag is held back."""

    @abstractmethod
    def finish(self) -> ReasoningSplit:
        """Release what is held back: the output ended."""


class ThinkTagParser(ReasoningParser):
    """`<think>reasoning</think>content`.

    The output may begin with the start tag (leading whitespace before it is dropped). Without it, the
    text up to the end tag is reasoning when `opened_by_template` (the chat template already wrote the
    start tag into the prompt), else the whole output is content. Without an end tag, reasoning runs to
    the end of the output.
    """

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    opened_by_template: ClassVar[bool]

    def __init__(self) -> None:
        self._state = "begin"  # begin → reasoning → content
        self._held = ""

    def feed(self, text: str) -> ReasoningSplit:
        return self._split(self._held + text, final=False)

    def finish(self) -> ReasoningSplit:
        held, self._held = self._held, ""
        return self._split(held, final=True)

    def _split(self, text: str, final: bool) -> ReasoningSplit:
        self._held = ""
        if self._state == "begin":
            text = self._begin(text, final)
            if self._state == "begin":
                return ReasoningSplit("", "")
        if self._state == "content":
            return ReasoningSplit("", text)
        at = text.find(self.end_tag)
        if at >= 0:
            self._state = "content"
            return ReasoningSplit(text[:at], text[at + len(self.end_tag) :])
        keep = len(text) if final else partial_marker_start(text, (self.end_tag,))
        self._held = text[keep:]
        return ReasoningSplit(text[:keep], "")

    def _begin(self, text: str, final: bool) -> str:
        """Decide whether the output opens with the start tag; return the text left to split."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            self._state = "reasoning"
            return stripped[len(self.start_tag) :]
        if not final and self.start_tag.startswith(stripped):
            self._held = text  # only whitespace, or the start tag so far
            return ""
        self._state = "reasoning" if self.opened_by_template else "content"
        return text
