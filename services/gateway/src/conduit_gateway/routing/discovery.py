"""DNS discovery: every A record of one name is an engine (a Kubernetes headless Service lists one record
per ready pod), re-resolved periodically so engines join and leave the pool as pods come and go.

The resolver is injectable: it maps (host, port) to socket addresses the way getaddrinfo does, so tests
(and other discovery back ends) control exactly which addresses come back.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[tuple[str, int]]]]

# getaddrinfo's answers for "this name has no address (now)": the Service exists but has no ready pods, or
# the name is gone. Any other failure (timeout, no DNS server) keeps the last known engines.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_a_records(host: str, port: int) -> list[tuple[str, int]]:
    """(IPv4 address, port) of every A record of `host`, sorted and without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
    )
    return sorted({(sockaddr[0], sockaddr[1]) for *_, sockaddr in infos})


class DnsDiscovery:
    """Resolves `target` (HOST:PORT) and hands the resulting set of HOST:PORT addresses to `on_resolved`."""

    def __init__(
        self,
        target: str,
        interval_s: float,
        on_resolved: Callable[[set[str]], None],
        resolver: Resolver | None = None,
    ) -> None:
        host, _, port = target.strip().rpartition(":")
        self.host = host
        self.port = int(port)
        self.interval_s = interval_s
        self._on_resolved = on_resolved
        self._resolver = resolver or resolve_a_records
        self._last: set[str] | None = None

    async def resolve_now(self) -> set[str] | None:
        """Resolve once and apply the result; None (and the pool left as it is) when resolution failed."""
        try:
            records = await self._resolver(self.host, self.port)
        except socket.gaierror as exc:
            if exc.errno not in _NO_ADDRESS:
                log.warning("DNS discovery of %s failed (%s); keeping the known engines", self.host, exc)
                return None
            records = []
        except OSError as exc:
            log.warning("DNS discovery of %s failed (%s); keeping the known engines", self.host, exc)
            return None
        addresses = {_format(address, port) for address, port in records}
        if addresses != self._last:
            log.info("DNS discovery: %s has %d engine(s): %s", self.host, len(addresses), sorted(addresses))
            self._last = addresses
        self._on_resolved(addresses)
        return addresses

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.resolve_now()
            except Exception:  # the loop must outlive any single bad round
                log.exception("DNS discovery of %s failed", self.host)


def _format(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
