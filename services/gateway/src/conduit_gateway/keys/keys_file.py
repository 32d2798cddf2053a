"""The --api-keys-file format (YAML or JSON) → ApiKey records, with errors that name the entry at fault.

```yaml
keys:
  - name: team-a                 # unique; what logs and rate limits are keyed by
    key: sk-team-a-...           # or key_sha256: <hex digest of the key>, to keep the key itself out
    limits:                      # optional; a missing limit is no limit
      requests_per_minute: 60    # every request counts, refused ones too
      tokens_per_minute: 40000   # a request's worst case is reserved before it runs
      max_concurrent_requests: 4 # requests of this key in progress at once
    priority: [-10, 10]          # optional: the `priority` range this key may ask for; without it
                                 # the key's `priority` is ignored
```

Keys are ASCII (HTTP headers carry latin-1, so a non-ASCII key could never be presented): another
key is refused at load with its line.

Keys are kept as SHA-256 digests only: a presented key is hashed and looked up, and no key ever
reaches a log, a repr or an error message.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FLAG = "--api-keys-file"
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")
_INT32 = 2**31


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and the entry (never a key)."""


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """Limits of one key; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: bytes = field(repr=False)
    limits: KeyLimits = KeyLimits()
    # The `priority` values the key may ask for (low, high); None: its `priority` is ignored.
    priority: tuple[int, int] | None = None


def plain_keys(keys: tuple[str, ...], prefix: str = "key") -> list[ApiKey]:
    """Keys given on the command line (--api-key): unlimited, named key-1, key-2, ..."""
    return [ApiKey(f"{prefix}-{index}", key_digest(key)) for index, key in enumerate(keys, start=1)]


def load_keys_file(path: str) -> list[ApiKey]:
    """Parse `path` (YAML, of which JSON is a subset); KeysFileError names what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        document = yaml.safe_load(text)
    except OSError as exc:
        raise KeysFileError(f"{FLAG}: cannot read {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        # The parser's message may quote the offending line, which may hold a key: say where only.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise KeysFileError(f"{FLAG}: {path} is not valid YAML or JSON{where}") from None
    entries = document.get("keys") if isinstance(document, dict) else document
    if not isinstance(entries, list):
        raise KeysFileError(f"{FLAG}: {path} must hold a list of keys (or a mapping with `keys:`)")
    keys = [_entry(path, index, entry, text) for index, entry in enumerate(entries)]
    _check_unique(path, keys)
    return keys


def _entry(path: str, index: int, entry: Any, text: str) -> ApiKey:
    where = f"{FLAG}: {path}: keys[{index}]"
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: must be a mapping with name, key (or key_sha256) and limits")
    unknown = sorted(set(entry) - {"name", "key", "key_sha256", "limits", "priority"})
    if unknown:
        raise KeysFileError(f"{where}: unknown field {unknown[0]!r}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise KeysFileError(f"{where}.name: must be a non-empty string")
    return ApiKey(
        name.strip(),
        _digest_of(where, entry, text),
        _limits(where, entry.get("limits")),
        _priority(where, entry.get("priority")),
    )


def _digest_of(where: str, entry: dict[str, Any], text: str) -> bytes:
    key, hashed = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (hashed is None):
        raise KeysFileError(f"{where}: give exactly one of key and key_sha256")
    if key is not None:
        if not isinstance(key, str) or not key.strip() or any(c.isspace() for c in key.strip()):
            raise KeysFileError(f"{where}.key: must be a non-empty string without spaces")
        if not key.isascii():
            raise KeysFileError(
                f"{where}.key{_line_of(key.strip(), text)}: must be ASCII (HTTP headers cannot carry "
                "other characters, so this key could never match)"
            )
        return key_digest(key.strip())
    if not isinstance(hashed, str) or not _HEX_DIGEST.fullmatch(hashed.lower()):
        raise KeysFileError(f"{where}.key_sha256: must be 64 hexadecimal digits (a SHA-256 digest)")
    return bytes.fromhex(hashed)


def _limits(where: str, limits: Any) -> KeyLimits:
    if limits is None:
        return KeyLimits()
    if not isinstance(limits, dict):
        raise KeysFileError(f"{where}.limits: must be a mapping")
    unknown = sorted(set(limits) - set(_LIMIT_FIELDS))
    if unknown:
        raise KeysFileError(
            f"{where}.limits: unknown field {unknown[0]!r} (expected {', '.join(_LIMIT_FIELDS)})"
        )
    values = {}
    for name in _LIMIT_FIELDS:
        value = limits.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise KeysFileError(f"{where}.limits.{name}: must be an integer >= 1, got {value!r}")
        values[name] = value
    return KeyLimits(**values)


def _line_of(key: str, text: str) -> str:
    """at line N: where `key` is written in the file (the message never holds the key itself)."""
    for number, line in enumerate(text.splitlines(), start=1):
        if key in line:
            return f" at line {number}"
    return ""


def _priority(where: str, priority: Any) -> tuple[int, int] | None:
    if priority is None:
        return None
    bounds = priority if isinstance(priority, list) and len(priority) == 2 else None
    if bounds is None or any(
        isinstance(value, bool) or not isinstance(value, int) or not -_INT32 <= value < _INT32
        for value in bounds
    ):
        raise KeysFileError(f"{where}.priority: must be a range [low, high] of two 32-bit integers")
    if bounds[0] > bounds[1]:
        raise KeysFileError(f"{where}.priority: the low end {bounds[0]} is above the high end {bounds[1]}")
    return bounds[0], bounds[1]


def _check_unique(path: str, keys: list[ApiKey]) -> None:
    names: set[str] = set()
    digests: dict[bytes, str] = {}
    for index, key in enumerate(keys):
        if key.name in names:
            raise KeysFileError(f"{FLAG}: {path}: keys[{index}].name: {key.name!r} is used twice")
        if key.digest in digests:
            raise KeysFileError(f"{FLAG}: {path}: keys[{index}]: the same key as {digests[key.digest]!r}")
        names.add(key.name)
        digests[key.digest] = key.name
