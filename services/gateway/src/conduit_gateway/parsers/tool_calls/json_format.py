"""Tool calls written as JSON between markers: the machinery hermes, llama3_json, mistral and the forced
(tool_choice required or named) formats share; each of them only sets the class constants.

Rules, the same streamed or not:
- Text outside calls is content. Whitespace next to a call (before its start, after its end, and at
  the end of an output that made calls) is dropped, so a reply that only calls tools has no content.
- A call is announced when its name is complete; its arguments then stream as the model writes them.
- Malformed JSON (or JSON that is not a call) ends parsing: every character not yet delivered as part
  of a call (the marker too, when nothing of its region was delivered) and all later text is content.
- An output that ends inside a call keeps what was delivered (the arguments are cut short, as the
  finish reason `length` says).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from conduit_gateway.parsers.markers import find_marker, partial_marker_start
from conduit_gateway.parsers.tool_calls.base import ParsedText, ToolCallDelta, ToolCallParser
from conduit_gateway.parsers.tool_calls.json_calls import JsonCallScanner, MalformedCall, ScannedCall


class JsonToolCallParser(ToolCallParser):
    # Texts that open a call region (the JSON follows).
    start_markers: ClassVar[tuple[str, ...]] = ()
    # Text that closes a region after its JSON (None: the JSON's end closes it).
    end_marker: ClassVar[str | None] = None
    # Text between two calls written one after the other without markers (llama3_json's ";").
    separator: ClassVar[str | None] = None
    # Characters that open a call region without a marker when they start the output.
    bare_start: ClassVar[str] = ""
    # Keys of a call object whose value is the arguments.
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def __init__(self) -> None:
        self._state = "start" if self.bare_start else "content"
        self._buffer = ""
        self._strip_leading = False  # drop whitespace before the next content (it follows a call)
        self._prefix = ""  # what opened the region: a marker, with the whitespace dropped before it
        self._region = ""  # the prefix and every character given to the region's scanner
        self._scanner = JsonCallScanner(self.argument_keys)
        self._announced: dict[int, tuple[int, int]] = {}  # scanner call → (index, argument chars sent)
        self.calls_made = 0
        # The state machine: each state's step consumes what it can and may move to another state.
        self._steps: dict[str, Callable[[ParsedText, bool], None]] = {
            "start": self._start,
            "content": self._content,
            "call": self._call,
            "after": self._after,
            "separated": self._separated,
            "tail": self._tail,
        }

    def feed(self, text: str) -> ParsedText:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> ParsedText:
        return self._run(final=True)

    # -- the state machine -------------------------------------------------------------------------

    def _run(self, final: bool) -> ParsedText:
        out = ParsedText()
        while True:
            state = self._state
            self._steps[state](out, final)
            if self._state == state:
                return out

    def _start(self, out: ParsedText, final: bool) -> None:
        stripped = self._buffer.lstrip()
        if not stripped and not final:
            return
        if stripped and stripped[0] in self.bare_start:
            self._open_region("")
        else:
            self._state = "content"

    def _content(self, out: ParsedText, final: bool) -> None:
        if self._strip_leading:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return
            self._strip_leading = False
        found = find_marker(self._buffer, self.start_markers) if self.start_markers else None
        if found is not None:
            at, marker = found
            before = self._buffer[:at]
            content = before.rstrip()
            out.content += content
            self._buffer = self._buffer[at + len(marker) :]
            # The dropped whitespace stays with the region: it comes back if the region is not a call.
            self._open_region(before[len(content) :] + marker)
            return
        if final:
            text, self._buffer = self._buffer, ""
            out.content += text.rstrip() if self.calls_made else text
            return
        held = (
            partial_marker_start(self._buffer, self.start_markers)
            if self.start_markers
            else len(self._buffer)
        )
        keep = len(self._buffer[:held].rstrip())
        out.content += self._buffer[:keep]
        self._buffer = self._buffer[keep:]

    def _open_region(self, prefix: str) -> None:
        self._state = "call"
        self._prefix = prefix
        self._region = prefix
        self._scanner = JsonCallScanner(self.argument_keys)
        self._announced = {}

    def _call(self, out: ParsedText, final: bool) -> None:
        text, self._buffer = self._buffer, ""
        self._region += text
        try:
            self._scanner.feed(text)
        except MalformedCall as error:
            self._deliver(out)
            self._fall_back(out, len(self._prefix) + error.position)
            return
        self._deliver(out)
        if self._scanner.done:
            self._buffer = self._region[len(self._prefix) + self._scanner.position :]
            self._state = "after"
        elif final:
            self._fall_back(out, len(self._region))

    def _after(self, out: ParsedText, final: bool) -> None:
        """A call's JSON ended: the region's end marker, a separator and the next call, or content."""
        self._buffer = self._buffer.lstrip()
        text, end = self._buffer, self.end_marker
        if not text and not final:
            return
        if end is not None and text.startswith(end):
            self._buffer = text[len(end) :]
        elif end is not None and end.startswith(text) and not final:
            return  # the end marker so far
        elif self.separator is not None and text.startswith(self.separator):
            self._buffer = text[len(self.separator) :]
            self._state = "separated"
            return
        self._state = "content"
        self._strip_leading = True

    def _separated(self, out: ParsedText, final: bool) -> None:
        """After a separator: the next call's JSON (whitespace first is fine)."""
        if not self._buffer.strip() and not final:
            return
        self._open_region(self.separator or "")

    def _tail(self, out: ParsedText, final: bool) -> None:
        out.content += self._buffer
        self._buffer = ""

    # -- calls -------------------------------------------------------------------------------------

    def _deliver(self, out: ParsedText) -> None:
        """Announce newly named calls and send their new argument text."""
        for number, call in enumerate(self._scanner.calls):
            if call.name is None:
                continue
            if number not in self._announced:
                self._announced[number] = (self.calls_made, 0)
                out.tool_calls.append(ToolCallDelta(self.calls_made, self.new_call_id(), call.name))
                self.calls_made += 1
            self._send_arguments(out, number, call)

    def _send_arguments(self, out: ParsedText, number: int, call: ScannedCall) -> None:
        index, sent = self._announced[number]
        if call.arguments_string:
            return  # a quoted arguments value is sent decoded, once it has ended
        arguments = call.arguments
        if call.complete and not call.arguments_seen and not arguments:
            arguments = "{}"
        if len(arguments) > sent:
            out.tool_calls.append(ToolCallDelta(index, arguments=arguments[sent:]))
            self._announced[number] = (index, len(arguments))

    def _fall_back(self, out: ParsedText, position: int) -> None:
        """Malformed or cut short: what no call delivered becomes content, as does all later text."""
        calls = self._scanner.calls
        if not self._announced:
            start = 0
        elif calls[-1].name is None:
            start = len(self._prefix) + calls[-1].start
        else:
            start = position
        out.content += self._region[start:]
        self._region = ""
        self._state = "tail"
