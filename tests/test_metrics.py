"""Prometheus metrics: the numbers a scrape gets, and the server in a running daemon."""

from pathlib import Path

import pytest
import trio

from node.metrics import NodeMetrics, exposition
from tests.conftest import open_swarm

NAMES = (
    "swarmtrain_peers",
    "swarmtrain_reachability",
    "swarmtrain_rounds_total",
    "swarmtrain_loss",
    "swarmtrain_tokens_total",
    "swarmtrain_bytes_sent_total",
    "swarmtrain_bytes_received_total",
    "swarmtrain_bans_total",
    "swarmtrain_penalties_total",
)


def test_a_scrape_reports_the_nodes_numbers() -> None:
    status = {
        "peers_seen": 3,
        "reachability": "private",
        "training": {"rounds": 7, "final_loss": 2.5, "tokens": 1000, "bytes_sent": 10, "bytes_received": 20},
    }
    text = exposition(lambda: NodeMetrics.of(status, bans=1, penalties=6)).decode()
    for name in NAMES:
        assert f"\n{name}" in f"\n{text}", name
    lines = set(text.splitlines())
    for line in (
        "swarmtrain_peers 3.0",
        'swarmtrain_reachability{state="private"} 1.0',
        'swarmtrain_reachability{state="public"} 0.0',
        "swarmtrain_rounds_total 7.0",
        "swarmtrain_loss 2.5",
        "swarmtrain_tokens_total 1000.0",
        "swarmtrain_bans_total 1.0",
        "swarmtrain_penalties_total 6.0",
    ):
        assert line in lines, line
    idle = exposition(lambda: NodeMetrics.of({"peers_seen": 0}, bans=0, penalties=0)).decode()
    assert "swarmtrain_loss NaN" in idle  # no training yet: no loss, not a made-up 0


async def get(port: int, request: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        reply = b""
        while chunk := await stream.receive_some(65536):
            reply += chunk
    return reply


@pytest.mark.integration
async def test_a_daemon_serves_metrics_where_its_status_says(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        node = await swarm.start("n", metrics_port=0, run__new_run="metrics")
        url = node.status()["metrics_url"]
        assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        port = int(url.split(":")[2].split("/")[0])
        with trio.fail_after(30):
            reply = await get(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 200 OK") and b"swarmtrain_peers" in reply
            assert (await get(port, b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404")
            assert (await get(port, b"\x00\xff" * 2000 + b"\r\n\r\n")).startswith(b"HTTP/1.1 404")  # garbage: no crash
            reply = await get(port, b"GET /metrics HTTP/1.0\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 200 OK")  # the node went on serving


def test_the_grafana_dashboard_plots_only_metrics_a_node_exports() -> None:
    import json
    import re

    dashboard = json.loads((Path(__file__).parent.parent / "deploy" / "grafana-dashboard.json").read_text())
    exported = {m.name for m in NodeMetrics().families()} | {f"{m.name}_total" for m in NodeMetrics().families()}
    plotted = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"swarmtrain_[a-z_]+", target["expr"])
    }
    assert plotted and plotted <= exported, plotted - exported
    assert {"swarmtrain_loss", "swarmtrain_peers", "swarmtrain_tokens_total"} <= plotted
