"""IPv6: nodes listen on and dial ``/ip6`` addresses, and tensors take the data channel over
IPv6 as over IPv4 (a channel on both families has one port for both)."""

import socket
from pathlib import Path
from typing import Any

import pytest
import trio

from protocol.errors import DialError
from protocol.net import addrs, exchange
from protocol.net.data_channel import DataChannel
from protocol.net.exchange import Payload, TensorReceiver, TensorSpec, any_transfer
from protocol.net.host import open_host, parse_dial_addr
from tests.adversarial.harness import finished, micro_noloco, until
from tests.conftest import open_swarm


def loopback_v6() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_v6 = pytest.mark.skipif(not loopback_v6(), reason="this machine has no IPv6 loopback (::1)")


def test_listen_addresses_of_both_families_are_checked() -> None:
    assert addrs.check_listen_addr("/ip6/::1/tcp/7400") == ("::1", 7400)
    assert addrs.check_listen_addr("/ip6/::/tcp/0") == ("::", 0)
    assert addrs.check_listen_addr("/ip4/0.0.0.0/tcp/7400") == ("0.0.0.0", 7400)
    for bad in ("/ip6/::1/udp/7400", "/ip6/1.2.3.4/tcp/1", "/ip4/::1/tcp/1", "/ip6/::1/tcp/x", "/ip6/::1"):
        with pytest.raises(ValueError, match="/ip6/<ip>/tcp/<port>"):
            addrs.check_listen_addr(bad)
    with pytest.raises(ValueError):  # /p2p belongs in dial addresses only
        addrs.check_listen_addr("/ip6/::1/tcp/1/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq")


def test_an_address_is_written_in_its_own_family() -> None:
    assert addrs.ip_addr("2001:db8::7", 1) == "/ip6/2001:db8::7/tcp/1"
    assert addrs.ip_addr("::ffff:192.0.2.1", 2) == "/ip4/192.0.2.1/tcp/2"  # as a dual-stack socket reports it
    assert addrs.ip_addr("192.0.2.1", 3) == "/ip4/192.0.2.1/tcp/3"
    assert str(addrs.plain_ip("fe80::1%eth0")) == "fe80::1"


def test_a_wildcard_of_either_family_is_announced_on_this_machines_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    local = {"ip4": ["10.0.0.5", "127.0.0.1"], "ip6": ["2001:db8::5", "::1"]}
    monkeypatch.setattr(addrs, "local_ips", lambda family: local[family])
    listen = ["/ip4/0.0.0.0/tcp/7400", "/ip6/::/tcp/7400"]
    assert addrs.announce_for(listen) == ["/ip4/10.0.0.5/tcp/7400", "/ip6/2001:db8::5/tcp/7400"]
    assert addrs.on_local_ips(listen, with_loopback=True) == [
        "/ip4/10.0.0.5/tcp/7400",
        "/ip4/127.0.0.1/tcp/7400",
        "/ip6/2001:db8::5/tcp/7400",
        "/ip6/::1/tcp/7400",
    ]
    assert addrs.announce_for(["/ip6/::/tcp/0"]) == []  # the port is known only once bound
    assert addrs.announce_for(["/ip6/::1/tcp/7400"]) == []  # a specific address: libp2p's own
    local["ip6"] = ["::1"]  # no address but loopback: loopback, never ::
    assert addrs.announce_for(["/ip6/::/tcp/7400"]) == ["/ip6/::1/tcp/7400"]


def test_this_machines_ipv6_addresses_leave_out_link_local_ones() -> None:
    for ip in addrs.local_ips("ip6"):
        parsed = addrs.plain_ip(ip)
        assert parsed.version == 6 and not parsed.is_link_local


@needs_v6
def test_a_port_taken_on_ipv6_is_found_before_listening() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DialError, match="cannot listen"):
            addrs.ensure_port_free(f"/ip6/::1/tcp/{port}")


def payload() -> Payload:
    specs = (TensorSpec("w", "float32", (256, 64)),)
    return Payload(3, specs, bytes(range(256)) * (specs[0].nbytes // 256))


@pytest.mark.integration
@needs_v6
async def test_tensors_take_the_data_channel_over_ipv6_and_ipv4_on_one_port() -> None:
    received: list[bytes] = []

    async def accept(peer_id: str, got: Payload) -> None:
        received.append(bytes(got.data))

    async with (
        open_host(
            identity_seed=b"\x02" * 32, listen_addrs=["/ip6/::1/tcp/0", "/ip4/127.0.0.1/tcp/0"], announce_addrs=[]
        ) as target,
        open_host(identity_seed=b"\x01" * 32, listen_addrs=["/ip6/::1/tcp/0"], announce_addrs=[]) as over_v6,
        open_host(identity_seed=b"\x03" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as over_v4,
        trio.open_nursery() as nursery,
    ):
        channel = DataChannel("::1", "127.0.0.1")
        await nursery.start(channel.run)
        receiver = TensorReceiver(
            target, accept, authorize=any_transfer, max_payload_nbytes=1 << 20, timeout_s=10, channel=channel
        )
        receiver.register()
        by_family = {a.split("/")[1]: a for a in target.addrs()}
        await over_v6.connect(parse_dial_addr(by_family["ip6"]), timeout_s=5)
        await over_v4.connect(parse_dial_addr(by_family["ip4"]), timeout_s=5)
        assert over_v6.direct_ip(target.peer_id) == "::1"
        assert over_v4.direct_ip(target.peer_id) == "127.0.0.1"
        sent = payload()
        with trio.fail_after(30):
            await exchange.send_tensors(over_v6, target.peer_id, sent, timeout_s=10)
            await exchange.send_tensors(over_v4, target.peer_id, sent, timeout_s=10)
        assert receiver.num_direct == 2  # both over the data channel, not the libp2p stream
        assert received == [bytes(sent.data)] * 2
        nursery.cancel_scope.cancel()


@pytest.mark.integration
@needs_v6
async def test_nodes_listening_on_ipv6_only_train_together(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both pair over IPv6. Neither pairs before both workers are ready: once in a full run
    of the suite one node had no partner in the run's 3 micro rounds (suspected: the
    second's worker started more than the first's pairing bound later, so the first trained
    alone and the second joined at the end; not reproduced in 14 runs)."""
    from node.algorithms.noloco import Noloco
    from node.algorithms.noloco.pairing import Pairing

    ready_ids: set[str] = set()
    both_ready = trio.Event()
    ready_before, find = Noloco.ready, Pairing.find_partner

    def ready(self: Noloco, worker: Any) -> None:
        ready_before(self, worker)
        ready_ids.add(self.ctx.host.peer_id)
        if len(ready_ids) == 2:
            both_ready.set()

    async def held(self: Pairing, *args: Any, **kwargs: Any) -> Any:
        await both_ready.wait()
        return await find(self, *args, **kwargs)

    monkeypatch.setattr(Noloco, "ready", ready)
    monkeypatch.setattr(Pairing, "find_partner", held)
    v6 = {"network__listen": ["/ip6/::1/tcp/0"]}
    async with open_swarm(short_tmp) as swarm:
        boot = await swarm.start("boot", role="bootstrap", **v6)
        assert boot.host is not None
        (addr,) = boot.host.addrs()
        assert addr.startswith("/ip6/::1/tcp/")
        training = {**micro_noloco(3), **v6, "network__bootstrap": [addr]}
        first = await swarm.start("n0", run__new_run="v6", **training)
        assert first.run_service is not None
        second = await swarm.start("n1", run__run_id=first.run_service.state.run_id, **training)
        nodes = [first, second]
        await until(nodes, lambda: all(finished(n) for n in nodes), timeout_s=240)
        for node, other in ((first, second), (second, first)):
            assert node.host is not None and node.host.direct_ip(other.peer_id) == "::1"
            status = node.training.status() if node.training else None
            seen = None if status is None else {k: status.get(k) for k in ("rounds", "start_round", "joined_from")}
            # What each node's training did, if this fails.
            assert node.training is not None and node.training.metrics.rounds_with_partner >= 1, (
                seen,
                node.training.metrics.loss_curve if node.training else None,
            )
