"""Text in, batches of token ids out: an embedded corpus, a byte tokenizer, per-node shards.

- The text: the embedded corpus or the user's files (training/corpus.py, torch-free).
- Tokens are bytes (vocabulary 256), or the run's BPE (training/tokenizer.py).
- The stream is cut into blocks of ``context_len + 1`` tokens; the last ``val_fraction``
  of blocks is the validation split, shared by all nodes (which of its blocks a loss is
  measured on: training/validation.py); the rest is dealt round-robin,
  block b to node ``b % num_nodes``, so node shards are disjoint and deterministic.
- Batches are drawn with a seeded generator (node index, step): reproducible.
"""

from dataclasses import dataclass

import torch

from training import validation
from training.tokenizer import Codec

VOCAB_SIZE = 256


def encode(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.long)


def tokens_of(text: bytes, codec: Codec) -> torch.Tensor:
    """``text`` as the run's token ids: bytes straight from the buffer, or the run's BPE."""
    if codec.json is None:
        return encode(text)
    return torch.tensor(codec.encode(text), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode(errors="replace")


@dataclass(frozen=True, slots=True)
class Shard:
    """One node's training blocks and the shared validation blocks, each (num_blocks, context_len + 1)."""

    train: torch.Tensor
    val: torch.Tensor

    def batch(self, *, batch_size: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for one training step, the same on every run."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        rows = torch.randint(len(self.train), (batch_size,), generator=generator)
        blocks = self.train[rows]
        return blocks[:, :-1], blocks[:, 1:]

    def val_batches(self, *, batch_size: int, num_rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``num_rows`` validation blocks spread evenly over the split (all of them if it
        has no more), the same ones on every node and at every call, in batches of
        ``batch_size`` (training/validation.py says how many a run measures)."""
        rows = validation.spread(len(self.val), max(1, num_rows))
        blocks = self.val[rows]
        starts = range(0, len(blocks), batch_size)
        return [(blocks[i : i + batch_size, :-1], blocks[i : i + batch_size, 1:]) for i in starts]


def make_shard(
    tokens: torch.Tensor, *, context_len: int, node_index: int, num_nodes: int, val_fraction: float = 0.05
) -> Shard:
    if not 0 <= node_index < num_nodes:
        raise ValueError(f"node index {node_index} is not in [0, {num_nodes})")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    block_len = context_len + 1
    num_blocks = len(tokens) // block_len
    num_val = max(1, int(num_blocks * val_fraction))
    if num_blocks - num_val < num_nodes:
        raise ValueError(f"{len(tokens)} tokens make {num_blocks} blocks of {block_len}: too few for {num_nodes} nodes")
    blocks = tokens[: num_blocks * block_len].view(num_blocks, block_len)
    train, val = blocks[: num_blocks - num_val], blocks[num_blocks - num_val :]
    return Shard(train=train[node_index::num_nodes].clone(), val=val.clone())
