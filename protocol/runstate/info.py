"""Who are you and which run are you in: lets ``swarmtrain join ADDR`` find the run.

Protocol flow (``/swarmtrain/info/1.0.0``), one exchange per stream:

    asker                                   answerer
    {t: "info?", v: 1}       ──────────────▶
                             ◀────────────── {t: "info", v: 1, peer_id, role, runs: [run id],
                                              agent, versions: {name: version}}
    both close

``versions`` names what must match between peers of one run (the run document's format,
the sync protocol's version, ...): a joiner compares them first and refuses with one line
naming both sides' versions, instead of syncing documents it would then refuse. A peer of
an earlier release sends no ``versions``.
"""

from dataclasses import dataclass, field

import trio

from protocol import wire
from protocol.errors import BadMessage, ProtocolError
from protocol.net.hostlike import HostLike, StreamLike
from protocol.runstate.state import RUN_ID_PATTERN

PROTOCOL_ID = "/swarmtrain/info/1.0.0"
VERSION = 1
MAX_FRAME_NBYTES = 16 << 10
# A daemon holds one run today; the list leaves room for more.
MAX_RUNS = 16
TIMEOUT_S = 10.0
MAX_VERSIONS = 32


@dataclass(frozen=True, slots=True)
class NodeInfo:
    peer_id: str
    role: str
    runs: tuple[str, ...]
    agent: str
    versions: dict[str, int] = field(default_factory=dict)

    def incompatible(self, ours: dict[str, int]) -> list[str]:
        """What differs between its versions and ``ours`` ("state: theirs 2, ours 3")."""
        return [
            f"{name}: theirs {self.versions[name]}, ours {version}"
            for name, version in sorted(ours.items())
            if name in self.versions and self.versions[name] != version
        ]


def serve_info(host: HostLike, info: NodeInfo) -> None:
    async def serve(stream: StreamLike) -> None:
        with trio.fail_after(TIMEOUT_S):
            await wire.receive(stream, msg_types=frozenset({"info?"}), version=VERSION, max_nbytes=MAX_FRAME_NBYTES)
            fields = {
                "peer_id": info.peer_id,
                "role": info.role,
                "runs": list(info.runs),
                "agent": info.agent,
                "versions": info.versions,
            }
            await wire.send(stream, "info", VERSION, fields)

    host.set_handler(PROTOCOL_ID, serve)


async def ask_info(host: HostLike, peer_id: str) -> NodeInfo:
    """Ask a connected peer who it is; raises ``ProtocolError``."""
    stream = await host.open_stream(peer_id, PROTOCOL_ID, timeout_s=TIMEOUT_S)
    try:
        with trio.fail_after(TIMEOUT_S):
            await wire.send(stream, "info?", VERSION, {})
            reply = await wire.receive(
                stream, msg_types=frozenset({"info"}), version=VERSION, max_nbytes=MAX_FRAME_NBYTES
            )
    except trio.TooSlowError as exc:
        raise ProtocolError(f"{peer_id} did not answer who it is within {TIMEOUT_S:g} s") from exc
    finally:
        await stream.close()
    runs = wire.get_str_list(reply, "runs", max_items=MAX_RUNS, max_len=64)
    for run_id in runs:
        if not RUN_ID_PATTERN.fullmatch(run_id):
            raise BadMessage(f"invalid run id {run_id[:64]!r}")
    return NodeInfo(
        peer_id=wire.get_str(reply, "peer_id", max_len=64),
        role=wire.get_str(reply, "role", max_len=16),
        runs=tuple(runs),
        agent=wire.get_str(reply, "agent", max_len=64),
        versions=wire.get_count_map(reply, "versions", max_items=MAX_VERSIONS, lo=0, hi=1 << 31)
        if "versions" in reply
        else {},
    )
