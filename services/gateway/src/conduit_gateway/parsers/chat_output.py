"""One chat choice's generated text split into reasoning, content and tool calls, in that order: the
reasoning parser takes the raw text, the tool-call parser only the content part. It also keeps the whole
message so far, which is the non-streamed response (the streamed parse of the text in one piece)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conduit_gateway.parsers.reasoning import ReasoningParser, ReasoningSplit
from conduit_gateway.parsers.tool_calls import ParsedText, ToolCallDelta, ToolCallParser


@dataclass(slots=True)
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


class ChatOutputParser:
    """Feed the choice's text deltas, then finish() once; `reasoning`, `content` and `tool_calls` hold
    the whole message so far. `max_calls` drops calls past that many (parallel_tool_calls false)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolCallParser | None = None,
        max_calls: int | None = None,
    ) -> None:
        self._reasoning_parser = reasoning
        self._tool_parser = tools
        self._max_calls = max_calls
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []

    @property
    def parses(self) -> bool:
        """Whether any parser is set (without one, the text is the content as it comes)."""
        return self._reasoning_parser is not None or self._tool_parser is not None

    def feed(self, text: str) -> OutputDelta:
        split = self._reasoning_parser.feed(text) if self._reasoning_parser else ReasoningSplit("", text)
        parsed = self._tool_parser.feed(split.content) if self._tool_parser else ParsedText(split.content)
        return self._record(split.reasoning, parsed)

    def finish(self) -> OutputDelta:
        split = self._reasoning_parser.finish() if self._reasoning_parser else ReasoningSplit("", "")
        if self._tool_parser is None:
            return self._record(split.reasoning, ParsedText(split.content))
        parsed = self._tool_parser.feed(split.content)
        last = self._tool_parser.finish()
        parsed.content += last.content
        parsed.tool_calls += last.tool_calls
        return self._record(split.reasoning, parsed)

    def _record(self, reasoning: str, parsed: ParsedText) -> OutputDelta:
        calls = [
            call for call in parsed.tool_calls if self._max_calls is None or call.index < self._max_calls
        ]
        self.reasoning += reasoning
        self.content += parsed.content
        for call in calls:
            if call.name is not None:
                self.tool_calls.append(ToolCall(call.id or "", call.name))
            self.tool_calls[call.index].arguments += call.arguments
        return OutputDelta(reasoning, parsed.content, calls)
