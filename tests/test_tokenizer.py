"""Runs with a BPE tokenizer: every node trains the same one on the run's text, the model's
vocabulary is the tokenizer's, and the export carries it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.training import tokenizer_for_run
from tests.adversarial.harness import finished, micro_noloco, start_trainers, until
from tests.conftest import open_swarm
from training import corpus, tokenizer
from training.settings import RunSettings, SettingsError
from training.tokenizer import Codec, TokenizerError, bpe_vocab

TRAIN_IN_A_CHILD = (
    "from training import corpus, tokenizer; "
    "print(tokenizer.sha256(tokenizer.train_bpe(corpus.embedded_corpus(), 600)))"
)


def test_the_setting_is_bytes_or_bpe_of_a_bounded_size() -> None:
    assert bpe_vocab("bytes") is None and bpe_vocab("bpe-4096") == 4096
    for bad in ("bpe-12", "bpe-70000", "bpe", "wordpiece", "bpe-4096 "):
        with pytest.raises(TokenizerError):
            bpe_vocab(bad)
    with pytest.raises(SettingsError, match="tokenizer"):
        RunSettings(tokenizer="bpe-1")


def test_every_process_trains_the_same_tokenizer_and_it_round_trips_text() -> None:
    hashes = {
        subprocess.run([sys.executable, "-c", TRAIN_IN_A_CHILD], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    ours = tokenizer.train_bpe(corpus.embedded_corpus(), 600)
    assert hashes == {tokenizer.sha256(ours) + "\n"}  # the same in other processes: nodes agree
    codec = Codec(ours)
    assert codec.vocab_size == 600
    text = "A document.\n\nAnother one: ça marche, 東京, tabs\tand all."
    ids = codec.encode(text.encode())
    assert len(ids) < len(text.encode()) and max(ids) < 600
    assert codec.decode(ids) == text
    assert Codec().encode(b"ab") == [97, 98] and Codec().decode([97, 98]) == "ab"


def test_a_node_whose_tokenizer_is_not_the_runs_does_not_train(tmp_path: Path) -> None:
    run = RunSettings(tokenizer="bpe-600", tokenizer_sha256="a" * 64)
    path, why = tokenizer_for_run(run, None, tmp_path / "run.tokenizer.json")
    assert path is None and why is not None and "is not the run's" in why
    fine = RunSettings(tokenizer="bpe-600")  # the creator's own (no hash to meet yet)
    path, why = tokenizer_for_run(fine, None, tmp_path / "run.tokenizer.json")
    assert why is None and path is not None and Codec.load(path).vocab_size == 600
    assert tokenizer_for_run(RunSettings(), None, tmp_path / "other.json") == (None, None)  # bytes


@pytest.mark.integration
async def test_a_bpe_run_trains_with_the_same_tokenizer_everywhere_and_exports_it(short_tmp: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the optional extra .[hf]")
    from node.cli import main

    settings = {**micro_noloco(2), "run__settings__tokenizer": "bpe-600"}
    async with open_swarm(short_tmp) as swarm:
        nodes = await start_trainers(swarm, 2, settings, run_name="bpe")
        await until(nodes, lambda: all(finished(n) for n in nodes), timeout_s=240)
        creator = nodes[0]
        assert creator.run_service is not None and creator.run_service.state.manifest is not None
        run_id = creator.run_service.state.run_id
        from training import settings as run_settings

        recorded = run_settings.decode(creator.run_service.state.manifest.settings).tokenizer_sha256
        files = [n.data_dir.tokenizer_file(run_id) for n in nodes]
        assert {tokenizer.sha256(f.read_text()) for f in files} == {recorded}  # one tokenizer, trained twice
        for node in nodes:
            assert node.training is not None and node.training.algorithm is not None
            assert node.training.algorithm.ctx.worker_config.model_overrides == {"vocab_size": 600}
    out = short_tmp / "model"
    assert main(["export", "--data-dir", str(creator.data_dir.path), "--out", str(out)]) == 0
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads(files[0].read_text())
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 600
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "The swarm trains."
    assert loaded(text)["input_ids"] == Codec.load(files[0]).encode(text.encode())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    from training.export import load_trained

    ours = load_trained(creator.data_dir.checkpoint_file(run_id)).model
    ids = torch.tensor([Codec.load(files[0]).encode(text.encode())])
    with torch.no_grad():
        assert float((model(ids).logits - ours(ids)).abs().max()) <= 1e-4
