"""Who may set a request's `priority` (the engine runs lower values first, so it lets a request jump the
queue of every other tenant).

- No keys configured (one tenant): honoured.
- A key whose keys-file entry has a `priority: [low, high]` range: honoured inside it; a value outside
  is a 400 naming `priority` and the range.
- Any other key (a keys-file entry without a range, an --api-key flag key): ignored, the request runs at
  the default priority, and the key's name is logged once.
"""

from __future__ import annotations

import logging

from conduit_gateway.errors import invalid_param
from conduit_gateway.keys.keys_file import ApiKey

log = logging.getLogger(__name__)


def allowed_priority(key: ApiKey | None, priority: int, ignored: set[str]) -> int | None:
    """The priority to send the engine for a request of `key` asking for `priority` (None: the engine's
    default); `ignored` holds the names already logged."""
    if key is None:
        return priority
    if key.priority is None:
        if key.name not in ignored:
            ignored.add(key.name)
            log.warning(
                "API key %r set `priority`, which its keys-file entry does not allow (no `priority` "
                "range): ignored for this key from now on",
                key.name,
            )
        return None
    low, high = key.priority
    if not low <= priority <= high:
        raise invalid_param("priority", f"must be between {low} and {high} for this API key, got {priority}")
    return priority
