"""Real daemons (libp2p hosts, DHT, GossipSub, state sync) in one process, on loopback."""

from pathlib import Path

import pytest
import trio

from node.daemon import Daemon
from protocol import wire
from protocol.errors import ProtocolError
from protocol.net import gossip
from protocol.net.host import open_host, parse_dial_addr
from protocol.net.peers import BAN_POINTS
from protocol.runstate import sync
from tests.conftest import Swarm, open_swarm, wait_until

pytestmark = pytest.mark.integration

TIMEOUT_S = 60.0


def run_id_of(daemon: Daemon) -> str:
    assert daemon.run_service is not None
    return daemon.run_service.state.run_id


def converged(daemons: list[Daemon]) -> bool:
    """Everyone holds every member, the same digest, and sees every other as live."""
    if not all(d.run_service for d in daemons):
        return False
    digests = {d.run_service.state.digest for d in daemons if d.run_service}
    return len(digests) == 1 and all(
        len(d.run_service.state.members) == len(daemons)
        and set(d.peers.live()) >= {o.peer_id for o in daemons if o is not d}
        for d in daemons
        if d.run_service
    )


async def start_run(swarm: Swarm, num_nodes: int) -> tuple[Daemon, list[Daemon]]:
    """A bootstrap node outside the run, then nodes that can only meet through the DHT."""
    boot = await swarm.start("boot", role="bootstrap")
    boot_addr = boot.host.addrs()[0] if boot.host else ""
    creator = await swarm.start("n0", network__bootstrap=[boot_addr], run__new_run="it")
    nodes = [creator]
    for i in range(1, num_nodes):
        nodes.append(await swarm.start(f"n{i}", network__bootstrap=[boot_addr], run__run_id=run_id_of(creator)))
    return boot, nodes


async def test_nodes_find_each_other_through_the_dht_and_converge(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        boot, nodes = await start_run(swarm, 4)
        assert boot.run_service is None  # the bootstrap node is in no run: only the DHT joins them
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        # Nobody knew anyone's address but the bootstrap's: first contact came from provider records.
        assert sum(len(n.discovery.found) for n in nodes if n.discovery) >= 1
        for node in nodes:
            state = node.run_service.state  # type: ignore[union-attr]
            assert state.manifest is not None and state.manifest.creator == nodes[0].peer_id
            assert set(state.members) == {n.peer_id for n in nodes}


def test_libp2p_kademlia_waits_for_a_silent_peer_as_long_as_our_own_asks_do() -> None:
    """10 s a peer in libp2p's look-ups and ADD_PROVIDERs: behind NATs, a provide took 20 s."""
    import libp2p.kad_dht.kad_dht
    import libp2p.kad_dht.peer_routing
    import libp2p.kad_dht.provider_store

    from protocol.net.host import DHT_QUERY_TIMEOUT_S

    for module in (libp2p.kad_dht.kad_dht, libp2p.kad_dht.peer_routing, libp2p.kad_dht.provider_store):
        assert module.QUERY_TIMEOUT == DHT_QUERY_TIMEOUT_S, module.__name__  # type: ignore[attr-defined]


async def test_late_joiner_gets_the_full_state(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        boot, nodes = await start_run(swarm, 3)
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        late = await swarm.start(
            "late",
            network__bootstrap=[boot.host.addrs()[0]],
            run__run_id=run_id_of(nodes[0]),  # type: ignore[union-attr]
        )
        everyone = [*nodes, late]
        await wait_until(lambda: converged(everyone), swarm.changes, timeout_s=TIMEOUT_S)
        assert late.run_service and late.run_service.state.manifest == nodes[0].run_service.state.manifest  # type: ignore[union-attr]


async def test_a_killed_node_expires_and_the_rest_carry_on(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        _, nodes = await start_run(swarm, 3)
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        victim, survivors = nodes[-1], nodes[:-1]
        swarm.kill(victim)  # no goodbye: only the TTL can tell
        await wait_until(
            lambda: all(victim.peer_id not in s.peers.live() for s in survivors), swarm.changes, timeout_s=TIMEOUT_S
        )
        # Membership is history, liveness is not: the record stays, the peer is no longer counted.
        assert all(victim.peer_id in s.run_service.state.members for s in survivors)  # type: ignore[union-attr]
        assert all(set(s.peers.live()) == {o.peer_id for o in survivors if o is not s} for s in survivors)


async def test_a_restarted_node_keeps_its_identity_and_state(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        first = await swarm.start("solo", run__new_run="restart")
        peer_id, run_id = first.peer_id, run_id_of(first)
        joined_at = first.run_service.state.members[peer_id].joined_at  # type: ignore[union-attr]
        await swarm.stop(first)
    async with open_swarm(short_tmp) as swarm:
        again = await swarm.start("solo", run__run_id=run_id)
        assert again.peer_id == peer_id
        state = again.run_service.state  # type: ignore[union-attr]
        assert state.manifest is not None and state.manifest.name == "restart"
        assert peer_id in state.members
        assert state.members[peer_id].joined_at == joined_at  # the record is updated, not replaced


async def test_bad_input_is_rejected_and_the_daemon_keeps_going(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        _, nodes = await start_run(swarm, 2)
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        target = nodes[0]
        state = target.run_service.state  # type: ignore[union-attr]
        digest, encoded = state.digest, state.encode()
        attacks = [
            wire.frame(b"\xc1garbage"),  # not msgpack
            wire.frame(wire.encode("diff", sync.VERSION, {"update": b"", "sv": b""})),  # a message out of turn
            (1 << 31).to_bytes(4, "big"),  # claims a 2 GiB frame
            wire.frame(
                wire.encode("sync", sync.VERSION, {"run": state.run_id, "sv": b"\xff\xff\xff\xff\x0f"})
            ),  # inflated sv
        ]
        async with open_host(
            identity_seed=b"\x07" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]
        ) as attacker:
            await attacker.connect(parse_dial_addr(target.host.addrs()[0]), timeout_s=5)  # type: ignore[union-attr]
            for payload in attacks:
                stream = await attacker.open_stream(target.peer_id, sync.PROTOCOL_ID, timeout_s=5)
                await stream.write(payload)
                with trio.fail_after(5), pytest.raises(ProtocolError):
                    await stream.read_exact(1)  # the target resets the stream instead of answering
            assert target.peers.penalty(attacker.peer_id) == len(attacks)
            # Another version of the protocol gets one answer naming both versions, in the
            # asker's version so it can read it; it is no misbehaviour.
            stream = await attacker.open_stream(target.peer_id, sync.PROTOCOL_ID, timeout_s=5)
            await stream.write(wire.frame(wire.encode("sync", 99, {"run": state.run_id, "sv": b""})))
            with trio.fail_after(5):
                refusal = await wire.receive(stream, msg_types=frozenset({"error"}), version=99, max_nbytes=4096)
            assert f"version {sync.VERSION}, you speak 99" in refusal["reason"]
            assert target.peers.penalty(attacker.peer_id) == len(attacks)
            # A garbage CRDT update inside a well-formed final message.
            stream = await attacker.open_stream(target.peer_id, sync.PROTOCOL_ID, timeout_s=5)
            await wire.send(stream, "sync", sync.VERSION, {"run": state.run_id, "sv": b"\x00"})
            reply = await wire.receive(stream, msg_types=frozenset({"diff"}), version=sync.VERSION, max_nbytes=1 << 20)
            assert reply["update"]
            await wire.send(stream, "diff", sync.VERSION, {"update": b"\x01\x02\x03garbage", "sv": b""})
            with trio.fail_after(5), pytest.raises(ProtocolError):
                await stream.read_exact(1)
            assert target.peers.is_banned(attacker.peer_id)
            # Banned: even a well-formed request gets no answer now (if it can still connect).
            with trio.fail_after(5), pytest.raises(ProtocolError):
                await attacker.connect(parse_dial_addr(target.host.addrs()[0]), timeout_s=5)  # type: ignore[union-attr]
                stream = await attacker.open_stream(target.peer_id, sync.PROTOCOL_ID, timeout_s=5)
                await wire.send(stream, "sync", sync.VERSION, {"run": state.run_id, "sv": b"\x00"})
                await stream.read_exact(1)
            assert target.peers.penalty(attacker.peer_id) == 0 and len(attacks) + 1 >= BAN_POINTS
        assert state.digest == digest and state.encode() == encoded
        # Still serving honest peers: a fresh node joins and converges.
        late = await swarm.start("late", run__run_id=state.run_id, network__bootstrap=[target.host.addrs()[0]])  # type: ignore[union-attr]
        await wait_until(lambda: converged([*nodes, late]), swarm.changes, timeout_s=TIMEOUT_S)


async def test_garbage_gossip_is_penalized_and_ignored(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        _, nodes = await start_run(swarm, 2)
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        target, sender = nodes
        topic = gossip.topic(run_id_of(target))
        digest = target.run_service.state.digest  # type: ignore[union-attr]
        await sender.host.publish(topic, b"\xc1not msgpack")  # type: ignore[union-attr]
        await sender.host.publish(topic, gossip.encode(gossip.Update(b"\x05junk")))  # type: ignore[union-attr]
        await wait_until(lambda: target.peers.penalty(sender.peer_id) >= 2, swarm.changes, timeout_s=TIMEOUT_S)
        assert target.run_service.state.digest == digest  # type: ignore[union-attr]


async def test_garbage_on_the_control_socket_is_refused(short_tmp: Path) -> None:
    from node import api

    async with open_swarm(short_tmp) as swarm:
        daemon = await swarm.start("solo", run__new_run="api")
        path = api.socket_path(daemon.config.data_dir)
        for payload in (b"\xff" * 64, wire.frame(b"\xc1"), wire.frame(wire.encode("rm-rf", 1, {})), b"\x00\x00"):
            stream = await trio.open_unix_socket(str(path))
            async with stream:
                await stream.send_all(payload)
                await stream.send_eof()
                reply = b""
                with trio.fail_after(15):
                    try:
                        while chunk := await stream.receive_some(4096):
                            reply += chunk
                    except trio.BrokenResourceError:
                        pass  # closed with our bytes unread: a reset
            assert b"result" not in reply  # an error answer, or none: never a result
        status = await api.call(daemon.config.data_dir, "status")
        assert status["run_id"] == run_id_of(daemon)


async def test_joining_through_a_peer_that_does_not_speak_swarmtrain_says_so(short_tmp: Path) -> None:
    """A libp2p peer that answers but serves none of our protocols is named as such: the
    user gave the address of something else."""
    from node.errors import NodeError
    from tests.conftest import node_config

    listen = ["/ip4/127.0.0.1/tcp/0"]
    async with open_host(identity_seed=b"\x09" * 32, listen_addrs=listen, announce_addrs=[]) as stranger:
        config = node_config(short_tmp / "joiner", network__bootstrap=[stranger.addrs()[0]])
        daemon = Daemon(config, run_from_bootstrap=True)
        with trio.fail_after(60):
            try:
                await daemon.run()
                raise AssertionError("the join went on")
            except BaseException as exc:  # the daemon's nursery wraps it in a group
                leaf = exc
                while isinstance(leaf, BaseExceptionGroup):
                    leaf = leaf.exceptions[0]
        assert isinstance(leaf, NodeError), repr(leaf)
        assert "does not speak swarmtrain" in str(leaf) and stranger.peer_id in str(leaf)
