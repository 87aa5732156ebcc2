"""UPnP port mapping against a fake gateway on loopback (SSDP over unicast UDP, HTTP + SOAP)."""

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from functools import partial

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from protocol.net import nat, upnp
from protocol.net.data_channel import DataChannel
from protocol.net.host import open_host

DESCRIPTION = b"""<?xml version="1.0"?>
<root xmlns="urn:schemas-upnp-org:device-1-0"><device><deviceList><device><deviceList><device>
<serviceList><service>
<serviceType>urn:schemas-upnp-org:service:WANIPConnection:1</serviceType>
<controlURL>/ctl/IPConn</controlURL>
</service></serviceList></device></deviceList></device></deviceList></device></root>"""


class FakeGateway:
    def __init__(self, *, refuse_mapping: bool = False) -> None:
        self.refuse_mapping = refuse_mapping
        self.actions: list[tuple[str, dict[str, str]]] = []
        self.ssdp_addr = ("127.0.0.1", 0)
        self.http_port = 0

    async def _ssdp(self, sock: trio.socket.SocketType) -> None:
        while True:
            data, addr = await sock.recvfrom(4096)
            if data.startswith(b"M-SEARCH"):
                reply = f"HTTP/1.1 200 OK\r\nLOCATION: http://127.0.0.1:{self.http_port}/desc.xml\r\nST: x\r\n\r\n"
                await sock.sendto(reply.encode(), addr)

    async def _http(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            body += await stream.receive_some(65536)
        if head.startswith(b"GET /desc.xml"):
            await self._reply(stream, 200, DESCRIPTION)
            return
        action = re.search(rb'SOAPAction: "[^#]*#(\w+)"', head).group(1).decode()  # type: ignore[union-attr]
        fields = {k.decode(): v.decode() for k, v in re.findall(rb"<(New\w+)>([^<]*)</New\w+>", body)}
        self.actions.append((action, fields))
        if action == "AddPortMapping" and self.refuse_mapping:
            fault = b"<s:Fault><errorCode>718</errorCode><errorDescription>ConflictInMappingEntry</errorDescription>"
            await self._reply(stream, 500, fault)
        elif action == "GetExternalIPAddress":
            await self._reply(stream, 200, b"<NewExternalIPAddress>203.0.113.7</NewExternalIPAddress>")
        else:
            await self._reply(stream, 200, b"<ok/>")

    @staticmethod
    async def _reply(stream: trio.SocketStream, status: int, body: bytes) -> None:
        await stream.send_all(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await stream.aclose()

    @asynccontextmanager
    async def running(self) -> AsyncIterator["FakeGateway"]:
        with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
            await sock.bind(("127.0.0.1", 0))
            self.ssdp_addr = sock.getsockname()
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(partial(trio.serve_tcp, self._http, 0, host="127.0.0.1"))
                self.http_port = listeners[0].socket.getsockname()[1]
                nursery.start_soon(self._ssdp, sock)
                yield self
                nursery.cancel_scope.cancel()


def policy(gateway: FakeGateway) -> nat.NatPolicy:
    return nat.NatPolicy(reachability="private", hole_punch=False, upnp=True, ssdp_addr=gateway.ssdp_addr)


async def test_the_router_forwards_our_port_and_we_announce_it_until_we_stop() -> None:
    async with FakeGateway().running() as gateway:
        async with open_host(
            identity_seed=b"\x21" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[], relay=policy(gateway)
        ) as host:
            with trio.fail_after(10):
                while host.nat.status.upnp != "mapped":
                    await host.nat.changed.wait()
            port = host.transport_addrs()[0].rsplit("/", 1)[1]
            assert f"/ip4/203.0.113.7/tcp/{port}/p2p/{host.peer_id}" in host.addrs()
            (_, mapping), (_, _) = gateway.actions
            assert gateway.actions[0][0] == "AddPortMapping" and gateway.actions[1][0] == "GetExternalIPAddress"
            assert mapping["NewExternalPort"] == port == mapping["NewInternalPort"]
            assert mapping["NewInternalClient"] == "127.0.0.1" and mapping["NewProtocol"] == "TCP"
        assert gateway.actions[-1] == (
            "DeletePortMapping",
            {"NewRemoteHost": "", "NewExternalPort": port, "NewProtocol": "TCP"},
        )


async def test_a_data_channels_port_is_forwarded_too_and_unmapped_when_we_stop() -> None:
    """A node public through UPnP announces its data channel's port to the peers that send
    to it (NoLoCo payloads, SPES versions): the router forwards that port too, under the same
    number, asked once however often; without UPnP nothing is asked."""
    async with FakeGateway().running() as gateway:
        async with open_host(
            identity_seed=b"\x23" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[], relay=policy(gateway)
        ) as host:
            channel = DataChannel("127.0.0.1")
            async with trio.open_nursery() as nursery:
                await nursery.start(channel.run)
                host.forward_data_port(channel.port)
                host.forward_data_port(channel.port)  # once is enough
                with trio.fail_after(10):
                    while host.nat.status.upnp_data.get(channel.port) != "mapped":
                        await host.nat.changed.wait()
                assert host.nat.summary()["upnp_data"] == {str(channel.port): "mapped"}
                port = str(channel.port)
                forwarded = [f for a, f in gateway.actions if a == "AddPortMapping" and f["NewExternalPort"] == port]
                assert len(forwarded) == 1
                assert forwarded[0]["NewInternalPort"] == port and forwarded[0]["NewProtocol"] == "TCP"
                nursery.cancel_scope.cancel()
            # The channel closed: its forward goes now, not when the host stops (the port is
            # the OS's to give to another process next).
            host.unforward_data_port(channel.port)
            with trio.fail_after(10):
                while channel.port in host.nat.status.upnp_data:
                    await host.nat.changed.wait()
            removed = [f["NewExternalPort"] for a, f in gateway.actions if a == "DeletePortMapping"]
            assert removed == [port]
            host.unforward_data_port(channel.port)  # again: nothing
        # The host's own port goes when it stops; the data port's was gone already, once.
        assert [f["NewExternalPort"] for a, f in gateway.actions if a == "DeletePortMapping"].count(port) == 1
    async with open_host(identity_seed=b"\x24" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as plain:
        plain.forward_data_port(40000)
        assert plain.nat.status.upnp_data == {}


async def test_a_refusing_router_is_reported_and_nothing_is_announced() -> None:
    async with (
        FakeGateway(refuse_mapping=True).running() as gateway,
        open_host(
            identity_seed=b"\x22" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[], relay=policy(gateway)
        ) as host,
    ):
        with trio.fail_after(10):
            while not host.nat.status.upnp.startswith("failed"):
                await host.nat.changed.wait()
        assert "refused AddPortMapping: HTTP 500 718 (ConflictInMappingEntry)" in host.nat.status.upnp
        assert not any("203.0.113.7" in a for a in host.addrs())


async def test_no_gateway_is_a_clear_error() -> None:
    with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as silent:
        await silent.bind(("127.0.0.1", 0))
        with pytest.raises(upnp.UpnpError, match="no UPnP gateway answered"):
            await upnp.discover(silent.getsockname(), timeout_s=0.2)


def test_a_description_without_a_wan_service_is_refused() -> None:
    with pytest.raises(upnp.UpnpError, match="no WANIPConnection"):
        upnp.parse_description(b"<root><service><serviceType>x</serviceType></service></root>", "http://h/")
    with pytest.raises(upnp.UpnpError, match="not http"):
        upnp.parse_description(DESCRIPTION.replace(b"/ctl/IPConn", b"ftp://h/x"), "http://h/")
    assert upnp.parse_description(DESCRIPTION, "http://10.0.0.1:5000/d.xml") == (
        "http://10.0.0.1:5000/ctl/IPConn",
        "urn:schemas-upnp-org:service:WANIPConnection:1",
    )


@given(st.binary(max_size=2000))
def test_any_description_parses_or_is_a_upnp_error(data: bytes) -> None:
    with suppress(upnp.UpnpError):
        upnp.parse_description(data, "http://10.0.0.1/")


def test_malformed_gateway_urls_are_upnp_errors_not_crashes() -> None:
    """Anyone on the LAN may answer SSDP: urllib's ValueError on a bad [IPv6] host or port
    once escaped upnp's loop and ended the daemon (found by bench/fuzz.py)."""
    from protocol.net import upnp

    assert upnp.location_of(b"HTTP/1.1 200 OK\r\nLOCATION: http://[fe80::1/desc.xml\r\n\r\n") is None
    assert upnp.location_of(b"HTTP/1.1 200 OK\r\nLOCATION: http://192.168.1.1:99999/d.xml\r\n\r\n") is None
    assert upnp.location_of(b"HTTP/1.1 200 OK\r\nLOCATION: http://192.168.1.1:5000/d.xml\r\n\r\n") is not None
    xml = (
        b"<root><device><serviceList><service><serviceType>urn:schemas-upnp-org:service:WANIPConnection:1"
        b"</serviceType><controlURL>http://[fe80::1/ctl</controlURL></service></serviceList></device></root>"
    )
    with pytest.raises(upnp.UpnpError):
        upnp.parse_description(xml, "http://192.168.1.1:5000/desc.xml")
