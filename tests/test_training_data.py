"""Corpus, tokenizer, shards and the model's shapes: everything the worker feeds on."""

from pathlib import Path

import pytest
import torch

from training import corpus, data
from training.models import GPT, GPTConfig, preset


def test_embedded_corpus_is_deterministic_and_round_trips() -> None:
    text = corpus.embedded_corpus()
    assert len(text) > 400_000
    assert text == corpus.embedded_corpus()
    tokens = data.encode(text[:1000])
    assert data.decode(tokens) == text[:1000].decode()


def test_user_folder_is_read_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.md").write_text("first")
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    assert corpus.read_corpus(tmp_path) == b"first\n\nsecond"
    with pytest.raises(ValueError, match="does not exist"):
        corpus.read_corpus(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \.txt, \.md, \.jsonl files"):
        corpus.read_corpus(tmp_path / "empty")


def test_jsonl_documents_are_read_by_their_text_field_and_bad_lines_named(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    lines = ['{"text": "one", "id": 1}', "", '{"text": "two"}']
    (tmp_path / "docs" / "a.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "docs" / "b.txt").write_text("three")
    assert corpus.read_corpus(tmp_path / "docs") == b"one\n\ntwo\n\nthree"
    assert corpus.corpus_sha256(tmp_path / "docs") == corpus.corpus_sha256(tmp_path / "docs")
    before = corpus.corpus_sha256(tmp_path / "docs")
    (tmp_path / "docs" / "b.txt").write_text("three!")
    assert corpus.corpus_sha256(tmp_path / "docs") != before  # a changed file is other data
    for bad, why in (('{"text": 3}', 'string "text"'), ("[1, 2]", 'string "text"'), ("{not json", "not JSON")):
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + bad + "\n")
        with pytest.raises(corpus.CorpusError, match=f"bad.jsonl:2: .*{why}"):
            corpus.read_corpus(tmp_path / "bad.jsonl")


def test_shards_are_disjoint_cover_the_training_blocks_and_share_validation() -> None:
    tokens = torch.arange(10_000)  # every block starts with a different value: blocks are identifiable
    shards = [data.make_shard(tokens, context_len=15, node_index=i, num_nodes=3) for i in range(3)]
    assert all(torch.equal(s.val, shards[0].val) for s in shards)
    num_blocks = 10_000 // 16
    starts = [int(row[0]) for s in shards for row in s.train]
    assert len(starts) == len(set(starts)) == num_blocks - len(shards[0].val)  # disjoint, and all of them
    assert set(starts).isdisjoint(int(row[0]) for row in shards[0].val)  # validation never trains


def test_batches_are_reproducible_and_shifted() -> None:
    shard = data.make_shard(data.encode(corpus.embedded_corpus()), context_len=32, node_index=1, num_nodes=4)
    x1, y1 = shard.batch(batch_size=4, seed=1, step=7)
    x2, y2 = shard.batch(batch_size=4, seed=1, step=7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (4, 32) and torch.equal(x1[:, 1:], y1[:, :-1])
    x3, _ = shard.batch(batch_size=4, seed=1, step=8)
    assert not torch.equal(x1, x3)


def test_too_little_text_for_the_nodes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="too few for 8 nodes"):
        data.make_shard(torch.zeros(100, dtype=torch.long), context_len=15, node_index=0, num_nodes=8)


def test_tiny_model_has_a_few_million_parameters_and_learns_a_batch() -> None:
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    assert 1_000_000 < model.num_params() < 10_000_000
    tokens = torch.randint(0, 256, (2, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model.loss(tokens[:, :-1], tokens[:, 1:]).item()
    for _ in range(20):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first == pytest.approx(5.55, abs=0.2)  # ln(256): an untrained model guesses uniformly
    assert loss.item() < first / 2


def test_model_config_is_validated() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(embed_dim=30, num_heads=4)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt-9000")
    with pytest.raises(ValueError, match="exceeds the context"):
        GPT(GPTConfig(context_len=8, num_layers=1, embed_dim=16, num_heads=2))(torch.zeros(1, 9, dtype=torch.long))


def test_torch_free_preset_list_matches_the_models() -> None:
    from training.models import PRESETS
    from training.settings import MODEL_PRESETS

    assert set(MODEL_PRESETS) == set(PRESETS)


def test_a_hugging_face_dataset_saved_to_disk_is_read_by_its_text_column(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="datasets is in the optional extra .[hf]")
    datasets.Dataset.from_dict({"text": ["first row", "", "second row"], "id": [1, 2, 3]}).save_to_disk(
        str(tmp_path / "plain")
    )
    assert corpus.read_corpus(tmp_path / "plain") == b"first row\n\nsecond row"  # empty rows skipped
    splits = {"test": ["held out"], "train": ["trained on"]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "dict")
    )
    assert corpus.read_corpus(tmp_path / "dict") == b"trained on"  # the train split
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "no-text"))
    with pytest.raises(corpus.CorpusError, match='no "text" column'):
        corpus.read_corpus(tmp_path / "no-text")
