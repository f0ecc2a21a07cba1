"""Which peer addresses may connect to a relay's MAC-only ROUTER: the hosts of its attempt's
relay tree.

Why: a MAC-only link has no handshake, and ZeroMQ receives a whole message before the relay can
check its tag, so without a gate any pod that reaches the port could make the relay buffer
frames up to `relay.max_payload_bytes`. The relays of an attempt are the only legitimate senders
there; their endpoints name them by address (pod IPs in a cluster), or by host name in a static
setup, resolved once and cached.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit


def endpoint_host(endpoint: str) -> str:
    """The host of `tcp://host:port` (an IPv6 literal without its brackets); "" if none."""
    try:
        return urlsplit(endpoint).hostname or ""
    except ValueError:
        return ""


@functools.lru_cache(maxsize=1024)
def _addresses(host: str) -> frozenset[str]:
    """`host` itself when it is an IP literal, else what it resolves to (empty on failure)."""
    try:
        return frozenset({str(ipaddress.ip_address(host))})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return frozenset()
    return frozenset(str(info[4][0]) for info in infos)


def member_addresses(endpoints: Iterable[str]) -> frozenset[str]:
    """Every address the relays at `endpoints` may connect from."""
    out: set[str] = set()
    for endpoint in endpoints:
        host = endpoint_host(endpoint)
        if host:
            out |= _addresses(host)
    return frozenset(out)


def admits(members: frozenset[str], peer: str) -> bool:
    """True when `peer` (a ZAP address: an IP literal) is one of `members` (IPv4-mapped IPv6
    addresses count as their IPv4 address)."""
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip) in members
