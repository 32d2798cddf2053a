"""The keys a gateway accepts right now: --api-key values plus the keys file, swapped whole on reload.

A reload that fails (the file is gone, or wrong) keeps the keys in force and says why in the log, so a
bad edit never locks every client out.
"""

from __future__ import annotations

import logging

from conduit_gateway.keys.keys_file import ApiKey, KeysFileError, key_digest, load_keys_file, plain_keys

log = logging.getLogger(__name__)


class ApiKeyStore:
    """Lookup of a presented key by its SHA-256 digest."""

    def __init__(self, keys: tuple[str, ...] = (), keys_file: str | None = None, prefix: str = "key") -> None:
        self._plain = plain_keys(keys, prefix)
        self.keys_file = keys_file
        self._by_digest = self._index(self._load())

    @property
    def enabled(self) -> bool:
        """False when no key is configured: the guarded paths are open."""
        return bool(self._plain) or self.keys_file is not None

    @property
    def keys(self) -> list[ApiKey]:
        return list(self._by_digest.values())

    def lookup(self, presented: str) -> ApiKey | None:
        return self._by_digest.get(key_digest(presented))

    def reload(self) -> bool:
        """Re-read the keys file (SIGHUP); False, keeping the old keys, when it cannot be used."""
        if self.keys_file is None:
            return True
        try:
            keys = self._load()
            by_digest = self._index(keys)
        except KeysFileError as exc:
            log.error("SIGHUP: keeping the API keys in force: %s", exc)
            return False
        self._by_digest = by_digest
        log.info("SIGHUP: %d API key(s) from %s", len(by_digest), self.keys_file)
        return True

    def _load(self) -> list[ApiKey]:
        return [*self._plain, *(load_keys_file(self.keys_file) if self.keys_file is not None else ())]

    def _index(self, keys: list[ApiKey]) -> dict[bytes, ApiKey]:
        by_digest: dict[bytes, ApiKey] = {}
        for key in keys:
            if key.digest in by_digest:
                raise KeysFileError(
                    f"--api-keys-file: {self.keys_file}: {key.name!r} is the same key as "
                    f"{by_digest[key.digest].name!r}"
                )
            by_digest[key.digest] = key
        return by_digest
