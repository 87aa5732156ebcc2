"""Transport addresses: what we listen on, what we announce, what we dial.

IPv4 and IPv6 alike: ``/ip4/<ip>/tcp/<port>`` and ``/ip6/<ip>/tcp/<port>`` (a wildcard,
``0.0.0.0`` or ``::``, listens on every address of its family). A dial address may name a
DNS name (``/dns``, ``/dns4``, ``/dns6``): it is resolved to IP addresses before the dial.
No libp2p here, only ``multiaddr``.
"""

import ipaddress
import logging
import socket

import ifaddr
import multiaddr
import multiaddr.exceptions
import trio

from protocol.errors import DialError

logger = logging.getLogger("protocol.net")

_ADDR_ERRORS = (ValueError, TypeError, KeyError, multiaddr.exceptions.Error)

# The wildcard address of each family: listening on it is listening on every address.
WILDCARDS = {"ip4": "0.0.0.0", "ip6": "::"}
_FAMILIES = {"ip4": socket.AF_INET, "ip6": socket.AF_INET6}
_LOOPBACK = {"ip4": "127.0.0.1", "ip6": "::1"}

# Names in dial addresses (`/dns/...`, `/dns4/...`, `/dns6/...`): the address families each asks for.
DNS_FAMILIES = {"dns": socket.AF_UNSPEC, "dns4": socket.AF_INET, "dns6": socket.AF_INET6}


def plain_ip(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``ip`` as the address it is: an IPv4 address mapped into IPv6 (as a dual-stack socket
    reports one) is the IPv4 address; an IPv6 zone (``%eth0``) is dropped."""
    parsed = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped
    return parsed


def is_global_addr(addr: str) -> bool:
    """Whether a transport address may reach a machine on the internet: an ``/ip4`` or
    ``/ip6`` address that is globally routable, or a DNS name (resolved later: assumed so);
    not a private, loopback or link-local one, nor a relay circuit."""
    parts = addr.split("/")
    if "/p2p-circuit" in addr or len(parts) < 3:
        return False
    if parts[1] in DNS_FAMILIES:
        return True
    if parts[1] not in _FAMILIES:
        return False
    try:
        return plain_ip(parts[2]).is_global
    except ValueError:
        return False


def ip_addr(ip: str, port: int) -> str:
    """``/ip4/<ip>/tcp/<port>`` or ``/ip6/<ip>/tcp/<port>``, as ``ip`` is."""
    parsed = plain_ip(ip)
    return f"/ip{parsed.version}/{parsed}/tcp/{port}"


def check_listen_addr(addr: str) -> tuple[str, int]:
    """Validate a ``/ip4/<ip>/tcp/<port>`` or ``/ip6/<ip>/tcp/<port>`` listen address;
    returns (ip, port)."""
    parts = addr.split("/")
    try:
        if len(parts) != 5 or parts[0] or parts[1] not in _FAMILIES or parts[3] != "tcp":
            raise ValueError("not /ip4|ip6/<ip>/tcp/<port>")
        maddr = multiaddr.Multiaddr(addr)
        ip = str(maddr.value_for_protocol(parts[1]))
        port = int(maddr.value_for_protocol("tcp"))
    except _ADDR_ERRORS as exc:
        raise ValueError(f"{addr!r} is not an /ip4/<ip>/tcp/<port> or /ip6/<ip>/tcp/<port> address") from exc
    return ip, port


def ensure_port_free(addr: str) -> None:
    """Fail if another process already listens on ``addr``.

    libp2p's listener sets SO_REUSEPORT, so a second daemon would silently share the port;
    a plain bind (without SO_REUSEPORT) tells the truth.
    """
    ip, port = check_listen_addr(addr)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if family == socket.AF_INET6:  # as libp2p's (trio's) listener: IPv6 only
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            probe.bind((ip, port))
        except OSError as exc:
            raise DialError(f"cannot listen on {addr}: {exc.strerror}") from exc


async def resolve_addr(addr: str) -> list[str]:
    """``addr`` with a DNS name as the /ip4 and /ip6 addresses the name has now (py-libp2p's
    TCP transport dials IP addresses only); any other address as it is. [] if the name does
    not resolve."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in DNS_FAMILIES:
        return [addr]
    try:
        found = await trio.socket.getaddrinfo(parts[2], None, family=DNS_FAMILIES[parts[1]], type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        logger.info("cannot resolve %s: %s", parts[2], exc)
        return []
    resolved: list[str] = []
    for family, *_, sockaddr in found:
        ip = "/".join(["", "ip4" if family == socket.AF_INET else "ip6", str(sockaddr[0]), *parts[3:]])
        if ip not in resolved:
            resolved.append(ip)
    return resolved


def local_ips(family: str) -> list[str]:
    """This machine's addresses of ``family`` ("ip4" or "ip6"), loopback last. IPv6
    link-local addresses are left out: they need an interface to be dialed, and no peer
    elsewhere can use them."""
    ips: set[str] = set()
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if family == "ip4" and ip.is_IPv4:
                ips.add(str(ip.ip))
            elif family == "ip6" and ip.is_IPv6 and isinstance(ip.ip, tuple):
                parsed = ipaddress.IPv6Address(ip.ip[0].split("%")[0])
                if not parsed.is_link_local:
                    ips.add(str(parsed))
    return sorted(ips, key=lambda ip: (ipaddress.ip_address(ip).is_loopback, ip))


def _wildcard_family(addr: str) -> str | None:
    parts = addr.split("/")
    return parts[1] if len(parts) > 2 and WILDCARDS.get(parts[1]) == parts[2] else None


def on_local_ips(addrs: list[str], *, with_loopback: bool) -> list[str]:
    """``addrs``, each wildcard one (``0.0.0.0``, ``::``) as the same address on each of
    this machine's addresses of its family; without loopback ones unless there is nothing
    else, or ``with_loopback``."""
    out: list[str] = []
    for addr in addrs:
        family = _wildcard_family(addr)
        if family is None:
            out.append(addr)
            continue
        ips = local_ips(family)
        if not with_loopback:
            ips = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback] or [_LOOPBACK[family]]
        rest = "/".join(addr.split("/")[3:])
        out.extend(f"/{family}/{ip}/{rest}" for ip in ips)
    return out


def announce_for(listen_addrs: list[str]) -> list[str]:
    """What to tell peers when listening on a wildcard: this machine's addresses, not loopback.

    libp2p would announce ``/ip4/0.0.0.0/...`` (identify) and we would add 127.0.0.1: a peer
    dialing either reaches *itself*, fails the handshake (the peer id differs), and libp2p
    then forgets every address of the peer it meant and blocks it for a minute, which is
    what hole punching needs least. Empty (libp2p's default) if a port is not fixed yet.
    """
    if not any(_wildcard_family(a) for a in listen_addrs) or any(a.split("/")[4:5] == ["0"] for a in listen_addrs):
        return []
    return on_local_ips(listen_addrs, with_loopback=False)
