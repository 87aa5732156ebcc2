"""What lies under a libp2p connection: peer ids, the TCP socket of a direct connection."""

import socket

import trio
from libp2p.abc import IHost
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from protocol.errors import DialError
from protocol.net.addrs import plain_ip


def parse_peer_id(peer_id: str) -> ID:
    try:
        return ID.from_base58(peer_id)
    except (ValueError, BaseLibp2pError) as exc:
        raise DialError(f"invalid peer id {peer_id!r}") from exc


def socket_stream_of(conn: object) -> trio.SocketStream | None:
    """The TCP socket under a connection: conn → muxer → security → raw → trio stream.

    A relayed connection ends in a stream over another peer, not in a socket: None.
    """
    return socket_under(getattr(conn, "muxed_conn", None))


def socket_under(layer: object) -> trio.SocketStream | None:
    """The TCP socket under one layer of a connection's stack (its muxer, its security)."""
    for _ in range(8):  # the stack is 5 layers deep in 0.8.1
        if layer is None or isinstance(layer, trio.SocketStream):
            break
        layer = next((getattr(layer, a) for a in ("secured_conn", "conn", "stream") if hasattr(layer, a)), None)
    return layer if isinstance(layer, trio.SocketStream) else None


def remote_ip(raw_host: IHost, peer_id: str) -> tuple[str, int] | None:
    """(IP, port) of the peer on our direct connection to it (IPv4 or IPv6; an IPv4 address
    mapped into IPv6 as the IPv4 it is); None if relayed or none."""
    try:
        conns = raw_host.get_network().connections.get(parse_peer_id(peer_id), [])
    except DialError:
        return None
    for conn in conns:
        sock = socket_stream_of(conn)
        if sock is None or sock.socket.family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            ip, port = sock.socket.getpeername()[:2]
        except OSError:  # closed under us
            continue
        return str(plain_ip(str(ip))), int(port)
    return None


def free_stream_slots(raw_host: IHost) -> dict[str, int]:
    """Per connected peer, the fewest free slots for streams we open on one of its
    connections (yamux allows 256 at once; a slot leaked per stream ends, after 256, every
    new stream to that peer: the soak's diagnosis)."""
    free: dict[str, int] = {}
    for peer, conns in raw_host.get_network().connections.items():
        for conn in conns:
            semaphore = getattr(getattr(conn, "muxed_conn", None), "stream_backlog_semaphore", None)
            value = getattr(semaphore, "value", None)
            if isinstance(value, int):
                key = peer.to_base58()
                free[key] = min(free.get(key, value), value)
    return free
