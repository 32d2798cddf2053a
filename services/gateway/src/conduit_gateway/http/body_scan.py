"""A few top-level string fields of a JSON object, found without parsing the whole body.

A body carrying one huge string (a prompt many times the context) costs more to parse than to refuse:
orjson builds the whole string. `top_level_strings` walks only the object's top level, skipping
string contents with bytes.find and nested values by their brackets (regular-expression search, C
speed), so an 8 MB prompt costs a few finds. It answers only where it is sure of what a full parser
would see, and gives up (None) otherwise: a key with an escape (it may decode to a wanted key), a
wanted value with an escape (its decoded length is not its raw length), more than `max_steps`
structural characters (a large array of strings), or anything malformed. Repeated keys: the last
one counts, as with json and orjson.
"""

from __future__ import annotations

import re
from collections.abc import Collection

_STRUCTURE = re.compile(rb'["{}\[\]]')
_LITERAL_END = re.compile(rb"[,}\]]")
_WHITESPACE = b" \t\r\n"
_MAX_BACKSLASH_RUN = 64  # a longer run of backslashes before a quote: give up rather than count


class _GiveUp(Exception):
    pass


def top_level_strings(
    body: bytes, keys: Collection[bytes], max_steps: int = 512
) -> dict[bytes, tuple[int, int] | None] | None:
    """For each of `keys` present at the top level of the JSON object `body`: the (start, end) byte
    span of its string value, which has no escapes (so its raw bytes are its text); None for a value
    that is not such a string. None for the whole answer when the scan cannot be sure."""
    scan = _Scan(body, max_steps)
    try:
        return scan.object_fields(keys)
    except _GiveUp:
        return None


class _Scan:
    def __init__(self, body: bytes, max_steps: int) -> None:
        self.body = body
        self.steps_left = max_steps

    def object_fields(self, keys: Collection[bytes]) -> dict[bytes, tuple[int, int] | None]:
        body = self.body
        i = self._skip_ws(0)
        if body[i : i + 1] != b"{":
            raise _GiveUp
        found: dict[bytes, tuple[int, int] | None] = {}
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
            i = self._skip_ws(i + 1)
            head = body[i : i + 1]
            if head == b'"':
                end = self._string_end(i)
                span = (i + 1, end) if body.find(b"\\", i + 1, end) < 0 else None
                i = end + 1
            elif head in (b"{", b"["):
                span, i = None, self._container_end(i)
            elif head:
                match = _LITERAL_END.search(body, i)
                if match is None:
                    raise _GiveUp
                span, i = None, match.start()
            else:
                raise _GiveUp
            if key in keys:
                found[key] = span

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
