"""What a hostile node does, as a modified build would: shared by tests/adversarial/ and
bench/adversarial.py. Each function turns one in-process daemon (node.daemon.Daemon) of a
run into an attacker; nothing here ships in the daemon itself.

    await poison_payloads(d, scale)   NoLoCo: its payloads carry Δ × scale (φ then Δ, float32)
    await inflate_sparse(d, model, k) NoLoCo with sparseloco payloads: well formed, every chunk's
                                      magnitudes × k (model: the run's preset, for the layout)
    await never_send(d)               NoLoCo: it pairs (asks, accepts) and never sends a payload
    await poison_experts(d, scale)    SPES: the versions of its experts it publishes carry values × scale
    await fight_for_leases(d)         SPES: it claims one expert more than the rule gives it, then
                                      each round it claims back every expert it ever held
    flood_batch(d, n)           ZO: one signed batch of n entries for its current round, every
                                g the largest (n > steps per round breaks the run's rules)
    equivocation(d)             ZO: another signed batch for its sequence numbers 0…H-1
"""

import hashlib
from dataclasses import replace
from typing import Any

import numpy as np
import trio

from node.algorithms.noloco import Noloco
from node.algorithms.noloco.pairing import Pairing
from node.algorithms.spes import Spes
from node.algorithms.zo import Zo, zolog
from node.algorithms.zo.rounds import ZoRounds
from node.daemon import Daemon
from protocol.runstate.state import LeaseRecord, sign_lease
from training.encodings import topk
from training.encodings.experts import DELTA, Chain


async def pairing_of(daemon: Daemon) -> Pairing:
    """A NoLoCo node's pairing, once its algorithm is there (before its first round ends)."""
    assert daemon.training is not None
    await daemon.training.started.wait()
    assert isinstance(daemon.training.algorithm, Noloco), "not a NoLoCo trainer"
    return daemon.training.algorithm.pairing


async def poison_payloads(daemon: Daemon, scale: float) -> None:
    pairing = await pairing_of(daemon)
    send = pairing._send

    async def poisoned(partner: str, current: Any, sent: trio.Event) -> None:
        data = np.frombuffer(bytes(current.outbox), dtype=np.float32).copy()
        data[data.size // 2 :] *= scale
        await send(partner, replace(current, outbox=memoryview(data.tobytes())), sent)

    pairing._send = poisoned  # type: ignore[method-assign]


async def inflate_sparse(daemon: Daemon, model: str, factor: float) -> None:
    from training.encodings.sparseloco import magnitudes_nbytes  # torch: only where this attack runs
    from training.models import GPT, preset

    numels = [p.numel() for p in GPT(preset(model)).parameters()] * 2
    tail = magnitudes_nbytes(numels)
    pairing = await pairing_of(daemon)
    send = pairing._send

    async def inflated(partner: str, current: Any, sent: trio.Event) -> None:
        data = bytearray(current.outbox)
        magnitudes = np.frombuffer(bytes(data[-tail:]), dtype=np.float32) * np.float32(factor)
        data[-tail:] = magnitudes.tobytes()
        await send(partner, replace(current, outbox=memoryview(bytes(data))), sent)

    pairing._send = inflated  # type: ignore[method-assign]


async def never_send(daemon: Daemon) -> None:
    pairing = await pairing_of(daemon)

    def nothing(current: Any) -> None:
        sent = trio.Event()
        sent.set()
        current.sends.append(sent)

    pairing._start_sending = nothing  # type: ignore[method-assign]


async def spes_of(daemon: Daemon) -> Spes:
    assert daemon.training is not None
    await daemon.training.started.wait()
    algorithm = daemon.training.algorithm
    assert isinstance(algorithm, Spes), "not a SPES trainer"
    return algorithm


async def poison_experts(daemon: Daemon, scale: float) -> None:
    spes = await spes_of(daemon)
    store, versions = spes.store, spes.versions
    if versions.chain > 1:
        # Chained versions (sparseloco): every delta's magnitudes scaled, its keyframes left
        # honest; its chain goes on from the poisoned bytes (as a modified build's would),
        # so each version after a keyframe is a poisoned delta.
        spes.versions = _PoisonedDeltas(spes, versions, scale)
        return
    publish = store.publish

    def poisoned(seed: bytes, expert: int, round_index: int, data: bytes) -> Any:
        # As the run's versions travel (int8: a NaN scale stays NaN; huge values, huge scales).
        values = np.frombuffer(versions.decode(data, spes.expert_numel), dtype=np.float32)
        with np.errstate(all="ignore"):
            scaled = (values * np.float32(scale)).astype(np.float32)
        return publish(seed, expert, round_index, versions.encode(scaled.tobytes()))

    store.publish = poisoned  # type: ignore[method-assign]


class _PoisonedDeltas:
    """One daemon's expert versions, each delta's magnitudes × scale (a delta's values are its
    chunks' magnitudes with signs); the chain it returns names the poisoned bytes."""

    def __init__(self, spes: Spes, versions: Any, scale: float) -> None:
        self._spes, self._versions, self._scale = spes, versions, scale

    def __getattr__(self, name: str) -> Any:
        return getattr(self._versions, name)

    def encode_next(self, data: bytes, chain: Chain | None) -> tuple[bytes, Chain | None]:
        wire, next_chain = self._versions.encode_next(data, chain)
        if wire[:1] != bytes([DELTA]) or next_chain is None:
            return wire, next_chain
        at = len(wire) - 8 * len(topk.chunk_sizes(self._spes.expert_numel))  # known once its worker is up
        with np.errstate(all="ignore"):
            magnitudes = (np.frombuffer(wire[at:], dtype="<f4") * np.float32(self._scale)).astype("<f4")
        wire = wire[:at] + magnitudes.tobytes()
        return wire, replace(next_chain, sha256=hashlib.sha256(wire).digest())


async def fight_for_leases(daemon: Daemon) -> None:
    keeper = (await spes_of(daemon)).keeper
    claims = keeper.claims
    held: set[int] = set()

    def fighting(owners: Any, round_index: int) -> list[bytes]:
        updates = claims(owners, round_index)
        mine = set(keeper.mine())
        if mine and not held:  # to begin with, one expert more than its share
            held.add(min(set(range(keeper.num_experts)) - mine, default=0))
        held.update(mine)
        state = keeper._state
        for expert in sorted(held - mine):
            top = state.leases.get(expert)  # none yet: the others have not claimed theirs
            record = LeaseRecord(expert, keeper.peer_id, 1 if top is None else top.epoch + 1, round_index)
            updates.append(state.put_lease(sign_lease(record, keeper._seed, state.run_id)))
        return updates

    keeper.claims = fighting  # type: ignore[method-assign]


def has_zo(daemon: Daemon) -> bool:
    return daemon.training is not None and isinstance(daemon.training.algorithm, Zo)


def zo_of(daemon: Daemon) -> ZoRounds:
    assert daemon.training is not None and isinstance(daemon.training.algorithm, Zo), "not a ZO trainer (yet)"
    return daemon.training.algorithm.rounds


def flood_batch(daemon: Daemon, num_entries: int, *, round_index: int | None = None) -> zolog.Batch:
    zo = zo_of(daemon)
    seq = zo.log.next_seq(daemon.peer_id)
    at = zo.round if round_index is None else round_index
    return zolog.sign_batch(zo._identity_seed, zo._run_id, seq, [at] * num_entries, b"\x7f" * num_entries)


def equivocation(daemon: Daemon, steps: int) -> zolog.Batch:
    """Another batch for the sequence numbers of its round-0 batch (peers hold that one)."""
    zo = zo_of(daemon)
    return zolog.sign_batch(zo._identity_seed, zo._run_id, 0, [0] * steps, b"\x01" * steps)


async def gossip(daemon: Daemon, batch: zolog.Batch) -> None:
    assert daemon.run_service is not None
    await daemon.run_service.push_zo(batch.encode())
