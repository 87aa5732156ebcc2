"""The zeroth-order update log: each peer's signed chain of (round, g) entries.

A ZO update is fully described by who made it, for which round, its place in the author's
chain, and one byte of g: the seed is not chosen by the peer but derived,
``seed_of(run, peer, round, seq)``, so it costs no bytes and cannot be ground for a lucky
perturbation. Each peer numbers its entries 0, 1, 2, … (rounds never decreasing along its
chain: a round may hold several of its updates) and publishes them in **batches** signed
with its node key (ed25519; the public key is inside its peer id, so anyone can check a
batch without asking). One signature covers a whole batch, so its 64 bytes are shared by
every entry in it: a node that makes H updates per round publishes them as one batch.

Wire form of a batch (msgpack map): {v: 1, peer, first_seq, rounds: bytes (varint deltas:
first round, then increments ≥ 0), g: bytes (one byte per entry), sig}. The signature is
over msgpack(["swarmtrain/zo-log/1", run_id, peer, first_seq, rounds, g]).

What ``UpdateLog.add`` refuses (``BadMessage``, nothing stored): a bad or missing
signature (forged or unsigned), a peer that is not a member of the run, a batch whose
entries contradict ones we hold for the same sequence numbers (equivocation), rounds that
decrease or lie too far ahead, malformed fields. A batch we already hold adds
nothing (a replay is harmless); a batch that starts past our next sequence number for
that peer is kept aside (bounded) until the gap is filled by a pull.

Canonical order, the same on every peer: by round, then peer id, then sequence number.
"""

import hashlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import BadMessage

VERSION = 1
DOMAIN = "swarmtrain/zo-log/1"
MAX_BATCH = 1024
MAX_ROUND = 1 << 40
MAX_PENDING_PER_PEER = 16
SIGNATURE_NBYTES = 64
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# identity multihash (0x00, 36 bytes) of protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}
_ED25519_PEER_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])


class UnknownAuthor(BadMessage):
    """A batch signed by a peer we do not (yet) know as a member: not the sender's fault
    when it merely forwards it (our member list may lag), so it is skipped, not punished."""


@dataclass(frozen=True, slots=True, order=True)
class Entry:
    round: int
    peer_id: str
    seq: int
    g_code: int


@dataclass(frozen=True, slots=True)
class Batch:
    peer_id: str
    first_seq: int
    rounds: tuple[int, ...]
    g_codes: bytes
    signature: bytes

    def entries(self) -> list[Entry]:
        return [
            Entry(r, self.peer_id, self.first_seq + i, g)
            for i, (r, g) in enumerate(zip(self.rounds, self.g_codes, strict=True))
        ]

    def encode(self) -> bytes:
        body: bytes = msgpack.packb(
            {
                "v": VERSION,
                "peer": self.peer_id,
                "first_seq": self.first_seq,
                "rounds": _encode_rounds(self.rounds),
                "g": self.g_codes,
                "sig": self.signature,
            },
            use_bin_type=True,
        )
        return body


def seed_of(run_id: str, peer_id: str, round_index: int, seq: int) -> int:
    """The 64-bit perturbation seed of a peer's update number ``seq`` (made in a round)."""
    material = "\0".join(("swarmtrain-zo-seed", run_id, peer_id, str(round_index), str(seq))).encode()
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "big")


def _b58decode(text: str) -> bytes:
    value = 0
    for char in text:
        digit = _B58.find(char)
        if digit < 0:
            raise BadMessage("peer id is not base58")
        value = value * 58 + digit
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return b"\0" * (len(text) - len(text.lstrip("1"))) + raw


def _b58encode(data: bytes) -> str:
    value = int.from_bytes(data, "big")
    out = ""
    while value:
        value, digit = divmod(value, 58)
        out = _B58[digit] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The ed25519 key inside a peer id (``BadMessage`` for other kinds of id)."""
    if len(peer_id) > 64:
        raise BadMessage("peer id too long")
    raw = _b58decode(peer_id)
    if len(raw) != len(_ED25519_PEER_PREFIX) + 32 or not raw.startswith(_ED25519_PEER_PREFIX):
        raise BadMessage("peer id does not hold an ed25519 key")
    return Ed25519PublicKey.from_public_bytes(raw[len(_ED25519_PEER_PREFIX) :])


def peer_id_of(seed: bytes) -> str:
    """The peer id of a node key seed (the same as libp2p's, without importing libp2p)."""
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
    return _b58encode(_ED25519_PEER_PREFIX + public)


def _encode_rounds(rounds: tuple[int, ...]) -> bytes:
    out = bytearray()
    previous = 0
    for i, r in enumerate(rounds):
        delta = r if i == 0 else r - previous
        previous = r
        while True:
            byte = delta & 0x7F
            delta >>= 7
            out.append(byte | (0x80 if delta else 0))
            if not delta:
                break
    return bytes(out)


def _decode_rounds(data: bytes, count: int) -> tuple[int, ...]:
    rounds: list[int] = []
    value = shift = 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        if shift > 63:
            raise BadMessage("round varint too long")
        if not byte & 0x80:
            rounds.append(value if not rounds else rounds[-1] + value)
            value = shift = 0
    if shift or len(rounds) != count:
        raise BadMessage(f"rounds field holds {len(rounds)} complete rounds, expected {count}")
    if rounds and rounds[-1] > MAX_ROUND:
        raise BadMessage("round out of range")
    return tuple(rounds)


def _signed_bytes(run_id: str, peer_id: str, first_seq: int, rounds: bytes, g_codes: bytes) -> bytes:
    body: bytes = msgpack.packb([DOMAIN, run_id, peer_id, first_seq, rounds, g_codes], use_bin_type=True)
    return body


def sign_batch(seed: bytes, run_id: str, first_seq: int, rounds: list[int], g_codes: bytes) -> Batch:
    """Our own entries ``first_seq``… as a signed batch."""
    if not 0 < len(rounds) == len(g_codes) <= MAX_BATCH:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH} entries, one g byte each")
    if any(b < a for a, b in itertools.pairwise(rounds)) or rounds[0] < 0:
        raise ValueError("rounds must be non-negative and never decrease")
    peer_id = peer_id_of(seed)
    encoded = _encode_rounds(tuple(rounds))
    signature = Ed25519PrivateKey.from_private_bytes(seed).sign(
        _signed_bytes(run_id, peer_id, first_seq, encoded, g_codes)
    )
    return Batch(peer_id, first_seq, tuple(rounds), bytes(g_codes), signature)


def decode_batch(raw: bytes, run_id: str) -> Batch:
    """Parse and verify a batch from a peer; ``BadMessage`` says why it is refused."""
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=4 * MAX_BATCH, max_str_len=64)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise BadMessage(f"undecodable batch: {exc}") from exc
    if not isinstance(msg, dict) or set(msg) != {"v", "peer", "first_seq", "rounds", "g", "sig"}:
        raise BadMessage("batch has the wrong fields")
    peer, first_seq, rounds, g_codes, sig = msg["peer"], msg["first_seq"], msg["rounds"], msg["g"], msg["sig"]
    if msg["v"] != VERSION or not isinstance(peer, str):
        raise BadMessage("batch of another version, or without a peer")
    if not isinstance(first_seq, int) or isinstance(first_seq, bool) or not 0 <= first_seq < 1 << 40:
        raise BadMessage("first_seq out of range")
    if not (isinstance(rounds, bytes) and isinstance(g_codes, bytes) and isinstance(sig, bytes)):
        raise BadMessage("rounds, g and sig must be bytes")
    if not 0 < len(g_codes) <= MAX_BATCH or len(sig) != SIGNATURE_NBYTES:
        raise BadMessage("batch size or signature length out of range")
    try:
        public_key_of(peer).verify(sig, _signed_bytes(run_id, peer, first_seq, rounds, g_codes))
    except InvalidSignature as exc:
        raise BadMessage(f"bad signature on a batch claiming to be from {peer}") from exc
    return Batch(peer, first_seq, _decode_rounds(rounds, len(g_codes)), g_codes, sig)


class UpdateLog:
    """Every peer's entries we hold, each chain contiguous from seq 0, plus the batches that
    carried them (to serve pulls with the original signatures)."""

    def __init__(self, run_id: str, *, is_member: Callable[[str], bool]) -> None:
        self.run_id = run_id
        self._is_member = is_member
        self._chains: dict[str, list[Entry]] = {}
        self._batches: dict[str, list[Batch]] = {}
        self._pending: dict[str, dict[int, Batch]] = {}

    def next_seq(self, peer_id: str) -> int:
        return len(self._chains.get(peer_id, ()))

    def last_round(self, peer_id: str) -> int:
        """The round of a peer's newest entry we hold; -1 if none."""
        chain = self._chains.get(peer_id)
        return chain[-1].round if chain else -1

    def max_round(self) -> int:
        return max((chain[-1].round for chain in self._chains.values() if chain), default=-1)

    def count_below(self, round_index: int) -> dict[str, int]:
        """Per peer, how many of its entries have rounds < ``round_index`` (peers with none left out)."""
        counts = {p: sum(1 for e in chain if e.round < round_index) for p, chain in self._chains.items()}
        return {p: n for p, n in counts.items() if n}

    def vector(self) -> dict[str, int]:
        """How many entries we hold per peer: what a pull asks beyond."""
        return {peer: len(chain) for peer, chain in self._chains.items()}

    def add(self, batch: Batch, *, max_round: int) -> list[Entry]:
        """Take a verified batch; returns the entries that are new (in chain order)."""
        if not self._is_member(batch.peer_id):
            raise UnknownAuthor(f"{batch.peer_id} is not a member of run {self.run_id}")
        if batch.rounds[-1] > max_round:
            raise BadMessage(f"entry for round {batch.rounds[-1]}, beyond {max_round}")
        chain = self._chains.setdefault(batch.peer_id, [])
        entries = batch.entries()
        overlap = [e for e in entries if e.seq < len(chain)]
        if any(chain[e.seq] != e for e in overlap):
            raise BadMessage(f"{batch.peer_id} signed two different entries for one sequence number")
        if batch.first_seq > len(chain):
            pending = self._pending.setdefault(batch.peer_id, {})
            if len(pending) < MAX_PENDING_PER_PEER:
                pending[batch.first_seq] = batch
            return []
        fresh = [e for e in entries if e.seq >= len(chain)]
        if fresh and chain and fresh[0].round < chain[-1].round:
            raise BadMessage(f"{batch.peer_id}'s rounds decrease along its chain")
        chain.extend(fresh)
        if fresh:
            self._batches.setdefault(batch.peer_id, []).append(batch)
        waiting = self._pending.get(batch.peer_id, {}).pop(len(chain), None)
        if waiting is not None:
            fresh += self.add(waiting, max_round=max_round)
        return fresh

    def batches_after(self, peer_id: str, seq: int) -> list[Batch]:
        """The stored batches that hold entries ``seq``… of a peer (to answer a pull)."""
        return [b for b in self._batches.get(peer_id, []) if b.first_seq + len(b.g_codes) > seq]

    def ordered(self, *, below_round: int) -> Iterator[Entry]:
        """Every entry we hold for rounds < ``below_round``, in the canonical order."""
        return iter(sorted(e for chain in self._chains.values() for e in chain if e.round < below_round))
