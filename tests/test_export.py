"""A trained model out of a node's checkpoint: transformers loads it and computes our logits."""

import json
import os
from pathlib import Path

import pytest
import torch

from node.cli import main
from training import saver
from training.export import _bytes_to_unicode, load_trained, sample
from training.settings import RunSettings
from training.worker import build_trainer
from training.worker_config import WorkerConfig

RUN_ID = "demo-1a2b3c"


def trained_checkpoint(data_dir: Path, *, model: str = "micro", algorithm: str = "noloco") -> Path:
    """A checkpoint as a worker writes it after a round of training, where a node keeps it."""
    path = data_dir / "runs" / f"{RUN_ID}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    run = RunSettings(algorithm=algorithm, model=model, rounds=2).with_values({"inner.steps_per_round": 3})
    config = WorkerConfig(run=run, checkpoint_path=str(path))
    trainer = build_trainer(config)
    trainer.inner_steps()
    trainer.apply_noloco(None)  # a round with no partner: φ moves to the trained weights
    tensors, meta = trainer.state()
    assert saver.write(path, tensors, {**meta, "fingerprint": config.fingerprint()}) is None
    return path


def test_the_byte_alphabet_is_gpt2s() -> None:
    alphabet = _bytes_to_unicode()
    assert len(set(alphabet.values())) == 256
    assert alphabet[ord("A")] == "A" and alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"


def test_transformers_loads_the_export_and_computes_our_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the optional extra .[hf]")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trained_checkpoint(tmp_path)
    out = tmp_path / "model"
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out)]) == 0
    ours = load_trained(tmp_path / "runs" / f"{RUN_ID}.ckpt").model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "Peer to peer: 'ça marche', 東京\n\ttabs & bytes!"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode())  # token id = byte
    assert tokenizer.decode(ids) == text
    tokens = torch.tensor([ids[: ours.config.context_len]])
    with torch.no_grad():
        expected = ours(tokens)
        got = theirs(tokens).logits
    # float32 both ways, the same operations (0.0 apart on the development machine; another
    # CPU or torch may order a sum differently, a few ulp of logits of size ~1: far below 1e-4).
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) <= 1e-4
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu"


def test_sample_continues_a_prompt_the_same_way_for_the_same_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trained_checkpoint(tmp_path)
    args = ["sample", "--data-dir", str(tmp_path), "--prompt", "The ", "--tokens", "40", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("The ") and len(first.encode()) >= 40
    model = load_trained(tmp_path / "runs" / f"{RUN_ID}.ckpt").model
    greedy = sample(model, "ab", max_new_tokens=5, temperature=0.0, top_k=0, seed=0)
    assert greedy == sample(model, "ab", max_new_tokens=5, temperature=0.0, top_k=0, seed=99)


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("none", [], "no training checkpoint in"),
        ("none", ["--run", "other-abcdef"], "no training checkpoint of run other-abcdef"),
        ("moe", [], "mixture of experts"),
        ("garbage", [], "cannot read"),
    ],
)
def test_what_cannot_be_exported_says_why_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, args: list[str], message: str
) -> None:
    if setup == "moe":
        trained_checkpoint(tmp_path, model="micro-moe", algorithm="noloco")
    elif setup == "garbage":
        (tmp_path / "runs").mkdir()
        (tmp_path / "runs" / f"{RUN_ID}.ckpt").write_bytes(b"not a checkpoint")
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out"), *args]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.integration
async def test_export_average_writes_the_mean_of_the_live_trainers_weights(short_tmp: Path) -> None:
    """`export --average` asks the running node to fetch its peers' states (hashed as they
    arrive) and writes the mean of theirs and ours, each replica's loss beside it."""
    import subprocess
    import sys

    import trio
    from safetensors.torch import load_file

    from tests.adversarial.harness import finished, micro_noloco, start_trainers, until
    from tests.conftest import open_swarm
    from training import checkpoint

    training = micro_noloco(3)
    async with open_swarm(short_tmp) as swarm:
        nodes = await start_trainers(swarm, 3, training, run_name="avg")
        await until(nodes, lambda: all(finished(n) for n in nodes), timeout_s=240)
        ours = nodes[0]
        out = short_tmp / "swarm-model"
        args = ["export", "--average", "--data-dir", str(ours.data_dir.path), "--out", str(out)]
        done = await trio.run_process(
            [sys.executable, "-m", "node", *args], capture_stdout=True, stderr=subprocess.STDOUT
        )
        text = done.stdout.decode()
        assert "the mean of 3" in text and text.count("val loss") == 4, text
        run_id = ours.run_service.state.run_id if ours.run_service else ""
        states = [ours.data_dir.checkpoint_file(run_id)]
        states += sorted((ours.data_dir.path / "exports" / "peers").glob("*.ckpt"))
        assert len(states) == 3 and {p.stem for p in states[1:]} == {n.peer_id for n in nodes[1:]}
        embeddings = [checkpoint.load(p)[0]["phi.0"] for p in states]  # φ.0: the token embedding
        exported = load_file(str(out / "model.safetensors"))["transformer.wte.weight"]
        # The float32 mean of 3 values of size < 1 in the same order: at most a few ulp (1e-7) apart.
        assert torch.allclose(exported, torch.stack(embeddings).mean(dim=0), rtol=0, atol=1e-6)


def test_the_newest_run_is_found_by_its_own_checkpoint_not_the_states_it_offers(tmp_path: Path) -> None:
    import os

    from node.export import find_checkpoint

    runs = tmp_path / "runs"
    runs.mkdir()
    for name, mtime in (("old-aaaaaa.ckpt", 1), ("new-bbbbbb.ckpt", 2), ("new-bbbbbb.state-3.ckpt", 3)):
        (runs / name).write_bytes(b"x")
        os.utime(runs / name, (mtime, mtime))
    assert find_checkpoint(tmp_path, None) == ("new-bbbbbb", runs / "new-bbbbbb.ckpt")
