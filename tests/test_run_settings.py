"""One RunSettings: defined and checked once, set from TOML or flags, carried by the
manifest to every joiner and on to the worker; a node keeps only its local settings."""

import logging
from pathlib import Path

import pytest

from node import cli, launch
from node import config as config_module
from node.errors import ConfigError
from node.simulate import NAT_SETTLE_S, SimulationOptions
from node.training import adopt
from protocol.runstate.state import Manifest
from training import settings
from training.settings import InnerConfig, OuterConfig, RunSettings, ZoConfig
from training.worker_config import WorkerConfig

RUN = dict(run_id="demo-abcdef", name="demo", creator="12D3KooW" + "A" * 44, created_at=1.7e9)
CUSTOM = RunSettings(
    algorithm="zo",
    model="micro",
    rounds=3,
    compression="int8",
    inner=InnerConfig(steps_per_round=7, lr=2e-3, batch_size=4),
    outer=OuterConfig(beta=0.5),
    zo=ZoConfig(eps=2e-3, lr=1e-3, g_max=8.0),
)


def test_a_trainer_adopts_the_runs_settings_whole(caplog: pytest.LogCaptureFixture) -> None:
    ours = RunSettings(algorithm="diloco", model="tiny")
    with caplog.at_level(logging.WARNING):
        adopted = adopt(ours, Manifest(**RUN, settings=CUSTOM.encode()))
    assert adopted == CUSTOM
    assert "algorithm 'diloco' -> 'zo'" in caplog.text and "zo.lr 0.0 -> 0.001" in caplog.text


def test_a_joiner_with_default_settings_adopts_quietly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert adopt(RunSettings(), Manifest(**RUN, settings=CUSTOM.encode())) == CUSTOM
    assert "replace ours" not in caplog.text


def test_a_run_that_trains_nothing_or_asks_the_impossible_is_not_trained() -> None:
    assert adopt(RunSettings(), Manifest(**RUN, settings=RunSettings(algorithm="none").encode())) is None
    # A manifest naming a model this node does not know (a newer release): stay on the
    # network, do not crash. The creator signed it; it is still only bytes to us.
    raw = {**CUSTOM.to_dict(), "model": "gpt-9000"}
    import msgpack

    assert adopt(RunSettings(), Manifest(**RUN, settings=msgpack.packb(raw))) is None
    for hostile in (b"", b"\xc1", b"\x91\x01", msgpack.packb({"rounds": 1 << 40}), msgpack.packb({"x": 1})):
        assert adopt(RunSettings(), Manifest(**RUN, settings=hostile)) is None


def test_settings_round_trip_through_every_carrier() -> None:
    assert settings.decode(CUSTOM.encode()) == CUSTOM
    assert settings.from_dict(CUSTOM.to_dict()) == CUSTOM
    config = WorkerConfig(run=CUSTOM)
    assert WorkerConfig.from_json(config.to_json()) == config
    # CRDT documents hand back whole floats for ints: accepted as the int they are.
    assert settings.from_dict({"rounds": 3.0}).rounds == 3


def test_a_manifest_without_a_newer_setting_means_what_its_release_did() -> None:
    """``spes.prefer_owned`` came after manifests without it: there it means 0 (off), as
    the release that wrote them routed; a user's file or flags without it get the default."""
    import msgpack

    data = RunSettings(algorithm="spes", model="tiny-moe").to_dict()
    del data["spes"]["prefer_owned"]
    assert settings.decode(msgpack.packb(data)).spes.prefer_owned == 0.0
    assert settings.from_dict(data).spes.prefer_owned == RunSettings().spes.prefer_owned > 0
    del data["spes"]  # a whole table missing: its newer settings too
    assert settings.decode(msgpack.packb(data)).spes.prefer_owned == 0.0
    assert settings.decode(msgpack.packb(data)).spes.merge_alpha == RunSettings().spes.merge_alpha
    assert settings.decode(RunSettings().encode()) == RunSettings()  # present: as written
    # zo.signs: version 2 became the default after runs had been made with version 1 and
    # manifests without the setting; theirs must replay with the generator they trained with
    data = RunSettings(algorithm="zo").to_dict()
    del data["zo"]["signs"]
    assert settings.decode(msgpack.packb(data)).zo.signs == 1
    assert settings.from_dict(data).zo.signs == RunSettings().zo.signs == 2


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"algorithm": "allreduce"}, "algorithm"),
        ({"rounds": -1}, "rounds"),
        ({"rounds": (1 << 30) + 1}, "rounds"),
        ({"rounds": 1.5}, "rounds"),
        ({"rounds": True}, "rounds"),
        ({"inner": {"lr": float("nan")}}, "inner.lr"),
        ({"inner": {"steps_per_round": "5"}}, "inner.steps_per_round"),
        ({"outer": {"beta": 3.0}}, "outer.beta"),
        ({"outer": {"delta": 1.0}}, "outer.delta"),
        ({"zo": {"g_max": 0.0}}, "zo.g_max"),
        ({"zo": {"signs": 5}}, "zo.signs"),
        ({"spes": {"prefer_owned": -0.1}}, "spes.prefer_owned"),
        ({"spes": {"prefer_owned": 1.5}}, "spes.prefer_owned"),
        ({"zo": 5}, "zo"),
        ({"model": "x" * 1000}, "model"),
        ({"learning_rate": 1.0}, "learning_rate"),
        ({"rounds": 10**400}, "rounds"),
        ({"inner": {"lr": 10**400}}, "inner.lr"),
    ],
)
def test_a_bad_setting_is_named(data: dict[str, object], named: str) -> None:
    with pytest.raises(settings.SettingsError) as info:
        settings.from_dict(data)
    assert str(info.value).startswith(named)


def test_toml_and_flags_reach_the_run_settings(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('[run]\nnew_run = "demo"\n[run.settings]\nalgorithm = "zo"\n[run.settings.zo]\nlr = 1e-3\n')
    args = cli.build_parser().parse_args(
        ["node", "--config", str(toml), "--rounds", "7", "--inner-steps", "3", "--set", "outer.gamma=0.25"]
    )
    config = launch.node_config(args)
    assert config.run.settings == RunSettings(
        algorithm="zo",
        rounds=7,
        inner=InnerConfig(steps_per_round=3),
        outer=OuterConfig(gamma=0.25),
        zo=ZoConfig(lr=1e-3),
    )
    with pytest.raises(ConfigError, match=r"run\.settings\.zo\.lr"):
        config_module.load(None, {"run.settings.zo.lr": -1.0})
    for bad, named in (("outer.beta", "NAME=VALUE"), ("outer.bta=1", "outer.bta"), ("rounds=many", "rounds")):
        with pytest.raises(ConfigError, match=named):
            launch.node_config(cli.build_parser().parse_args(["node", "--set", bad]))


def test_a_run_started_with_node_trains_until_stopped_unless_given_a_budget() -> None:
    """A node that starts a run cannot know how long its friends need: no budget unless it
    is given one (every trainer stops before ``round_limit``); simulate keeps a short one."""
    until_stopped = launch.node_config(cli.build_parser().parse_args(["node", "--new-run", "duo"])).run.settings
    assert until_stopped.rounds == 0 and until_stopped.round_limit == settings.MAX_ROUNDS
    budget = launch.node_config(cli.build_parser().parse_args(["node", "--new-run", "duo", "--rounds", "30"]))
    assert budget.run.settings.rounds == budget.run.settings.round_limit == 30
    assert settings.decode(until_stopped.encode()) == until_stopped  # a manifest says so to every joiner
    simulated = cli._simulated_settings(cli.build_parser().parse_args(["simulate"]))
    assert simulated.rounds == simulated.round_limit == 10
    no_budget = cli._simulated_settings(cli.build_parser().parse_args(["simulate", "--rounds", "0"]))
    with pytest.raises(ConfigError, match="--rounds"):
        SimulationOptions(settings=no_budget)


def test_simulate_hands_every_setting_to_the_run_creator() -> None:
    args = cli.build_parser().parse_args(
        ["simulate", "--algorithm", "zo", "--set", "zo.eps=0.002", "--set", "inner.batch_size=4"]
    )
    options = SimulationOptions(settings=cli._simulated_settings(args))
    assert options.settings.zo.eps == 0.002 and options.settings.inner.batch_size == 4
    node_args = cli.build_parser().parse_args(["node", *options.run_flags()])
    assert launch.node_config(node_args).run.settings == options.settings


def test_simulate_caps_every_trainers_uploads_with_link_mbps() -> None:
    args = cli.build_parser().parse_args(["simulate", "--link-mbps", "100"])
    options = SimulationOptions(settings=cli._simulated_settings(args), link_mbps=args.link_mbps)
    node_args = cli.build_parser().parse_args(["node", *options.run_flags(), *options.training_flags(0)])
    assert launch.node_config(node_args).network.upload_limit_mbps == 100.0
    uncapped = SimulationOptions(settings=cli._simulated_settings(args))
    assert "--upload-limit-mbps" not in uncapped.training_flags(0)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="--link-mbps"):
            SimulationOptions(link_mbps=bad)


def test_simulate_takes_how_long_a_relayed_pair_may_settle() -> None:
    args = cli.build_parser().parse_args(["simulate", "--topology", "nat", "--nat-settle-s", "30"])
    assert args.nat_settle_s == 30.0
    assert cli.build_parser().parse_args(["simulate"]).nat_settle_s == NAT_SETTLE_S
    assert SimulationOptions(topology="nat", nat_settle_s=args.nat_settle_s).nat_settle_s == 30.0
    for bad in (-1.0, float("nan"), 1e9):
        with pytest.raises(ConfigError, match="--nat-settle-s"):
            SimulationOptions(topology="nat", nat_settle_s=bad)
    with pytest.raises(ConfigError, match="--nat-settle-s"):
        SimulationOptions(nat_settle_s=30.0)  # loopback: no NATs to settle
