"""What the admin API may add: an address that is HOST:PORT and nothing else, inside --admin-node-allow.

gRPC reads a target as a URI: `unix:PATH`, `unix-abstract:NAME`, `ipv4:ADDR`, `dns:NAME` all dial
something other than a TCP host, so an address from the admin API is parsed here by its own grammar
(a DNS name, an IPv4 address or a bracketed IPv6 address, then `:PORT`) rather than handed to gRPC.

The allow list holds CIDRs (an IP host must lie in one) and host patterns (`*` matches any characters,
dots included: `*.engines.svc.cluster.local`). A name is matched as written, not resolved: a pattern
trusts the DNS for the names it covers; a list of CIDRs only refuses every name.
"""

from __future__ import annotations

import fnmatch
import functools
import ipaddress
import re
from dataclasses import dataclass

MAX_HOST_CHARS = 253  # a DNS name's limit; IP literals are shorter
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_PATTERN = re.compile(r"[A-Za-z0-9.*-]+")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class NodeAddressError(ValueError):
    """The address is not HOST:PORT; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class NodeAddress:
    host: str  # as written (IPv6 without its brackets)
    port: int
    ip: IpAddress | None  # the host, when it is an IP literal


def parse_node_address(address: str) -> NodeAddress:
    """`address` as HOST:PORT: a DNS name, an IPv4 address or a [bracketed] IPv6 address, and a port in
    [1, 65535]; raises NodeAddressError otherwise (schemes, control characters, over-long hosts)."""
    if any(not char.isprintable() or char.isspace() for char in address):
        raise NodeAddressError("must not contain whitespace or control characters")
    if "/" in address:
        raise NodeAddressError("must be HOST:PORT without a scheme or path")
    if address.startswith("["):
        host, bracket, port = address[1:].partition("]")
        if not bracket or not port.startswith(":"):
            raise NodeAddressError("an IPv6 host must be written [ADDRESS]:PORT")
        port = port[1:]
    else:
        host, colon, port = address.rpartition(":")
        if not colon:
            raise NodeAddressError("needs a port (HOST:PORT)")
        if ":" in host:
            raise NodeAddressError("must be HOST:PORT without a scheme (an IPv6 host goes in brackets)")
    if len(host) > MAX_HOST_CHARS:
        raise NodeAddressError(f"the host is {len(host)} characters, over the limit of {MAX_HOST_CHARS}")
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
        raise NodeAddressError("the port must be a number in [1, 65535]")
    ip = _ip(host, bracketed=address.startswith("["))
    if ip is None and not _is_dns_name(host):
        raise NodeAddressError("the host must be a DNS name, an IPv4 address or a [bracketed] IPv6 address")
    return NodeAddress(host, int(port), ip)


def _ip(host: str, bracketed: bool) -> IpAddress | None:
    try:
        if bracketed:
            return ipaddress.IPv6Address(host)  # no zone ids: `%` is refused by the address class
        return ipaddress.IPv4Address(host)
    except ValueError:
        if bracketed:
            raise NodeAddressError("the host in brackets must be an IPv6 address") from None
        return None


def _is_dns_name(host: str) -> bool:
    labels = host.split(".")
    # An all-numeric last label would be read as a (shortened) IPv4 address by resolvers: `127.1`.
    return all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


@dataclass(frozen=True, slots=True)
class NodeAllowList:
    """--admin-node-allow: CIDRs and host patterns; empty allows every host."""

    networks: tuple[IpNetwork, ...] = ()
    patterns: tuple[str, ...] = ()

    def allows(self, address: NodeAddress) -> bool:
        if not self.networks and not self.patterns:
            return True
        if address.ip is not None:
            ips = [address.ip]
            mapped = getattr(address.ip, "ipv4_mapped", None)
            if mapped is not None:
                ips.append(mapped)  # ::ffff:10.0.0.1 is 10.0.0.1
            if any(ip in network for ip in ips for network in self.networks):
                return True
        host = address.host.lower()
        return any(fnmatch.fnmatchcase(host, pattern) for pattern in self.patterns)


@functools.lru_cache(maxsize=8)
def parse_allow_list(entries: tuple[str, ...]) -> NodeAllowList:
    """The allow list of --admin-node-allow entries; ValueError naming a bad entry."""
    networks: list[IpNetwork] = []
    patterns: list[str] = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        if "/" in entry or not _PATTERN.fullmatch(entry) or len(entry) > MAX_HOST_CHARS:
            raise ValueError(
                f"{entry!r} is neither a CIDR nor a host pattern (letters, digits, '-', '.', '*')"
            )
        patterns.append(entry.lower())
    return NodeAllowList(tuple(networks), tuple(patterns))
