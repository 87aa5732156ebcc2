"""A run on the user's own text: its hash in the manifest, trainers with the same files
train, one with other files stays on the network without training and says why."""

from pathlib import Path

import pytest

from node.daemon import Daemon
from node.errors import ConfigError
from node.training import data_for_run
from tests.adversarial.harness import finished, micro_noloco, until
from tests.conftest import node_config, open_swarm
from tests.forked_workers import start_together
from training import corpus, settings
from training.settings import RunSettings

ROUNDS = 3
TRAINING = micro_noloco(ROUNDS)
TIMEOUT_S = 240.0


def write_texts(folder: Path, words: str) -> Path:
    folder.mkdir(parents=True)
    for i in range(4):  # enough blocks for the micro model's shards (4 kB a file)
        (folder / f"part{i}.txt").write_text(f"{words} {i}. " * 300)
    (folder / "more.jsonl").write_text('{"text": "a document of the run"}\n')
    return folder


def test_the_data_a_node_trains_on_follows_the_run() -> None:
    ours = "a" * 64
    embedded, theirs = RunSettings(), RunSettings(data_sha256=ours)
    assert data_for_run(embedded, None, "") == (None, None)
    assert data_for_run(embedded, "/texts", ours) == (None, None)  # the run's corpus wins (a warning)
    assert data_for_run(theirs, "/texts", ours) == ("/texts", None)
    path, why = data_for_run(theirs, None, "")
    assert path is None and why is not None and "--data" in why
    path, why = data_for_run(theirs, "/other", "b" * 64)
    assert path is None and why is not None and "not the run's data" in why
    with pytest.raises(settings.SettingsError, match="data_sha256"):
        RunSettings(data_sha256="not a hash")


def test_data_that_cannot_be_read_is_refused_before_the_network_starts(tmp_path: Path) -> None:
    daemon = Daemon(node_config(tmp_path / "n", training__data=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="does not exist"):
        daemon.prepare()


@pytest.mark.integration
async def test_trainers_with_the_runs_files_train_on_them_and_others_do_not(short_tmp: Path) -> None:
    texts = write_texts(short_tmp / "texts", "the run's own words")
    copy = write_texts(short_tmp / "copy", "the run's own words")  # another node's copy: same bytes
    other = write_texts(short_tmp / "other", "different words")
    async with open_swarm(short_tmp) as swarm:
        boot = await swarm.start("boot", role="bootstrap")
        assert boot.host is not None
        addr = boot.host.addrs()[0]
        start_together(2)  # the creator's and the joiner's workers (the outsider trains nothing)
        creator = await swarm.start(
            "creator", network__bootstrap=[addr], run__new_run="data", training__data=str(texts), **TRAINING
        )
        assert creator.run_service is not None
        run_id = creator.run_service.state.run_id
        joining = {"network__bootstrap": [addr], "run__run_id": run_id, **TRAINING}
        joiner = await swarm.start("joiner", training__data=str(copy), **joining)
        outsider = await swarm.start("outsider", training__data=str(other), **joining)
        nodes = [creator, joiner]
        await until(nodes, lambda: all(finished(n) for n in nodes), timeout_s=TIMEOUT_S)
        manifest = creator.run_service.state.manifest
        assert manifest is not None
        assert settings.decode(manifest.settings).data_sha256 == corpus.corpus_sha256(texts)
        for node, data in ((creator, texts), (joiner, copy)):
            assert node.training is not None and node.training.algorithm is not None
            assert node.training.algorithm.ctx.worker_config.data_path == str(data.resolve())
            assert node.training.metrics.rounds_with_partner >= 1  # they trained together
        # The outsider decides once it has the run's manifest: the trainers, whose workers
        # now start in a fraction of a second, can finish before that (seen once in CI).
        outsider_training = outsider.training
        assert outsider_training is not None
        await until([outsider], lambda: outsider_training.refusal is not None, timeout_s=TIMEOUT_S)
        assert outsider_training.algorithm is None
        assert outsider_training.refusal is not None and "not the run's data" in outsider_training.refusal
        assert outsider.status()["not_training"] == outsider.training.refusal
