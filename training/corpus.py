"""The text a run trains on, as bytes, and its hash: no torch (the daemon hashes it too).

- The default corpus is Python's own documentation topics (``pydoc_data``, ≈465 kB,
  shipped with every CPython): no download, identical on every machine.
- A user's data (``--data PATH``): a file, or a folder whose ``.txt``, ``.md`` and
  ``.jsonl`` files are read in sorted order of their paths (every node builds the same
  byte stream from the same files). A ``.jsonl`` file holds one JSON object per line with
  a string ``text`` (other fields are ignored, blank lines skipped): each text is a
  document. Documents and files are joined by a blank line.
- A Hugging Face ``datasets`` dataset saved to disk (``save_to_disk``: a folder with
  ``state.json`` or ``dataset_dict.json``) is read by ``datasets`` (the ``hf`` extra): its
  ``text`` column (a dataset dict: its ``train`` split, else its first), one document a row.
- ``corpus_sha256``: the SHA-256 of those bytes. A run started with ``--data`` writes it
  into its settings (``data_sha256``), and a node trains in that run only with data that
  hashes the same: peers know they train on the same thing.
"""

import hashlib
import json
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"
# Refuse to read more than this from user paths: a mistaken `/` should fail, not fill memory.
MAX_CORPUS_NBYTES = 1 << 30
SEPARATOR = b"\n\n"


class CorpusError(ValueError):
    """The data cannot be read as a corpus (the message names the file and why)."""


def embedded_corpus() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode()


def _jsonl_texts(path: Path) -> bytes:
    texts = []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise CorpusError(f"{path}:{number}: not JSON ({exc})") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise CorpusError(f'{path}:{number}: expected an object with a string "text"')
            texts.append(text.encode())
    if not texts:
        raise CorpusError(f"{path}: no texts")
    return SEPARATOR.join(texts)


HF_MARKERS = ("state.json", "dataset_dict.json")


def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in HF_MARKERS)


def _hf_texts(path: Path) -> bytes:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError as exc:
        raise CorpusError(
            f"{path} is a Hugging Face dataset saved to disk: reading it needs the hf extra "
            "(pip install 'swarmtrain[hf]')"
        ) from exc
    try:
        dataset = load_from_disk(str(path))
    except (OSError, ValueError) as exc:
        raise CorpusError(f"{path}: not a readable Hugging Face dataset: {exc}") from exc
    if isinstance(dataset, DatasetDict):
        if not dataset:
            raise CorpusError(f"{path}: the dataset has no splits")
        dataset = dataset["train"] if "train" in dataset else dataset[sorted(dataset)[0]]
    if "text" not in dataset.column_names:
        raise CorpusError(f'{path}: the dataset has no "text" column (it has {", ".join(dataset.column_names)})')
    texts = [t.encode() for t in dataset["text"] if isinstance(t, str) and t]
    if not texts:
        raise CorpusError(f"{path}: no texts")
    return SEPARATOR.join(texts)


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        suffixes = (*TEXT_SUFFIXES, JSONL_SUFFIX)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        if not files:
            raise CorpusError(f"no {', '.join(suffixes)} files under {path}")
        return files
    if path.is_file():
        return [path]
    raise CorpusError(f"training data {path} does not exist")


def read_corpus(path: Path | None) -> bytes:
    """The embedded corpus, or the text at ``path`` (see above); ``CorpusError`` if unusable."""
    if path is None:
        return embedded_corpus()
    if _is_hf_dataset(path):
        total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if total > MAX_CORPUS_NBYTES:
            raise CorpusError(f"training data under {path} is {total} bytes, more than {MAX_CORPUS_NBYTES}")
        return _hf_texts(path)
    files = _files(path)
    total = sum(f.stat().st_size for f in files)
    if total > MAX_CORPUS_NBYTES:
        raise CorpusError(f"training data under {path} is {total} bytes, more than {MAX_CORPUS_NBYTES}")
    try:
        parts = [_jsonl_texts(f) if f.suffix == JSONL_SUFFIX else f.read_bytes() for f in files]
    except OSError as exc:
        raise CorpusError(f"cannot read training data under {path}: {exc.strerror or exc}") from exc
    corpus = SEPARATOR.join(parts)
    if not corpus.strip():
        raise CorpusError(f"training data under {path} is empty")
    return corpus


def text_sha256(text: bytes) -> str:
    """The hash a run records for its text (``read_corpus``'s bytes)."""
    return hashlib.sha256(text).hexdigest()


def corpus_sha256(path: Path) -> str:
    """The hash a run records for the data at ``path``."""
    return text_sha256(read_corpus(path))
