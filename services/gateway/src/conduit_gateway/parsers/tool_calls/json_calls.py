"""An incremental reader of tool calls written as JSON: one call object
`{"name": ..., "arguments": {...}}` or an array of them, fed in pieces as the model writes it.

It checks JSON syntax character by character (strict JSON, as `json.loads`), so a malformed call is
found at its first wrong character, and it reports each call as soon as it can: the call's name once its
string is complete, then the raw text of its arguments value as it arrives. A call's arguments are the
exact JSON text the model wrote (a string value is decoded, as some models quote their arguments).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_LITERAL_CHARS = frozenset("0123456789+-.eEtruefalsn")
_LITERAL = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")


class MalformedCall(Exception):
    """The text stopped being a JSON tool call at `position` (characters since the scanner's start)."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(f"{reason} at character {position}")
        self.position = position


@dataclass(slots=True)
class ScannedCall:
    """What the scanner has found of one call: `name` once complete, `arguments` the raw text so far."""

    start: int  # position of the call object's `{`
    name: str | None = None
    arguments: str = ""
    arguments_seen: bool = False
    arguments_string: bool = False  # the value is a JSON string, decoded when it ends
    complete: bool = False


class JsonCallScanner:
    """Feed text; `calls` grows as calls are found; `done` once the top-level value has ended.

    `feed` consumes up to the end of the top-level value and returns how many characters it used; it
    raises MalformedCall on the first character that is not JSON, or not a call.
    """

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.argument_keys = argument_keys
        self.calls: list[ScannedCall] = []
        self.done = False
        self.position = 0
        self._stack: list[str] = []  # open containers, "{" or "["
        self._expect = "value"  # value | value_or_end | key | key_or_end | colon | comma_or_end
        self._string: list[str] | None = None  # characters of the string being read
        self._string_is_key = False
        self._escape = -1  # -1: none; 0: after a backslash; 1..4: hex digits still due
        self._literal: list[str] | None = None
        self._call_depth = 0  # stack depth of call objects: 1 (a lone object) or 2 (in an array)
        self._key = ""  # last key read at the call's depth
        self._value_role = ""  # "name" | "arguments" | "other" while a call's member value is read
        self._value_depth = 0  # stack depth at which that value started

    # -- feeding -----------------------------------------------------------------------------------

    def feed(self, text: str) -> int:
        for offset, char in enumerate(text):
            if self.done:
                return offset
            self._char(char)
            self.position += 1
        return len(text)

    # -- one character -----------------------------------------------------------------------------

    def _char(self, char: str) -> None:
        if self._string is not None:
            self._string_char(char)
            return
        if self._literal is not None:
            if char in _LITERAL_CHARS:
                self._literal.append(char)
                self._capture(char)
                return
            self._end_literal()
        if char in _WHITESPACE:
            self._capture(char)
            return
        expect = self._expect
        if expect in ("value", "value_or_end"):
            if char == "]" and expect == "value_or_end":
                self._close("[")
            else:
                self._value_start(char)
        elif expect in ("key", "key_or_end"):
            if char == "}" and expect == "key_or_end":
                self._close("{")
            elif char == '"':
                self._capture(char)
                self._string, self._string_is_key = [], True
            else:
                raise MalformedCall(self.position, f"expected a key, got {char!r}")
        elif expect == "colon":
            if char != ":":
                raise MalformedCall(self.position, f"expected ':', got {char!r}")
            self._capture(char)
            self._expect = "value"
        else:  # comma_or_end
            if char == ",":
                self._capture(char)
                self._expect = "key" if self._stack[-1] == "{" else "value"
            elif char in "}]":
                self._close("{" if char == "}" else "[")
            else:
                raise MalformedCall(self.position, f"expected ',' or the end of the container, got {char!r}")

    def _value_start(self, char: str) -> None:
        depth = len(self._stack)
        if depth == 0 and char not in "{[":
            raise MalformedCall(self.position, "a tool call is a JSON object or an array of them")
        if depth == 1 and self._stack[0] == "[" and char != "{":
            raise MalformedCall(self.position, "each tool call is a JSON object")
        if depth == self._call_depth and depth > 0:
            self._member_value_start(char)
        if char in "{[":
            self._capture(char)
            self._stack.append(char)
            if char == "{" and (depth == 0 or (depth == 1 and self._stack[0] == "[")):
                self._call_depth = depth + 1
                self.calls.append(ScannedCall(start=self.position))
            self._expect = "key_or_end" if char == "{" else "value_or_end"
        elif char == '"':
            self._capture(char)
            self._string, self._string_is_key = [], False
        elif char in _LITERAL_CHARS:
            self._capture(char)
            self._literal = [char]
        else:
            raise MalformedCall(self.position, f"expected a JSON value, got {char!r}")

    def _member_value_start(self, char: str) -> None:
        """A value of the call object itself begins: its role follows from the key before it."""
        call = self.calls[-1]
        self._value_depth = len(self._stack)
        if self._key == "name" and call.name is None:
            if char != '"':
                raise MalformedCall(self.position, "a tool call's name is a string")
            self._value_role = "name"
        elif self._key in self.argument_keys and not call.arguments_seen:
            call.arguments_seen = True
            call.arguments_string = char == '"'
            self._value_role = "arguments"
        else:
            self._value_role = "other"

    def _string_char(self, char: str) -> None:
        string = self._string
        assert string is not None
        if self._escape == 0:
            if char not in _ESCAPES:
                raise MalformedCall(self.position, f"invalid escape \\{char}")
            self._escape = 4 if char == "u" else -1
        elif self._escape > 0:
            if char not in _HEX:
                raise MalformedCall(self.position, "invalid \\u escape")
            self._escape -= 1
            if self._escape == 0:
                self._escape = -1
        elif char == "\\":
            self._escape = 0
        elif char == '"':
            self._string = None
            self._capture(char)
            self._string_end("".join(string))
            return
        elif ord(char) < 0x20:
            raise MalformedCall(self.position, "control character in a string")
        string.append(char)
        self._capture(char)

    def _string_end(self, raw: str) -> None:
        if self._string_is_key:
            if len(self._stack) == self._call_depth:
                self._key = json.loads(f'"{raw}"')
            self._expect = "colon"
            return
        if len(self._stack) == self._call_depth and self._value_role == "name":
            self.calls[-1].name = json.loads(f'"{raw}"')
        self._value_end()

    def _end_literal(self) -> None:
        literal = "".join(self._literal or ())
        self._literal = None
        if not _LITERAL.fullmatch(literal):
            raise MalformedCall(self.position, f"invalid JSON literal {literal!r}")
        self._value_end()

    def _close(self, opener: str) -> None:
        if self._stack[-1] != opener:
            raise MalformedCall(self.position, "mismatched bracket")
        self._capture("}" if opener == "{" else "]")
        self._stack.pop()
        depth = len(self._stack)
        if opener == "{" and depth + 1 == self._call_depth:
            call = self.calls[-1]
            if call.name is None:
                raise MalformedCall(self.position, "a tool call needs a name")
            call.complete = True
        self._value_end()

    def _value_end(self) -> None:
        """A value ended at the current depth: maybe a call member, maybe the whole top-level value."""
        depth = len(self._stack)
        if depth == self._call_depth and self._value_role and depth == self._value_depth:
            if self._value_role == "arguments" and self.calls[-1].arguments_string:
                call = self.calls[-1]
                call.arguments = json.loads(call.arguments)
                call.arguments_string = False
            self._value_role = ""
        if depth == 0:
            self.done = True
        else:
            self._expect = "comma_or_end"

    def _capture(self, char: str) -> None:
        """Characters of an arguments value become the call's raw arguments text."""
        if self._value_role == "arguments" and len(self._stack) >= self._value_depth:
            self.calls[-1].arguments += char
