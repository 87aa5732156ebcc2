"""The run's GossipSub topic: hints, never the truth.

Protocol flow (topic ``/swarmtrain/run/<run id>/1``), every message signed by libp2p:

    {t: "hb",     v: 1, digest, role,   every heartbeat interval: "I am alive, my state
     every}                             digest is this, my next heartbeat comes within
                                        ``every`` seconds" (optional: the receiver's own
                                        interval). A differing digest makes the receiver
                                        pull state from the sender.
    {t: "update", v: 1, update}         a small local change, pushed so peers need not wait
                                        for the next pull; bigger ones are only pulled.
    {t: "bye",    v: 1}                 a clean shutdown: stop counting me as live now.
    {t: "zo",     v: 1, batch}          a new signed batch of zeroth-order updates
                                        (node/algorithms/zo/zolog.py); pulls repair what is lost.
    {t: "zoequiv", v: 1, a, b}          two signed batches of one author that contradict
                                        each other: the evidence that excludes it
                                        (node/algorithms/zo/zosync.py); pulls carry it too.

GossipSub drops messages under bursts and never delivers over 1 MiB, so nothing here is
relied on: a lost heartbeat is covered by the TTL, a lost update by anti-entropy pulls.
"""

import re
from dataclasses import dataclass

from protocol import wire
from protocol.errors import BadMessage

# GossipSub's mesh degree D (the spec's default): each message reaches a node from up to D
# mesh peers and goes on to as many, so a node's gossip costs ~D copies in and out of every
# message (protocol/net/memnet.py's traffic model counts that many); the messages are hints
# that pulls repair, so no more copies than the spec's default.
MESH_DEGREE = 6

VERSION = 1
# Well under GossipSub's 1 MiB delivery ceiling; larger changes travel by pull.
MAX_PUSH_NBYTES = 64 << 10
MAX_MESSAGE_NBYTES = MAX_PUSH_NBYTES + 1024
# The longest heartbeat interval a message may announce (a run of ~14,000 live members at
# protocol/runstate/run.py's HEARTBEATS_PER_S).
MAX_HEARTBEAT_EVERY_S = 3600
DIGEST_PATTERN = re.compile(r"[0-9a-f]{16}")
_TYPES = frozenset({"hb", "update", "bye", "zo", "zoequiv"})


def topic(run_id: str) -> str:
    return f"/swarmtrain/run/{run_id}/1"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    digest: str
    role: str
    every_s: int = 0
    """The sender's next heartbeat comes within this many seconds; 0: not said."""


@dataclass(frozen=True, slots=True)
class Update:
    update: bytes


@dataclass(frozen=True, slots=True)
class Bye:
    pass


@dataclass(frozen=True, slots=True)
class ZoBatch:
    batch: bytes


@dataclass(frozen=True, slots=True)
class ZoEvidence:
    first: bytes
    second: bytes


GossipPayload = Heartbeat | Update | Bye | ZoBatch | ZoEvidence


def encode(payload: GossipPayload) -> bytes:
    match payload:
        case Heartbeat(digest=digest, role=role, every_s=every_s):
            fields: dict[str, object] = {"digest": digest, "role": role}
            if every_s:
                fields["every"] = every_s
            return wire.encode("hb", VERSION, fields)
        case Update(update=update):
            if len(update) > MAX_PUSH_NBYTES:
                raise ValueError(f"update of {len(update)} bytes is too large to gossip")
            return wire.encode("update", VERSION, {"update": update})
        case Bye():
            return wire.encode("bye", VERSION, {})
        case ZoBatch(batch=batch):
            if len(batch) > MAX_PUSH_NBYTES:
                raise ValueError(f"batch of {len(batch)} bytes is too large to gossip")
            return wire.encode("zo", VERSION, {"batch": batch})
        case ZoEvidence(first=first, second=second):
            if len(first) + len(second) > MAX_PUSH_NBYTES:
                raise ValueError("evidence too large to gossip")
            return wire.encode("zoequiv", VERSION, {"a": first, "b": second})
    raise AssertionError(payload)


def decode(data: bytes) -> GossipPayload:
    if len(data) > MAX_MESSAGE_NBYTES:
        raise BadMessage(f"gossip message of {len(data)} bytes exceeds {MAX_MESSAGE_NBYTES}")
    msg = wire.decode(data, msg_types=_TYPES, version=VERSION)
    if msg["t"] == "hb":
        return Heartbeat(
            digest=wire.get_str(msg, "digest", max_len=16, pattern=DIGEST_PATTERN),
            role=wire.get_str(msg, "role", max_len=16),
            every_s=wire.get_int(msg, "every", lo=1, hi=MAX_HEARTBEAT_EVERY_S) if "every" in msg else 0,
        )
    if msg["t"] == "update":
        return Update(update=wire.get_bytes(msg, "update", max_nbytes=MAX_PUSH_NBYTES))
    if msg["t"] == "zo":
        return ZoBatch(batch=wire.get_bytes(msg, "batch", max_nbytes=MAX_PUSH_NBYTES))
    if msg["t"] == "zoequiv":
        return ZoEvidence(
            first=wire.get_bytes(msg, "a", max_nbytes=MAX_PUSH_NBYTES),
            second=wire.get_bytes(msg, "b", max_nbytes=MAX_PUSH_NBYTES),
        )
    return Bye()
