"""A connection on which streams stop opening is closed, and the next stream dials afresh
(protocol/net/host.py Host.open_stream), between two real hosts on loopback."""

import pytest
import trio

from protocol.errors import StreamError
from protocol.net.host import STUCK_OPEN_FAILURES, open_host, parse_dial_addr
from protocol.net.hostlike import StreamLike

pytestmark = pytest.mark.integration
PROTOCOL = "/swarmtrain/test-stuck/1.0.0"


async def test_a_connection_whose_streams_stop_opening_is_closed_and_the_next_stream_dials_afresh() -> None:
    listen = ["/ip4/127.0.0.1/tcp/0"]
    release = trio.Event()

    async def serve(stream: StreamLike) -> None:
        await stream.write(b"ok")

    async def unanswered(raw: object) -> None:  # the peer's side never negotiates a protocol
        await release.wait()

    async with (
        open_host(identity_seed=b"\x01" * 32, listen_addrs=listen, announce_addrs=[]) as us,
        open_host(identity_seed=b"\x02" * 32, listen_addrs=listen, announce_addrs=[]) as peer,
    ):
        peer.set_handler(PROTOCOL, serve)
        await us.connect(parse_dial_addr(peer.addrs()[0]), timeout_s=5)
        network = peer._host.get_network()  # a fault no public API makes
        network.set_stream_handler(unanswered)
        try:
            for _ in range(STUCK_OPEN_FAILURES):
                assert peer.peer_id in us.connected_peers()
                with pytest.raises(StreamError, match="timed out"):
                    await us.open_stream(peer.peer_id, PROTOCOL, timeout_s=0.5)
            assert us.stuck_connections_closed == 1 and peer.peer_id not in us.connected_peers()
        finally:
            release.set()
            network.set_stream_handler(peer._host._swarm_stream_handler)
        stream = await us.open_stream(peer.peer_id, PROTOCOL, timeout_s=10)  # dials again
        assert await stream.read_exact(2) == b"ok"
        await stream.close()
        assert us.stuck_connections_closed == 1
