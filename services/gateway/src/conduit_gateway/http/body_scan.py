"""A few top-level string fields of a JSON object, found without parsing the whole body.

A body carrying one huge string (a prompt many times the context) costs more to parse than to refuse:
orjson builds the whole string. `top_level_strings` walks only the object's top level, skipping
string contents with bytes.find and nested values by their brackets (regular-expression search, C
speed), so an 8 MB prompt costs a few finds. A wanted value is reported as its raw string, or as the
raw strings of an array of strings; anything else as None. The walk answers only where it is sure of
what a full parser would see, and gives up (None for the whole answer) otherwise: a key with an escape
(it may decode to a wanted key), more than `max_steps` structural characters, or anything malformed.
Repeated keys: the last one counts, as with json and orjson.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

_STRUCTURE = re.compile(rb'["{}\[\]]')
_LITERAL_END = re.compile(rb"[,}\]]")
_WHITESPACE = b" \t\r\n"
_MAX_BACKSLASH_RUN = 64  # a longer run of backslashes before a quote: give up rather than count
# The most raw bytes one byte of text takes in a JSON string: \u0041 is six bytes for one.
_MAX_RAW_PER_TEXT_BYTE = 6


@dataclass(frozen=True, slots=True)
class RawString:
    """A JSON string's raw bytes body[start:end] (between its quotes)."""

    start: int
    end: int
    escaped: bool  # it holds a backslash escape: its text is shorter than its raw bytes

    @property
    def max_text_bytes(self) -> int:
        """Its text's UTF-8 bytes are at most its raw bytes (an escape only ever shrinks)."""
        return self.end - self.start

    @property
    def min_text_bytes(self) -> int:
        """...and at least this many (exactly its raw bytes when it holds no escape)."""
        raw = self.end - self.start
        return -(-raw // _MAX_RAW_PER_TEXT_BYTE) if self.escaped else raw


Value = RawString | tuple[RawString, ...] | None


def top_level_strings(
    body: bytes, keys: Collection[bytes], max_steps: int = 5000
) -> dict[bytes, Value] | None:
    """For each of `keys` present at the top level of the JSON object `body`: its value as a RawString,
    a tuple of them (an array of strings), or None (any other value). None when the walk cannot be sure."""
    scan = _Scan(body, max_steps)
    try:
        return scan.object_fields(keys)
    except _GiveUp:
        return None


class _GiveUp(Exception):
    pass


class _Scan:
    def __init__(self, body: bytes, max_steps: int) -> None:
        self.body = body
        self.steps_left = max_steps

    def object_fields(self, keys: Collection[bytes]) -> dict[bytes, Value]:
        body = self.body
        i = self._skip_ws(0)
        if body[i : i + 1] != b"{":
            raise _GiveUp
        found: dict[bytes, Value] = {}
        i += 1
        while True:
            self._step()
            i = self._skip_ws(i)
            head = body[i : i + 1]
            if head == b"}":
                return found
            if head == b",":
                i += 1
                continue
            if head != b'"':
                raise _GiveUp
            end = self._string_end(i)
            key = body[i + 1 : end]
            if b"\\" in key:
                raise _GiveUp  # it may decode to one of `keys`
            i = self._skip_ws(end + 1)
            if body[i : i + 1] != b":":
                raise _GiveUp
            value, i = self._value(self._skip_ws(i + 1), wanted=key in keys)
            if key in keys:
                found[key] = value

    def _value(self, i: int, wanted: bool) -> tuple[Value, int]:
        """The value at `i` (a RawString or an array of them when `wanted`, else None) and the index
        after it."""
        body = self.body
        head = body[i : i + 1]
        if head == b'"':
            end = self._string_end(i)
            return RawString(i + 1, end, body.find(b"\\", i + 1, end) >= 0), end + 1
        if head == b"[" and wanted:
            return self._string_array(i)
        if head in (b"{", b"["):
            return None, self._container_end(i)
        if not head:
            raise _GiveUp
        match = _LITERAL_END.search(body, i)
        if match is None:
            raise _GiveUp
        return None, match.start()

    def _string_array(self, start: int) -> tuple[Value, int]:
        """The array at `start`: its strings when it holds only strings, else None (and its end)."""
        body = self.body
        strings: list[RawString] = []
        i = start + 1
        while True:
            self._step()
            i = self._skip_ws(i)
            head = body[i : i + 1]
            if head == b"]":
                return tuple(strings), i + 1
            if head == b",":
                i += 1
                continue
            if head != b'"':
                return None, self._container_end(start)
            end = self._string_end(i)
            strings.append(RawString(i + 1, end, body.find(b"\\", i + 1, end) >= 0))
            i = end + 1

    def _step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _GiveUp

    def _skip_ws(self, i: int) -> int:
        body = self.body
        while body[i : i + 1] and body[i] in _WHITESPACE:
            i += 1
        return i

    def _string_end(self, start: int) -> int:
        """The index of the quote closing the string that opens at `start`."""
        body = self.body
        i = start + 1
        while True:
            self._step()
            quote = body.find(b'"', i)
            if quote < 0:
                raise _GiveUp
            run = 0
            while body[quote - 1 - run] == 0x5C:  # backslashes before the quote: odd escapes it
                run += 1
                if run > _MAX_BACKSLASH_RUN:
                    raise _GiveUp
            if run % 2 == 0:
                return quote
            i = quote + 1

    def _container_end(self, start: int) -> int:
        """The index after the object or array that opens at `start`."""
        body = self.body
        depth, i = 0, start
        while True:
            self._step()
            match = _STRUCTURE.search(body, i)
            if match is None:
                raise _GiveUp
            char, i = match.group(), match.start()
            if char == b'"':
                i = self._string_end(i) + 1
                continue
            depth += 1 if char in (b"{", b"[") else -1
            i += 1
            if depth == 0:
                return i
