"""Run-state sync: each side sends the other exactly what it lacks.

Protocol flow (``/swarmtrain/state/1.0.0``), one exchange per stream:

    initiator                                        responder
    {t: "sync", v: 1, run, sv}          ───────────▶
                                        ◀─────────── {t: "diff", v: 1, update, sv}
                                                     (update = what the initiator lacks;
                                                      sv = the responder's state vector)
    {t: "diff", v: 1, update, sv: b""}  ───────────▶ (what the responder lacks)
    both close

A responder that does not hold the run answers ``{t: "error", v: 1, reason}``. Any bad
message (malformed, oversized, an update that fails validation) ends the exchange with a
reset; the sender is penalized and our state is untouched (protocol/state.py validates
before applying). Every read has a deadline, so a silent peer never holds us.
"""

import logging

import trio

from protocol import wire
from protocol.errors import BadMessage, ProtocolError
from protocol.host import Host, Stream
from protocol.peers import PeerTable
from protocol.state import MAX_DOC_NBYTES, RunState

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/state/1.0.0"
VERSION = 1
# A state vector costs ~10 bytes per writer: 64 KiB covers thousands of members.
MAX_STATE_VECTOR_NBYTES = 64 << 10
MAX_FRAME_NBYTES = MAX_DOC_NBYTES + (64 << 10)
# Small documents: a whole exchange on loopback takes milliseconds. This bounds a stalled peer.
EXCHANGE_TIMEOUT_S = 10.0
_REQUEST = frozenset({"sync"})
_REPLY = frozenset({"diff", "error"})
_FINAL = frozenset({"diff"})


async def _receive(stream: Stream, msg_types: frozenset[str]) -> dict[str, object]:
    return await wire.receive(stream, msg_types=msg_types, version=VERSION, max_nbytes=MAX_FRAME_NBYTES)


class StateSync:
    """Serves and initiates state exchanges for one run."""

    def __init__(self, host: Host, state: RunState, peers: PeerTable) -> None:
        self._host = host
        self._state = state
        self._peers = peers

    def register(self) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve)

    async def punish(self, peer_id: str, reason: str) -> None:
        """Penalize ``peer_id`` for bad input; a peer that earns a ban is also disconnected."""
        if self._peers.penalize(peer_id, reason):
            await self._host.disconnect(peer_id)

    async def pull(self, peer_id: str) -> bool:
        """Exchange state with ``peer_id``; True if ours changed.

        Raises ``ProtocolError``; a ``BadMessage`` has already penalized the peer.
        """
        changed = False
        with trio.move_on_after(EXCHANGE_TIMEOUT_S) as scope:
            stream = await self._host.open_stream(peer_id, PROTOCOL_ID, timeout_s=EXCHANGE_TIMEOUT_S)
            try:
                await wire.send(stream, "sync", VERSION, {"run": self._state.run_id, "sv": self._state.state_vector()})
                reply = await _receive(stream, _REPLY)
                if reply["t"] == "error":
                    reason = wire.get_str(reply, "reason", max_len=200)
                    raise ProtocolError(f"{peer_id} refused to sync: {reason}")
                update = wire.get_bytes(reply, "update", max_nbytes=MAX_DOC_NBYTES)
                their_sv = wire.get_bytes(reply, "sv", max_nbytes=MAX_STATE_VECTOR_NBYTES)
                changed = self._apply(peer_id, update)
                await wire.send(stream, "diff", VERSION, {"update": self._state.diff(their_sv), "sv": b""})
            except BadMessage as exc:
                await stream.reset()
                await self.punish(peer_id, f"state sync: {exc}")
                raise
            await stream.close()
        if scope.cancelled_caught:
            raise ProtocolError(f"state sync with {peer_id} timed out")
        self._peers.seen(peer_id)
        return changed

    async def _serve(self, stream: Stream) -> None:
        peer_id = stream.peer_id
        if self._peers.is_banned(peer_id):
            await stream.reset()
            return
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT_S):
                request = await _receive(stream, _REQUEST)
                run_id = wire.get_str(request, "run", max_len=64)
                their_sv = wire.get_bytes(request, "sv", max_nbytes=MAX_STATE_VECTOR_NBYTES)
                if run_id != self._state.run_id:
                    await wire.send(stream, "error", VERSION, {"reason": f"not in run {run_id}"})
                    return
                diff = self._state.diff(their_sv)
                await wire.send(stream, "diff", VERSION, {"update": diff, "sv": self._state.state_vector()})
                final = await _receive(stream, _FINAL)
                self._apply(peer_id, wire.get_bytes(final, "update", max_nbytes=MAX_DOC_NBYTES))
        except BadMessage as exc:
            await self.punish(peer_id, f"state sync: {exc}")
            raise
        except trio.TooSlowError as exc:
            raise ProtocolError(f"state sync with {peer_id} timed out") from exc
        self._peers.seen(peer_id)

    def _apply(self, peer_id: str, update: bytes) -> bool:
        changed = self._state.apply_remote(update)
        if changed:
            logger.debug(
                "state from %s: now %d members, digest %s", peer_id, len(self._state.members), self._state.digest
            )
        return changed
