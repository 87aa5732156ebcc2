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

What ``UpdateLog.add`` refuses, nothing stored:
- ``BadMessage``: a bad or missing signature (forged or unsigned), rounds that decrease
  along the chain, malformed fields;
- ``Forbidden`` (a ``BadMessage`` whose signed batch convicts its author): entries for a
  round the run does not have, or more entries in one round than the run's steps per round
  (one SPSA update per inner step: a flood of thousands crash-looped the worker);
- ``Equivocation`` (convicts its author too): entries that contradict ones we hold for the
  same sequence numbers. The two signed batches are the evidence; ``exclude`` drops the
  author's whole chain, here and, once the evidence spread, on every node, so the weights
  never split on who saw which batch first;
- ``UnknownAuthor``, ``NotYet``, ``Excluded`` (not the sender's fault, nothing penalized):
  a peer not (yet) known as a member, rounds beyond the window we accept now (our agreed
  round plus a few: node/algorithms/zo/zosync.py), an author already excluded.
A batch we already hold adds nothing (a replay is harmless); a batch that starts past our
next sequence number for that peer is kept aside (bounded) until the gap is filled.

Canonical order, the same on every peer: by round, then peer id, then sequence number.
"""

import hashlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol import keys
from protocol.errors import BadMessage, ProtocolError

VERSION = 1
DOMAIN = "swarmtrain/zo-log/1"
MAX_BATCH = 1024
MAX_ROUND = 1 << 40
MAX_PENDING_PER_PEER = 16
SIGNATURE_NBYTES = keys.SIGNATURE_NBYTES


class UnknownAuthor(BadMessage):
    """A batch signed by a peer we do not (yet) know as a member: not the sender's fault
    when it merely forwards it (our member list may lag), so it is skipped, not punished."""


class NotYet(ProtocolError):
    """Entries for rounds past the window we accept now: not stored, pulled again later."""


class Excluded(ProtocolError):
    """A batch of an author excluded for equivocation: skipped."""


class Forbidden(BadMessage):
    """A validly signed batch that breaks the run's rules: it convicts its author."""

    def __init__(self, message: str, *, author: str) -> None:
        super().__init__(message)
        self.author = author


class Equivocation(Forbidden):
    """Two different signed batches for one author and sequence number: the evidence."""

    def __init__(self, message: str, *, author: str, held: "Batch", other: "Batch") -> None:
        super().__init__(message, author=author)
        self.held = held
        self.other = other


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


public_key_of = keys.public_key_of
peer_id_of = keys.peer_id_of


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


def _signed_fields(run_id: str, peer_id: str, first_seq: int, rounds: bytes, g_codes: bytes) -> list[Any]:
    return [run_id, peer_id, first_seq, rounds, g_codes]


def sign_batch(seed: bytes, run_id: str, first_seq: int, rounds: list[int], g_codes: bytes) -> Batch:
    """Our own entries ``first_seq``… as a signed batch."""
    if not 0 < len(rounds) == len(g_codes) <= MAX_BATCH:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH} entries, one g byte each")
    if any(b < a for a, b in itertools.pairwise(rounds)) or rounds[0] < 0:
        raise ValueError("rounds must be non-negative and never decrease")
    peer_id = peer_id_of(seed)
    encoded = _encode_rounds(tuple(rounds))
    signature = keys.sign(seed, DOMAIN, _signed_fields(run_id, peer_id, first_seq, encoded, g_codes))
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
    keys.verify(peer, sig, DOMAIN, _signed_fields(run_id, peer, first_seq, rounds, g_codes))
    return Batch(peer, first_seq, _decode_rounds(rounds, len(g_codes)), g_codes, sig)


def _tail_count(chain: list[Entry], round_index: int) -> int:
    """Entries of ``round_index`` at the end of a chain (rounds never decrease along it)."""
    count = 0
    for entry in reversed(chain):
        if entry.round != round_index:
            break
        count += 1
    return count


class UpdateLog:
    """Every peer's entries we hold, each chain contiguous from seq 0, plus the batches that
    carried them (to serve pulls with the original signatures)."""

    def __init__(
        self,
        run_id: str,
        *,
        is_member: Callable[[str], bool],
        rounds: int = MAX_ROUND,
        max_per_round: int = MAX_BATCH,
    ) -> None:
        self.run_id = run_id
        self._is_member = is_member
        self._rounds = rounds
        self._max_per_round = max_per_round
        self._chains: dict[str, list[Entry]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        """Per author, a running hash of its chain: [i] covers entries 0..i (8 bytes each)."""
        self._batches: dict[str, list[Batch]] = {}
        self._pending: dict[str, dict[int, Batch]] = {}
        self.excluded: dict[str, tuple[Batch, Batch]] = {}
        """Author → the two signed batches that convicted it of equivocation."""

    def next_seq(self, peer_id: str) -> int:
        return len(self._chains.get(peer_id, ()))

    def last_round(self, peer_id: str) -> int:
        """The round of a peer's newest entry we hold; -1 if none."""
        chain = self._chains.get(peer_id)
        return chain[-1].round if chain else -1

    def max_round(self) -> int:
        return max((chain[-1].round for chain in self._chains.values() if chain), default=-1)

    def agreed_round(self) -> int:
        """The round the authors we hold have reached, robustly: the lower median over
        authors of (their newest round + 1). One author claiming a far round moves it not
        at all (today's main started joiners at the largest round anyone claimed)."""
        ends = sorted(chain[-1].round + 1 for chain in self._chains.values() if chain)
        return ends[(len(ends) - 1) // 2] if ends else 0

    def count_below(self, round_index: int) -> dict[str, int]:
        """Per peer, how many of its entries have rounds < ``round_index`` (peers with none left out)."""
        counts = {p: sum(1 for e in chain if e.round < round_index) for p, chain in self._chains.items()}
        return {p: n for p, n in counts.items() if n}

    def vector(self) -> dict[str, int]:
        """How many entries we hold per peer: what a pull asks beyond."""
        return {peer: len(chain) for peer, chain in self._chains.items()}

    def chain_hash(self, peer_id: str, length: int | None = None) -> bytes:
        """8 bytes naming a peer's first ``length`` entries (all we hold by default): two nodes
        with the same count and another hash hold different signed batches (equivocation)."""
        hashes = self._hashes.get(peer_id, [])
        length = len(hashes) if length is None else length
        return hashes[length - 1] if 0 < length <= len(hashes) else b""

    def add(self, batch: Batch, *, max_round: int) -> list[Entry]:
        """Take a verified batch; returns the entries that are new (in chain order)."""
        author = batch.peer_id
        if author in self.excluded:
            raise Excluded(f"{author} was excluded for equivocation")
        if not self._is_member(author):
            raise UnknownAuthor(f"{author} is not a member of run {self.run_id}")
        if batch.rounds[-1] >= self._rounds:
            raise Forbidden(
                f"{author} signed an entry for round {batch.rounds[-1]}; the run has {self._rounds}", author=author
            )
        if batch.rounds[-1] > max_round:
            raise NotYet(f"entry for round {batch.rounds[-1]}, beyond {max_round} for now")
        chain = self._chains.setdefault(author, [])
        entries = batch.entries()
        overlap = [e for e in entries if e.seq < len(chain)]
        conflict = next((e for e in overlap if chain[e.seq] != e), None)
        if conflict is not None:
            held = next(b for b in self._batches[author] if b.first_seq <= conflict.seq < b.first_seq + len(b.g_codes))
            raise Equivocation(
                f"{author} signed two different entries for sequence number {conflict.seq}",
                author=author,
                held=held,
                other=batch,
            )
        if batch.first_seq > len(chain):
            pending = self._pending.setdefault(author, {})
            if len(pending) < MAX_PENDING_PER_PEER:
                pending[batch.first_seq] = batch
            return []
        fresh = [e for e in entries if e.seq >= len(chain)]
        if fresh and chain and fresh[0].round < chain[-1].round:
            raise BadMessage(f"{author}'s rounds decrease along its chain")
        if fresh:
            per_round = Counter(e.round for e in fresh)
            for round_index, count in per_round.items():
                held_in_round = _tail_count(chain, round_index)
                if held_in_round + count > self._max_per_round:
                    raise Forbidden(
                        f"{author} signed {held_in_round + count} entries for round {round_index};"
                        f" the run allows {self._max_per_round}",
                        author=author,
                    )
        chain.extend(fresh)
        hashes = self._hashes.setdefault(author, [])
        for entry in fresh:
            previous = hashes[-1] if hashes else b""
            hashes.append(hashlib.sha256(previous + f"{entry.round}:{entry.g_code}".encode()).digest()[:8])
        if fresh:
            self._batches.setdefault(author, []).append(batch)
        waiting = self._pending.get(author, {}).pop(len(chain), None)
        if waiting is not None:
            fresh += self.add(waiting, max_round=max_round)
        return fresh

    def exclude(self, author: str, evidence: tuple[Batch, Batch]) -> bool:
        """Drop an equivocating author's chain for good; True if it was not excluded yet."""
        if author in self.excluded:
            return False
        self.excluded[author] = evidence
        for table in (self._chains, self._hashes, self._batches, self._pending):
            table.pop(author, None)
        return True

    def batches_after(self, peer_id: str, seq: int) -> list[Batch]:
        """The stored batches that hold entries ``seq``… of a peer (to answer a pull)."""
        return [b for b in self._batches.get(peer_id, []) if b.first_seq + len(b.g_codes) > seq]

    def ordered(self, *, below_round: int) -> Iterator[Entry]:
        """Every entry we hold for rounds < ``below_round``, in the canonical order."""
        return iter(sorted(e for chain in self._chains.values() for e in chain if e.round < below_round))


# Robust |g| (every node computes the same from the log alone: it decides the weights).
# g travels as a log-scale level (training/zo.py: 12 levels an octave). Over the previous
# ROBUST_WINDOW_ROUNDS rounds of the log, the lower median level of all non-zero entries
# is the run's scale; an entry above it by more than CLIP_LEVELS (2 octaves: 4×) is
# clipped to that, and an author whose own median sits more than AUTHOR_LEVELS above the
# run's (2.5 octaves: 5.7×) counts zero for the round: a flood of huge g weighs no more
# than a few honest updates. Honest levels are spread wide (SPSA on one batch: measured on
# micro, 4 nodes, H = 5, σ ≈ 19 levels around a median of 93, 28 to 119), and with
# staggered starts an honest author's median strayed 12 levels from the run's; 30 and
# MIN_AUTHOR_SAMPLES = 16 leave a wide margin while a saturating flood (level 127) still
# counts zero. Below MIN_SAMPLES entries (the first rounds) nothing is changed.
ROBUST_WINDOW_ROUNDS = 4
MIN_SAMPLES = 32
MIN_AUTHOR_SAMPLES = 16
CLIP_LEVELS = 24
AUTHOR_LEVELS = 30
_LEVEL_MASK = 0x7F
_SIGN = 0x80


def _lower_median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True, slots=True)
class Robust:
    """The codes to apply, in the order of the entries given, and what was changed."""

    codes: list[int]
    clipped: int
    silenced: int
    silenced_authors: frozenset[str]


def robust_codes(entries: list[Entry]) -> Robust:
    """Each entry's applied g code (entries in the canonical order, oldest rounds first)."""
    codes: list[int] = []
    clipped = silenced = 0
    silenced_authors: set[str] = set()
    window: list[list[tuple[str, int]]] = []
    for _, group in itertools.groupby(entries, key=lambda e: e.round):
        members = list(group)
        levels = [level for rnd in window for _, level in rnd if level]
        scale = _lower_median(levels) if len(levels) >= MIN_SAMPLES else None
        by_author: dict[str, list[int]] = {}
        for rnd in window:
            for author, level in rnd:
                if level:
                    by_author.setdefault(author, []).append(level)
        for entry in members:
            code = entry.g_code
            level = code & _LEVEL_MASK
            if scale is not None and level:
                own = by_author.get(entry.peer_id, [])
                if len(own) >= MIN_AUTHOR_SAMPLES and _lower_median(own) > scale + AUTHOR_LEVELS:
                    code = 0
                    silenced += 1
                    silenced_authors.add(entry.peer_id)
                elif level > scale + CLIP_LEVELS:
                    code = (code & _SIGN) | (scale + CLIP_LEVELS)
                    clipped += 1
            codes.append(code)
        window.append([(e.peer_id, e.g_code & _LEVEL_MASK) for e in members])
        del window[:-ROBUST_WINDOW_ROUNDS]
    return Robust(codes, clipped, silenced, frozenset(silenced_authors))
