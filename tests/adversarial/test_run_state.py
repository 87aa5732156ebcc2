"""A hostile member against the replicated run state, between real daemons on loopback.

The attacker is one of the run's own daemons whose host we make publish crafted bytes, as
a modified build would. Each test failed on the main before issue 12: records were
unsigned (forged and deleted at will), a crafted update crashed pycrdt in every receiver,
and thousands of made-up members blocked joins.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from pycrdt import Doc, Map

from node.daemon import Daemon
from protocol import keys
from protocol.net import gossip
from protocol.runstate.state import MAX_MEMBERS, MemberRecord, RunState, sign_member
from tests.conftest import Swarm, open_swarm, wait_until
from tests.test_integration import converged, run_id_of, start_run

pytestmark = pytest.mark.integration
TIMEOUT_S = 60.0
RESEND_S = 3.0
VECTORS = Path(__file__).parent.parent / "vectors" / "crdt_hostile_v1.json"


def state_of(daemon: Daemon) -> RunState:
    assert daemon.run_service is not None
    return daemon.run_service.state


async def publish(attacker: Daemon, payload: gossip.GossipPayload) -> None:
    assert attacker.host is not None
    await attacker.host.publish(gossip.topic(run_id_of(attacker)), gossip.encode(payload))


def crafted(base: RunState, write: Any) -> bytes:
    """An update written by hand on top of ``base``'s document."""
    doc: Doc[Any] = Doc()
    doc.apply_update(base.encode())
    before = doc.get_state()
    write(doc)
    return bytes(doc.get_update(before))


async def until_judged(swarm: Swarm, victims: list[Daemon], attacker: Daemon, send: Any) -> None:
    """Send until every victim penalized or banned the attacker (gossip may drop a message:
    it is resent every few seconds, never more than the bound)."""

    def judged() -> bool:
        return all(v.peers.penalty(attacker.peer_id) > 0 or v.peers.is_banned(attacker.peer_id) for v in victims)

    with trio.fail_after(TIMEOUT_S):
        while not judged():
            await send()
            with trio.move_on_after(RESEND_S):
                await wait_until(judged, swarm.changes, timeout_s=TIMEOUT_S)


async def test_a_forged_record_is_refused_and_its_sender_penalized(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        _, nodes = await start_run(swarm, 3)
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        *victims, attacker = nodes
        target = victims[0].peer_id
        record = state_of(attacker).members[target]
        forged = {**vars_of(record), "addrs": ["/ip4/6.6.6.6/tcp/6666"], "seq": record.seq + 1}
        update = crafted(state_of(attacker), lambda d: d.get("members", type=Map).__setitem__(target, forged))
        digests = {v.peer_id: state_of(v).digest for v in victims}
        await until_judged(swarm, victims, attacker, lambda: publish(attacker, gossip.Update(update)))
        for victim in victims:
            assert state_of(victim).members[target] == record
            assert state_of(victim).digest == digests[victim.peer_id]


async def test_a_deleted_record_stays_in_the_view_and_is_written_back(short_tmp: Path) -> None:
    async with open_swarm(short_tmp) as swarm:
        boot, nodes = await start_run(swarm, 3)
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        *victims, attacker = nodes
        target = victims[1].peer_id
        update = crafted(state_of(attacker), lambda d: d.get("members", type=Map).pop(target))
        state_of(attacker).apply_remote(update)  # the attacker's own document serves the delete too
        await publish(attacker, gossip.Update(update))
        for victim in victims:
            assert target in state_of(victim).members  # the view never loses it
        # Upkeep writes it back; a newcomer pulling from anyone, the attacker included, sees it.
        assert boot.host is not None
        late = await swarm.start("late", run__run_id=run_id_of(attacker), network__bootstrap=[boot.host.addrs()[0]])
        await wait_until(lambda: target in state_of(late).members, swarm.changes, timeout_s=TIMEOUT_S)
        assert all(v.peers.penalty(o.peer_id) == 0 for v in victims for o in victims)  # no honest blame


async def test_updates_that_crashed_pycrdt_crash_nobody(short_tmp: Path) -> None:
    cases = json.loads(VECTORS.read_text())["cases"]
    segfaults = [c["updates"][-1] for c in cases if "SIGSEGV" in c["what"] or "signal 11" in c["what"]]
    assert segfaults
    async with open_swarm(short_tmp) as swarm:
        _, nodes = await start_run(swarm, 4)
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        *victims, attacker = nodes

        async def send_all() -> None:
            for update in segfaults:
                await publish(attacker, gossip.Update(bytes.fromhex(update)))

        await until_judged(swarm, victims, attacker, send_all)
        # Everyone is alive, and a change made now still reaches every other victim.
        assert victims[0].run_service is not None and victims[0].host is not None
        await victims[0].run_service.push(
            state_of(victims[0]).put_member(victims[0]._member_record(victims[0].host, state_of(victims[0])))
        )
        mine = state_of(victims[0]).members[victims[0].peer_id]
        await wait_until(
            lambda: all(state_of(v).members.get(victims[0].peer_id) == mine for v in victims),
            swarm.changes,
            timeout_s=TIMEOUT_S,
        )


async def test_thousands_of_made_up_members_neither_block_joins_nor_turn_honest_nodes_on_each_other(
    short_tmp: Path,
) -> None:
    async with open_swarm(short_tmp) as swarm:
        boot, nodes = await start_run(swarm, 3)
        await wait_until(lambda: converged(nodes), swarm.changes, timeout_s=TIMEOUT_S)
        *honest, attacker = nodes
        run_id = run_id_of(attacker)
        fakes = []
        for i in range(MAX_MEMBERS + 1000):  # valid records: keys are free
            seed = (i + 1).to_bytes(4, "big") * 8
            record = MemberRecord(keys.peer_id_of(seed), ("/ip4/10.255.0.1/tcp/9",), "trainer", "cpu", 1, 1.7e9, 1)
            fakes.append(vars_of(sign_member(record, seed, run_id)))

        def fill(doc: Doc[Any]) -> None:
            members = doc.get("members", type=Map)
            with doc.transaction():
                for fake in fakes:
                    members[fake["peer_id"]] = fake

        state_of(attacker).apply_remote(crafted(state_of(attacker), fill))  # honest peers pull it from here
        await wait_until(
            lambda: (
                all(len(state_of(h).members) <= MAX_MEMBERS + len(nodes) for h in honest)
                and any(len(state_of(h).members) > len(nodes) for h in honest)
            ),
            swarm.changes,
            timeout_s=TIMEOUT_S,
        )
        assert boot.host is not None
        late = await swarm.start("late", run__run_id=run_id, network__bootstrap=[boot.host.addrs()[0]])
        everyone = [*honest, late]
        await wait_until(
            lambda: all({o.peer_id for o in everyone} <= state_of(d).members.keys() for d in everyone),
            swarm.changes,
            timeout_s=TIMEOUT_S,
        )
        assert all(
            d.peers.penalty(o.peer_id) == 0 and not d.peers.is_banned(o.peer_id) for d in everyone for o in everyone
        )


def vars_of(record: MemberRecord) -> dict[str, Any]:
    return {
        "peer_id": record.peer_id,
        "addrs": list(record.addrs),
        "role": record.role,
        "device": record.device,
        "memory_nbytes": record.memory_nbytes,
        "joined_at": record.joined_at,
        "seq": record.seq,
        "sig": record.sig,
    }
