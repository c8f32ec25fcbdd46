"""Which IP addresses an image may be fetched from: public unicast only, unless an operator allows a network.

Checked on the address that is actually dialled (see fetch.GuardedBackend), never on a name.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from .errors import ForbiddenAddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Cloud instance-metadata endpoints that are not link-local (169.254.169.254 is): AWS IPv6, Alibaba.
METADATA = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200"))


def unmapped(address: IPAddress) -> IPAddress:
    """::ffff:127.0.0.1 is 127.0.0.1 on the wire."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def classify(address: IPAddress) -> str | None:
    """Why ``address`` is forbidden ("loopback", "private", ...), or None for a public unicast address.

    A 6to4 address (2002::/16) carries an IPv4 address that a relay delivers to: it is judged by that one
    (``2002:7f00:1::`` is "6to4 loopback"; one embedding a public IPv4 passes, as that IPv4 would). The
    deprecated site-local fec0::/10 is routable inside a site, and Python does not count it as private."""
    address = unmapped(address)
    if isinstance(address, ipaddress.IPv6Address):
        if address.sixtofour is not None:
            inner = classify(address.sixtofour)
            return None if inner is None else f"6to4 {inner}"
        if address.is_site_local:
            return "site-local"
    checks = (
        (address in METADATA, "metadata"),
        (address.is_loopback, "loopback"),
        (address.is_link_local, "link-local"),
        (address.is_unspecified, "unspecified"),
        (address.is_multicast, "multicast"),
        (address.is_private, "private"),
        (address.is_reserved, "reserved"),
        (not address.is_global, "not globally routable"),
    )
    return next((reason for hit, reason in checks if hit), None)


class AddressPolicy:
    def __init__(self, allow: Iterable[str] = ()) -> None:
        self.allow: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(c, strict=False) for c in allow)

    def check(self, host: str, address_text: str) -> None:
        """Raise ForbiddenAddress naming ``host``, the address and the reason; allowed networks pass."""
        address = unmapped(ipaddress.ip_address(address_text.split("%", 1)[0]))  # drop an IPv6 zone id
        if any(address in network for network in self.allow):
            return
        reason = classify(address)
        if reason is not None:
            shown = host if host == address_text else f"{host} ({address_text})"
            raise ForbiddenAddress(f"image URL host {shown} is a {reason} address; refused")
