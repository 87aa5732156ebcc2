"""A peer lying about dial-backs cannot make a node behind a NAT believe it is public.

The rule (``nat.Verdicts``, protocol/net/nat.py's docstring) as a pure function: verdicts in,
reachability out, times passed as numbers (no hosts, no clock). Each test fails under the
old rule, "one success makes us public".
"""

from hypothesis import given
from hypothesis import strategies as st

from protocol.net.nat import CONFIRMATIONS, MAX_VERDICTS, RECHECK_INTERVAL_S, Verdicts

BOOT = "boot"
LIAR_IP = "203.0.113.66"
HONEST_IPS = ["198.51.100.1", "198.51.100.2", "198.51.100.3", "192.0.2.7"]


def test_a_single_liar_among_honest_failing_peers_cannot_make_a_natted_node_public() -> None:
    verdicts = Verdicts()
    verdicts.add("liar", LIAR_IP, True, 0.0)  # answers first, claiming it dialed us back
    assert verdicts.reachability([BOOT], 0.0) == "unknown"  # one voice: not public
    verdicts.add(BOOT, HONEST_IPS[0], False, 1.0)
    assert verdicts.reachability([BOOT], 1.0) == "private"  # so we reserve a relay slot
    for step, ip in enumerate(HONEST_IPS[1:], start=2):
        verdicts.add(f"honest{step}", ip, False, float(step))
        verdicts.add("liar", LIAR_IP, True, float(step))  # insisting, check after check
        assert verdicts.reachability([BOOT], float(step)) == "private"


def test_a_liar_with_many_peer_ids_on_one_ip_is_still_one_voice() -> None:
    verdicts = Verdicts()
    for k in range(10):
        verdicts.add(f"sybil{k}", LIAR_IP, True, float(k))
        assert verdicts.reachability([BOOT], float(k)) == "unknown"
    verdicts.add(BOOT, HONEST_IPS[0], False, 10.0)
    assert verdicts.reachability([BOOT], 10.0) == "private"


def test_two_distinct_honest_successes_make_a_node_public_even_across_checks() -> None:
    verdicts = Verdicts()
    verdicts.add("a", HONEST_IPS[0], True, 0.0)
    assert verdicts.reachability([], 0.0) == "unknown"
    verdicts.add("b", HONEST_IPS[1], True, 30.0)  # a later check, a new peer: confirmations add up
    assert verdicts.reachability([], 30.0) == "public"
    assert CONFIRMATIONS == 2


def test_two_servers_on_one_ip_confirm_once() -> None:
    verdicts = Verdicts()
    verdicts.add("a", HONEST_IPS[0], True, 0.0)
    verdicts.add("b", HONEST_IPS[0], True, 0.0)
    assert verdicts.reachability([], 0.0) == "unknown"
    verdicts.add("c", HONEST_IPS[1], True, 1.0)
    assert verdicts.reachability([], 1.0) == "public"


def test_successes_must_outnumber_failures() -> None:
    verdicts = Verdicts()
    for server, ip, reached in [("a", 0, True), ("b", 1, True), ("c", 2, False), ("d", 3, False)]:
        verdicts.add(server, HONEST_IPS[ip], reached, 0.0)
    assert verdicts.reachability([], 0.0) == "private"  # two confirmations, but as many failures


def test_the_bootstrap_alone_makes_a_node_public_only_while_nobody_else_ever_answered() -> None:
    verdicts = Verdicts()
    verdicts.add(BOOT, "127.0.0.1", True, 0.0)
    assert verdicts.reachability([BOOT], 0.0) == "public"  # a node and its bootstrap on loopback

    stranger = Verdicts()
    stranger.add("stranger", "127.0.0.1", True, 0.0)
    assert stranger.reachability([BOOT], 0.0) == "unknown"  # a peer we did not choose is one voice

    failing = Verdicts()
    failing.add(BOOT, HONEST_IPS[0], False, 0.0)
    assert failing.reachability([BOOT], 0.0) == "private"

    seen_others = Verdicts()
    seen_others.add("stranger", HONEST_IPS[1], True, 0.0)
    later = RECHECK_INTERVAL_S + 1.0  # the stranger's verdict expired: the network is still not tiny
    seen_others.add(BOOT, HONEST_IPS[0], True, later)
    assert seen_others.reachability([BOOT], later) == "unknown"


def test_a_public_node_falls_back_when_failures_reach_successes() -> None:
    verdicts = Verdicts()
    verdicts.add("a", HONEST_IPS[0], True, 0.0)
    verdicts.add("b", HONEST_IPS[1], True, 0.0)
    assert verdicts.reachability([], 0.0) == "public"
    verdicts.add("a", HONEST_IPS[0], False, 10.0)  # the latest verdict per server counts
    assert verdicts.reachability([], 10.0) == "private"
    verdicts.add("a", HONEST_IPS[0], True, 20.0)
    assert verdicts.reachability([], 20.0) == "public"


def test_public_holds_while_successes_outnumber_failures_as_verdicts_expire() -> None:
    verdicts = Verdicts()
    verdicts.add("a", HONEST_IPS[0], True, 0.0)
    verdicts.add("b", HONEST_IPS[1], True, 0.0)
    assert verdicts.reachability([], 0.0) == "public"
    later = RECHECK_INTERVAL_S + 5.0  # the periodic recheck: only "c" answered this time
    verdicts.add("c", HONEST_IPS[2], True, later)
    assert len(verdicts) == 1  # a and b were dropped
    assert verdicts.reachability([], later) == "public"
    verdicts.add("c", HONEST_IPS[2], False, later + 1.0)
    assert verdicts.reachability([], later + 1.0) == "private"
    verdicts.add("c", HONEST_IPS[2], True, later + 2.0)
    assert verdicts.reachability([], later + 2.0) == "unknown"  # public must be earned again


def test_verdicts_older_than_the_recheck_interval_do_not_count() -> None:
    verdicts = Verdicts()
    verdicts.add("a", HONEST_IPS[0], True, 0.0)
    later = RECHECK_INTERVAL_S + 1.0
    verdicts.add("b", HONEST_IPS[1], True, later)
    assert verdicts.reachability([], later) == "unknown"

    stale = Verdicts()
    stale.add("a", HONEST_IPS[0], False, 0.0)
    assert stale.reachability([], RECHECK_INTERVAL_S) == "private"
    assert stale.reachability([], RECHECK_INTERVAL_S + 1.0) == "unknown"


def test_new_addresses_forget_the_verdicts_but_not_who_answered() -> None:
    verdicts = Verdicts()
    verdicts.add(BOOT, HONEST_IPS[0], True, 0.0)
    verdicts.add("a", HONEST_IPS[1], True, 0.0)
    assert verdicts.reachability([BOOT], 0.0) == "public"
    verdicts.forget()
    assert len(verdicts) == 0
    verdicts.add(BOOT, HONEST_IPS[0], True, 1.0)
    assert verdicts.reachability([BOOT], 1.0) == "unknown"  # "a" answered once: no bootstrap shortcut


def test_verdicts_kept_are_bounded_and_the_oldest_go_first() -> None:
    verdicts = Verdicts()
    for k in range(MAX_VERDICTS * 4):
        verdicts.add(f"s{k}", f"10.0.{k // 256}.{k % 256}", False, float(k) / 1000)
    assert len(verdicts) == MAX_VERDICTS
    verdicts.add("x", "192.0.2.1", True, 1.0)
    verdicts.add("y", "192.0.2.2", True, 1.0)
    assert verdicts.reachability([], 1.0) == "private"  # 2 confirmations, 62 failures kept


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 3), st.floats(0, RECHECK_INTERVAL_S)),
        max_size=40,
    ),
    st.booleans(),
)
def test_one_liar_on_one_ip_never_makes_a_node_behind_a_nat_public(
    steps: list[tuple[bool, int, int, float]], boot_first: bool
) -> None:
    """Whatever the order, timing and number of its peer ids, a liar on one IP facing
    honest peers that cannot dial us back (the bootstrap included) never wins."""
    verdicts = Verdicts()
    now = 0.0
    if boot_first:
        verdicts.add(BOOT, HONEST_IPS[0], False, now)
    for is_liar, peer, ip, wait_s in steps:
        now += wait_s
        if is_liar:
            verdicts.add(f"liar{peer}", LIAR_IP, True, now)
        else:
            verdicts.add(BOOT if peer == 0 else f"honest{peer}", HONEST_IPS[ip], False, now)
        assert verdicts.reachability([BOOT], now) != "public"
