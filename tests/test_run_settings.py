"""The run manifest decides what every trainer trains; a node keeps only its local settings."""

import logging

import pytest

from node.config import TrainingConfig
from node.training import RUN_SETTINGS, adopt
from protocol.state import Manifest

RUN = dict(run_id="demo-abcdef", name="demo", creator="12D3KooW" + "A" * 44, created_at=1.7e9)


def test_a_trainer_adopts_the_runs_settings_and_keeps_its_own_shard(caplog: pytest.LogCaptureFixture) -> None:
    manifest = Manifest(**RUN, algorithm="noloco", model="micro", steps_per_round=7, rounds=3, compression="int8")
    ours = TrainingConfig(algorithm="diloco", model="tiny", shard_index=2, num_shards=4, threads=2)
    with caplog.at_level(logging.WARNING):
        config = adopt(ours, manifest)
    assert config is not None
    assert {n: getattr(config, n) for n in RUN_SETTINGS} == {n: getattr(manifest, n) for n in RUN_SETTINGS}
    assert (config.shard_index, config.num_shards, config.threads) == (2, 4, 2)
    assert "algorithm 'diloco' -> 'noloco'" in caplog.text and "model 'tiny' -> 'micro'" in caplog.text


def test_a_run_that_trains_nothing_or_asks_the_impossible_is_not_trained() -> None:
    assert adopt(TrainingConfig(algorithm="noloco"), Manifest(**RUN, algorithm="none")) is None
    # A manifest naming a model this node does not know: stay on the network, do not crash.
    assert adopt(TrainingConfig(), Manifest(**RUN, algorithm="noloco", model="gpt-9000")) is None
