"""Files that hold secrets: bearer tokens and PEM certificates, read with errors that name the flag.

Every reader is strict (a missing, unreadable or empty file is an error naming the flag) so that a
misconfigured service fails at start, and `TokenFile.reload` keeps the old token when the new read
fails, so that a bad edit during a rotation never locks clients out.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path


class SecretFileError(ValueError):
    """A secret or certificate file cannot be used; the message starts with the flag that names it."""


def read_secret_file(flag: str, path: str) -> bytes:
    """The bytes of `path`, or SecretFileError naming `flag` (never the file's content)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecretFileError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise SecretFileError(f"{flag}: {path} is empty")
    return data


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class TokenFile:
    """A bearer token kept in a file (one line, surrounding whitespace ignored)."""

    def __init__(self, flag: str, path: str) -> None:
        self.flag = flag
        self.path = path
        self._token = self._read()
        self._digest = _digest(self._token)

    def _read(self) -> str:
        try:
            token = read_secret_file(self.flag, self.path).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise SecretFileError(f"{self.flag}: {self.path} is not UTF-8 text") from None
        if any(char.isspace() for char in token) or not token.isprintable():
            raise SecretFileError(f"{self.flag}: {self.path} must hold one token without spaces")
        return token

    def reload(self) -> bool:
        """Re-read the file (raises SecretFileError and keeps the old token when it cannot); True when
        the token changed."""
        token = self._read()
        changed = token != self._token
        self._token, self._digest = token, _digest(token)
        return changed

    def matches(self, presented: str) -> bool:
        """Constant-time comparison of digests: neither the length nor the content of the token leaks."""
        return hmac.compare_digest(_digest(presented), self._digest)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata that presents this token."""
        return (("authorization", f"Bearer {self._token}"),)

    def __repr__(self) -> str:
        return f"TokenFile({self.flag}={self.path})"  # never the token
