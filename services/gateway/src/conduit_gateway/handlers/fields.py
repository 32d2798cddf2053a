"""Checks turning OpenAI JSON values into values the proto can hold, each failing with a 400 naming the field.

Pydantic has already checked the types; these check ranges the proto's integer and float widths impose
(the engine checks the semantic ranges, e.g. temperature >= 0, and names the field itself).
"""

from __future__ import annotations

import math
import struct

from conduit_gateway.errors import invalid_param

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def uint32(name: str, value: int, minimum: int = 0) -> int:
    if not minimum <= value <= UINT32_MAX:
        raise invalid_param(name, f"must be in [{minimum}, {UINT32_MAX}], got {value}")
    return value


def int32(name: str, value: int) -> int:
    if not INT32_MIN <= value <= INT32_MAX:
        raise invalid_param(name, f"must be in [{INT32_MIN}, {INT32_MAX}], got {value}")
    return value


def float32(name: str, value: float) -> float:
    if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
        raise invalid_param(name, f"must be a finite 32-bit float, got {value}")
    return value


def text(name: str, value: str) -> str:
    """Strings must be valid UTF-8 (JSON can carry lone surrogates, which protobuf cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_param(name, "must be valid UTF-8 text (it contains a lone surrogate)") from None
    return value


def token_ids(name: str, ids: list[int]) -> list[int]:
    if not ids:
        raise invalid_param(name, "must not be empty")
    for position, token in enumerate(ids):
        if not 0 <= token <= UINT32_MAX:
            raise invalid_param(name, f"token id at position {position} must be >= 0, got {token}")
    return ids
