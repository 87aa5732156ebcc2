"""Every byte this node sends and receives over TCP: libp2p's connections (after Noise and
yamux: what the wire carries, gossip, DHT and identify included) and our data channel's.

One pair of counters per process (a daemon is one process). libp2p's TCP connections are
counted in py-libp2p 0.8.1's ``TrioTCPStream`` (``count_libp2p``, installed when
protocol/net/host.py is imported); the data channel counts its own (data_channel.py).
Not counted: UDP (mDNS, UPnP's SSDP), the dial-back probe's few bytes, and IP/TCP headers.
Reported as ``wire_bytes_sent`` / ``wire_bytes_received`` in the training status and in
``simulate``'s report (issue 16: the bytes a compressed run saves are measured here, not
only its payloads).
"""

from dataclasses import dataclass


@dataclass(slots=True)
class Traffic:
    sent: int = 0
    received: int = 0


TRAFFIC = Traffic()


def count_libp2p() -> None:
    """Count every write and read of libp2p's TCP connections in ``TRAFFIC`` (once)."""
    from libp2p.io.trio import TrioTCPStream

    if getattr(TrioTCPStream, "_swarmtrain_counted", False):
        return
    write, read = TrioTCPStream.write, TrioTCPStream.read

    async def counted_write(self: TrioTCPStream, data: bytes) -> None:
        await write(self, data)
        TRAFFIC.sent += len(data)

    async def counted_read(self: TrioTCPStream, n: int | None = None) -> bytes:
        data: bytes = await read(self, n)
        TRAFFIC.received += len(data)
        return data

    TrioTCPStream.write = counted_write
    TrioTCPStream.read = counted_read
    TrioTCPStream._swarmtrain_counted = True
