"""UPnP IGD port mapping (``network.upnp = true``): ask the home router to forward our port.

Many home routers forward a port when asked over UPnP (Internet Gateway Device protocol):

    SSDP M-SEARCH (UDP multicast 239.255.255.250:1900) → a LOCATION URL
    GET LOCATION → the device description (XML) → the WAN*Connection service's control URL
    SOAP AddPortMapping(external port = our listen port → our LAN IP, TCP, lease)
    SOAP GetExternalIPAddress → the public IP we announce
    ... renewed at half the lease; DeletePortMapping when we stop.

With a mapping the node is dialable: the next dial-back check (protocol/net/nat.py) finds it
public, and it needs no relay. Off by default: it changes the user's router.

Everything from the network here is untrusted: replies are read up to ``MAX_REPLY_NBYTES``
with a deadline, XML is parsed by the standard library's expat (which refuses entity
expansion attacks since expat 2.4), and anything unexpected is a ``UpnpError`` naming it.
"""

import logging
import re
import socket
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import trio

logger = logging.getLogger(__name__)

SSDP_ADDR = ("239.255.255.250", 1900)
SEARCH_TARGET = "urn:schemas-upnp-org:device:InternetGatewayDevice:1"
SERVICE_TYPES = (
    "urn:schemas-upnp-org:service:WANIPConnection:2",
    "urn:schemas-upnp-org:service:WANIPConnection:1",
    "urn:schemas-upnp-org:service:WANPPPConnection:1",
)
DISCOVER_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 5.0
MAX_REPLY_NBYTES = 64 << 10
LEASE_S = 3600
RETRY_S = 600.0
UNMAP_TIMEOUT_S = 2.0
DESCRIPTION = "swarmtrain"
_IPV4 = re.compile(r"\d{1,3}(\.\d{1,3}){3}")


class UpnpError(Exception):
    """No usable gateway, or it said no (the message says which)."""


@dataclass(frozen=True, slots=True)
class Gateway:
    control_url: str
    service_type: str
    local_ip: str
    """Our address on the gateway's network (the mapping's internal client)."""


async def discover(ssdp_addr: tuple[str, int] = SSDP_ADDR, timeout_s: float = DISCOVER_TIMEOUT_S) -> Gateway:
    """Find a gateway that maps ports; ``UpnpError`` if none answers in time."""
    request = (
        "M-SEARCH * HTTP/1.1\r\n"
        f"HOST: {ssdp_addr[0]}:{ssdp_addr[1]}\r\n"
        'MAN: "ssdp:discover"\r\nMX: 2\r\n'
        f"ST: {SEARCH_TARGET}\r\n\r\n"
    ).encode()
    locations: list[str] = []
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        await sock.bind(("0.0.0.0", 0))
        await sock.sendto(request, ssdp_addr)
        with trio.move_on_after(timeout_s):
            while not locations:
                data, _ = await sock.recvfrom(4096)
                location = location_of(data)
                if location is not None:
                    locations.append(location)
    if not locations:
        raise UpnpError(f"no UPnP gateway answered within {timeout_s:g} s")
    status, body = await _http("GET", locations[0])
    if status != 200:
        raise UpnpError(f"the gateway's description at {locations[0]} answered HTTP {status}")
    control_url, service_type = parse_description(body, locations[0])
    return Gateway(control_url, service_type, _local_ip_towards(control_url))


def location_of(answer: bytes) -> str | None:
    """The http LOCATION of an SSDP answer (anyone on the LAN may answer: None for anything else)."""
    location = _header(answer.decode("latin-1"), "location")
    return location if location and _is_http(location) else None


def parse_description(xml: bytes, base_url: str) -> tuple[str, str]:
    """(control URL, service type) of the first WAN*Connection service in a device description."""
    try:
        root = ElementTree.fromstring(xml)
    except ElementTree.ParseError as exc:
        raise UpnpError(f"the gateway's description is not XML: {exc}") from exc
    services = {}
    for service in root.iter():
        if not service.tag.endswith("}service") and service.tag != "service":
            continue
        fields = {child.tag.rsplit("}", 1)[-1]: (child.text or "").strip() for child in service}
        if fields.get("serviceType") in SERVICE_TYPES and fields.get("controlURL"):
            services[fields["serviceType"]] = fields["controlURL"]
    for service_type in SERVICE_TYPES:
        if service_type in services:
            try:
                url = urljoin(base_url, services[service_type])
            except ValueError as exc:
                raise UpnpError(f"the gateway's control URL is malformed: {exc}") from exc
            if not _is_http(url):
                raise UpnpError(f"the gateway's control URL {url[:200]!r} is not http")
            return url, service_type
    raise UpnpError("the gateway offers no WANIPConnection or WANPPPConnection service")


async def add_mapping(gateway: Gateway, port: int, *, lease_s: int = LEASE_S) -> None:
    await _soap(
        gateway,
        "AddPortMapping",
        {
            "NewRemoteHost": "",
            "NewExternalPort": str(port),
            "NewProtocol": "TCP",
            "NewInternalPort": str(port),
            "NewInternalClient": gateway.local_ip,
            "NewEnabled": "1",
            "NewPortMappingDescription": DESCRIPTION,
            "NewLeaseDuration": str(lease_s),
        },
    )


async def delete_mapping(gateway: Gateway, port: int) -> None:
    await _soap(gateway, "DeletePortMapping", {"NewRemoteHost": "", "NewExternalPort": str(port), "NewProtocol": "TCP"})


async def external_ip(gateway: Gateway) -> str:
    body = await _soap(gateway, "GetExternalIPAddress", {})
    match = re.search(rb"<NewExternalIPAddress>\s*([^<]*?)\s*</NewExternalIPAddress>", body)
    ip = match.group(1).decode("ascii", "replace") if match else ""
    if not _IPV4.fullmatch(ip) or not all(int(part) < 256 for part in ip.split(".")):
        raise UpnpError(f"the gateway gave no usable external IP ({ip[:40]!r})")
    return ip


async def _soap(gateway: Gateway, action: str, arguments: dict[str, str]) -> bytes:
    args = "".join(f"<{k}>{_escape(v)}</{k}>" for k, v in arguments.items())
    body = (
        '<?xml version="1.0"?>'
        '<s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/" '
        's:encodingStyle="http://schemas.xmlsoap.org/soap/encoding/"><s:Body>'
        f'<u:{action} xmlns:u="{gateway.service_type}">{args}</u:{action}>'
        "</s:Body></s:Envelope>"
    ).encode()
    headers = {"Content-Type": 'text/xml; charset="utf-8"', "SOAPAction": f'"{gateway.service_type}#{action}"'}
    status, reply = await _http("POST", gateway.control_url, body, headers)
    if status != 200:
        code = re.search(rb"<errorCode>\s*(\d+)\s*</errorCode>", reply)
        text = re.search(rb"<errorDescription>\s*([^<]{0,200})</errorDescription>", reply)
        detail = f" {code.group(1).decode()}" if code else ""
        detail += f" ({text.group(1).decode('utf-8', 'replace')})" if text else ""
        raise UpnpError(f"the gateway refused {action}: HTTP {status}{detail}")
    return reply


def _split(url: str) -> tuple[str, int, str, str]:
    """(host, port, path with query, netloc) of an http URL a gateway gave us; anything
    malformed (urllib raises ValueError for bad brackets or ports) is an ``UpnpError``:
    the answer comes from whoever spoke on the LAN multicast."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or 80
    except ValueError as exc:
        raise UpnpError(f"malformed URL {url[:200]!r}: {exc}") from exc
    if parts.scheme != "http" or not host:
        raise UpnpError(f"not an http URL: {url[:200]!r}")
    return host, port, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), parts.netloc


def _is_http(url: str) -> bool:
    try:
        _split(url)
    except UpnpError:
        return False
    return True


async def _http(method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    host, port, path, netloc = _split(url)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {netloc}", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    reply = b""
    with trio.move_on_after(REQUEST_TIMEOUT_S) as scope:
        try:
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(request)
                while chunk := await stream.receive_some(16384):
                    reply += chunk
                    if len(reply) > MAX_REPLY_NBYTES:
                        raise UpnpError(f"{url} answered more than {MAX_REPLY_NBYTES} bytes")
        except (OSError, trio.BrokenResourceError) as exc:
            raise UpnpError(f"{method} {url}: {exc}") from exc
    if scope.cancelled_caught:
        raise UpnpError(f"{method} {url}: no answer within {REQUEST_TIMEOUT_S:g} s")
    head, _, content = reply.partition(b"\r\n\r\n")
    status = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    if status is None:
        raise UpnpError(f"{url} did not answer HTTP")
    return int(status.group(1)), content


def _header(response: str, name: str) -> str | None:
    for line in response.split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _local_ip_towards(url: str) -> str:
    """Our source address towards the gateway (a UDP 'connect' sends nothing)."""
    host, port, _, _ = _split(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
        except OSError as exc:
            raise UpnpError(f"no route to the gateway at {host}: {exc}") from exc


@dataclass(slots=True)
class Mapping:
    gateway: Gateway
    external_ip: str
    port: int

    @property
    def addr(self) -> str:
        return f"/ip4/{self.external_ip}/tcp/{self.port}"


async def keep_mapped(port: int, ssdp_addr: tuple[str, int], on_change: Callable[[str, str | None], None]) -> None:
    """Keep ``port`` forwarded to us for as long as this runs; remove the mapping when cancelled.

    ``on_change(state, addr)`` hears "mapping", "mapped" with the forwarded address,
    "unmapped" (renewal failed, or stopping) and "failed: <why>" (retried every ``RETRY_S``).
    """
    while True:
        on_change("mapping", None)
        try:
            gateway = await discover(ssdp_addr)
            await add_mapping(gateway, port, lease_s=LEASE_S)
            ip = await external_ip(gateway)
        except UpnpError as exc:
            on_change(f"failed: {exc}", None)
            logger.warning("UPnP: %s; retrying in %.0f min", exc, RETRY_S / 60)
            await trio.sleep(RETRY_S)
            continue
        addr = f"/ip4/{ip}/tcp/{port}"
        logger.info("UPnP: the router forwards %s to us", addr)
        on_change("mapped", addr)
        try:
            while True:
                await trio.sleep(LEASE_S / 2)
                await add_mapping(gateway, port, lease_s=LEASE_S)
        except UpnpError as exc:
            logger.warning("UPnP: renewing the mapping failed: %s", exc)
        finally:
            on_change("unmapped", None)
            with trio.CancelScope(shield=True), trio.move_on_after(UNMAP_TIMEOUT_S):
                try:
                    await delete_mapping(gateway, port)
                except UpnpError as exc:
                    logger.info("UPnP: removing the mapping: %s (it expires by itself)", exc)
