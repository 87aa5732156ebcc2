"""Expert versions: each round an owner publishes its experts; the others fetch what they lack.

Protocol flow (``/swarmtrain/experts/1.0.0``), one exchange per stream:

    asker                                           holder
    {t: "heads?", v: 1, run}             ─────────▶
                                         ◀───────── {t: "heads", v: 1, round, training, heads:
                                                     [[expert, owner, round, sha256, sig], ...]}
                                                     (the newest version of each expert it
                                                     holds, its own or fetched: any holder
                                                     serves a version; round: the holder's;
                                                     training: its worker is in its rounds,
                                                     not starting, restarting or finished)
    {t: "get", v: 1, run, expert, sha256,
     channel}                            ─────────▶
                                         ◀───────── {t: "expert", v: 1, nbytes, channel} then
                                                     nbytes raw bytes (one expert's flat
                                                     layout, training/spes.py, as the run's
                                                     versions travel: float32, int8, or a
                                                     keyframe or delta where the run's
                                                     compression is sparseloco,
                                                     training/encodings/experts.py),
                                                     or {t: "gone", v: 1}
    channel = CHANNEL (both sides said so): instead of the bytes on this stream,
    {t: "go", v: 1, port, token,
     nonce}                              ─────────▶ the bytes over the asker's direct data
                                                     channel (protocol/net/data_channel.py,
                                                     ``hashed``: once it greeted with
                                                     greeting_of(nonce), sha256(token)
                                                     first), to its IP on our connection,
                                                     that port
                                         ◀───────── {t: "failed", v: 1, reason} if it could
                                                     not connect (else nothing more)

Why the data channel: a py-libp2p stream's framing and encryption run in Python. Measured
(`swarmtrain simulate --nodes 4 --algorithm spes`, tiny-moe, 10 rounds, per-process CPU
time): each daemon moved ~24 MB of versions a round each way on streams and used 9.1 s of
CPU against 2.1 s for a dense NoLoCo daemon, whose payloads take the data channel; on 2
cores that was CPU the workers lacked. An asker offers the channel unless it knows it is
behind a NAT (there the bytes take the stream), a holder takes the offer where it reaches
the asker directly; a holder of an older release answers without ``direct`` and sends on
the stream, as before. Integrity is the sha256 the owner signed, whichever way the bytes
came, but only a stream authenticates its sender: a version from the channel that does not
hash as signed is refused without blaming the holder (a tamperer on the path could have
made it so), and, like a holder whose connection did not come within DIRECT_CONNECT_S (our
port unreachable from it: a firewall), that holder's versions take the stream for
NO_DIRECT_S, where a bad hash is the holder's own. A holder whose connection to an asker
failed sends to it on streams for as long: an asker cannot make it dial again and again.

Heads are asked again every SYNC_INTERVAL_S, so an asker keeps one stream per holder for
them (``/swarmtrain/expert-heads/1.0.0``: ``heads?`` and ``heads`` as above, again and
again, SESSION_ASKS times, then a new stream): opening a py-libp2p stream cost ~5.3 ms of
CPU (both ends, loopback) and an ask on an open one ~0.9 ms, and a daemon of a 4-node run
asked 6 times a second. A holder of an older release lacks the protocol: it is asked one
stream an ask, as before.

``get`` names a version by its sha256: the head's, or, where versions are chained (deltas
against the version before), any version of the chain a holder keeps. A holder keeps each
expert's chain from its keyframe to its newest version (at most the codec's ``chain``
versions) and serves any of them; the heads list the newest only.

A head is its owner's ed25519 signature over (run, expert, owner, round, sha256), so a
holder can relay a version but never make one up: the asker checks the signature before it
wants the bytes, and the bytes against the sha256 before it keeps them. Which heads are
wanted (signed by the expert's owner now, newer than what we hold) is the algorithm's call
(node/algorithms/spes/__init__.py); the worker then bounds the values before they replace
its copy (training/spes.py ``check_version``), and a refused version costs its signer.

Chains: a delta names its base's sha256 inside its bytes (covered by the signed head's
sha256, so every version back to the keyframe is its signer's word, transitively). A holder
applies a delta only onto that exact version: lacking it, it fetches back along the chain by
sha256 from the holder that listed the head, to a version it holds or to a keyframe, each
step one version nearer the keyframe (the codec's ``link`` checks the depth), at most
``chain − 1`` steps; a chain it cannot complete is left (that head is not asked for again),
one whose links do not fit is kept as it came, for the worker's side to refuse and its
signer to be banned (node/algorithms/spes/__init__.py).

Bounds: a holder keeps one heads session per peer (a new one ends the old), answers a
peer's asks, on sessions or not, at most every MIN_ASK_INTERVAL_S (faster asks wait), and
ends a session after SESSION_ASKS asks or SESSION_IDLE_S without one; ``nbytes`` must be
one of the run's version sizes (known from the worker and the codec: a keyframe's or a
delta's) before a byte is allocated; at most MAX_PARALLEL_FETCHES transfers at once (the
fan-out cap: a node behind fetches its versions a few at a time, never all at once from
everyone); a chain is walked back at most ``chain − 1`` versions; heads are asked of live
trainers only, every SYNC_INTERVAL_S; tensors only over direct connections
(``Host.tensor_refusal``), capped by the node's upload limit; a holder dials a data port
of data_channel.MIN_PORT or above only, writes nothing before the asker's channel greeted
it with a hash of the nonce the asker named (a greeting the asker cannot choose, so no
other service's banner passes), then a hash of the asker's token, and dials an asker it
failed to reach no more for NO_DIRECT_S.
"""

import contextlib
import hashlib
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from protocol import keys, wire
from protocol.errors import BadMessage, NotSupported, ProtocolError
from protocol.net import data_channel
from protocol.net.data_channel import DataChannel
from protocol.net.hostlike import StreamLike, TensorHostLike, exchange
from protocol.ratelimit import UNLIMITED, RateLimit

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/experts/1.0.0"
HEADS_PROTOCOL_ID = "/swarmtrain/expert-heads/1.0.0"
VERSION = 1
DOMAIN = "swarmtrain/expert-version/1"
# Experts of a run: leases allow at most this many (protocol/runstate/state.py MAX_EXPERTS).
MAX_EXPERTS = 1024
MAX_ROUND = 1 << 40
HEADER_TIMEOUT_S = 10.0
# gpt-125m-moe's expert is 113 MB: minutes on a slow uplink.
TRANSFER_TIMEOUT_S = 600.0
CHUNK_NBYTES = 1 << 20
MAX_PARALLEL_FETCHES = 2
# Heads are small (≈ 130 bytes an expert): asked of every live trainer this often.
SYNC_INTERVAL_S = 0.5
# A heads session: this many asks (~2 min at SYNC_INTERVAL_S), then a new stream.
SESSION_ASKS = 240
# A session without an ask for this long ends (its asker went away or stopped asking).
SESSION_IDLE_S = 10.0
# A peer that did not serve a session is asked a stream an ask this long, then offered one again.
SESSIONLESS_S = 60.0
# A holder answers one peer's asks at most this often (an honest asker asks every SYNC_INTERVAL_S).
MIN_ASK_INTERVAL_S = 0.25
# Where the data channel failed between two peers, versions take streams this long.
NO_DIRECT_S = 600.0
# The data-channel handshake an asker offers and a holder takes (``channel`` in get and
# expert; 0: none). Commits 88249dc to 314cb95 of main offered another under ``direct``
# (unhashed, then greeted by bytes the asker chose): a node of those and one of this never
# use the channel between them, so neither blames the other for a handshake it lacks.
CHANNEL = 2
# An asker gives up on a holder's data-channel connection after this long (a holder that
# cannot reach it says so at once; one whose dial hangs gives up after CONNECT_TIMEOUT_S).
DIRECT_CONNECT_S = 10.0
# Peers kept in the maps of when each may be answered or dialed again, before the ones
# whose time has passed are forgotten.
MAX_TIMED_PEERS = 256
SHA256_NBYTES = 32


@dataclass(frozen=True, slots=True)
class Head:
    """One published version of an expert, signed by its owner."""

    expert: int
    owner: str
    round: int
    sha256: bytes
    sig: bytes

    def signed_fields(self, run_id: str) -> list[object]:
        return [run_id, self.expert, self.owner, self.round, self.sha256]

    def wire(self) -> list[object]:
        return [self.expert, self.owner, self.round, self.sha256, self.sig]


def sign_head(seed: bytes, run_id: str, expert: int, round_index: int, data: bytes) -> Head:
    owner = keys.peer_id_of(seed)
    unsigned = Head(expert, owner, round_index, hashlib.sha256(data).digest(), b"")
    return Head(expert, owner, round_index, unsigned.sha256, keys.sign(seed, DOMAIN, unsigned.signed_fields(run_id)))


def parse_head(item: object, run_id: str) -> Head:
    """A head from a peer, its owner's signature checked; ``BadMessage`` if anything is off."""
    if not (isinstance(item, list) and len(item) == 5):
        raise BadMessage("a head is [expert, owner, round, sha256, sig]")
    expert, owner, round_index, sha256, sig = item
    if not (type(expert) is int and 0 <= expert < MAX_EXPERTS and type(round_index) is int):
        raise BadMessage("a head's expert or round is not an integer in range")
    if not 0 <= round_index <= MAX_ROUND:
        raise BadMessage("a head's round is out of range")
    if not (isinstance(owner, str) and len(owner) <= 64 and isinstance(sha256, bytes) and isinstance(sig, bytes)):
        raise BadMessage("a head's owner, sha256 or signature has the wrong type")
    if len(sha256) != SHA256_NBYTES or len(sig) != keys.SIGNATURE_NBYTES:
        raise BadMessage("a head's sha256 or signature has the wrong length")
    head = Head(expert, owner, round_index, sha256, sig)
    keys.verify(owner, sig, DOMAIN, head.signed_fields(run_id))
    return head


def _standalone(wire: bytes) -> tuple[int, bytes | None]:
    return 0, None


@dataclass(frozen=True, slots=True)
class Held:
    head: Head
    data: bytes
    """The newest version's bytes (the head's)."""
    chain: tuple[bytes, ...] = ()
    """The versions from its keyframe to ``data`` included (empty: ``data`` alone)."""
    shas: tuple[bytes, ...] = field(default=())
    """Each of ``chain``'s sha256."""

    def versions(self) -> tuple[bytes, ...]:
        return self.chain or (self.data,)

    def find(self, sha256: bytes) -> int | None:
        """Where the version of this sha256 is in ``versions()``."""
        shas = self.shas or (self.head.sha256,)
        return shas.index(sha256) if sha256 in shas else None


def _held(head: Head, chain: tuple[bytes, ...], known: tuple[bytes, ...] = ()) -> Held:
    """``known``: the sha256 of the chain's first versions, where we have them (the last's
    is the head's, checked on its download or made by our signature): hashing a float32
    version of gpt-125m-moe (113 MB) again took ~0.2 s of the event loop."""
    shas = (*known, *(hashlib.sha256(w).digest() for w in chain[len(known) : -1]), head.sha256)
    return Held(head, chain[-1], chain, shas)


class ExpertStore:
    """The newest version we hold of each expert (our own and fetched), served to peers."""

    def __init__(
        self,
        host: TensorHostLike,
        run_id: str,
        *,
        upload_limit: RateLimit = UNLIMITED,
        channel: DataChannel | None = None,
    ) -> None:
        """``channel``: our direct data channel for versions we fetch (its ``per_peer`` at
        least MAX_PARALLEL_FETCHES, running before the first fetch); None: streams only."""
        self._host = host
        self._run_id = run_id
        self._upload_limit = upload_limit
        self._channel = channel
        self.num_experts = 0
        self.expert_nbytes = 0
        """Known once our worker is ready: until then we hold, serve and fetch nothing."""
        self.sizes: frozenset[int] = frozenset()
        """Every size a version may have (a keyframe's, a delta's): ``expert_nbytes`` the largest."""
        self.max_chain = 1
        self._link: Callable[[bytes], tuple[int, bytes | None]] = _standalone
        self.unresolved: dict[tuple[int, str], int] = {}
        """Per (expert, owner), the newest round of a head whose chain we could not complete:
        that owner's heads of that expert up to that round are not asked for again (an owner
        re-signing another head for the same round each time we asked made us fetch its
        chain again, up to 8 versions each time)."""
        self.chain_fetches = 0
        """Versions fetched back along a chain (not heads)."""
        self.round = 0
        """Our round, told to askers."""
        self.held: dict[int, Held] = {}
        self.newest_by_owner: dict[str, int] = {}
        """The newest round of any version we saw signed by each owner."""
        self.reported: dict[str, int] = {}
        """Each peer's own round, as it last told us (its heads)."""
        self.training = False
        """Whether our worker is in its rounds now (told to askers: only such peers get leases)."""
        self.peers_training: dict[str, bool] = {}
        """What each peer said of its own worker, last time it answered."""
        self.answered: dict[str, tuple[int, float]] = {}
        """Our round and the time when each peer last answered us: an owner that misses its
        rounds, or stops answering, loses its leases (node/algorithms/spes/leases.py)."""
        self.fetched = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.direct_received = 0
        """Versions that came over our data channel (the rest came on streams)."""
        self.changed = trio.Event()
        """Set when a version arrives: take it before checking, then wait."""
        self._fetches = trio.CapacityLimiter(MAX_PARALLEL_FETCHES)
        self._sessions: dict[str, trio.CancelScope] = {}
        """The heads session each peer has with us now (one each)."""
        self._next_answer: dict[str, float] = {}
        """When each peer's next ``heads?`` may be answered (MIN_ASK_INTERVAL_S)."""
        self._no_direct = data_channel.Cooldowns(NO_DIRECT_S, max_peers=MAX_TIMED_PEERS)
        """Peers the data channel failed with lately (either way): versions between us
        take streams instead."""
        self._sessionless: dict[str, float] = {}
        """Peers that did not serve heads sessions (an older release, or one whose store was
        not up yet), and until when each is asked a stream an ask instead."""

    def register(self) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve, deadline_s=TRANSFER_TIMEOUT_S + HEADER_TIMEOUT_S)
        self._host.set_handler(
            HEADS_PROTOCOL_ID, self._serve_session, deadline_s=SESSION_ASKS * (SESSION_IDLE_S + MIN_ASK_INTERVAL_S)
        )

    def configure(
        self,
        num_experts: int,
        *sizes: int,
        link: Callable[[bytes], tuple[int, bytes | None]] = _standalone,
        max_chain: int = 1,
    ) -> None:
        """``sizes``: every size a version may have; ``link``: a version's (depth, base
        sha256) (the codec's, ``ValueError`` if its header does not fit); ``max_chain``: the
        most versions in a chain, keyframe included."""
        if not (0 < num_experts <= MAX_EXPERTS and sizes and min(sizes) > 0 and max_chain >= 1):
            raise ValueError(f"{num_experts} experts of {sizes} bytes, chains of {max_chain}")
        self.num_experts, self.expert_nbytes, self.sizes = num_experts, max(sizes), frozenset(sizes)
        self._link, self.max_chain = link, max_chain

    def publish(self, seed: bytes, expert: int, round_index: int, data: bytes) -> Head:
        """Our own version of an expert we own (as it travels); a delta extends the chain
        of the version it names, which must be our newest of that expert."""
        if len(data) not in self.sizes:
            raise ValueError(f"a version is one of {sorted(self.sizes)} bytes, got {len(data)}")
        head = sign_head(seed, self._run_id, expert, round_index, data)
        _, base = self._link(data)
        held = self.held.get(expert)
        at = None if base is None or held is None else held.find(base)
        if base is not None and (held is None or at is None):
            raise ValueError(f"expert {expert}: a delta against a version we do not hold")
        if held is None or at is None:
            self._keep(_held(head, (data,)))
        else:
            known = (held.shas or (held.head.sha256,))[: at + 1]
            self._keep(_held(head, (*held.versions()[: at + 1], data), known))
        return head

    def _keep(self, held: Held) -> None:
        self.held[held.head.expert] = held
        self.saw(held.head)
        self.changed.set()
        self.changed = trio.Event()

    def saw(self, head: Head) -> None:
        """A verified head: how far its owner has come."""
        self.newest_by_owner[head.owner] = max(self.newest_by_owner.get(head.owner, -1), head.round)

    async def heads(self, peer_id: str) -> tuple[int, list[Head]]:
        """``peer_id``'s round and the versions it holds (each verified). Raises
        ``ProtocolError``, already judged."""
        async with exchange(
            self._host, peer_id, PROTOCOL_ID, what="expert heads", timeout_s=HEADER_TIMEOUT_S
        ) as stream:
            return self.take_heads(peer_id, await self._ask_heads(stream))

    async def _ask_heads(self, stream: StreamLike) -> dict[str, object]:
        await wire.send(stream, "heads?", VERSION, {"run": self._run_id})
        return await wire.receive(stream, msg_types=frozenset({"heads"}), version=VERSION, max_nbytes=256 * MAX_EXPERTS)

    def take_heads(self, peer_id: str, reply: dict[str, object]) -> tuple[int, list[Head]]:
        """A peer's answer to ``heads?``: its round and its heads (each verified), noted.
        ``BadMessage`` if anything is off (then nothing of it is noted)."""
        round_index = wire.get_int(reply, "round", lo=0, hi=MAX_ROUND)
        training = reply.get("training") is True
        raw = reply.get("heads")
        if not isinstance(raw, list) or len(raw) > MAX_EXPERTS:
            raise BadMessage(f"heads must be a list of at most {MAX_EXPERTS}")
        heads = [parse_head(item, self._run_id) for item in raw]
        if len({h.expert for h in heads}) != len(heads):
            raise BadMessage("heads name an expert twice")
        for head in heads:
            self.saw(head)
        self.reported[peer_id] = round_index
        self.peers_training[peer_id] = training
        self.answered[peer_id] = (self.round, trio.current_time())
        return round_index, heads

    async def watch(self, peer_id: str, answered: Callable[[str, list[Head]], None]) -> None:
        """Ask ``peer_id`` for its heads every SYNC_INTERVAL_S on one stream, ``answered``
        with each answer, until the session's SESSION_ASKS asks are done (the caller starts
        another); a peer without sessions is asked once, on a stream of its own. Raises
        ``ProtocolError`` (already judged) or ``trio.TooSlowError`` (an ask not answered
        within HEADER_TIMEOUT_S: not judged, the slow one may be us)."""
        if self._sessionless.get(peer_id, -math.inf) > trio.current_time():
            answered(peer_id, (await self.heads(peer_id))[1])
            return
        try:
            async with exchange(
                self._host,
                peer_id,
                HEADS_PROTOCOL_ID,
                what="expert heads",
                timeout_s=SESSION_ASKS * (SYNC_INTERVAL_S + HEADER_TIMEOUT_S),
                open_timeout_s=HEADER_TIMEOUT_S,
            ) as stream:
                for ask in range(SESSION_ASKS):
                    if ask:
                        await trio.sleep(SYNC_INTERVAL_S)
                    with trio.fail_after(HEADER_TIMEOUT_S):
                        reply = await self._ask_heads(stream)
                    answered(peer_id, self.take_heads(peer_id, reply)[1])
        except NotSupported:
            self._sessionless[peer_id] = trio.current_time() + SESSIONLESS_S
            answered(peer_id, (await self.heads(peer_id))[1])

    async def _serve_session(self, stream: StreamLike) -> None:
        """One peer's heads session: its asks answered at most every MIN_ASK_INTERVAL_S,
        SESSION_ASKS of them, while it asks within SESSION_IDLE_S; a new session of the same
        peer ends this one."""
        peer_id = stream.peer_id
        previous = self._sessions.get(peer_id)
        if previous is not None:
            previous.cancel()
        with trio.CancelScope() as scope:
            self._sessions[peer_id] = scope
            try:
                for _ in range(SESSION_ASKS):
                    request: dict[str, object] | None = None
                    with trio.move_on_after(SESSION_IDLE_S):
                        request = await wire.receive(
                            stream, msg_types=frozenset({"heads?"}), version=VERSION, max_nbytes=4096
                        )
                    if request is None:
                        return  # it stopped asking: not a fault (a loaded asker may be late)
                    await self._pace(peer_id)
                    await self._send_heads(stream, request)
            finally:
                if self._sessions.get(peer_id) is scope:
                    del self._sessions[peer_id]

    async def _pace(self, peer_id: str) -> None:
        """Wait for ``peer_id``'s next answer slot: one per MIN_ASK_INTERVAL_S, on any
        stream and any session (slots are taken in order, so asks at once wait in turn)."""
        now = trio.current_time()
        if len(self._next_answer) > MAX_TIMED_PEERS:  # forget peers whose slot has passed
            self._next_answer = {p: t for p, t in self._next_answer.items() if t > now}
        slot = max(now, self._next_answer.get(peer_id, now))
        self._next_answer[peer_id] = slot + MIN_ASK_INTERVAL_S
        if slot > now:
            await trio.sleep_until(slot)

    def _channel_fails(self, peer_id: str) -> None:
        """The data channel failed with ``peer_id``: streams between us for NO_DIRECT_S."""
        self._no_direct.mark(peer_id)

    def _channel_failed(self, peer_id: str) -> bool:
        """Whether the data channel failed with ``peer_id`` within NO_DIRECT_S."""
        return peer_id in self._no_direct

    async def _send_heads(self, stream: StreamLike, request: dict[str, object]) -> None:
        ours = wire.get_str(request, "run", max_len=64) == self._run_id
        heads = [held.head.wire() for _, held in sorted(self.held.items())] if ours else []
        await wire.send(stream, "heads", VERSION, {"round": self.round, "training": self.training, "heads": heads})

    async def fetch(self, peer_id: str, head: Head) -> bool:
        """The bytes of ``head`` from ``peer_id`` (who listed it); False if it no longer has
        them. Raises ``ProtocolError``, already judged (bytes that do not hash as signed)."""
        if self.expert_nbytes == 0 or not 0 <= head.expert < self.num_experts:
            return False
        async with self._fetches:
            data = await self._download(peer_id, head.expert, head.sha256)
            if data is None:
                return False
            chain = await self._chain_to(peer_id, head, data)
        if chain is None:
            key = (head.expert, head.owner)
            self.unresolved[key] = max(self.unresolved.get(key, -1), head.round)
            return False
        held = self.held.get(head.expert)
        if held is None or _newer(head, held.head):
            self.fetched += 1
            self._keep(_held(head, chain))
        return True

    async def _chain_to(self, peer_id: str, head: Head, data: bytes) -> tuple[bytes, ...] | None:
        """The chain of versions from a keyframe (or from a version we hold) up to ``data``,
        fetched back by sha256 from ``peer_id`` one version at a time, at most
        ``max_chain − 1`` of them; None if it no longer has one. A chain whose links do not
        fit (a header the codec refuses, a depth that does not fall by one a step) is
        returned as far as it came: the signer's own doing, refused at decoding."""
        wires = [data]
        try:
            depth, base = self._link(data)
        except ValueError:
            return (data,)
        while base is not None:
            held = self.held.get(head.expert)
            at = None if held is None else held.find(base)
            if held is not None and at is not None:
                if at + 1 + len(wires) > self.max_chain or depth != at + 1:
                    # Longer than a chain may be, or a depth that lies about its place
                    # (the version we hold is ``at`` deltas deep): refused at decoding.
                    return tuple(reversed(wires))
                return (*held.versions()[: at + 1], *reversed(wires))
            if len(wires) >= self.max_chain:
                return tuple(reversed(wires))  # longer than a chain may be: refused at decoding
            older = await self._download(peer_id, head.expert, base)
            if older is None:
                return None
            self.chain_fetches += 1
            wires.append(older)
            try:
                older_depth, base = self._link(older)
            except ValueError:
                break
            if older_depth != depth - 1:
                break
            depth = older_depth
        return tuple(reversed(wires))

    async def _download(self, peer_id: str, expert: int, sha256: bytes) -> bytes | None:
        """The bytes of the version of ``expert`` that hash to ``sha256``, from ``peer_id``;
        None if it does not hold it. Raises ``ProtocolError``, already judged (bytes that
        do not hash as asked)."""
        async with exchange(
            self._host,
            peer_id,
            PROTOCOL_ID,
            what="expert fetch",
            timeout_s=TRANSFER_TIMEOUT_S,
            open_timeout_s=HEADER_TIMEOUT_S,
        ) as stream:
            # Behind a NAT nobody can open a connection to our data port: the bytes take the stream.
            direct = self._channel is not None and not self._host.private and not self._channel_failed(peer_id)
            request = {"run": self._run_id, "expert": expert, "sha256": sha256, "channel": CHANNEL if direct else 0}
            await wire.send(stream, "get", VERSION, request)
            try:
                with trio.fail_after(HEADER_TIMEOUT_S):
                    reply = await wire.receive(
                        stream, msg_types=frozenset({"expert", "gone"}), version=VERSION, max_nbytes=4096
                    )
            except trio.TooSlowError as exc:
                raise ProtocolError(f"{peer_id} did not answer for expert {expert} in time") from exc
            if reply["t"] == "gone":
                return None
            nbytes = wire.get_int(reply, "nbytes", lo=min(self.sizes), hi=self.expert_nbytes)
            if nbytes not in self.sizes:
                raise BadMessage(f"an expert version is one of {sorted(self.sizes)} bytes, not {nbytes}")
            if reply.get("channel") == CHANNEL:
                if not direct or self._channel is None:
                    raise BadMessage("the bytes offered over a data channel we did not offer")
                try:
                    data = await _receive_direct(self._channel, stream, peer_id, nbytes)
                except ProtocolError:
                    self._channel_fails(peer_id)
                    raise
                self.direct_received += 1
                if hashlib.sha256(data).digest() != sha256:
                    # Not authenticated: maybe the holder, maybe the path. Not judged; the
                    # stream, where a bad hash is the holder's own, serves this pair now.
                    self._channel_fails(peer_id)
                    raise ProtocolError("the expert's bytes from the data channel do not hash as its owner signed")
            else:
                data = await _receive(stream, nbytes)
                if hashlib.sha256(data).digest() != sha256:
                    raise BadMessage("the expert's bytes do not hash as its owner signed")
        self.bytes_received += len(data)
        return data

    def forget(self, head: Head) -> None:
        """Drop a version the worker refused (we neither serve nor offer it again)."""
        held = self.held.get(head.expert)
        if held is not None and held.head == head:
            del self.held[head.expert]

    async def sync_forever(self, partners: Callable[[], list[str]], wanted: Callable[[Head], bool]) -> None:
        """Ask every live trainer for its heads every SYNC_INTERVAL_S (a heads session
        each: ``watch``), and fetch each wanted version newer than ours in the background,
        one fetch per expert at a time, from a holder that listed it (a random one: owners
        are not the only ones serving). The asking never waits for a fetch, nor one peer's
        ask for another's: a slow transfer, a holder trickling bytes, or a peer whose cable
        was pulled (its ask hangs until HEADER_TIMEOUT_S, as long as SILENT_S) must not make
        the owners look silent. Each answer is looked at when it comes (a fetch starts at
        once), with every live peer's latest answer to find the other holders."""
        fetching: set[int] = set()
        watching: dict[str, trio.CancelScope] = {}
        latest: dict[str, list[Head]] = {}
        """Each live peer's heads, as it last answered."""

        async with trio.open_nursery() as nursery:

            async def get(head: Head, holders: list[str]) -> None:
                try:
                    await self._get(head, holders)
                finally:
                    fetching.discard(head.expert)

            def answered(peer_id: str, heads: list[Head]) -> None:
                """What one answer lists that we want (its holders: every live peer whose
                latest answer lists it; a look at the others only for a version to fetch,
                so each answer costs its own length, not the swarm's)."""
                if peer_id not in watching:
                    return  # no longer live
                latest[peer_id] = heads
                if not self.expert_nbytes:
                    return
                for head, _ in self._choose({head: [] for head in heads}, wanted):
                    if head.expert not in fetching:
                        fetching.add(head.expert)
                        holders = [p for p, listed in latest.items() if head in listed]
                        nursery.start_soon(get, head, holders)

            async def watch(peer_id: str, scope: trio.CancelScope) -> None:
                with scope:
                    while True:  # until it is no longer live
                        try:
                            await self.watch(peer_id, answered)
                        except (ProtocolError, trio.TooSlowError) as exc:
                            logger.debug("no expert heads from %s: %s", peer_id, exc)
                        await trio.sleep(SYNC_INTERVAL_S)

            while True:
                if self.expert_nbytes:
                    live = set(partners())
                    for peer_id in set(watching) - live:
                        watching.pop(peer_id).cancel()
                        latest.pop(peer_id, None)
                    for peer_id in live - set(watching):
                        watching[peer_id] = trio.CancelScope()
                        nursery.start_soon(watch, peer_id, watching[peer_id])
                await trio.sleep(SYNC_INTERVAL_S)

    async def sync_once(self, peers: list[str], wanted: Callable[[Head], bool]) -> None:
        """Ask ``peers`` for their heads once, then fetch what is wanted, and wait for it."""
        if self.expert_nbytes == 0:
            return
        chosen = self._choose(await self._ask_all(peers), wanted)
        async with trio.open_nursery() as nursery:
            for head, holders in chosen:
                nursery.start_soon(self._get, head, holders)

    async def _ask_all(self, peers: list[str]) -> dict[Head, list[str]]:
        """Every peer's heads (asked at once), by head: who holds it."""
        offers: dict[Head, list[str]] = {}

        async def ask(peer_id: str) -> None:
            try:
                _, heads = await self.heads(peer_id)
            except ProtocolError as exc:
                logger.debug("no expert heads from %s: %s", peer_id, exc)
                return
            for head in heads:
                offers.setdefault(head, []).append(peer_id)

        async with trio.open_nursery() as nursery:
            for peer_id in peers:
                nursery.start_soon(ask, peer_id)
        return offers

    def _choose(self, offers: dict[Head, list[str]], wanted: Callable[[Head], bool]) -> list[tuple[Head, list[str]]]:
        """Per expert, the newest wanted version that is newer than ours, with its holders."""
        best: dict[int, Head] = {}
        for head in offers:
            held = self.held.get(head.expert)
            if (
                head.expert >= self.num_experts
                or not wanted(head)
                or (held is not None and not _newer(head, held.head))
                or self._unresolved(head)
            ):
                continue
            if head.expert not in best or _newer(head, best[head.expert]):
                best[head.expert] = head
        return [(head, offers[head]) for head in best.values()]

    def _unresolved(self, head: Head) -> bool:
        """A head of an owner whose chain we could not complete at this round or a later one."""
        return head.round <= self.unresolved.get((head.expert, head.owner), -1)

    async def _get(self, head: Head, holders: list[str]) -> None:
        holders = list(holders)
        random.shuffle(holders)
        for peer_id in holders:
            try:
                if await self.fetch(peer_id, head):
                    return
            except ProtocolError as exc:
                logger.debug("expert %d from %s: %s", head.expert, peer_id, exc)

    async def _serve(self, stream: StreamLike) -> None:
        with trio.fail_after(HEADER_TIMEOUT_S):
            request = await wire.receive(
                stream, msg_types=frozenset({"heads?", "get"}), version=VERSION, max_nbytes=4096
            )
        if request["t"] == "heads?":
            await self._pace(stream.peer_id)
            await self._send_heads(stream, request)
            return
        ours = wire.get_str(request, "run", max_len=64) == self._run_id
        expert = wire.get_int(request, "expert", lo=0, hi=MAX_EXPERTS - 1)
        sha256 = wire.get_bytes(request, "sha256", max_nbytes=SHA256_NBYTES)
        held = self.held.get(expert)
        at = None if held is None else held.find(sha256)
        refusal = self._host.tensor_refusal(stream.peer_id)
        if not ours or held is None or at is None or refusal is not None:
            await wire.send(stream, "gone", VERSION, {})
            return
        data = held.versions()[at]
        direct = request.get("channel") == CHANNEL and not self._channel_failed(stream.peer_id)
        peer_ip = self._host.direct_ip(stream.peer_id) if direct else None
        await wire.send(stream, "expert", VERSION, {"nbytes": len(data), "channel": CHANNEL if peer_ip else 0})
        limit = self._host.tensor_limit(stream.peer_id, self._upload_limit)
        view = memoryview(data)
        if peer_ip is not None:
            with trio.fail_after(HEADER_TIMEOUT_S):
                go = await wire.receive(stream, msg_types=frozenset({"go"}), version=VERSION, max_nbytes=4096)
            port = wire.get_int(go, "port", lo=data_channel.MIN_PORT, hi=65535)
            token = wire.get_bytes(go, "token", max_nbytes=data_channel.TOKEN_NBYTES)
            nonce = wire.get_bytes(go, "nonce", max_nbytes=data_channel.TOKEN_NBYTES)
            if len(token) != data_channel.TOKEN_NBYTES or len(nonce) != data_channel.TOKEN_NBYTES:
                raise BadMessage(f"a data channel's token and nonce are {data_channel.TOKEN_NBYTES} bytes each")
            try:
                await data_channel.send(peer_ip, port, data_channel.presented(token), view, limit, nonce=nonce)
            except ProtocolError as exc:  # nobody's fault we know of: a firewall, a NAT
                logger.info("expert %d to %s: %s; on streams for %g s", expert, stream.peer_id, exc, NO_DIRECT_S)
                self._channel_fails(stream.peer_id)
                # Said, and the stream closed, not reset (a reset may drop what was said):
                # the asker need not wait for a connection that will not come.
                await wire.send(stream, "failed", VERSION, {"reason": str(exc)[:200]})
                return
            self.bytes_sent += len(view)
            return
        for start in range(0, len(view), CHUNK_NBYTES):
            chunk = view[start : start + CHUNK_NBYTES]
            await limit.take(len(chunk))
            await stream.write(bytes(chunk))
            self.bytes_sent += len(chunk)


def _newer(head: Head, other: Head) -> bool:
    """Versions of one expert: the later round wins (and, at one round, a hand-over's new owner)."""
    return (head.round, head.owner) > (other.round, other.owner)


async def _receive_direct(channel: DataChannel, stream: StreamLike, peer_id: str, nbytes: int) -> bytes:
    """``nbytes`` (the run's size, checked before this allocation) over our data channel."""
    out = bytearray(nbytes)
    token = channel.expect(memoryview(out), peer_id)
    failed: str | None = None
    error: ProtocolError | None = None
    try:
        await wire.send(stream, "go", VERSION, {"port": channel.port, "token": token, "nonce": channel.nonce})
        async with trio.open_nursery() as nursery:

            async def holder_failed() -> None:
                """The holder's word that it could not reach us (else it says nothing more)."""
                nonlocal failed
                with contextlib.suppress(ProtocolError):  # ended: it closes once it sent
                    said = await wire.receive(stream, msg_types=frozenset({"failed"}), version=VERSION, max_nbytes=4096)
                    failed = str(said.get("reason"))[:200]
                    nursery.cancel_scope.cancel()

            nursery.start_soon(holder_failed)
            try:  # caught here: raised in a nursery's body it would leave as an ExceptionGroup
                await channel.wait(token, connect_timeout_s=DIRECT_CONNECT_S)
            except ProtocolError as exc:
                error = exc
            nursery.cancel_scope.cancel()
    finally:
        channel.cancel(token)
    if failed is not None:
        raise ProtocolError(f"the holder could not reach our data channel: {failed}")
    if error is not None:
        raise error
    return bytes(out)


async def _receive(stream: StreamLike, nbytes: int) -> bytes:
    out = bytearray(nbytes)  # the size the run fixes, checked before this allocation
    view = memoryview(out)
    got = 0
    while got < nbytes:
        chunk = await stream.read_exact(min(CHUNK_NBYTES, nbytes - got))
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    return bytes(out)
