"""Run-state sync: each side sends the other exactly what it lacks.

Protocol flow (``/swarmtrain/state/1.0.0``), one exchange per stream:

    initiator                                        responder
    {t: "sync", v: 2, run, sv}          ───────────▶
                                        ◀─────────── {t: "diff", v: 2, update, sv}
                                                     (update = what the initiator lacks;
                                                      sv = the responder's state vector)
    {t: "diff", v: 2, update, sv: b""}  ───────────▶ (what the responder lacks)
    both close

A responder that does not hold the run answers ``{t: "error", v: 2, reason}``; one that
speaks another version answers ``{t: "error", v: <the asker's>, reason}`` naming both. Any bad
message (malformed, oversized, an update that fails validation) ends the exchange with a
reset; the sender is penalized and our state is untouched (protocol/runstate/state.py validates
before applying). Every read has a deadline, so a silent peer never holds us.
"""

import logging
from collections.abc import Callable

from protocol import wire
from protocol.errors import ProtocolError, UnsupportedVersion
from protocol.net.hostlike import HostLike, StreamLike, exchange
from protocol.runstate.state import MAX_DOC_NBYTES, RunState

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/state/1.0.0"
# 2: the document holds signed records (protocol/runstate/state.py format 3). A peer of version 1
# gets one "error" naming both versions instead of documents it would refuse.
VERSION = 2
# A state vector costs ~10 bytes per writer: 64 KiB covers thousands of members.
MAX_STATE_VECTOR_NBYTES = 64 << 10
MAX_FRAME_NBYTES = MAX_DOC_NBYTES + (64 << 10)
# Small documents: a whole exchange on loopback takes milliseconds. This bounds a stalled peer.
EXCHANGE_TIMEOUT_S = 10.0
_REQUEST = frozenset({"sync"})
_REPLY = frozenset({"diff", "error"})
_FINAL = frozenset({"diff"})


async def _receive(stream: StreamLike, msg_types: frozenset[str]) -> dict[str, object]:
    return await wire.receive(stream, msg_types=msg_types, version=VERSION, max_nbytes=MAX_FRAME_NBYTES)


class StateSync:
    """Serves and initiates state exchanges for one run. A peer we exchanged with counts as
    live (``PeerTable.seen``) for ``live_for_s()`` seconds, or the table's TTL if None."""

    def __init__(self, host: HostLike, state: RunState, *, live_for_s: Callable[[], float] | None = None) -> None:
        self._host = host
        self._state = state
        self._live_for_s = live_for_s

    def _seen(self, peer_id: str) -> None:
        self._host.peers.seen(peer_id, ttl_s=self._live_for_s() if self._live_for_s is not None else None)

    def register(self) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve, deadline_s=EXCHANGE_TIMEOUT_S)

    async def pull(self, peer_id: str) -> bool:
        """Exchange state with ``peer_id``; True if ours changed.

        Raises ``ProtocolError``, already judged (a malformed answer penalized the peer).
        """
        changed = False
        what = "state sync"  # judged like a handler's: another version or an overfull document is no misbehaviour
        async with exchange(self._host, peer_id, PROTOCOL_ID, what=what, timeout_s=EXCHANGE_TIMEOUT_S) as stream:
            await wire.send(stream, "sync", VERSION, {"run": self._state.run_id, "sv": self._state.state_vector()})
            try:
                reply = await _receive(stream, _REPLY)
            except UnsupportedVersion as exc:  # another release: no blame
                raise ProtocolError(f"{peer_id} speaks another run-state version: {exc}") from exc
            if reply["t"] == "error":
                reason = wire.get_str(reply, "reason", max_len=200)
                raise ProtocolError(f"{peer_id} refused to sync: {reason}")
            update = wire.get_bytes(reply, "update", max_nbytes=MAX_DOC_NBYTES)
            their_sv = wire.get_bytes(reply, "sv", max_nbytes=MAX_STATE_VECTOR_NBYTES)
            changed = self._apply(peer_id, update)
            await wire.send(stream, "diff", VERSION, {"update": self._state.diff(their_sv), "sv": b""})
        self._seen(peer_id)
        return changed

    async def _serve(self, stream: StreamLike) -> None:
        """The responder's side (under the host's guard and deadline: a bad message is judged there)."""
        peer_id = stream.peer_id
        try:
            request = await _receive(stream, _REQUEST)
        except UnsupportedVersion as exc:  # answered, then closed (a reset could drop the answer)
            logger.info("state sync from %s: %s", peer_id, exc)
            await wire.refuse_version(stream, exc, "run-state sync")
            return
        run_id = wire.get_str(request, "run", max_len=64)
        their_sv = wire.get_bytes(request, "sv", max_nbytes=MAX_STATE_VECTOR_NBYTES)
        if run_id != self._state.run_id:
            await wire.send(stream, "error", VERSION, {"reason": f"not in run {run_id}"})
            return
        diff = self._state.diff(their_sv)
        await wire.send(stream, "diff", VERSION, {"update": diff, "sv": self._state.state_vector()})
        final = await _receive(stream, _FINAL)
        self._apply(peer_id, wire.get_bytes(final, "update", max_nbytes=MAX_DOC_NBYTES))
        self._seen(peer_id)

    def _apply(self, peer_id: str, update: bytes) -> bool:
        changed = self._state.apply_remote(update)
        if changed:
            logger.debug(
                "state from %s: now %d members, digest %s", peer_id, len(self._state.members), self._state.digest
            )
        return changed
