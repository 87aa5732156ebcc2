"""Prometheus metrics of a node: one typed snapshot, read at each scrape, over a tiny HTTP server.

    GET /metrics   → 200, the text exposition format (prometheus_client's ``generate_latest``)
    anything else  → 404

The server listens on ``metrics_host`` (127.0.0.1 by default: the numbers say who we talk
to, so they are for the machine's owner; a Prometheus elsewhere needs ``metrics_host``
set) at ``metrics_port``, and runs in the daemon's nursery: trio, no thread. A request is
one line and a few headers, read within ``REQUEST_TIMEOUT_S`` and ``MAX_REQUEST_NBYTES``.

Metrics (each a gauge or counter of ``NodeMetrics``, the one place they are defined):

    swarmtrain_peers                       live peers
    swarmtrain_reachability{state}         1 for our reachability (public, private, unknown), 0 for the others
    swarmtrain_rounds_total                outer rounds this node trained
    swarmtrain_loss                        validation loss after the last round
    swarmtrain_tokens_total                tokens the inner steps trained on
    swarmtrain_bytes_sent_total            training payload bytes sent
    swarmtrain_bytes_received_total        training payload bytes received
    swarmtrain_bans_total                  peers we banned
    swarmtrain_penalties_total             penalty points we gave peers
    swarmtrain_training_finished           1 once this node's worker finished its rounds
"""

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

REACHABILITY_STATES = ("public", "private", "unknown")
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_NBYTES = 8192


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeMetrics:
    peers: int = 0
    reachability: str = "unknown"
    rounds: int = 0
    loss: float | None = None
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bans: int = 0
    penalties: int = 0
    finished: bool = False

    @classmethod
    def of(cls, status: dict[str, Any], *, bans: int, penalties: int) -> "NodeMetrics":
        """From the node's ``status()`` and its peer table's counts."""
        training = status.get("training") or {}
        return cls(
            peers=int(status.get("peers_seen", 0)),
            reachability=str(status.get("reachability", "unknown")),
            rounds=int(training.get("rounds", 0)),
            loss=training.get("final_loss"),
            tokens=int(training.get("tokens", 0)),
            bytes_sent=int(training.get("bytes_sent", 0)),
            bytes_received=int(training.get("bytes_received", 0)),
            bans=bans,
            penalties=penalties,
            finished=bool(training.get("finished", False)),
        )

    def families(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("swarmtrain_peers", "Live peers.", value=self.peers)
        reach = GaugeMetricFamily(
            "swarmtrain_reachability", "Our reachability (1 for the current state).", labels=["state"]
        )
        for state in REACHABILITY_STATES:
            reach.add_metric([state], float(self.reachability == state))
        yield reach
        counters = (
            ("swarmtrain_rounds", "Outer rounds this node trained.", self.rounds),
            ("swarmtrain_tokens", "Tokens the inner steps trained on.", self.tokens),
            ("swarmtrain_bytes_sent", "Training payload bytes sent.", self.bytes_sent),
            ("swarmtrain_bytes_received", "Training payload bytes received.", self.bytes_received),
            ("swarmtrain_bans", "Peers this node banned.", self.bans),
            ("swarmtrain_penalties", "Penalty points this node gave peers.", self.penalties),
        )
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily(
            "swarmtrain_loss",
            "Validation loss after the last round.",
            value=math.nan if self.loss is None else self.loss,
        )
        yield GaugeMetricFamily("swarmtrain_training_finished", "1 once training finished.", value=float(self.finished))


class _Snapshot(Collector):
    def __init__(self, read: Callable[[], NodeMetrics]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        yield from self._read().families()


def exposition(read: Callable[[], NodeMetrics]) -> bytes:
    """The text a scrape gets."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(read))
    body: bytes = generate_latest(registry)
    return body


def _response(status: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _answer(stream: trio.SocketStream, read: Callable[[], NodeMetrics]) -> None:
    request = b""
    with trio.move_on_after(REQUEST_TIMEOUT_S):
        while b"\r\n\r\n" not in request and b"\n\n" not in request and len(request) < MAX_REQUEST_NBYTES:
            chunk = await stream.receive_some(MAX_REQUEST_NBYTES)
            if not chunk:
                break
            request += chunk
    parts = request.split(b"\n", 1)[0].split()
    if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
        reply = _response("200 OK", exposition(read), CONTENT_TYPE_LATEST)
    else:
        reply = _response("404 Not Found", b"not found: GET /metrics\n", "text/plain; charset=utf-8")
    with trio.move_on_after(REQUEST_TIMEOUT_S):
        await stream.send_all(reply)


async def serve_metrics(
    host: str, port: int, read: Callable[[], NodeMetrics], *, task_status: "TaskStatus[int]" = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``task_status`` gets the port (``port`` 0 picks a free one)."""
    listeners = await trio.open_tcp_listeners(port, host=host)

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await _answer(stream, read)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                logger.debug("metrics client went away: %s", exc)
            except Exception:  # a scrape must never take the node down
                logger.exception("answering a metrics scrape failed")

    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)
