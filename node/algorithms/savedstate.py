"""Fetching a peer's saved state, so a late joiner starts where the run is: a ZO checkpoint
(the joiner need not replay the whole log), or a φ/Δ node's state (node/algorithms/joining.py,
under its own protocol id).

Protocol flow (``/swarmtrain/zo-ckpt/1.0.0``), one exchange per stream:

    joiner                                   holder
    {t: "ckpt?", v: 2, run, head}  ───────▶
                                   ◀─────── {t: "ckpt", v: 2, round, vector, param_hash, nbytes,
                                             sha256}
                                            then (unless head) nbytes raw bytes (a
                                            training/checkpoint.py safetensors file)
                                            or {t: "none", v: 2}

``sha256`` is the file's: the joiner checks it while the bytes arrive and refuses the file
(before anything parses it) if it differs. ``head``: the header only, to compare weights
(node/algorithms/zo/rounds.py: the param-hash agreement) without fetching them.

A checkpoint at round r is the weights after every logged update of rounds < r; ``vector``
says how many entries of each peer's chain it includes. The joiner takes it only if that
vector equals what its own (pulled) log holds below r, the file parses and fits the
model, and the weights hash to ``param_hash`` (the worker checks the last two). A holder
can still lie consistently (bad weights with their own hash): the joiner's final weights
would then differ from everyone's, which ``param_hash`` in the report shows; checking the
hash with a second peer is left for later.
"""

import contextlib
import hashlib
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

import trio

from protocol import wire
from protocol.errors import BadMessage, ProtocolError
from protocol.net.hostlike import StreamLike, TensorHostLike, exchange
from protocol.ratelimit import UNLIMITED

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/zo-ckpt/1.0.0"
# 2: the file's sha256 in the header (checked before parsing), head-only requests.
VERSION = 2
CHUNK_NBYTES = 1 << 20
HEADER_TIMEOUT_S = 10.0
TRANSFER_TIMEOUT_S = 600.0
MAX_PEERS_IN_VECTOR = 4096
HASH_PATTERN = re.compile(r"[0-9a-f]{64}")


LAZY = ""
"""An offer's ``sha256`` (and ``param_hash``) not computed yet: on the first request."""


@dataclass(frozen=True, slots=True)
class Offer:
    round: int
    vector: dict[str, int]
    param_hash: str
    path: Path
    nbytes: int
    sha256: str


async def file_sha256(path: Path) -> str:
    """The hash a holder announces for its file (read in a thread: files reach gigabytes)."""

    def digest() -> str:
        hasher = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_NBYTES):
                hasher.update(chunk)
        return hasher.hexdigest()

    return await trio.to_thread.run_sync(digest)


class ZoCheckpoints:
    """Serves our offer and fetches peers'; ``protocol_id`` names what is offered (ZO weights
    by default; node/algorithms/rounds.py offers a φ/Δ node's saved state the same way)."""

    def __init__(self, host: TensorHostLike, run_id: str, *, max_nbytes: int, protocol_id: str = PROTOCOL_ID) -> None:
        self._host = host
        self._run_id = run_id
        self._max_nbytes = max_nbytes
        self._protocol_id = protocol_id
        self.download: tuple[int, int] | None = None
        """(bytes received, bytes in all) of the fetch under way, for the progress shown."""
        self.offer: Offer | None = None
        """What we serve: set by the ZO rounds after the worker saved a checkpoint (its
        hashes may be ``LAZY``: computed when a peer first asks, once)."""
        self._hashing = trio.Lock()

    def register(self) -> None:
        self._host.set_handler(self._protocol_id, self._serve, deadline_s=TRANSFER_TIMEOUT_S + HEADER_TIMEOUT_S)

    async def fetch(self, peer_id: str, dest: Path) -> Offer | None:
        """Ask ``peer_id`` for its checkpoint and write it to ``dest``; None if it has none.

        The file is written only if its bytes hash as announced (else ``BadMessage``, and
        nothing is left at ``dest``). Raises ``ProtocolError``, already judged.
        """
        return await self._ask(peer_id, dest)

    async def head(self, peer_id: str, *, race_connection: bool = False) -> Offer | None:
        """What ``peer_id`` offers (round, vector, weights hash), without the file;
        ``race_connection``: for a node starting or joining, which may hold no connection
        to it yet (``open_stream_racing``: an open that fails at once waits for one)."""
        return await self._ask(peer_id, None, race_connection=race_connection)

    async def _ask(self, peer_id: str, dest: Path | None, *, race_connection: bool = False) -> Offer | None:
        timeout_s = TRANSFER_TIMEOUT_S if dest is not None else HEADER_TIMEOUT_S
        what = "zo checkpoint"
        async with exchange(
            self._host,
            peer_id,
            self._protocol_id,
            what=what,
            timeout_s=timeout_s,
            open_timeout_s=HEADER_TIMEOUT_S,
            race_connection=race_connection,
        ) as stream:
            await wire.send(stream, "ckpt?", VERSION, {"run": self._run_id, "head": dest is None})
            try:
                with trio.fail_after(HEADER_TIMEOUT_S):
                    header = await wire.receive(
                        stream, msg_types=frozenset({"ckpt", "none"}), version=VERSION, max_nbytes=1 << 20
                    )
            except trio.TooSlowError as exc:
                raise ProtocolError(f"{peer_id} did not describe its checkpoint in time") from exc
            if header["t"] == "none":
                return None
            offer = Offer(
                round=wire.get_int(header, "round", lo=1, hi=1 << 40),
                vector=wire.get_count_map(header, "vector", max_items=MAX_PEERS_IN_VECTOR, lo=1, hi=(1 << 40) - 1),
                param_hash=wire.get_str(header, "param_hash", max_len=64, pattern=HASH_PATTERN),
                path=dest or Path(),
                nbytes=wire.get_int(header, "nbytes", lo=1, hi=self._max_nbytes),
                sha256=wire.get_str(header, "sha256", max_len=64, pattern=HASH_PATTERN),
            )
            if dest is not None:
                await self._receive_file(stream, offer, dest)
        return offer

    async def _receive_file(self, stream: StreamLike, offer: Offer, dest: Path) -> None:
        """The bytes into ``dest``, hashed as they come; nothing stays there unless they match."""
        digest = hashlib.sha256()
        partial = dest.with_name(dest.name + ".part")
        try:
            async with await trio.open_file(partial, "wb") as out:
                left = offer.nbytes
                while left:
                    self.download = (offer.nbytes - left, offer.nbytes)
                    chunk = await stream.read_exact(min(CHUNK_NBYTES, left))
                    digest.update(chunk)
                    await out.write(chunk)
                    left -= len(chunk)
            if digest.hexdigest() != offer.sha256:
                raise BadMessage("the checkpoint's bytes do not hash as announced")
            await trio.Path(partial).replace(dest)
        finally:
            self.download = None
            with contextlib.suppress(FileNotFoundError):
                await trio.Path(partial).unlink()

    async def _resolved(self) -> Offer | None:
        """The current offer with its hashes (a lazy one is hashed now, once)."""
        async with self._hashing:
            offer = self.offer
            if offer is None or offer.sha256 != LAZY:
                return offer
            sha256 = await file_sha256(offer.path)
            resolved = replace(
                offer, sha256=sha256, param_hash=sha256 if offer.param_hash == LAZY else offer.param_hash
            )
            if self.offer is offer:  # not replaced by a newer one meanwhile
                self.offer = resolved
            return resolved

    async def _serve(self, stream: StreamLike) -> None:
        with trio.fail_after(HEADER_TIMEOUT_S):
            request = await wire.receive(stream, msg_types=frozenset({"ckpt?"}), version=VERSION, max_nbytes=4096)
        try:
            offer = await self._resolved()
        except OSError as exc:  # the file went (a newer round replaced it): nothing to offer now
            logger.info("our checkpoint offer is gone: %s", exc)
            offer = None
        refusal = self._host.tensor_refusal(stream.peer_id)
        if refusal is not None:
            logger.info("no checkpoint for %s: %s", stream.peer_id, refusal)
        if wire.get_str(request, "run", max_len=64) != self._run_id or offer is None or refusal is not None:
            await wire.send(stream, "none", VERSION, {})
            await stream.close()
            return
        header = {
            "round": offer.round,
            "vector": offer.vector,
            "param_hash": offer.param_hash,
            "nbytes": offer.nbytes,
            "sha256": offer.sha256,
        }
        if request.get("head") is True:
            await wire.send(stream, "ckpt", VERSION, header)
            return
        with trio.move_on_after(TRANSFER_TIMEOUT_S):
            # The file is never rewritten in place (one file per round), so it matches the header.
            async with await trio.open_file(offer.path, "rb") as source:
                await wire.send(stream, "ckpt", VERSION, header)
                limit = self._host.tensor_limit(stream.peer_id, UNLIMITED)  # capped if opted in over a relay
                while chunk := await source.read(CHUNK_NBYTES):
                    await limit.take(len(chunk))
                    await stream.write(chunk)
            await stream.close()
