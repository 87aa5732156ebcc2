"""Fuzz targets: every decoder of bytes from a peer, the LAN or the worker pipe, with valid seeds.

Shared by bench/fuzz.py (the CLI; coverage-guided with atheris when it is installed) and
tests/test_fuzz_decoders.py (a few hundred seeded inputs per decoder). It lives in its own
module, not in the CLI, because atheris must instrument protocol/ and training/ *before*
they are imported: the CLI imports this module only once it knows how it runs.

A target turns one input into a verdict:

    accepted   the decoder returned
    refused    it raised its documented refusal (``Target.refusals``)
    crash      anything else, BaseExceptions included (not KeyboardInterrupt, SystemExit);
               for a target run in child processes (``Target.isolate``: pycrdt can
               segfault), also the child dying or hanging on that input

Inputs (``Inputs``): the seeds (valid messages built with the project's own encoders),
random bytes, and mutations of the seeds and of accepted inputs: bit flips, byte inserts
and deletes, splices, overwritten integers (length fields), LEB128 varints, msgpack type
bytes, and msgpack-aware edits (one value of the decoded message replaced, the message
re-encoded with its length prefix, hash or signature fixed up as an attacker would).
"""

import atexit
import contextlib
import copy
import hashlib
import io
import ipaddress
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import msgpack
import multiaddr
import numpy as np
import torch
import trio
from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError
from pycrdt import Doc

from node.algorithms import savedstate
from node.algorithms.spes import experts
from node.algorithms.zo import zolog, zosync
from node.versions import our_versions
from protocol import keys, wire
from protocol.errors import BadMessage, DialError, ProtocolError
from protocol.net import dialback, exchange, gossip, libp2p_fixes, nat, upnp
from protocol.net import host as host_module
from protocol.ratelimit import UNLIMITED, RateLimit
from protocol.runstate import crdt_check, info
from protocol.runstate.state import (
    MAX_UPDATE_STRUCTS,
    LeaseRecord,
    Manifest,
    MemberRecord,
    RunState,
    sign_lease,
    sign_member,
)
from training import checkpoint, encodings, ipc, settings
from training import corpus as text_corpus
from training import data as token_data
from training.models import GPT, GPTConfig
from training.settings import InnerConfig, OuterConfig
from training.trainer import PayloadRejected, Trainer

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "fuzz-abc123"
SEED_A, SEED_B, SEED_C = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32
PEER_A, PEER_B, PEER_C = (keys.peer_id_of(s) for s in (SEED_A, SEED_B, SEED_C))
# The peer on the other end of every fake stream.
PEER_X = keys.peer_id_of(b"\x0d" * 32)
# Our own client id in the run document (fixed, so a run is reproducible).
OWN_CLIENT = 1234567
# Inputs per child process for isolated targets: a child starts in ≈2 s.
CHILD_BATCH = 2000
# A child that takes this much longer than its batch should is hanging on one input.
CHILD_SLACK_S = 60.0
# A child's first line, once it has read its inputs.
READY = b"ready"
# Crash descriptions kept per decoder (all crashes are counted).
MAX_CRASH_EXAMPLES = 5
# Inputs kept to mutate (the seeds, then accepted mutants: valid inputs the seeds did not show).
MAX_CORPUS = 256


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a msgpack object sits in an input, for msgpack-aware edits (``edit_structured``).

    ``split``: the object and the bytes after it (None if the input holds none); ``join``:
    the input again, with what any sender can fix up so an edit reaches the deeper checks
    (the length prefix, a hash over the payload).
    """

    split: Callable[[bytes], tuple[Any, bytes] | None]
    join: Callable[[Any, bytes, random.Random], bytes]


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    decode: Callable[[bytes], object]
    """Runs the decoder on one input: returns (accepted) or raises (refused or a crash)."""
    refusals: tuple[type[BaseException], ...]
    seeds: Callable[[], list[bytes]]
    what: str
    layout: Layout | None = None
    tokens: tuple[bytes, ...] = ()
    """Words of a text format, inserted whole by the mutator (libFuzzer's dictionary)."""
    isolate: bool = False
    """Run in child processes: native code that can segfault sees the input."""
    ours: bool = True
    """False where the parsing is a library's (expat, urllib, multiaddr): coverage of our
    code cannot guide a fuzzer there, so the CLI runs our mutations alone (more valid inputs)."""


@dataclass(slots=True)
class Report:
    name: str
    mode: str
    inputs: int = 0
    accepted: int = 0
    refused: int = 0
    crashes: int = 0
    seconds: float = 0.0
    crash_examples: list[dict[str, Any]] = field(default_factory=list)
    _signatures: set[str] = field(default_factory=set)

    def count(self, verdict: "Verdict") -> None:
        self.inputs += 1
        if verdict.kind == "accepted":
            self.accepted += 1
        elif verdict.kind == "refused":
            self.refused += 1
        else:
            self.crashes += 1
            assert verdict.crash is not None
            self._keep(verdict.crash)

    def merge(self, summary: dict[str, Any], crash_examples: list[dict[str, Any]]) -> None:
        """Add another run's counts (``summary()``) and crash descriptions to these."""
        self.inputs += summary.get("inputs", 0)
        self.accepted += summary.get("accepted", 0)
        self.refused += summary.get("refused", 0)
        self.crashes += summary.get("crashes", 0)
        for crash in crash_examples:
            self._keep(crash)

    def _keep(self, crash: dict[str, Any]) -> None:
        """The first crash of each kind (exception type and where it was raised) is shown."""
        if crash["signature"] not in self._signatures and len(self.crash_examples) < MAX_CRASH_EXAMPLES:
            self._signatures.add(crash["signature"])
            self.crash_examples.append(crash)

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "accepted": self.accepted,
            "refused": self.refused,
            "crashes": self.crashes,
            "seconds": round(self.seconds, 2),
            "mode": self.mode,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str  # "accepted" | "refused" | "crash"
    crash: dict[str, Any] | None = None


ACCEPTED = Verdict("accepted")
REFUSED = Verdict("refused")


def crash_of(name: str, data: bytes, exc: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
    return {
        "decoder": name,
        "exception": f"{type(exc).__name__}: {str(exc)[:300]}",
        "signature": f"{type(exc).__name__} at {where}",
        "input_hex": data.hex(),
        "traceback": "".join(traceback.format_exception(exc, limit=-12))[-4000:],
    }


def run_one(target: Target, data: bytes) -> Verdict:
    """One input through one decoder, in this process."""
    try:
        target.decode(data)
    except target.refusals:
        return REFUSED
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the point of fuzzing: everything else is a finding
        return Verdict("crash", crash_of(target.name, data, exc))
    return ACCEPTED


# --- in-memory peers ---


class _RawStream:
    """What protocol.net.host.Stream needs of a libp2p stream: the peer's bytes, then EOF."""

    def __init__(self, incoming: bytes) -> None:
        self._incoming = incoming
        self._offset = 0
        self.written = bytearray()
        self.muxed_conn = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: PEER_X))

    async def read(self, nbytes: int | None = None) -> bytes:
        end = len(self._incoming) if nbytes is None else self._offset + nbytes
        chunk = self._incoming[self._offset : end]
        self._offset += len(chunk)
        return chunk

    async def write(self, chunk: bytes) -> None:
        self.written += chunk

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


class _FakeHost:
    """The parts of protocol.net.host.Host the handlers under test touch: one stream to a peer
    that sends ``incoming``; no direct IP (nothing gets dialed); judging does nothing."""

    def __init__(self, incoming: bytes) -> None:
        self.stream = host_module.Stream(_RawStream(incoming))
        self.guard = self
        self.peers = self

    async def open_stream(self, peer_id: str, protocol_id: str, *, timeout_s: float) -> host_module.Stream:
        return self.stream

    async def judge(self, peer_id: str, what: str, exc: BaseException) -> None:
        pass

    async def punish(self, peer_id: str, reason: str, *, points: int = 1) -> bool:
        return False

    def seen(self, peer_id: str, **_: Any) -> bool:
        return False

    def direct_ip(self, peer_id: str) -> str | None:
        return None

    def tensor_refusal(self, peer_id: str) -> str | None:
        return None

    def tensor_limit(self, peer_id: str, upload: RateLimit) -> RateLimit:
        return upload


def _run(async_fn: Callable[..., Any], *args: Any) -> Any:
    return trio.run(async_fn, *args)


# --- mutations ---

INTERESTING_INTS: tuple[int, ...] = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000)
INTERESTING_INTS += ((1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 53, (1 << 63) - 1, (1 << 64) - 1)
# nil, false, true, bin 8/16/32, ext, float, uint, int, fixext, str 8/16/32, array, map, never used.
MSGPACK_TYPE_BYTES = bytes.fromhex("c0c1c2c3c4c5c6c7cacbcccfd0d3d4d8d9dadbdcdddedf808f909fa0bfe0ff")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def mutate_bytes(
    data: bytes, rng: random.Random, corpus: Sequence[bytes], max_len: int, tokens: Sequence[bytes] = ()
) -> bytes:
    """1-8 stacked byte-level mutations."""
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4, 8))):
        op = rng.randrange(12 if tokens else 11)
        pos = rng.randrange(len(out) + 1)
        if rng.random() < 0.3:
            pos = min(pos, rng.randrange(17))  # headers and length fields sit at the start
        if op == 0 and out:
            i = min(pos, len(out) - 1)
            out[i] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[min(pos, len(out) - 1)] = rng.choice((0, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2:
            blob = (
                rng.randbytes(rng.randrange(1, 9))
                if rng.random() < 0.5
                else bytes([rng.randrange(256)]) * rng.randrange(1, 65)
            )
            out[pos:pos] = blob
        elif op == 3 and out:
            del out[pos : pos + rng.randrange(1, 17)]
        elif op == 4 and out:
            start = rng.randrange(len(out))
            out[pos:pos] = out[start : start + rng.randrange(1, 33)]
        elif op == 5:
            other = rng.choice(corpus)
            cut = rng.randrange(len(other) + 1)
            out = out[:pos] + other[cut:] if rng.random() < 0.5 else bytearray(other[:cut]) + out[pos:]
        elif op == 6 and out:
            width = rng.choice((1, 2, 4, 8))
            value = rng.choice((*INTERESTING_INTS, len(out), len(out) - 4, len(out) + 1, rng.randrange(1 << 16)))
            value += rng.choice((0, 0, -1, 1))
            order: Literal["big", "little"] = "big" if rng.random() < 0.8 else "little"
            out[pos : pos + width] = (value % (1 << (8 * width))).to_bytes(width, order)
        elif op == 7:
            del out[pos:]
        elif op == 8:
            encoded = _varint(rng.choice(INTERESTING_INTS)) if rng.random() < 0.7 else b"\xff" * rng.randrange(1, 12)
            out[pos : pos + rng.randrange(0, 3)] = encoded
        elif op == 9 and out:
            out[min(pos, len(out) - 1)] = rng.choice(MSGPACK_TYPE_BYTES)
        elif op == 10:
            out = bytearray(out[:pos] + out[pos:] * rng.randrange(1, 3))
        elif op == 11:
            token = rng.choice(tokens)
            out[pos : pos + (len(token) if rng.random() < 0.5 else 0)] = token
    return bytes(out[:max_len])


def _interesting_value(rng: random.Random, like: Any) -> Any:
    choices: list[Any] = [
        None,
        True,
        False,
        rng.choice(INTERESTING_INTS),
        -rng.choice(INTERESTING_INTS) - 1,
        rng.choice((0.0, -0.0, 1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324, 0.5)),
        "",
        "x" * rng.choice((1, 16, 17, 64, 65, 200, 257)),
        rng.choice(("\x00", "é", "\u2028", "🙂", "../", "/", "a" * 1000)),
        b"",
        rng.randbytes(rng.choice((1, 31, 32, 33, 63, 64, 65))),
        [],
        {},
        [[[[[[[[]]]]]]]],
        {"": None},
    ]
    if isinstance(like, bool):
        choices.append(not like)
    elif isinstance(like, int):
        choices += [like + 1, like - 1, like * 2, -like, float(like)]
    elif isinstance(like, float):
        choices += [like * 1e300, -like, int(like) if math.isfinite(like) else 0]
    elif isinstance(like, str):
        choices += [like + like, like[:-1], like.upper(), like.encode(), like + "\x00"]
    elif isinstance(like, bytes):
        choices += [like + like, like[:-1], like.decode("latin-1"), bytes(len(like))]
    elif isinstance(like, list):
        choices += [like * 2, like[:-1], [like], like[::-1]]
    elif isinstance(like, dict):
        choices += [dict(list(like.items())[:-1]), {**like, "extra": 1}, [like]]
    return rng.choice(choices)


def _nodes(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _nodes(value, (*path, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _nodes(value, (*path, i))


def edit_value(obj: Any, rng: random.Random) -> Any:
    """A copy of a decoded msgpack object with one node replaced, removed or added."""
    obj = msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)  # deep copy
    nodes = list(_nodes(obj))
    path, node = rng.choice(nodes)
    if not path:
        return _interesting_value(rng, node)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    action = rng.random()
    if action < 0.7:
        parent[key] = _interesting_value(rng, node)
    elif action < 0.85:
        del parent[key]
    elif isinstance(parent, dict):
        parent[rng.choice(("t", "v", "x", str(key) + "_", 7))] = _interesting_value(rng, node)
    else:
        parent.insert(key, node)  # a duplicate entry
    return obj


def edit_structured(data: bytes, layout: Layout, rng: random.Random) -> bytes | None:
    """A msgpack-aware edit of ``data``; None if it does not hold its layout's object."""
    try:
        parts = layout.split(data)
    except (ValueError, TypeError, msgpack.UnpackException, IndexError):
        return None
    if parts is None:
        return None
    obj, tail = parts
    if rng.random() < 0.2 and tail:
        tail = mutate_bytes(tail, rng, [tail], len(tail) + 64)
    try:
        for _ in range(rng.choice((1, 1, 2, 3))):
            obj = edit_value(obj, rng)
        return layout.join(obj, tail, rng)
    except (ValueError, TypeError, OverflowError):  # a value msgpack cannot encode
        return None


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _split_whole(data: bytes) -> tuple[Any, bytes]:
    return _unpack(data), b""


def _join_whole(obj: Any, tail: bytes, rng: random.Random) -> bytes:
    return _pack(obj)


def _split_frame(data: bytes) -> tuple[Any, bytes] | None:
    nbytes = int.from_bytes(data[:4], "big")
    if len(data) < 4 + nbytes:
        return None
    return _unpack(data[4 : 4 + nbytes]), data[4 + nbytes :]


def _join_frame(obj: Any, tail: bytes, rng: random.Random) -> bytes:
    body = _pack(obj)
    nbytes = len(body) if rng.random() < 0.9 else len(body) + rng.choice((-1, 1, 1 << 20))
    return (nbytes % (1 << 32)).to_bytes(4, "big") + body + tail


def _join_exchange(obj: Any, tail: bytes, rng: random.Random) -> bytes:
    """A tensors header frame, then the payload: fix its hash, as any sender can."""
    if isinstance(obj, dict) and rng.random() < 0.8:
        obj["blake3"] = exchange.digest(tail)
    return _join_frame(obj, tail, rng)


def _join_zockpt(obj: Any, tail: bytes, rng: random.Random) -> bytes:
    """A checkpoint header frame, then the file: fix its hash, as any holder can."""
    if isinstance(obj, dict) and rng.random() < 0.8:
        obj["sha256"] = hashlib.sha256(tail).hexdigest()
    return _join_frame(obj, tail, rng)


def _split_safetensors(data: bytes) -> tuple[Any, bytes] | None:
    nbytes = int.from_bytes(data[:8], "little")
    if len(data) < 8 + nbytes:
        return None
    return json.loads(data[8 : 8 + nbytes]), data[8 + nbytes :]


def _join_safetensors(obj: Any, tail: bytes, rng: random.Random) -> bytes:
    """A checkpoint (safetensors: 8-byte length, JSON header, tensor bytes) again."""
    header = json.dumps(obj).encode()
    nbytes = len(header) if rng.random() < 0.9 else len(header) + rng.choice((-1, 1, 1 << 40))
    return nbytes.to_bytes(8, "little") + header + tail


WHOLE = Layout(_split_whole, _join_whole)
FRAME = Layout(_split_frame, _join_frame)
EXCHANGE = Layout(_split_frame, _join_exchange)
ZOCKPT = Layout(_split_frame, _join_zockpt)
SAFETENSORS = Layout(_split_safetensors, _join_safetensors)


class Inputs:
    """The deterministic stream of inputs for one target: seeds first, then mutations."""

    def __init__(self, target: Target, seed: int) -> None:
        self.target = target
        self.rng = random.Random(f"{target.name}/{seed}")
        self.seeds = target.seeds()
        self.corpus: list[bytes] = list(self.seeds)
        self.max_len = max(256, 2 * max(len(s) for s in self.seeds) + 64)
        self._next_seed = 0

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self._next_seed < len(self.seeds):
            self._next_seed += 1
            return self.seeds[self._next_seed - 1]
        return self.mutant()

    def mutant(self) -> bytes:
        roll = self.rng.random()
        if roll < 0.04:
            return self.rng.randbytes(self.rng.randrange(0, min(self.max_len, 512)))
        return self.mutate(self.rng.choice(self.corpus), self.rng)

    def mutate(self, base: bytes, rng: random.Random) -> bytes:
        """One mutant of ``base``: msgpack-aware edits where the target has a layout, else bytes."""
        if rng.random() < 0.45 and self.target.layout is not None:
            edited = edit_structured(base, self.target.layout, rng)
            if edited is not None:
                return edited[: self.max_len] if rng.random() < 0.5 else edited
        return mutate_bytes(base, rng, self.corpus, self.max_len, self.target.tokens)

    def note(self, data: bytes, verdict: Verdict) -> None:
        """Accepted mutants join the corpus: they are valid inputs the seeds did not show."""
        if verdict.kind == "accepted" and len(data) <= self.max_len and data not in self.seeds:
            if len(self.corpus) < MAX_CORPUS:
                self.corpus.append(data)
            else:
                self.corpus[self.rng.randrange(len(self.seeds), MAX_CORPUS)] = data


def fuzz(
    target: Target,
    num_inputs: int,
    seed: int,
    *,
    before: Callable[[bytes], None] | None = None,
    after: Callable[[Report], None] | None = None,
) -> Report:
    """Run ``num_inputs`` inputs through ``target``: in this process, or in children if it
    isolates. ``before`` sees each input before it runs (in this process only); ``after`` the
    report after each input (after each batch, in children)."""
    if target.isolate:
        return fuzz_in_children(target, num_inputs, seed, after=after)
    report = Report(target.name, "mutation")
    inputs = Inputs(target, seed)
    start = time.perf_counter()
    for _ in range(num_inputs):
        data = next(inputs)
        if before is not None:
            before(data)
        verdict = run_one(target, data)
        report.count(verdict)
        inputs.note(data, verdict)
        report.seconds = time.perf_counter() - start
        if after is not None:
            after(report)
    return report


def fuzz_in_children(
    target: Target,
    num_inputs: int,
    seed: int,
    *,
    batch: int = CHILD_BATCH,
    after: Callable[[Report], None] | None = None,
) -> Report:
    """Batches of inputs through child processes (``python -m bench.fuzz_targets NAME``); a
    child that dies or hangs is a crash on the input it was running, and a new child goes on
    with the rest of the batch."""
    report = Report(target.name, "mutation")
    inputs = Inputs(target, seed)
    start = time.perf_counter()
    while report.inputs < num_inputs:
        pending = [next(inputs) for _ in range(min(batch, num_inputs - report.inputs))]
        while pending:
            verdicts, died = _child_batch(target.name, pending)
            for data, verdict in zip(pending, verdicts, strict=False):
                report.count(verdict)
                inputs.note(data, verdict)
            pending = pending[len(verdicts) :]
            if died is not None:
                report.count(Verdict("crash", {**died, "input_hex": pending[0].hex()}))
                pending = pending[1:]
        report.seconds = time.perf_counter() - start
        if after is not None:
            after(report)
    return report


def _child_batch(name: str, inputs: list[bytes]) -> tuple[list[Verdict], dict[str, Any] | None]:
    """Verdicts for a prefix of ``inputs``; and how the child died, if it did before the end."""
    paths = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    timeout_s = CHILD_SLACK_S + 0.05 * len(inputs)
    with subprocess.Popen(
        [sys.executable, "-m", "bench.fuzz_targets", name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=env,
    ) as child:
        try:
            out, err = child.communicate(_pack(inputs), timeout=timeout_s)
            hung = False
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            hung = True
    lines = out.splitlines()
    if not lines or lines[0] != READY:  # no input ran: a broken child, not a finding
        raise RuntimeError(f"the fuzz child for {name} did not start: {err.decode(errors='replace')[-2000:]}")
    verdicts: list[Verdict] = []
    for line in lines[1:]:
        record = json.loads(line)
        verdicts.append(Verdict(record["kind"], record.get("crash")))
    if len(verdicts) >= len(inputs):
        return verdicts, None
    how = f"hung past {timeout_s:.0f} s" if hung else f"exit status {child.returncode}"
    died = {
        "decoder": name,
        "exception": f"child process died ({how}) on this input",
        "signature": f"child died: {how}",
        "traceback": err.decode(errors="replace")[-4000:],
    }
    return verdicts, died


def _child_main(name: str) -> None:
    """The child's side: inputs on stdin (one msgpack list), one JSON verdict per line out."""
    target = TARGETS[name]
    inputs = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
    out = sys.stdout
    out.write(READY.decode() + "\n")
    for data in inputs:
        verdict = run_one(target, data)
        out.write(json.dumps({"kind": verdict.kind, "crash": verdict.crash}) + "\n")
        out.flush()  # what was written survives a segfault on the next input


# --- seeds and decoders, one section per format ---


def _frame(msg_type: str, version: int, fields: dict[str, Any]) -> bytes:
    return wire.frame(wire.encode(msg_type, version, fields))


def _member(peer_id: str, seed: bytes, **changes: Any) -> MemberRecord:
    values: dict[str, Any] = {
        "peer_id": peer_id,
        "addrs": ("/ip4/127.0.0.1/tcp/4001",),
        "role": "trainer",
        "device": "cpu",
        "memory_nbytes": 8 << 30,
        "joined_at": 1.7e9,
        "seq": 1,
    }
    values.update(changes)
    return sign_member(MemberRecord(**values), seed, RUN)


def _run_state(client_id: int) -> RunState:
    """A state whose document writes as ``client_id``: RunState draws one at random, and a
    fixed one makes the documents, so the inputs, the same on every run."""
    state = RunState(RUN)
    state._doc = Doc(client_id=client_id)
    return state


@cache
def _documents() -> dict[str, bytes]:
    """The base document (manifest, member A) and updates of it, as our writers make them."""
    base = _run_state(101)
    base.create_manifest(Manifest(run_id=RUN, name="fuzz", creator=PEER_A, created_at=1.7e9), SEED_A)
    base.put_member(_member(PEER_A, SEED_A))
    other = _run_state(202)
    other.apply_remote(base.encode())
    add_b = other.put_member(_member(PEER_B, SEED_B, addrs=("/ip4/10.0.0.2/tcp/4001", "/dns4/b.example/tcp/1")))
    renew_a = other.put_member(_member(PEER_A, SEED_A, seq=2, role="observer"))
    evict_b = other.evict([PEER_B])
    lease_a = other.put_lease(sign_lease(LeaseRecord(3, PEER_A, 1, 0), SEED_A, RUN))
    lease_b = other.put_lease(sign_lease(LeaseRecord(3, PEER_B, 2, 5), SEED_B, RUN))
    lone = _run_state(303)
    lone.put_member(_member(PEER_C, SEED_C, role="bootstrap"))
    return {
        "base": base.encode(),
        "full": other.encode(),
        "add_b": add_b,
        "renew_a": renew_a,
        "evict_b": evict_b,
        "lease_a": lease_a,
        "lease_b": lease_b,
        "diff": other.diff(base.state_vector()),
        "lone": lone.encode(),
        "sv_base": base.state_vector(),
        "sv_other": other.state_vector(),
        "sv_lone": lone.state_vector(),
        "sv_empty": _run_state(404).state_vector(),
    }


def _hostile_updates() -> list[bytes]:
    """The updates that once hurt pycrdt (now refused): mutants of them probe the same edges."""
    cases = json.loads((REPO_ROOT / "tests" / "vectors" / "crdt_hostile_v1.json").read_text())["cases"]
    updates = [bytes.fromhex(u) for case in cases for u in case["updates"]]
    return [u for u in updates if len(u) <= 2048]


def _update_seeds() -> list[bytes]:
    docs = _documents()
    return [docs[k] for k in ("base", "full", "add_b", "renew_a", "evict_b", "diff", "lone")]


def _state_vector_seeds() -> list[bytes]:
    docs = _documents()
    return [docs[k] for k in ("sv_base", "sv_other", "sv_lone", "sv_empty")]


def _check_update(raw: bytes) -> object:
    return crdt_check.check_update(raw, max_structs=MAX_UPDATE_STRUCTS, own_client=OWN_CLIENT, own_clock=5)


@cache
def _base_state() -> RunState:
    state = _run_state(OWN_CLIENT)
    state.load(_documents()["base"])
    return state


def _fresh_state() -> RunState:
    """A state holding the base document. ``apply_remote`` never changes its document in place
    (it validates a scratch copy and swaps it in), so a shallow copy is a fresh state."""
    return copy.copy(_base_state())


def _apply_remote(raw: bytes) -> object:
    return _fresh_state().apply_remote(raw)


def _state_diff(raw: bytes) -> object:
    return _base_state().diff(raw)


def _gossip_seeds() -> list[bytes]:
    batch = zolog.sign_batch(SEED_A, RUN, 0, [1, 1, 2], b"\x01\x80\xff").encode()
    return [
        gossip.encode(gossip.Heartbeat(digest="0123456789abcdef", role="trainer")),
        gossip.encode(gossip.Update(update=_documents()["add_b"])),
        gossip.encode(gossip.Bye()),
        gossip.encode(gossip.ZoBatch(batch=batch)),
    ]


@cache
def _batches() -> list[zolog.Batch]:
    return [
        zolog.sign_batch(SEED_A, RUN, 0, [0, 0, 1], b"\x01\x02\x03"),
        zolog.sign_batch(SEED_A, RUN, 3, [1, 200, 20000, 1 << 30], b"\x00\x7f\x80\xff"),
        zolog.sign_batch(SEED_B, RUN, 0, list(range(0, 600, 6)), bytes(range(100))),
        zolog.sign_batch(SEED_B, RUN, 1 << 39, [5], b"\x10"),
    ]


def _batch_seeds() -> list[bytes]:
    return [b.encode() for b in _batches()]


def _decode_batch(raw: bytes) -> object:
    return zolog.decode_batch(raw, RUN)


_SIGNERS = {PEER_A: SEED_A, PEER_B: SEED_B}


def _signed_batch_into_log(raw: bytes) -> object:
    """A batch its author signed whatever it holds (any stranger can sign its own garbage):
    re-signed here when the author is one of ours, then decoded and added to a log."""
    # The harness's own parsing (not the decoder under test): what it cannot read goes as is.
    with contextlib.suppress(ValueError, TypeError, OverflowError, msgpack.UnpackException):
        msg = _unpack(raw)
        if isinstance(msg, dict) and msg.get("peer") in _SIGNERS:
            fields = [RUN, msg["peer"], msg.get("first_seq"), msg.get("rounds"), msg.get("g")]
            msg["sig"] = keys.sign(_SIGNERS[msg["peer"]], zolog.DOMAIN, fields)
            raw = _pack(msg)
    log = zolog.UpdateLog(RUN, is_member=lambda peer: peer != PEER_C)
    log.add(_batches()[0], max_round=1 << 41)
    return log.add(zolog.decode_batch(raw, RUN), max_round=1000)


ALL_TYPES = frozenset(
    {"hb", "update", "bye", "zo", "info?", "info", "sync", "diff", "error", "tensors", "go", "ack"}
    | {"pair?", "accept", "busy", "dialback?", "dialback", "seen", "ckpt?", "ckpt", "none", "want", "batches", "f"}
)


def _wire_seeds() -> list[bytes]:
    return [
        wire.encode("info", 1, {"peer_id": PEER_A, "role": "trainer", "runs": [RUN], "agent": "a", "versions": {}}),
        wire.encode("sync", 1, {"run": RUN, "sv": _documents()["sv_base"]}),
        wire.encode("pair?", 1, {"round": 3, "nbytes": 1 << 20}),
        wire.encode("busy", 1, {"retry": True, "reason": "asking someone"}),
        wire.encode("want", 1, {"run": RUN, "have": {PEER_A: 3, PEER_B: 0}}),
        wire.encode("bye", 2, {}),
    ]


def _wire_decode(raw: bytes) -> object:
    return wire.decode(raw, msg_types=ALL_TYPES, version=1)


def _wire_receive(raw: bytes) -> object:
    stream = host_module.Stream(_RawStream(raw))
    return _run(lambda: wire.receive(stream, msg_types=ALL_TYPES, version=1, max_nbytes=1 << 16))


def _fields_seeds() -> list[bytes]:
    return [
        wire.encode(
            "f",
            1,
            {
                "digest": "0123456789abcdef",
                "name": "anything",
                "b": b"\x00" * 32,
                "i": 7,
                "l": ["a", "bc"],
                "m": {PEER_A: 3, PEER_B: 1 << 40},
            },
        ),
        wire.encode("f", 1, {"digest": "fedcba9876543210", "name": "", "b": b"", "i": 0, "l": [], "m": {}}),
    ]


def _wire_fields(raw: bytes) -> object:
    """Every ``wire.get_*`` helper on its field; refused if any refuses (all of them run)."""
    msg = wire.decode(raw, msg_types=frozenset({"f"}), version=1)
    getters: list[Callable[[], object]] = [
        lambda: wire.get_str(msg, "digest", max_len=16, pattern=gossip.DIGEST_PATTERN),
        lambda: wire.get_str(msg, "name", max_len=16),
        lambda: wire.get_bytes(msg, "b", max_nbytes=32),
        lambda: wire.get_int(msg, "i", lo=0, hi=1 << 40),
        lambda: wire.get_str_list(msg, "l", max_items=4, max_len=8),
        lambda: wire.get_count_map(msg, "m", max_items=4, lo=0, hi=1 << 40),
    ]
    refusal: BadMessage | None = None
    for get in getters:
        try:
            get()
        except BadMessage as exc:
            refusal = exc
    if refusal is not None:
        raise refusal
    return msg


def _exchange_seeds() -> list[bytes]:
    specs = [("w", "float32", [2, 3]), ("layers.0/q:k", "int8", [5]), ("e", "bfloat16", [0, 4]), ("d", "float64", [])]
    payload = bytes(range(24)) + b"\x05" * 5 + bytes(8)
    header = {
        "round": 3,
        "tensors": [
            {"name": n, "dtype": d, "shape": s, "nbytes": math.prod(s) * exchange.ITEM_NBYTES[d]} for n, d, s in specs
        ],
        "nbytes": len(payload),
        "blake3": exchange.digest(payload),
        "channel": "stream",
    }
    empty = {"round": 0, "tensors": [], "nbytes": 0, "blake3": exchange.digest(b""), "channel": "direct"}
    return [_frame("tensors", exchange.VERSION, header) + payload, _frame("tensors", exchange.VERSION, empty)]


def _exchange_receive(raw: bytes) -> object:
    """``TensorReceiver._receive`` on a stream carrying ``raw`` (its header checks, the
    allocation, the payload and its hash): no data channel, any transfer authorized."""
    host = _FakeHost(raw)
    receiver = exchange.TensorReceiver(
        host,  # type: ignore[arg-type]
        _accept_nothing,
        authorize=exchange.any_transfer,
        max_payload_nbytes=1 << 20,
        timeout_s=10.0,
    )
    lease = exchange._Lease(receiver.pool)
    try:
        return _run(receiver._receive, host.stream, lease)
    finally:
        lease.release()


async def _accept_nothing(peer_id: str, payload: exchange.Payload) -> None:
    pass


def _info_seeds() -> list[bytes]:
    fields = {"peer_id": PEER_A, "role": "trainer", "runs": [RUN], "agent": "swarmtrain/0.1.0"}
    return [
        _frame("info", info.VERSION, {**fields, "versions": our_versions()}),
        _frame("info", info.VERSION, {**fields, "runs": []}),
    ]


def _info_ask(raw: bytes) -> object:
    return _run(info.ask_info, _FakeHost(raw), PEER_X)


class _NoVerdict(Exception):
    """``dialback.ask`` gave no verdict (None): how it refuses a malformed answer."""


def _dialback_answer_seeds() -> list[bytes]:
    return [
        _frame("dialback", dialback.VERSION, {"ok": [4001], "ip": "203.0.113.5"}),
        _frame("dialback", dialback.VERSION, {"ok": [], "ip": ""}),
        _frame("dialback", dialback.VERSION, {"ok": [], "ip": "", "refused": "asked too often"}),
        _frame("seen", dialback.VERSION, {"ip": "203.0.113.5"})
        + _frame("dialback", dialback.VERSION, {"ok": [], "ip": "203.0.113.5"}),
    ]


def _dialback_ask(raw: bytes) -> object:
    """With the early word of where the server sees us (its IP checked before we hear it)."""
    seen: list[str] = []
    answer = _run(partial(dialback.ask, on_seen=seen.append), _FakeHost(raw), PEER_X, [4001, 4002])
    for ip in seen:
        ipaddress.ip_address(ip)  # raises (a crash, to the fuzzer) if ask passed on a non-IP
    if answer is None:
        raise _NoVerdict
    return answer


def _dialback_request_seeds() -> list[bytes]:
    return [
        _frame("dialback?", dialback.VERSION, {"ports": [4001, 4002]}),
        _frame("dialback?", dialback.VERSION, {"ports": [65535]}),
        _frame("dialback?", dialback.VERSION, {"ports": [4001], "seen": True}),
    ]


def _dialback_serve(raw: bytes) -> object:
    """The asked side: the request's checks, then "not a direct connection" (nothing dialed)."""
    host = _FakeHost(raw)
    return _run(dialback.DialbackServer(host)._serve, host.stream)  # type: ignore[arg-type]


def _zockpt_seeds() -> list[bytes]:
    body = bytes(range(100))
    header = {"round": 5, "vector": {PEER_A: 3, PEER_B: 1}, "param_hash": "ab" * 32, "nbytes": len(body)}
    header["sha256"] = hashlib.sha256(body).hexdigest()
    return [_frame("ckpt", savedstate.VERSION, header) + body, _frame("none", savedstate.VERSION, {})]


@cache
def _scratch_dir() -> Path:
    """Where fetched files land (a fetch writes a ``.part`` file beside its destination)."""
    path = Path(tempfile.mkdtemp(prefix="swarmtrain-fuzz-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _zockpt_fetch(raw: bytes) -> object:
    checkpoints = savedstate.ZoCheckpoints(_FakeHost(raw), RUN, max_nbytes=1 << 16)  # type: ignore[arg-type]
    return _run(checkpoints.fetch, PEER_X, _scratch_dir() / "fetched.ckpt")


def _zosync_pull_seeds() -> list[bytes]:
    batches = _batch_seeds()
    return [
        _frame("batches", zosync.VERSION, {"batches": batches, "more": False}),
        _frame("batches", zosync.VERSION, {"batches": batches[:1], "more": True}),
        _frame("batches", zosync.VERSION, {"batches": [], "more": False}),
    ]


def _zosync_pull(raw: bytes) -> object:
    log = zolog.UpdateLog(RUN, is_member=lambda peer: peer != PEER_C)
    sync = zosync.ZoLogSync(_FakeHost(raw), log, current_round=lambda: 10)  # type: ignore[arg-type]
    return _run(sync._pull_once, PEER_X)


def _zosync_serve_seeds() -> list[bytes]:
    return [
        _frame("want", zosync.VERSION, {"run": RUN, "have": {PEER_A: 1}}),
        _frame("want", zosync.VERSION, {"run": "other-abcdef", "have": {}}),
    ]


def _zosync_serve(raw: bytes) -> object:
    host = _FakeHost(raw)
    log = zolog.UpdateLog(RUN, is_member=lambda peer: True)
    for batch in _batches()[:2]:
        log.add(batch, max_round=1 << 41)
    return _run(zosync.ZoLogSync(host, log, current_round=lambda: 10)._serve, host.stream)  # type: ignore[arg-type]


_EXPERT_NBYTES = 64


@cache
def _expert_heads() -> list[experts.Head]:
    return [
        experts.sign_head(SEED_A, RUN, 0, 3, bytes(_EXPERT_NBYTES)),
        experts.sign_head(SEED_B, RUN, 5, 1 << 30, bytes(range(_EXPERT_NBYTES))),
    ]


def _expert_store(host: "_FakeHost") -> experts.ExpertStore:
    store = experts.ExpertStore(host, RUN, upload_limit=UNLIMITED)  # type: ignore[arg-type]
    store.configure(8, _EXPERT_NBYTES)
    return store


def _experts_heads_seeds() -> list[bytes]:
    heads = [h.wire() for h in _expert_heads()]
    return [
        _frame("heads", experts.VERSION, {"round": 4, "heads": heads}),
        _frame("heads", experts.VERSION, {"round": 0, "heads": []}),
    ]


def _experts_heads(raw: bytes) -> object:
    return _run(_expert_store(_FakeHost(raw)).heads, PEER_X)


def _experts_fetch_seeds() -> list[bytes]:
    return [
        _frame("expert", experts.VERSION, {"nbytes": _EXPERT_NBYTES}) + bytes(_EXPERT_NBYTES),
        _frame("gone", experts.VERSION, {}),
    ]


def _experts_fetch(raw: bytes) -> object:
    return _run(_expert_store(_FakeHost(raw)).fetch, PEER_X, _expert_heads()[0])


def _experts_serve_seeds() -> list[bytes]:
    head = _expert_heads()[0]
    return [
        _frame("heads?", experts.VERSION, {"run": RUN}),
        _frame("get", experts.VERSION, {"run": RUN, "expert": 0, "sha256": head.sha256}),
        _frame("get", experts.VERSION, {"run": "other-abcdef", "expert": 7, "sha256": b""}),
    ]


def _experts_serve(raw: bytes) -> object:
    host = _FakeHost(raw)
    store = _expert_store(host)
    store.publish(SEED_A, 0, 3, bytes(_EXPERT_NBYTES))
    return _run(store._serve, host.stream)


def _multiselect_seeds() -> list[bytes]:
    names = [b"/multistream/1.0.0\n", b"/swarmtrain/state/1.0.0\n", b"na\n", b"ls\n", b"\n"]
    return [_varint(len(n)) + n for n in names]


def _multiselect_read(raw: bytes) -> object:
    communicator = SimpleNamespace(read_writer=_RawStream(raw))
    return _run(libp2p_fixes._multiselect_read, communicator)


@cache
def _checkpoint_seeds() -> list[bytes]:
    tensors = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
        "half": torch.ones(4, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    return [
        checkpoint.encode(tensors, {"round": 3, "step": 150, "algorithm": "noloco"}),
        checkpoint.encode({}, {}),
    ]


def _checkpoint_decode(raw: bytes) -> object:
    return checkpoint.decode(raw)


def _ipc_worker_seeds() -> list[bytes]:
    return [
        ipc.encode("ready", {"payload_nbytes": 1024, "outbox": "psm_1", "inbox": "psm_2", "round": 0}),
        ipc.encode("round_done", {"round": 3, "train_loss": 2.5, "val_loss": 2.7, "compute_s": 1.5}),
        ipc.encode("outer_done", {"round": 3, "used_peer": True, "rejected": None}),
        ipc.encode("zo_step", {"round": 4, "g_codes": b"\x01\x02", "val_loss": 2.0, "compute_s": 0.1}),
        ipc.encode("zo_loaded", {"ok": False, "reason": "hash differs"}),
    ]


def _ipc_decode(raw: bytes) -> object:
    return ipc.decode(raw, ipc.WORKER_TYPES)


def _settings_seeds() -> list[bytes]:
    custom = settings.RunSettings(algorithm="zo", rounds=3, zo=settings.ZoConfig(lr=1e-3))
    return [settings.RunSettings().encode(), custom.encode(), _pack({"inner": {"lr": 1}})]


def _ipc_body_seeds() -> list[bytes]:
    return [frame[ipc.LENGTH_NBYTES :] for frame in _ipc_worker_seeds()]


def _ipc_daemon_seeds() -> list[bytes]:
    return [
        ipc.encode("outer_go", {"round": 3, "peer": True}),
        ipc.encode("accumulate", {"round": 3, "key": PEER_A}),
        ipc.encode("zo_apply", {"rebuild": False, "updates": [[123456789, 7], [1 << 63, 255]]}),
        ipc.encode("zo_go", {"round": 4, "seeds": [1, 2, 3]}),
        ipc.encode("zo_load", {"path": "/tmp/x.ckpt", "param_hash": "ab" * 32}),
        ipc.encode("stop", {}),
    ]


def _ipc_read_blocking(raw: bytes) -> object:
    return ipc.read_blocking(io.BytesIO(raw), ipc.DAEMON_TYPES)


_GATEWAY = "http://192.168.1.1:5000/rootDesc.xml"


def _description(service_type: str, control_url: str) -> bytes:
    return (
        '<?xml version="1.0"?><root xmlns="urn:schemas-upnp-org:device-1-0"><device>'
        "<deviceType>urn:schemas-upnp-org:device:InternetGatewayDevice:1</deviceType><deviceList><device>"
        "<deviceType>urn:schemas-upnp-org:device:WANDevice:1</deviceType><serviceList><service>"
        f"<serviceType>{service_type}</serviceType><serviceId>urn:upnp-org:serviceId:WANIPConn1</serviceId>"
        f"<controlURL>{control_url}</controlURL><eventSubURL>/evt</eventSubURL><SCPDURL>/x.xml</SCPDURL>"
        "</service></serviceList></device></deviceList></device></root>"
    ).encode()


def _upnp_description_seeds() -> list[bytes]:
    return [
        _description(upnp.SERVICE_TYPES[1], "/ctl/IPConn"),
        _description(upnp.SERVICE_TYPES[0], "http://192.168.1.1:5000/ctl/IPConn"),
        _description(upnp.SERVICE_TYPES[2], "//192.168.1.1:5000/ppp"),
        _description(upnp.SERVICE_TYPES[1], "http://[fe80::1]:5000/ctl"),
        b"<root><service><serviceType>x</serviceType></service></root>",
    ]


def _upnp_description(raw: bytes) -> object:
    return upnp.parse_description(raw, _GATEWAY)


def _ssdp_seeds() -> list[bytes]:
    return [
        (
            "HTTP/1.1 200 OK\r\nCACHE-CONTROL: max-age=120\r\n"
            f"ST: {upnp.SEARCH_TARGET}\r\nUSN: uuid:1234::{upnp.SEARCH_TARGET}\r\n"
            f"LOCATION: {_GATEWAY}\r\nSERVER: router/1.0 UPnP/1.1\r\n\r\n"
        ).encode(),
        b"HTTP/1.1 200 OK\r\nLocation: http://[fe80::1]:5000/desc.xml\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nLOCATION: https://192.168.1.1/desc.xml\r\n\r\n",
    ]


class _NoLocation(Exception):
    """The SSDP answer names no http LOCATION: ``discover`` keeps listening."""


def _ssdp_answer(raw: bytes) -> object:
    """``upnp.discover``'s read of one SSDP answer."""
    location = upnp.location_of(raw)
    if location is None:
        raise _NoLocation
    return location


URL_TOKENS = (b"[", b"]", b"http://", b"https://", b"//", b"[::1]", b"%", b"@", b":", b":65536", b"?", b"#")
XML_TOKENS = (b"<", b">", b"</", b"&amp;", b"&#0;", b"<![CDATA[", b"]]>", b"<!ENTITY x 'y'>", b"xmlns:a='b'")
MULTIADDR_PROTOCOLS = "ip4 ip6 ip6zone dns dns4 dnsaddr tcp udp quic-v1 p2p p2p-circuit unix ipcidr certhash onion"
MULTIADDR_PROTOCOLS += " onion3 garlic32 garlic64 sni http-path memory"
MULTIADDR_TOKENS = (*(f"/{p}/".encode() for p in MULTIADDR_PROTOCOLS.split()), b"/", b"::", b"%", b"\x00", b"65536")


def _member_addr_seeds() -> list[bytes]:
    addrs = [
        "/ip4/127.0.0.1/tcp/4001",
        "/ip6/::1/tcp/4001",
        "/dns4/node.example.com/tcp/4001",
        f"/ip4/203.0.113.5/tcp/4001/p2p/{PEER_B}/p2p-circuit",
        f"/ip4/203.0.113.5/tcp/4001/p2p/{PEER_B}/p2p-circuit/p2p/{PEER_X}",
        "/ip4/10.0.0.1/udp/4001/quic-v1",
    ]
    return [a.encode() for a in addrs]


class _FakeTransport:
    async def dial(self, maddr: object) -> None:
        pass


def _member_addr(raw: bytes) -> object:
    """An address from a member record (any stranger signs its own; a string of ≤ 256
    characters) as ``Host.connect`` reads it: direct ones parsed as there (replica of its
    inline try), circuit ones through ``Nat.circuit_addrs_for`` and ``Nat.dial_circuit``."""
    addr = raw.decode("utf-8", errors="replace")[:256]
    if not nat.is_circuit(addr):
        try:
            return multiaddr.Multiaddr(addr)
        except host_module._ADDR_ERRORS as exc:
            raise DialError(f"bad address: {exc}") from exc
    fake_nat = SimpleNamespace(status=SimpleNamespace(reservations={}), _transport=_FakeTransport())
    for circuit in nat.Nat.circuit_addrs_for(fake_nat, PEER_X, [addr]):  # type: ignore[arg-type]
        _run(nat.Nat.dial_circuit, fake_nat, circuit)
    return addr


# A model small enough that a payload is a few KiB; two nodes, one trained round apart.
_SMALL = GPTConfig(context_len=8, embed_dim=8, num_layers=1, num_heads=2)


@cache
def _trainers(compression: str) -> tuple[Trainer, bytes]:
    """A trainer after one round, and an honest partner's payload for it."""
    tokens = token_data.encode(text_corpus.embedded_corpus()[:20_000])
    made = []
    for node in range(2):
        torch.manual_seed(0)
        shard = token_data.make_shard(tokens, context_len=_SMALL.context_len, node_index=node, num_nodes=2)
        inner = InnerConfig(steps_per_round=2, lr=3e-3, batch_size=4)
        trainer = Trainer(GPT(_SMALL), shard, inner=inner, outer=OuterConfig(), seed=node, compression=compression)
        trainer.inner_steps()
        made.append(trainer)
    ours, partner = made
    ours.outer_payload()
    return ours, partner.outer_payload().numpy().tobytes()


def _payload_target(compression: str) -> Target:
    def decode(raw: bytes) -> object:
        ours, _ = _trainers(compression)
        wire_bytes = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        return ours.parse_payload(wire_bytes)

    return Target(
        f"trainer_payload_{compression}",
        decode,
        (PayloadRejected,),
        lambda: [_trainers(compression)[1]],
        f"training/trainer.py Trainer.parse_payload ({compression}): a partner's outer payload",
    )


_EXPERT_NUMEL = 3 * 256 + 5  # blocks of 256 and a partial one


def _expert_version(raw: bytes) -> object:
    return encodings.expert_versions("int8").decode(raw, _EXPERT_NUMEL)


def _expert_version_seeds() -> list[bytes]:
    values = torch.randn(_EXPERT_NUMEL, generator=torch.Generator().manual_seed(0)) * 0.02
    return [encodings.expert_versions("int8").encode(values.numpy().tobytes())]


@cache
def _expert_chain() -> list[bytes]:
    """A keyframe and the two deltas after it (training/encodings/experts.py Sparse)."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(_EXPERT_NUMEL) * 0.02).astype(np.float32)
    versions, chain = [], None
    for _ in range(3):
        values = (values + rng.standard_normal(_EXPERT_NUMEL).astype(np.float32) * np.float32(0.002)).astype(np.float32)
        wire, chain = encodings.expert_versions("sparseloco").encode_next(values.tobytes(), chain)
        versions.append(wire)
    return versions


def _expert_version_sparse(raw: bytes) -> object:
    """A version after the seeds' keyframe: alone if a keyframe, else as the next of the
    chain; and a delta as a holder of the version before it decodes it (from that public
    copy: ``base``, and its depth)."""
    versions = encodings.expert_versions("sparseloco")
    keyframe, delta, _ = _expert_chain()
    chain = [raw] if raw[:1] == bytes([1]) else [keyframe, delta, raw] if raw[1:2] == bytes([2]) else [keyframe, raw]
    whole = versions.decode_chain(chain, _EXPERT_NUMEL)
    if raw[:1] == bytes([2]):
        depth = len(chain) - 2
        base = versions.decode_chain(chain[:-1], _EXPERT_NUMEL)
        onward = versions.decode_chain([raw], _EXPERT_NUMEL, base=base, base_depth=depth)
        assert np.array_equal(onward.view(np.uint32), whole.view(np.uint32)), "decoded from a base, other bits"
    return whole


def _targets() -> list[Target]:
    protocol_refusal = (ProtocolError,)
    return [
        Target("wire_decode", _wire_decode, (BadMessage,), _wire_seeds, "protocol/wire.py decode", WHOLE),
        Target(
            "wire_receive",
            _wire_receive,
            protocol_refusal,
            lambda: [wire.frame(m) for m in _wire_seeds()],
            "protocol/wire.py read_frame + decode over protocol.net.host.Stream",
            FRAME,
        ),
        Target("wire_fields", _wire_fields, (BadMessage,), _fields_seeds, "protocol/wire.py get_* helpers", WHOLE),
        Target("gossip_decode", gossip.decode, (BadMessage,), _gossip_seeds, "protocol/net/gossip.py decode", WHOLE),
        Target(
            "zolog_decode_batch",
            _decode_batch,
            (BadMessage,),
            _batch_seeds,
            "node/algorithms/zo/zolog.py decode_batch",
            WHOLE,
        ),
        Target(
            "zolog_signed_batch_add",
            _signed_batch_into_log,
            protocol_refusal,
            _batch_seeds,
            "node/algorithms/zo/zolog.py decode_batch + UpdateLog.add, the batch re-signed by its author",
            WHOLE,
        ),
        Target(
            "crdt_check_update",
            _check_update,
            (BadMessage,),
            lambda: _update_seeds() + _hostile_updates(),
            "protocol/runstate/crdt_check.py check_update",
        ),
        Target(
            "crdt_check_state_vector",
            crdt_check.check_state_vector,
            (BadMessage,),
            _state_vector_seeds,
            "protocol/runstate/crdt_check.py check_state_vector",
        ),
        Target(
            "state_apply_remote",
            _apply_remote,
            protocol_refusal,
            lambda: _update_seeds() + _hostile_updates()[:24],
            "protocol/runstate/state.py RunState.apply_remote on the base document (child processes)",
            isolate=True,
        ),
        Target(
            "state_diff",
            _state_diff,
            protocol_refusal,
            _state_vector_seeds,
            "protocol/runstate/state.py RunState.diff of a peer's state vector (child processes)",
            isolate=True,
        ),
        Target(
            "exchange_receive",
            _exchange_receive,
            protocol_refusal,
            _exchange_seeds,
            "protocol/net/exchange.py TensorReceiver._receive (_parse_specs, header checks, payload hash)",
            EXCHANGE,
        ),
        Target("info_ask", _info_ask, protocol_refusal, _info_seeds, "protocol/runstate/info.py ask_info reply", FRAME),
        Target(
            "dialback_ask",
            _dialback_ask,
            (_NoVerdict,),
            _dialback_answer_seeds,
            "protocol/net/dialback.py ask: the answer (None when malformed)",
            FRAME,
        ),
        Target(
            "dialback_serve",
            _dialback_serve,
            protocol_refusal,
            _dialback_request_seeds,
            "protocol/net/dialback.py DialbackServer._serve: the request",
            FRAME,
        ),
        Target(
            "zockpt_fetch",
            _zockpt_fetch,
            protocol_refusal,
            _zockpt_seeds,
            "node/algorithms/savedstate.py fetch",
            ZOCKPT,
        ),
        Target(
            "zosync_pull",
            _zosync_pull,
            protocol_refusal,
            _zosync_pull_seeds,
            "node/algorithms/zo/zosync.py _pull_once: the batches reply",
            FRAME,
        ),
        Target(
            "zosync_serve",
            _zosync_serve,
            protocol_refusal,
            _zosync_serve_seeds,
            "node/algorithms/zo/zosync.py _serve: the want request",
            FRAME,
        ),
        Target(
            "experts_heads",
            _experts_heads,
            protocol_refusal,
            _experts_heads_seeds,
            "node/algorithms/spes/experts.py ExpertStore.heads: the reply (each head's signature)",
            FRAME,
        ),
        Target(
            "experts_fetch",
            _experts_fetch,
            protocol_refusal,
            _experts_fetch_seeds,
            "node/algorithms/spes/experts.py ExpertStore.fetch: header, then the bytes",
            FRAME,
        ),
        Target(
            "experts_serve",
            _experts_serve,
            protocol_refusal,
            _experts_serve_seeds,
            "node/algorithms/spes/experts.py ExpertStore._serve: the request",
            FRAME,
        ),
        Target(
            "multiselect_read",
            _multiselect_read,
            (MultiselectCommunicatorError,),
            _multiselect_seeds,
            "protocol/net/libp2p_fixes.py _multiselect_read",
            tokens=(b"\n", b"\xff", b"\xc3\xa9", b"\xed\xa0\x80", b"\x80" * 9 + b"\x01"),
        ),
        Target(
            "checkpoint_decode",
            _checkpoint_decode,
            (checkpoint.CheckpointError,),
            _checkpoint_seeds,
            "training/checkpoint.py decode (safetensors' native reader: child processes)",
            SAFETENSORS,
            isolate=True,
        ),
        Target("ipc_decode", _ipc_decode, (ipc.IpcError,), _ipc_body_seeds, "training/ipc.py decode", WHOLE),
        Target(
            "run_settings",
            settings.decode,
            (settings.SettingsError,),
            _settings_seeds,
            "training/settings.py decode (a manifest's settings)",
            WHOLE,
        ),
        Target(
            "ipc_read_blocking",
            _ipc_read_blocking,
            (ipc.IpcError,),
            _ipc_daemon_seeds,
            "training/ipc.py read_blocking (the worker's side of the pipe)",
            FRAME,
        ),
        Target(
            "upnp_description",
            _upnp_description,
            (upnp.UpnpError,),
            _upnp_description_seeds,
            "protocol/net/upnp.py parse_description (the gateway's XML)",
            tokens=URL_TOKENS + XML_TOKENS,
            ours=False,
        ),
        Target(
            "upnp_ssdp_answer",
            _ssdp_answer,
            (_NoLocation,),
            _ssdp_seeds,
            "protocol/net/upnp.py location_of: reading an SSDP answer",
            tokens=(*URL_TOKENS, b"\r\n", b"LOCATION:", b"location: ", b":"),
            ours=False,
        ),
        Target(
            "member_addr",
            _member_addr,
            (DialError,),
            _member_addr_seeds,
            "protocol/net/host.py connect + protocol/net/nat.py dial_circuit: a member record's address",
            tokens=MULTIADDR_TOKENS,
            ours=False,
        ),
        *(_payload_target(name) for name in encodings.NAMES),
        Target(
            "expert_version_int8",
            _expert_version,
            (ValueError,),
            _expert_version_seeds,
            "training/encodings/experts.py Int8.decode: a SPES expert version, int8",
        ),
        Target(
            "expert_version_sparse",
            _expert_version_sparse,
            (ValueError,),
            _expert_chain,
            "training/encodings/experts.py Sparse.decode_chain: a SPES keyframe or delta after its base",
        ),
    ]


TARGETS: dict[str, Target] = {t.name: t for t in _targets()}


if __name__ == "__main__":
    _child_main(sys.argv[1])
