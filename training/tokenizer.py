"""How text becomes token ids in a run: bytes, or a BPE every node trains alike. No torch
(the daemon trains and checks the tokenizer before its worker starts).

A run's setting ``tokenizer`` says which:

- ``bytes`` (the default): token id = byte value, vocabulary 256: nothing to train or ship,
  exact on any text.
- ``bpe-N``: a byte-level BPE of at most N tokens (257 to 65536), trained offline with
  Hugging Face ``tokenizers`` on the run's own text (the embedded corpus or the ``--data``
  whose SHA-256 the run records). The text is what every trainer already holds and the
  training is deterministic, so every node trains the same tokenizer itself instead of
  fetching it from a stranger: the run's creator writes the SHA-256 of its tokenizer.json
  into the settings (``tokenizer_sha256``), and a node whose own differs (another release
  of ``tokenizers``) does not train in the run and says why. The model's vocabulary is the
  tokenizer's (smaller than N when the text allows no more merges). Text that is not UTF-8
  is read with U+FFFD in place of the bad bytes.

``Codec`` is what the worker, ``export`` and ``sample`` use either way.
"""

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BYTES = "bytes"
BPE_PATTERN = re.compile(r"bpe-(\d{3,5})")
MIN_BPE_VOCAB = 257
MAX_BPE_VOCAB = 65536
BYTE_VOCAB = 256
DOCUMENT_SEPARATOR = "\n\n"


class TokenizerError(ValueError):
    """A tokenizer setting or file we cannot use (the message says why)."""


def bpe_vocab(spec: str) -> int | None:
    """N of ``bpe-N``; None for ``bytes``; ``TokenizerError`` for anything else."""
    if spec == BYTES:
        return None
    found = BPE_PATTERN.fullmatch(spec)
    if found is None or not MIN_BPE_VOCAB <= int(found.group(1)) <= MAX_BPE_VOCAB:
        limits = f"[{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}]"
        raise TokenizerError(f"tokenizer: {BYTES!r} or 'bpe-N' with N in {limits}, got {spec!r}")
    return int(found.group(1))


def train_bpe(text: bytes, vocab_size: int) -> str:
    """A byte-level BPE trained on ``text`` (documents split at blank lines): tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.decode(errors="replace").split(DOCUMENT_SEPARATOR), trainer=trainer)
    trained: str = tokenizer.to_str()
    return trained


def sha256(tokenizer_json: str) -> str:
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()


class Codec:
    """Text to ids and back: bytes (``json`` None) or a trained tokenizer."""

    def __init__(self, tokenizer_json: str | None = None) -> None:
        self.json = tokenizer_json
        self._tokenizer: Tokenizer | None = None
        if tokenizer_json is not None:
            from tokenizers import Tokenizer as RustTokenizer

            try:
                self._tokenizer = RustTokenizer.from_str(tokenizer_json)
            except Exception as exc:  # the Rust parser's error, whatever its type
                raise TokenizerError(f"not a tokenizer: {exc}") from exc

    @classmethod
    def load(cls, path: Path | None) -> "Codec":
        if path is None:
            return cls()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"cannot read tokenizer {path}: {exc}") from exc
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB if self._tokenizer is None else self._tokenizer.get_vocab_size()

    def encode(self, text: bytes) -> list[int]:
        if self._tokenizer is None:
            return list(text)
        documents = text.decode(errors="replace").split(DOCUMENT_SEPARATOR)
        separator = self._tokenizer.encode(DOCUMENT_SEPARATOR).ids
        ids: list[int] = []
        for k, encoding in enumerate(self._tokenizer.encode_batch(documents)):
            if k:
                ids.extend(separator)
            ids.extend(encoding.ids)
        return ids

    def decode(self, ids: list[int]) -> str:
        if self._tokenizer is None:
            return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode(errors="replace")
        return self._tokenizer.decode(ids)
