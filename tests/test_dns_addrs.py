"""Dial addresses with DNS names (/dns, /dns4, /dns6): resolved at the façade, since
py-libp2p's TCP transport dials IP addresses only."""

import pytest
import trio

from protocol.errors import DialError
from protocol.net.host import open_host, parse_dial_addr, resolve_addr


async def test_names_resolve_to_ip_addresses_and_others_pass_unchanged() -> None:
    assert await resolve_addr("/dns4/localhost/tcp/7400") == ["/ip4/127.0.0.1/tcp/7400"]
    assert "/ip4/127.0.0.1/tcp/7400" in await resolve_addr("/dns/localhost/tcp/7400")
    assert await resolve_addr("/ip4/10.0.0.1/tcp/1") == ["/ip4/10.0.0.1/tcp/1"]


@pytest.mark.integration
async def test_a_peer_is_dialled_by_its_dns_name(monkeypatch: pytest.MonkeyPatch) -> None:
    listen = ["/ip4/127.0.0.1/tcp/0"]
    async with (
        open_host(identity_seed=b"\x01" * 32, listen_addrs=listen, announce_addrs=[]) as us,
        open_host(identity_seed=b"\x02" * 32, listen_addrs=listen, announce_addrs=[]) as peer,
    ):
        port = peer.addrs()[0].split("/tcp/")[1].split("/")[0]
        by_name = f"/dns4/localhost/tcp/{port}/p2p/{peer.peer_id}"
        with trio.fail_after(30):
            await us.connect(parse_dial_addr(by_name), timeout_s=10)
        assert peer.peer_id in us.connected_peers()
        await us.disconnect(peer.peer_id)

        async def unknown(addr: str) -> list[str]:  # a name with no address (no DNS query made)
            return []

        monkeypatch.setattr("protocol.net.host.resolve_addr", unknown)
        with pytest.raises(DialError, match="resolves"):
            await us.connect(parse_dial_addr(by_name), timeout_s=10)
