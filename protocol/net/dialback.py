"""Reachability by dial-back ("AutoNAT"): ask a peer to dial us on a fresh TCP connection.

Protocol flow (``/swarmtrain/autonat/1.0.0``), one exchange per stream:

    asker                                          asked
    {t: "dialback?", v: 1, ports: [port],  ───────▶ (one request per peer per 10 s)
     seen?: true}
                                           ◀─────── {t: "seen", v: 1, ip: what it sees}, only
                                                    if asked (``seen``), before it dials
                                                    opens a fresh TCP connection to the IP it
                                                    sees the asker on (never another, so
                                                    nobody can aim it at a third party), at
                                                    each port (1-4 of them)
                                           ◀─────── {t: "dialback", v: 1, ok: [ports that
                                                     answered], ip: what it saw, refused?}

``seen`` is early news for the asker: an IP that is none of its own says a NAT translates
its address, seconds before a dial-back to a NAT's dropped SYNs times out
(``DIALBACK_TIMEOUT_S``); protocol/net/nat.py reserves a relay slot on that hint. An asker
that does not ask for it (an older one) gets the verdict alone, as before; one that asks a
server that does not know it gets the verdict first, and reads it just the same.

Why not libp2p's own AutoNAT service: in py-libp2p 0.8.1 its dial-back calls
``host.connect``, which returns at once when a connection to the asker exists, and the
asker is always connected to it, so every dial-back "succeeds" (basic_host.py ``connect``).
A fresh TCP connection is the honest test. How verdicts make a node public or private is
protocol/net/nat.py's (``Nat.check_reachability``).
"""

import logging
from collections.abc import Callable

import trio

from protocol import wire
from protocol.errors import BadMessage, ProtocolError
from protocol.net.addrs import plain_ip
from protocol.net.hostlike import DirectHostLike, StreamLike

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/autonat/1.0.0"
VERSION = 1
MAX_FRAME_NBYTES = 1024
MAX_PORTS = 4
DIALBACK_TIMEOUT_S = 3.0
# The longest IP text there is (IPv6 with an embedded IPv4), twice over.
MAX_IP_CHARS = 2 * 45
ASK_TIMEOUT_S = 2 * DIALBACK_TIMEOUT_S + 2.0
# A peer may ask us to dial back at most this often (the dial-back costs us sockets).
COOLDOWN_S = 10.0
MAX_ASKERS_KEPT = 4096


class DialbackServer:
    """Answers dial-back requests for ``host``."""

    def __init__(self, host: DirectHostLike) -> None:
        self._host = host
        self._last_asked: dict[str, float] = {}

    def register(self) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve, deadline_s=ASK_TIMEOUT_S)

    async def _serve(self, stream: StreamLike) -> None:
        request = await wire.receive(
            stream, msg_types=frozenset({"dialback?"}), version=VERSION, max_nbytes=MAX_FRAME_NBYTES
        )
        ports = request.get("ports")
        if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_PORTS:
            raise BadMessage(f"dialback?: 'ports' must be a list of 1-{MAX_PORTS} ports")
        checked = [wire.get_int({"p": p}, "p", lo=1, hi=65535) for p in ports]
        now = trio.current_time()
        last = self._last_asked.get(stream.peer_id)
        if last is not None and now - last < COOLDOWN_S:
            await wire.send(stream, "dialback", VERSION, {"ok": [], "ip": "", "refused": "asked too often"})
            return
        self._last_asked[stream.peer_id] = now
        if len(self._last_asked) > MAX_ASKERS_KEPT:  # bounded: forget the oldest half
            for peer in sorted(self._last_asked, key=self._last_asked.__getitem__)[: MAX_ASKERS_KEPT // 2]:
                del self._last_asked[peer]
        ip = self._host.direct_ip(stream.peer_id)
        if ip is None:
            await wire.send(stream, "dialback", VERSION, {"ok": [], "ip": "", "refused": "not a direct connection"})
            return
        if request.get("seen") is True:
            await wire.send(stream, "seen", VERSION, {"ip": ip})
        reached: list[int] = []

        async def try_port(port: int) -> None:
            with trio.move_on_after(DIALBACK_TIMEOUT_S):
                try:
                    conn = await trio.open_tcp_stream(ip, port)
                except OSError:
                    return
                await trio.aclose_forcefully(conn)
                reached.append(port)

        async with trio.open_nursery() as nursery:
            for port in dict.fromkeys(checked):
                nursery.start_soon(try_port, port)
        await wire.send(stream, "dialback", VERSION, {"ok": sorted(reached), "ip": ip})


async def ask(
    host: DirectHostLike, server: str, ports: list[int], *, on_seen: Callable[[str], None] | None = None
) -> tuple[bool, str | None] | None:
    """Ask ``server`` to dial us back on ``ports``: (reached, the IP it saw us on), or None
    if it gave no verdict (unreachable, refused, or a malformed answer). ``on_seen`` is
    called, before the verdict, with the IP the server sees us on, where it says so first."""
    try:
        with trio.fail_after(ASK_TIMEOUT_S):
            stream = await host.open_stream(server, PROTOCOL_ID, timeout_s=ASK_TIMEOUT_S)
            try:
                await wire.send(stream, "dialback?", VERSION, {"ports": ports, "seen": on_seen is not None})
                reply = await wire.receive(
                    stream, msg_types=frozenset({"seen", "dialback"}), version=VERSION, max_nbytes=MAX_FRAME_NBYTES
                )
                if reply["t"] == "seen":
                    seen = _ip(wire.get_str(reply, "ip", max_len=MAX_IP_CHARS))
                    if seen is None:
                        raise BadMessage("'seen' names no IP address")
                    if on_seen is not None:
                        on_seen(seen)
                    reply = await wire.receive(
                        stream, msg_types=frozenset({"dialback"}), version=VERSION, max_nbytes=MAX_FRAME_NBYTES
                    )
            finally:
                await stream.close()
    except (ProtocolError, trio.TooSlowError) as exc:
        logger.debug("dial-back request to %s: %s", server, exc)
        return None
    if reply.get("refused"):
        logger.debug("dial-back request to %s refused: %s", server, str(reply["refused"])[:100])
        return None
    ok = reply.get("ok")
    ip = reply.get("ip")
    if (
        not isinstance(ok, list)
        or len(ok) > MAX_PORTS
        or not all(isinstance(port, int) for port in ok)
        or not isinstance(ip, str)
    ):
        logger.info("dial-back answer from %s is malformed", server)
        return None
    seen_as = _ip(ip) if ip else None
    if ip and seen_as is None:
        logger.info("dial-back answer from %s names no IP address", server)
        return None
    return any(port in ports for port in ok), seen_as


def _ip(text: str) -> str | None:
    """``text`` as an IP address in its canonical form (an IPv4 address a dual-stack server
    reports mapped into IPv6 is the IPv4 address, as our own are: ``addrs.plain_ip``), or
    None if it is none."""
    try:
        return str(plain_ip(text))
    except ValueError:
        return None
