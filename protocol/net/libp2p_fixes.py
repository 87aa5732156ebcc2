"""Where py-libp2p 0.8.1 lets one peer's bytes stop the whole daemon, and how we close it.

Found by probing 0.8.1 with hostile peers on loopback (issue 12; docs/security.md has the
list with each test). Why one bad stream is fatal there: every inbound stream's handler
runs as a task of the Swarm's service manager, and any exception it does not expect
(``is_expected_connection_shutdown``) cancels the whole Swarm: every connection, the
listener, and through ``BasicHost.run`` the host and our daemon with it. Pubsub's
``push_msg`` is likewise a task of the Pubsub service, whose failure ends the host.

Global fixes (module state, applied when protocol/net/host.py is imported, before any host):
1. Kademlia's protocol id: ``KadDHT(protocol_prefix=...)`` only stores the prefix; the id
   ``/ipfs/kad/1.0.0`` is hard-coded in five modules (registration, the dials of peer
   routing, providers and values, and the routing table's filter of peers by their
   protocols). We set it to ``/swarmtrain/kad/1.0.0`` in all five, so our DHT never mixes
   with the IPFS one. Test: tests/adversarial/test_libp2p.py (the id on the wire).
2. Multiselect, which runs before every handler of every stream: ``read()`` returns
   ``data.decode()`` and a ``UnicodeDecodeError`` escapes as no libp2p error (three
   invalid bytes as a protocol name killed the host), and its length prefix is not capped
   (megabytes per stream until a timeout). Now: invalid UTF-8 and names over
   ``MAX_MULTISELECT_NBYTES`` raise ``MultiselectCommunicatorError``, which libp2p handles,
   in both directions (``Host.open_stream`` no longer sees a bare ``UnicodeDecodeError``).

3. Streams opened under a timeout (every request of ours has one): yamux's ``open_stream``
   takes one of the connection's 256 stream slots, then writes the SYN, and gives the slot
   back only if that write raises an ``Exception``; ``SwarmConn.new_stream`` then awaits the
   swarm's bookkeeping with nothing to undo the stream if it stops there. A cancellation
   (our timeout) in either place leaked the slot for the connection's life: in the 16-node
   soak, daemons on 2 cores timed out opens all the time, and after 256 of them to one
   peer no stream to it ever opened again (every ZO pull to it failed while a fresh
   connection worked). Now both undo the stream on any exit but a return, cancellation
   included. Test: tests/adversarial/test_resources.py (an open cancelled mid-SYN).
4. Yamux's frame reader (``Yamux.handle_incoming``) writes the ACK of a peer's SYN, ping
   answers and RSTs itself, through ``_write_frame``, behind the connection's one write
   lock. A task writing DATA holds that lock while its write waits on a full TCP pipe; the
   reader then stops reading until it gets the lock, and if the peer's reader is stopped
   the same way neither pipe drains again: the connection stays up and nothing moves on it
   (no stream opens, no negotiation is answered, no transfer ends), while a fresh
   connection works. On 2 saturated cores in the 16-node soak (both sides writing, readers
   scheduled late), stream opens failed in the open hundreds of times per node on live
   connections. Now the reader hands its control frames to a task of the connection's
   nursery and goes back to reading; a peer that makes us owe more than
   ``MAX_PENDING_CONTROL_FRAMES`` of them (it writes and never reads) loses the
   connection. Test: tests/test_yamux_reader.py (both readers held while the writers fill
   the pipes: nothing moved before, everything does now). Found by a helper's reading of
   yamux.py with a repro.
5. A stream's reset (``YamuxStream.reset``) writes its RST behind the same write lock with
   no deadline, and libp2p calls it shielded when an open fails (``BasicHost.new_stream``):
   while a writer holds the lock (a slow peer's full pipe), a failed open outlived our
   timeout by as long (a helper's repro: over 60 s). The RST is now handed to a task of
   the connection as fix 4's frames are (the lock's FIFO keeps it after the stream's
   earlier frames) and the stream is closed here at once. Test: tests/test_yamux_reader.py.

Per-host fixes (``guard_host``, called by ``open_host`` right after the host is built):
6. Every inbound stream: the swarm's stream handler (``BasicHost._swarm_stream_handler``,
   which catches only ``MultiselectError`` around the protocol handler) runs inside our
   guard (protocol/net/guard.py): a malformed protobuf on pubsub's ``/meshsub`` streams (23
   bytes killed the daemon), a bug in any libp2p handler, resets that stream and
   penalizes its peer instead.
7. ``Pubsub.push_msg``: a published message whose ``key`` field is garbage makes
   ``signature_validator`` re-raise protobuf's ``DecodeError`` in a Pubsub service task,
   ending pubsub and the host. It runs in the guard now; the forwarder is judged.
8. Bans that hold: ``upgrade_security`` (every inbound and outbound connection, relayed
   ones too, passes there as soon as the peer's id is known) closes a banned peer's
   connection before a single stream can open, in both directions.

9. The relay client's refresher (``CircuitV2Transport._refresh_reservations_worker``,
   global): it renews each slot in the last ``RESERVATION_REFRESH_MARGIN`` (30 s) before
   it expires and then sleeps until the soonest slot is due again, which for a slot whose
   renewal failed (a relay gone or refusing) is at once: it tried again without a pause
   until the slot expired (a second reader counted 9,945 tries in 30 s on loopback, a core
   busy), and a relay answering each renewal with a slot of under 30 s got renewals back to
   back for good. It also slept until the soonest slot *it had*, past a shorter slot
   reserved meanwhile, and a renewal whose connection hung held every other slot's up. Now
   a failed renewal is tried again after ``RENEW_RETRY_S`` (1, 2, 4, then 8 s), a relay is
   renewed at most every ``MIN_RENEW_GAP_S``, a renewal gives up after ``RENEW_TIMEOUT_S``
   (its stream reset: the timeout cuts libp2p's own read of the answer short), a slot
   forgotten meanwhile (protocol/net/nat.py) is not renewed back into the table, and the
   refresher looks again every ``RESERVATION_REFRESH_INTERVAL`` (10 s) or sooner, between
   renewals (which run one after another). Test:
   tests/test_relay_refresher.py (fails without: the tries of a failing renewal counted).
10. Yamux's receive window (global, ``YamuxStream._auto_tune_and_send_window_update``):
   0.8.1 credits reads back to the sender one WINDOW_UPDATE frame per read (by default,
   ``PY_YAMUX_RELEASE_ON_READ``, and through its "partial slack" branch, which also
   credits each read twice: an increment of 2048 for a 1024-byte read). As many frames
   back as messages forth, each one sealed by Noise and written through the kernel, and
   through both legs of a relay on a relayed connection. Now the credit goes back as
   go-yamux sends it, once what was read and not yet credited reaches half the window,
   and besides at each read while the sender is down to its last quarter of the window
   (libp2p's writer gives up after 5 s at a window of 0: a steady reader slower than half
   a window in 5 s would cut it off), with libp2p's window growth (its target doubles
   while updates come within 4 round trips) kept on the half window's credits only, and
   within ``MAX_GRANTED_PER_CONNECTION`` for all the connection's streams. Measured
   (`bench/exchange_throughput.py --mib 128 --repeats 2`, four runs each, alternating):
   payloads over the libp2p stream median 220.6 MB/s against 177.1 before
   (docs/network.md). Tests: tests/test_yamux_reader.py (frames counted; the rule for a
   sender down to its last quarter).
11. A peer that ignores yamux's flow control (global; the frame headers, read through
   yamux's module-level ``read_exactly``, which only its header read uses once
   ``Yamux._read_data_body`` reads bodies itself): 0.8.1 notes a DATA frame past the
   stream's receive window in a log line, sets the window to 0 and buffers the bytes
   anyway, for as long as the peer sends. A stream whose handler does not read at once
   (or one of ours whose answer we wait for elsewhere) took 64 MiB in a probe, and would
   take any amount. And within their windows, a peer's many streams held 100 MiB in a
   second reader's probe (400 new streams with 256 KiB each; reset streams keep their
   bytes for 60-90 s). Now each header is judged before its frame is read on: a body
   past its stream's window (a new stream's first frame: 256 KiB) ends the connection
   (as go-yamux ends a session on ``ErrRecvWindowExceeded``), unread, and its peer earns
   a point on the host whose connection it was (``guard_host`` marks each secured
   connection with its guard). One that would bring what the connection's streams hold
   unread past ``MAX_HELD_PER_CONNECTION`` ends it too, without blame: a sender within
   every window reaches it by opening more streams than we read (the constant's comment).
   A third reader found the first version of that bound (64 MiB, windows growing without
   fix 10's budget, and blame) cut off honest senders with 5 slow streams on a 50 ms
   round trip. And what a connection holds past ``HELD_FREE_PER_CONNECTION`` comes out of
   one pool, ``MAX_HELD_POOL``, for the process (peer ids are free: 300 connections at
   256 MiB each): a frame with no room cuts the connection holding the most, without
   blame, a silent one too (the constants' comment). Frames for streams already
   gone are read and dropped, as before (a reset racing data in flight, and nothing is
   kept), up to the largest window; a frame on a stream id ours to open and not opened
   yet earns a point (its body would land in the stream we open meanwhile). Tests:
   tests/test_yamux_reader.py (a sender past its window; many streams; the pool; no
   stream).
12. Pubsub's per-message CPU (global). 0.8.1 attaches its signed peer record to every
   RPC it sends (``env_to_send_in_RPC``: the host's addresses listed and compared each
   time) and parses and verifies the sender's (ed25519) on every RPC it reads, twice for
   one with control messages (``maybe_consume_signed_record``, in pubsub and again in
   GossipSub's ``handle_rpc``); and it sends IDONTWANT to every mesh peer for every
   message it receives, whatever its size: most of an idle daemon's CPU went there
   (docs/scale.md). Now a peer's record is verified once per ``RECORD_RECHECK_S`` while
   it sends the same bytes (``MAX_RECORDS_KEPT`` pairs remembered; a different or invalid
   record is checked as before), our own record is taken from its cache for
   ``LOCAL_RECORD_REUSE_S``, and IDONTWANT goes out only for messages over
   ``IDONTWANT_MIN_NBYTES``, as go-libp2p's threshold does (it saves a copy of a large
   message; for a small one it costs more than the copy). Tests:
   tests/test_libp2p_fixes.py.
"""

import contextlib
import contextvars
import hashlib
import logging
import struct
import time
import weakref
from typing import Any

import libp2p.kad_dht.common as _kad_common
import libp2p.kad_dht.kad_dht as _kad_dht
import libp2p.kad_dht.peer_routing as _kad_peer_routing
import libp2p.kad_dht.provider_store as _kad_provider_store
import libp2p.kad_dht.value_store as _kad_value_store
import libp2p.pubsub.floodsub as _floodsub
import libp2p.pubsub.gossipsub as _gossipsub
import libp2p.pubsub.pubsub as _pubsub
import libp2p.pubsub.utils as _pubsub_utils
import libp2p.utils.varint as _varint
import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError, ParseError
from libp2p.io.exceptions import ConnectionClosedError, IOException
from libp2p.network.connection.exceptions import RawConnError
from libp2p.network.connection.swarm_connection import SwarmConn
from libp2p.network.stream.net_stream import INetStream
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.relay.circuit_v2 import transport as _relay_transport
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as _RELAY_HOP_ID
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.yamux import yamux as _yamux
from libp2p.stream_muxer.yamux.yamux import (
    DEFAULT_WINDOW_SIZE,
    FLAG_RST,
    FLAG_SYN,
    HEADER_SIZE,
    MAX_WINDOW_SIZE,
    TYPE_DATA,
    TYPE_WINDOW_UPDATE,
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)
from libp2p.transport.exceptions import SecurityUpgradeFailure

from protocol.net.conns import socket_under
from protocol.net.guard import Guard

logger = logging.getLogger(__name__)

KAD_PROTOCOL_ID = "/swarmtrain/kad/1.0.0"
# A protocol name in multistream-select is a short path ("/swarmtrain/state/1.0.0").
MAX_MULTISELECT_NBYTES = 1024
# Control frames (ACKs, ping answers, RSTs) a connection's reader may owe at once (fix 4).
MAX_PENDING_CONTROL_FRAMES = 256
# Fix 10: what a connection's streams may be granted in all before none of them grows its
# window further (each starts at 256 KiB; one may grow to 16 MiB while we read it fast).
MAX_GRANTED_PER_CONNECTION = 64 << 20
# Fix 11: bytes a connection's streams may hold unread, all together; past it the
# connection ends, without blame. Each stream's sender keeps within the window we grant:
# 256 KiB a stream, and the windows that grew at most MAX_GRANTED_PER_CONNECTION in all.
# But streams are not bounded: a sender that half-closes each (py-libp2p then frees its
# slot) may open more than we read, 1100 streams of 255 KiB in a fourth reader's probe,
# within every window. Our own protocols wait for each answer (they hold a few streams a
# peer); 400 streams opened with a window's worth each held 100 MiB in a second reader's
# probe, and a stranger could go on opening them.
MAX_HELD_PER_CONNECTION = 256 << 20
# Fix 11's pool over every connection of the process: a stranger's peer ids cost nothing,
# and libp2p takes 300 connections (250 inbound), each up to the bound above (75 GiB). What
# a connection holds unread past HELD_FREE_PER_CONNECTION comes out of one pool of
# MAX_HELD_POOL; a frame it has no room for cuts the connection holding the most (a silent
# one too: it sends nothing more that could be judged), without blame, until the pool is
# back under MAX_HELD_POOL - POOL_SLACK. Honest connections hold what fix 10's budget grants
# them (64 MiB at most), mostly a few requests under their free share.
MAX_HELD_POOL = 1 << 30
HELD_FREE_PER_CONNECTION = 1 << 20
# The pool is summed (every stream of every connection) only when what it may hold by then
# (its last sum plus the frames taken since) passes MAX_HELD_POOL; a sum leaves it at most
# MAX_HELD_POOL - POOL_SLACK, so a stranger pays each sum with this much of its own frames.
POOL_SLACK = 64 << 20
# How long a cut may take to close the connection (its buffers go at once, its socket is
# closed first): the reader that cuts waits that long at most.
CUT_CLOSE_S = 1.0


class _HeldPool:
    """Fix 11's pool: the live connections, and an upper bound on what they hold past their
    free shares (``used`` at the last sum, ``since``: frames taken since)."""

    def __init__(self) -> None:
        self.muxers: weakref.WeakSet[Yamux] = weakref.WeakSet()
        self.used = 0
        self.since = 0


_POOL = _HeldPool()
# Fix 9: the pauses before each next try of a failing slot renewal (the last one repeats),
# and the shortest time between two renewals of one slot.
RENEW_RETRY_S = (1.0, 2.0, 4.0, 8.0)
MIN_RENEW_GAP_S = 5.0
RENEW_TIMEOUT_S = 15.0  # one renewal (a relay whose connection hangs); libp2p's has none
_wall = time.time  # the slots' expiry is wall-clock time (the relay's); tests replace it


def _use_our_kad_id() -> None:
    for module in (_kad_common, _kad_dht, _kad_peer_routing, _kad_provider_store, _kad_value_store):
        module.PROTOCOL_ID = TProtocol(KAD_PROTOCOL_ID)


async def _multiselect_read(self: MultiselectCommunicator) -> str:
    try:
        data = await _varint.read_varint_prefixed_bytes_limited(self.read_writer, MAX_MULTISELECT_NBYTES)
    except (ParseError, IOException, BaseLibp2pError) as error:
        raise MultiselectCommunicatorError("fail to read from multiselect communicator") from error
    if not data or data[-1:] != b"\n":
        raise MultiselectCommunicatorError("multiselect message not delimited by a newline")
    try:
        return str(data[:-1].decode())
    except UnicodeDecodeError as error:
        raise MultiselectCommunicatorError("multiselect message is not UTF-8") from error


async def _yamux_open_stream(self: Yamux) -> YamuxStream:
    """0.8.1's ``Yamux.open_stream``, with the slot and the stream undone on any failure
    of the SYN write, a cancellation included (fix 3)."""
    await self.stream_backlog_semaphore.acquire()  # cancelled here, nothing is held yet
    try:
        async with self.streams_lock:
            if self.event_shutting_down.is_set():
                raise MuxedStreamError("Connection is shutting down")
            stream_id = self.next_stream_id
            self.next_stream_id += 2
            stream = YamuxStream(stream_id, self, True)
            stream._owns_backlog_slot = True
            self.streams[stream_id] = stream
            self.stream_buffers[stream_id] = bytearray()
            self.stream_events[stream_id] = trio.Event()
    except BaseException:
        self.stream_backlog_semaphore.release()
        raise
    try:
        await self._write_frame(struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_WINDOW_UPDATE, FLAG_SYN, stream_id, 0))
    except BaseException as exc:
        stream._backlog_slot_released = True
        self.stream_backlog_semaphore.release()
        for table in (self.streams, self.stream_buffers, self.stream_events):
            table.pop(stream_id, None)  # no await: nothing can cancel this part
        if isinstance(exc, Exception):
            raise MuxedStreamError(f"Failed to send SYN: {exc}") from exc
        raise
    return stream


async def _swarm_conn_new_stream(self: SwarmConn) -> Any:
    """0.8.1's ``SwarmConn.new_stream``; a stream its bookkeeping does not finish is reset (fix 3)."""
    muxed_stream = await self.muxed_conn.open_stream()
    try:
        return await self._add_stream(muxed_stream)
    except BaseException:
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            try:
                await muxed_stream.reset()
            except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                logger.debug("resetting a stream we could not finish opening: %s", exc)
        raise


_yamux_reader = Yamux._handle_incoming_with_ready_signal
_yamux_write_frame = Yamux._write_frame


async def _yamux_reader_task(self: Yamux, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """0.8.1's reader, known as such to ``_yamux_write_frame_off_the_reader`` (fix 4)."""
    self._swarmtrain_reader = trio.lowlevel.current_task()
    self._swarmtrain_owed = 0
    with contextlib.suppress(AttributeError):  # (a connection type that takes none: no fix 11 on it)
        self.secured_conn._swarmtrain_yamux = weakref.ref(self)
    _POOL.muxers.add(self)
    try:
        await _yamux_reader(self, task_status=task_status)
    finally:
        _POOL.muxers.discard(self)


async def _yamux_control_frame(self: Yamux, data: bytes) -> None:
    try:
        await _yamux_write_frame(self, data)
    except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        logger.debug("a yamux control frame to %s was not written: %s", self.peer_id, exc)  # the reader sees the end
    except Exception:  # the reader caught these before (its own except): never end the connection's nursery
        logger.exception("writing a yamux control frame to %s", self.peer_id)
    finally:
        self._swarmtrain_owed -= 1


def _owe_control_frame(self: Yamux, data: bytes) -> bool:
    """Have a task of the connection write ``data`` when the write lock frees (its FIFO
    keeps the order); False when the connection has no nursery (not started, or over)."""
    if self._nursery is None:
        return False
    owed = getattr(self, "_swarmtrain_owed", 0)
    if owed >= MAX_PENDING_CONTROL_FRAMES:
        raise RawConnError(f"{MAX_PENDING_CONTROL_FRAMES} control frames to {self.peer_id} wait: its writes are stuck")
    self._swarmtrain_owed = owed + 1
    self._nursery.start_soon(_yamux_control_frame, self, data)
    return True


async def _yamux_write_frame_off_the_reader(self: Yamux, data: bytes) -> None:
    """``Yamux._write_frame``; from the reader, written by a task of its own (fix 4)."""
    if trio.lowlevel.current_task() is not getattr(self, "_swarmtrain_reader", None) or not _owe_control_frame(
        self, data
    ):
        await _yamux_write_frame(self, data)
        return
    await trio.lowlevel.checkpoint()


async def _yamux_stream_reset(self: YamuxStream) -> None:
    """0.8.1's ``YamuxStream.reset``; the RST written by a task of the connection when the
    write lock frees, not waited for (fix 5). A deadline on the write itself could cut a
    noise frame in half and break the connection."""
    if not self.closed:
        async with self.close_lock:
            try:
                header = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_WINDOW_UPDATE, FLAG_RST, self.stream_id, 0)
                if not _owe_control_frame(self.conn, header):
                    await self.conn._write_frame(header)
            except (RawConnError, ConnectionClosedError) as exc:
                logger.debug("sending a RST, the connection likely closed: %s", exc)
            finally:
                self.closed = True
                self.send_closed = True
                self.recv_closed = True
                self.reset_received = True
        await self.conn._finalize_stream(self, fully_closed=True)


async def _renew(transport: _relay_transport.CircuitV2Transport, relay: ID) -> bool:
    """One renewal, in ``RENEW_TIMEOUT_S``; its stream closed, or reset if it was cut."""
    stream = None
    closed = False
    try:
        with trio.move_on_after(RENEW_TIMEOUT_S):
            stream = await transport.host.new_stream(relay, [_RELAY_HOP_ID])
            renewed = bool(await transport._make_reservation(stream, relay))
            await stream.close()
            closed = True
            return renewed
    except Exception as exc:  # libp2p's own refresher's net: any failure of one renewal
        logger.debug("renewing the relay slot on %s: %s", relay, exc)
    finally:
        if stream is not None and not closed:
            await _reset(stream)
    return False


async def _relay_refresher(self: _relay_transport.CircuitV2Transport) -> None:
    """0.8.1's ``_refresh_reservations_worker`` with pauses (fix 9)."""
    margin = float(_relay_transport.RESERVATION_REFRESH_MARGIN)
    failures: dict[ID, int] = {}
    next_try: dict[ID, float] = {}

    def due(relay: ID, expires: float) -> float:
        return max(expires - margin, next_try.get(relay, -float("inf")))

    try:
        while self._reservations:
            now = _wall()
            for relay, expires in list(self._reservations.items()):
                if expires <= now:
                    logger.info("relay slot on %s expired", relay)
                    del self._reservations[relay]
                    self._reservation_proofs.pop(relay, None)
            for relay in set(failures) - set(self._reservations):
                failures.pop(relay, None)
            for relay in set(next_try) - set(self._reservations):
                next_try.pop(relay, None)
            for relay, expires in list(self._reservations.items()):
                if relay not in self._reservations or due(relay, expires) > now:
                    continue  # (forgotten by protocol/net/nat.py while another renewal ran)
                renewed = await _renew(self, relay)
                if renewed:
                    failures.pop(relay, None)
                    next_try[relay] = _wall() + MIN_RENEW_GAP_S
                else:
                    tried = failures.get(relay, 0)
                    failures[relay] = tried + 1
                    next_try[relay] = _wall() + RENEW_RETRY_S[min(tried, len(RENEW_RETRY_S) - 1)]
                    logger.info("renewing the relay slot on %s failed (%d in a row)", relay, tried + 1)
            now = _wall()
            wake = min((due(r, e) for r, e in self._reservations.items()), default=now)
            await trio.sleep(min(max(0.0, wake - now), _relay_transport.RESERVATION_REFRESH_INTERVAL))
    finally:
        self._refreshing = False


async def _credit_in_halves(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """Fix 10: a WINDOW_UPDATE once half the window was read and not yet credited (what
    arrived lowered ``recv_window``; what is still buffered is not read yet), or at each
    read while the sender is down to its last quarter of the window: libp2p's writer gives
    up after 5 s at a window of 0, and a reader slower than half a window in 5 s must not
    cut it off (a second reader's probe did, with halves alone). The window grows (libp2p's
    autotune) only on a half window's credit, a reader keeping up, and only while what the
    connection's streams were granted stays within ``MAX_GRANTED_PER_CONNECTION``: the
    windows we grant bound what an honest peer can make us hold (fix 11)."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        owed = self.target_recv_window - (self.recv_window + buffered)
        target = self.target_recv_window
        if owed <= 0 or (owed < target // 2 and self.recv_window >= target // 4):
            return
        self.recv_window += owed
        self._pending_recv_release = 0  # (libp2p's own batching, which this replaces)
        if owed >= target // 2:
            granted = sum(stream.target_recv_window for stream in self.conn.streams.values())
            if granted + target <= MAX_GRANTED_PER_CONNECTION:
                owed += self._apply_autotune_epoch(buffered)  # may double the target: credits the growth
    await self.send_window_update(owed, skip_lock=True)


_yamux_read_exactly = _yamux.read_exactly


async def _yamux_read_header(reader: Any, n: int, *args: Any, **kwargs: Any) -> bytes:
    """Yamux's reads through the module's ``read_exactly``: the frame headers only, since
    ``_read_data_body`` reads bodies itself. Fix 11 judges each before its frame is read on."""
    owner = getattr(reader, "_swarmtrain_yamux", None)
    yamux = owner() if isinstance(owner, weakref.ref) else None
    if isinstance(yamux, Yamux):
        yamux._swarmtrain_pending = 0  # the last frame's bytes are buffered (or dropped) by now
    data: bytes = await _yamux_read_exactly(reader, n, *args, **kwargs)
    if isinstance(yamux, Yamux) and len(data) == HEADER_SIZE:
        overrun = await _overrun(yamux, data)
        if overrun is not None:
            reason, blame = overrun
            logger.warning("%s from %s: connection closed", reason, yamux.peer_id)
            if blame:
                # Ended first, as the reader's own handler of a failed header read would
                # (it does so again, a no-op, after the raise): a ban then closes the peer's
                # other connections, not this one from inside its own reader.
                await yamux._cleanup_on_error()
                await _punish_on_the_connections_host(yamux, reason)
            raise RawConnError(reason)  # the reader's own handler of a failed header read ends the connection
    return data


async def _overrun(yamux: Yamux, header: bytes) -> tuple[str, bool] | None:
    """Why a frame with this header must not be read (fix 11), and whether its sender is to
    blame (past its window, or on a stream we never opened: yes; past the connection's
    bound, which a sender within every window can reach by opening streams faster than we
    read them, or the pool's: no), or None."""
    _, typ, flags, stream_id, length = struct.unpack(YAMUX_HEADER_FORMAT, header)
    if typ != TYPE_DATA or length == 0:
        return None
    if getattr(yamux, "_swarmtrain_cut", False):
        return "yamux: a frame on a connection cut for the pool", False
    stream = yamux.streams.get(stream_id)
    if stream is not None:
        allowed = stream.recv_window
    elif flags & FLAG_SYN:
        allowed = DEFAULT_WINDOW_SIZE
    elif stream_id % 2 == yamux.next_stream_id % 2 and stream_id >= yamux.next_stream_id:
        # Ours to open, not opened yet: the body would land in the stream we open meanwhile.
        return f"yamux: a {length}-byte frame on stream {stream_id}, which we never opened", True
    else:
        allowed = MAX_WINDOW_SIZE  # gone (a reset racing data in flight): read and dropped
    if length > allowed:
        return f"yamux: a {length}-byte frame on stream {stream_id} past its window of {allowed}", True
    # What the connection holds is summed (over its streams) only once an upper bound of it,
    # the last sum and the frames since, passes its free share: never for a few requests.
    upper = getattr(yamux, "_swarmtrain_upper", 0) + length
    if upper <= min(HELD_FREE_PER_CONNECTION, MAX_HELD_PER_CONNECTION):
        yamux._swarmtrain_upper = upper
        return None
    held = _held(yamux)
    if held + length > MAX_HELD_PER_CONNECTION:
        return f"yamux: a {length}-byte frame on top of {held} bytes unread, past {MAX_HELD_PER_CONNECTION}", False
    taken = min(length, held + length - HELD_FREE_PER_CONNECTION)
    if taken > 0:
        if not await _room_in_the_pool(yamux, taken):
            return f"yamux: a {length}-byte frame on top of {held} bytes unread, the most of any, past the pool", False
        yamux._swarmtrain_pending = taken  # taken from the pool, not yet in its buffers
    yamux._swarmtrain_upper = held + length
    return None


async def _room_in_the_pool(yamux: Yamux, taken: int) -> bool:
    """Whether ``yamux`` may take ``taken`` more bytes from the pool (fix 11): when the pool's
    upper bound passes, it is summed, and the connections holding the most are cut until it
    is ``POOL_SLACK`` under; False when ``yamux`` is one of them."""
    _POOL.since += taken
    if _POOL.used + _POOL.since <= MAX_HELD_POOL:
        return True
    shares = {m: _share(m) for m in list(_POOL.muxers)}
    shares[yamux] = shares.get(yamux, 0) + taken
    _POOL.used, _POOL.since = sum(shares.values()), 0
    room = True
    while _POOL.used > MAX_HELD_POOL - POOL_SLACK:
        candidates = [m for m in shares if not getattr(m, "_swarmtrain_cut", False)]
        if not candidates:
            break
        largest = max(candidates, key=lambda m: shares[m])
        _POOL.used -= shares[largest]  # (ours: with this frame, which is not taken)
        _cut(largest)
        if largest is yamux:
            room = False
            continue
        logger.warning(
            "yamux: %d bytes unread on the connection from %s, the most of any, cut to make room for %s's frame",
            shares[largest] + HELD_FREE_PER_CONNECTION,
            largest.peer_id,
            yamux.peer_id,
        )
        sock = socket_under(largest)
        if sock is not None:
            await trio.aclose_forcefully(sock)  # a close stuck on a write behind a full pipe ends too
        with trio.move_on_after(CUT_CLOSE_S):
            await largest._cleanup_on_error()
    return room


def _cut(yamux: Yamux) -> None:
    """A connection cut for the pool: its bytes go now, whatever its close does (a close
    waits for the streams' lock, which a write behind a full pipe may hold), and any frame
    of it from now on is refused. It stays counted until its reader ends."""
    yamux._swarmtrain_cut = True
    for buffer in yamux.stream_buffers.values():
        buffer.clear()
    # Its streams' readers end now, at EOF: not on a body appended after the cut to a
    # buffer emptied under it (a tail whose head is gone, parsed as a peer's bad message).
    yamux.event_shutting_down.set()
    for event in yamux.stream_events.values():
        event.set()


def _held(yamux: Yamux) -> int:
    """What a connection's streams hold unread."""
    return sum(len(buffer) for buffer in yamux.stream_buffers.values())


def _share(yamux: Yamux) -> int:
    """What a connection takes from the pool: held past its free share, and the frame its
    reader judged and reads on (another reader may sum the pool meanwhile)."""
    pending = getattr(yamux, "_swarmtrain_pending", 0)
    return max(0, _held(yamux) - HELD_FREE_PER_CONNECTION) + (pending if type(pending) is int else 0)


async def _yamux_read_data_body(self: Yamux, length: int) -> bytes:
    """0.8.1's ``_read_data_body``, reading past ``_yamux_read_header`` (fix 11)."""
    with trio.fail_after(_yamux._yamux_data_read_timeout()):
        body: bytes = await _yamux_read_exactly(self.secured_conn, length)
    return body


async def _punish_on_the_connections_host(self: Yamux, reason: str) -> None:
    guard = getattr(self.secured_conn, "_swarmtrain_guard", None)
    if isinstance(guard, Guard):
        with trio.CancelScope(shield=True):  # the verdict stands even if we are being cancelled
            await guard.punish(self.peer_id.to_base58(), reason)


# Fix 12: a peer's signed record, once verified, is taken as verified again for this long
# while it sends the same bytes (libp2p keeps a record 2 h: re-consumed well before).
RECORD_RECHECK_S = 600.0
# (peer, record) pairs remembered; past this the oldest go (a peer with many records costs
# a check each, as before).
MAX_RECORDS_KEPT = 4096
# How long our own record is reused before the host's addresses are compared again.
LOCAL_RECORD_REUSE_S = 5.0
# go-libp2p's IDontWantMessageThreshold: IDONTWANT only for messages larger than this.
IDONTWANT_MIN_NBYTES = 1024

_records_checked: dict[tuple[bytes, bytes], float] = {}
"""(peer id, blake2b of its record) → when it was last consumed (time.monotonic)."""
_local_records: "weakref.WeakKeyDictionary[IHost, tuple[float, bytes]]" = weakref.WeakKeyDictionary()
_small_message: contextvars.ContextVar[bool] = contextvars.ContextVar("_small_message", default=False)
_consume_signed_record = _pubsub_utils.maybe_consume_signed_record
_env_to_send = _gossipsub.env_to_send_in_RPC
_gossipsub_publish = GossipSub.publish
_emit_idontwant = GossipSub._emit_idontwant_for_message


def _consume_signed_record_once(msg: rpc_pb2.RPC, host: IHost, peer_id: ID) -> bool:
    """0.8.1's ``maybe_consume_signed_record``, skipped for a record this peer sent and we
    consumed within ``RECORD_RECHECK_S`` (fix 12)."""
    if not msg.HasField("senderRecord"):
        return True
    key = (peer_id.to_bytes(), hashlib.blake2b(msg.senderRecord, digest_size=16).digest())
    now = time.monotonic()
    checked = _records_checked.get(key)
    if checked is not None and now - checked < RECORD_RECHECK_S:
        return True
    if not _consume_signed_record(msg, host, peer_id):
        return False
    if len(_records_checked) >= MAX_RECORDS_KEPT:
        for old in sorted(_records_checked, key=_records_checked.__getitem__)[: MAX_RECORDS_KEPT // 4]:
            del _records_checked[old]
    _records_checked[key] = now
    return True


def _local_record(host: IHost) -> tuple[bytes, bool]:
    """0.8.1's ``env_to_send_in_RPC``, its answer reused for ``LOCAL_RECORD_REUSE_S`` (fix 12)."""
    now = time.monotonic()
    kept = _local_records.get(host)
    if kept is not None and now - kept[0] < LOCAL_RECORD_REUSE_S:
        return kept[1], False
    envelope, created = _env_to_send(host)
    _local_records[host] = (now, envelope)
    return envelope, created


async def _publish_noting_size(self: GossipSub, msg_forwarder: ID, pubsub_msg: rpc_pb2.Message) -> None:
    token = _small_message.set(len(pubsub_msg.data) <= IDONTWANT_MIN_NBYTES)
    try:
        await _gossipsub_publish(self, msg_forwarder, pubsub_msg)
    finally:
        _small_message.reset(token)


async def _idontwant_for_large(self: GossipSub, msg_id: bytes, topic_ids: Any) -> None:
    if not _small_message.get():
        await _emit_idontwant(self, msg_id, topic_ids)


_use_our_kad_id()
MultiselectCommunicator.read = _multiselect_read
Yamux.open_stream = _yamux_open_stream
SwarmConn.new_stream = _swarm_conn_new_stream
Yamux._handle_incoming_with_ready_signal = _yamux_reader_task
Yamux._write_frame = _yamux_write_frame_off_the_reader
YamuxStream.reset = _yamux_stream_reset
_relay_transport.CircuitV2Transport._refresh_reservations_worker = _relay_refresher
YamuxStream._auto_tune_and_send_window_update = _credit_in_halves
_yamux.read_exactly = _yamux_read_header
Yamux._read_data_body = _yamux_read_data_body
for _module in (_pubsub, _gossipsub, _floodsub):
    _module.maybe_consume_signed_record = _consume_signed_record_once
for _module in (_gossipsub, _floodsub):
    _module.env_to_send_in_RPC = _local_record
GossipSub.publish = _publish_noting_size
GossipSub._emit_idontwant_for_message = _idontwant_for_large


def _peer_of(net_stream: INetStream) -> str:
    try:
        return str(net_stream.muxed_conn.peer_id.to_base58())
    except (AttributeError, BaseLibp2pError, ValueError):
        return "unknown peer"


async def _reset(net_stream: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await net_stream.reset()
        except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            logger.debug("resetting a stream: %s", exc)


def guard_host(raw_host: IHost, pubsub: Pubsub, guard: Guard) -> None:
    """Fixes 6-8 above, for one host."""
    network = raw_host.get_network()
    handle_stream = network.common_stream_handler

    async def guarded_stream(net_stream: INetStream) -> None:
        peer_id = _peer_of(net_stream)
        if guard.banned(peer_id):
            await _reset(net_stream)
            return
        if not await guard.run(peer_id, "inbound stream", handle_stream, net_stream):
            await _reset(net_stream)

    network.set_stream_handler(guarded_stream)

    push_msg = pubsub.push_msg
    me = raw_host.get_id()

    async def guarded_push(msg_forwarder: ID, msg: Any) -> None:
        if msg_forwarder == me:
            await push_msg(msg_forwarder, msg)  # our own publish: its errors are ours to see
        else:
            await guard.run(msg_forwarder.to_base58(), "gossip message", push_msg, msg_forwarder, msg)

    pubsub.push_msg = guarded_push

    upgrader = network.upgrader
    upgrade_security = upgrader.upgrade_security

    async def gated(raw_conn: Any, is_initiator: bool, peer_id: ID | None = None) -> Any:
        secured = await upgrade_security(raw_conn, is_initiator, peer_id)
        secured._swarmtrain_guard = guard  # fix 11: whose peer table a flow-control breach goes to
        remote = secured.get_remote_peer().to_base58()
        if guard.banned(remote):
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await secured.close()
                except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    logger.debug("closing a banned peer's connection: %s", exc)
            raise SecurityUpgradeFailure(f"{remote} is banned here")
        return secured

    upgrader.upgrade_security = gated
