"""NAT traversal across real NATs (nftables masquerade in network namespaces, node/simulate/netbed.py).

Two hosts behind different NATs find each other through the DHT, connect through the
public node's relay, hole-punch, and move a tensor over the direct connection; a host
behind a port-randomising NAT cannot punch, stays relayed, and still gets the run state.
Skips with the reason where namespaces are not allowed (not root, no iproute2/nftables).
"""

import json
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio

from node.simulate.netbed import Netbed, NetbedUnavailable, check_available

try:
    check_available()
except NetbedUnavailable as exc:
    pytest.skip(f"NAT test bed unavailable here: {exc}", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
SWARMTRAIN = [sys.executable, "-m", "node"]


class Peer:
    """A tests/nat_peer.py process in a namespace, driven by JSON lines."""

    def __init__(self, process: trio.Process, stderr: Any) -> None:
        self.process = process
        self.stderr = stderr
        """Its log (a temporary file): the tail goes into a failed assertion's message."""
        self._buffer = b""
        self.output: list[str] = []

    @classmethod
    async def start(cls, bed: Netbed, role: str, *args: str) -> "Peer":
        argv = [*bed.exec_prefix(role), sys.executable, "-m", "tests.nat_peer", *args]
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT
        )
        return cls(process, stderr)

    def log_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-3000:].decode(errors="replace")

    async def event(self, timeout_s: float = 90.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        with trio.fail_after(timeout_s):
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some(65536)
                assert chunk, f"peer exited; it said: {self.output}; its log: {self.log_tail()}"
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        self.output.append(line.decode())
        event: dict[str, Any] = json.loads(line)
        return event

    async def do(self, command: str, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(json.dumps({"do": command, **fields}).encode() + b"\n")
        return await self.event()

    async def stop(self) -> None:
        if self.process.stdin is not None:
            await self.process.stdin.aclose()
        with trio.move_on_after(10):
            await self.process.wait()
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        self.stderr.close()


async def test_two_nodes_behind_nats_meet_by_dht_punch_through_and_move_a_tensor_directly() -> None:
    with Netbed(num_nats=2) as bed:
        peers: list[Peer] = []
        try:
            pub = await Peer.start(bed, "pub", "public")
            peers.append(pub)
            boot = next(a for a in (await pub.event())["addrs"] if a.startswith(f"/ip4/{bed.public_ip}/"))
            a = await Peer.start(bed, "host0", "private", boot, "a")
            b = await Peer.start(bed, "host1", "private", boot, "b")
            peers += [a, b]
            a_up, b_up = await a.event(), await b.event()
            for up, k in ((a_up, 0), (b_up, 1)):
                assert up["nat"]["reachability"] == "private"  # the public node's dial-back got no answer
                assert up["nat"]["observed_ip"] == up["nat"]["translated"] == bed.nat_wan_ip(k)
                assert up["nat"]["timeline"]["translated"] < up["nat"]["timeline"]["verdict"]  # the early word
                assert list(up["nat"]["reservations"]) == [boot.rsplit("/p2p/", 1)[1]]

            found = await a.do("find")
            assert found["found"] == [b_up["peer_id"]]  # through the DHT, not told
            assert not any("p2p-circuit" in addr for addr in found["addrs"][b_up["peer_id"]])
            connected = await a.event()
            assert connected["connected"] == {b_up["peer_id"]: "relayed"}  # its direct address is behind a NAT

            direct = await a.do("await_direct", peer=b_up["peer_id"])
            assert direct["direct_after_s"] is not None, (direct, await b.do("status"))
            sent = await a.do("send", peer=b_up["peer_id"])
            assert sent == {"sent": True, "connection": "direct"}
            got = (await b.do("await_tensor"))["received"]
            assert got == {"peer": a_up["peer_id"], "nbytes": 4096 * 4, "same": True, "connection": "direct"}
            links = (await a.do("status"))["links"]
            assert links[b_up["peer_id"]] == "direct"
        finally:
            for peer in peers:
                await peer.stop()


async def test_a_node_that_cannot_punch_stays_relayed_and_still_gets_the_run(short_tmp: Path) -> None:
    report_path = short_tmp / "report.json"
    # The simulation ends once every pair still relayed had an extra hole-punch round end
    # (~20 s in; 75 s at most). A fixed 30 s once ended it with the cone pair still relayed
    # in a full run of the suite (its first punch failed under load, and the extra round
    # 20 s in had not ended); now that round's end is what it waits for.
    argv = [*SWARMTRAIN, "simulate", "--topology", "nat", "--nodes", "3", "--symmetric-nats", "1"]
    argv += ["--algorithm", "none", "--report", str(report_path), "--timeout-s", "150"]
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT)
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, output[-3000:]
    report = json.loads(report_path.read_text())
    assert report["converged"] and report["topology"] == "nat"
    n0, n1, n2 = report["nodes"]
    boot = report["bootstrap"]
    assert boot["reachability"] == "public"
    for node in (n0, n1, n2):
        assert node["reachability"] == "private" and node["relay_reservations"] == [boot["peer_id"]]
        assert node["state_digest"] == boot["state_digest"] and node["members"] == 4
    assert n0["connections"][n1["peer_id"]] == "direct"  # cone NATs: punched
    assert n2["connections"][n0["peer_id"]] == "relayed" and n2["connections"][n1["peer_id"]] == "relayed"
    assert report["pairs"] == {"direct": 1, "relayed": 2, "unconnected": 0}
    assert n0["first_direct_s"] is not None and n2["first_direct_s"] is None
    for node in (n0, n1):  # each relayed pair had an extra punch round end, still relayed, on a side
        assert node["punch_retries"].get(n2["peer_id"], 0) + n2["punch_retries"].get(node["peer_id"], 0) >= 1
    assert "behind NATs: 1 pairs direct, 2 relayed" in output


async def test_a_terminated_nat_simulation_stops_its_nodes_and_deletes_its_namespaces() -> None:
    argv = [*SWARMTRAIN, "simulate", "--topology", "nat", "--nodes", "2", "--algorithm", "none", "--linger-s", "60"]
    process = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    assert process.stdout is not None
    output = b""
    with trio.fail_after(60):
        while b"\nrun " not in output:  # the bed is up and the bootstrap node started the run
            chunk = await process.stdout.receive_some(4096)
            assert chunk, output.decode()
            output += chunk
    prefix = re.search(rb"namespaces (swt\w+)\*", output)
    assert prefix is not None, output.decode()
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(60):
        while chunk := await process.stdout.receive_some(4096):
            output += chunk
        assert await process.wait() == 128 + signal.SIGTERM, output.decode()
    listed = await trio.run_process(["ip", "netns", "list"], capture_stdout=True)
    assert prefix.group(1) not in listed.stdout
