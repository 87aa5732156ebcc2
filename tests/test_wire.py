"""Wire framing and every message decoder: round trips, size limits, arbitrary bytes."""

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import wire
from protocol.errors import BadMessage, ProtocolError, UnsupportedVersion
from protocol.net import gossip


class MemoryStream:
    """protocol.wire.ByteStream over a bytes buffer."""

    def __init__(self, data: bytes = b"") -> None:
        self.incoming = bytearray(data)
        self.written = bytearray()

    async def read_exact(self, nbytes: int) -> bytes:
        if nbytes > len(self.incoming):
            raise ProtocolError("ended early")
        chunk = bytes(self.incoming[:nbytes])
        del self.incoming[:nbytes]
        return chunk

    async def write(self, data: bytes) -> None:
        self.written += data


TYPES = frozenset({"ping"})


def test_round_trip_keeps_fields() -> None:
    data = wire.encode("ping", 1, {"n": 5, "b": b"\x00\x01", "s": "x"})
    msg = wire.decode(data, msg_types=TYPES, version=1)
    assert msg == {"t": "ping", "v": 1, "n": 5, "b": b"\x00\x01", "s": "x"}


def test_unknown_version_is_its_own_error() -> None:
    with pytest.raises(UnsupportedVersion, match="version 2"):
        wire.decode(wire.encode("ping", 2, {}), msg_types=TYPES, version=1)


@pytest.mark.parametrize(
    "obj",
    [[1, 2], {"t": "pong", "v": 1}, {"v": 1}, {"t": "ping"}, {"t": "ping", "v": True}, {"t": 3, "v": 1}],
)
def test_wrong_shapes_are_bad_messages(obj: object) -> None:
    with pytest.raises(BadMessage):
        wire.decode(msgpack.packb(obj), msg_types=TYPES, version=1)


@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_crash_decode(data: bytes) -> None:
    with contextlib.suppress(BadMessage):
        wire.decode(data, msg_types=TYPES, version=1)


@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_crash_gossip_decode(data: bytes) -> None:
    with contextlib.suppress(BadMessage):
        gossip.decode(data)


@given(
    st.one_of(
        st.builds(
            gossip.Heartbeat, digest=st.from_regex(gossip.DIGEST_PATTERN, fullmatch=True), role=st.just("trainer")
        ),
        st.builds(gossip.Update, update=st.binary(max_size=1024)),
        st.just(gossip.Bye()),
        st.builds(gossip.ZoBatch, batch=st.binary(max_size=1024)),
    )
)
def test_gossip_round_trip(payload: gossip.GossipPayload) -> None:
    assert gossip.decode(gossip.encode(payload)) == payload


def test_gossip_refuses_oversized_push() -> None:
    with pytest.raises(ValueError, match="too large"):
        gossip.encode(gossip.Update(b"x" * (gossip.MAX_PUSH_NBYTES + 1)))
    forged = wire.encode("update", 1, {"update": b"x" * (gossip.MAX_PUSH_NBYTES + 1)})
    with pytest.raises(BadMessage):
        gossip.decode(forged)


async def test_frame_round_trip() -> None:
    stream = MemoryStream()
    await wire.send(stream, "ping", 1, {"n": 1})
    assert len(stream.written) == wire.LENGTH_NBYTES + len(wire.encode("ping", 1, {"n": 1}))
    reader = MemoryStream(bytes(stream.written))
    assert (await wire.receive(reader, msg_types=TYPES, version=1, max_nbytes=100))["n"] == 1


async def test_oversized_frame_refused_before_reading_body() -> None:
    claimed = (1 << 30).to_bytes(wire.LENGTH_NBYTES, "big")
    stream = MemoryStream(claimed)  # no body at all: the length alone must be refused
    with pytest.raises(BadMessage, match="exceeds"):
        await wire.read_frame(stream, max_nbytes=1 << 20)


@pytest.mark.parametrize(
    ("getter", "kwargs", "value"),
    [
        (wire.get_str, {"max_len": 3}, "abcd"),
        (wire.get_str, {"max_len": 3}, 5),
        (wire.get_bytes, {"max_nbytes": 2}, b"abc"),
        (wire.get_bytes, {"max_nbytes": 2}, "ab"),
        (wire.get_int, {"lo": 0, "hi": 9}, 10),
        (wire.get_int, {"lo": 0, "hi": 9}, True),
        (wire.get_str_list, {"max_items": 1, "max_len": 5}, ["a", "b"]),
        (wire.get_str_list, {"max_items": 2, "max_len": 5}, ["a", 1]),
    ],
)
def test_field_getters_refuse_bad_values(getter, kwargs, value) -> None:
    with pytest.raises(BadMessage, match="'f'"):
        getter({"f": value}, "f", **kwargs)


def test_count_maps_are_checked_entry_by_entry() -> None:
    ok = {"m": {"peer-a": 3, "peer-b": 0}}
    assert wire.get_count_map(ok, "m", max_items=4, lo=0, hi=10) == {"peer-a": 3, "peer-b": 0}
    for bad in (
        {"m": [1]},
        {"m": {"p": -1}},
        {"m": {"p": True}},
        {"m": {"x" * 65: 1}},
        {"m": {str(i): 1 for i in range(5)}},
    ):
        with pytest.raises(BadMessage):
            wire.get_count_map(bad, "m", max_items=4, lo=0, hi=10)
