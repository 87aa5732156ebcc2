"""Which validation blocks a run's losses are measured on: the same blocks at every point.

A run's validation split is the last blocks of its text (training/data.py), the same on
every node. Its losses are two measures, never mixed:

- **The curve** (``val_loss`` of each round, ``final_loss``, ``export --average``):
  ``curve_rows(run)`` blocks spread evenly over the split, the same blocks at every round,
  on every node and after a restart, so the curve's points compare like with like. Its size
  keeps a round's evaluation near ``EVAL_SHARE`` of the round's compute: a round computes
  H·B steps of F forwards of a block each (``FORWARDS_PER_STEP``: a training step's forward
  and backward ≈ 3 forwards; ZO's SPSA, 2), and a block's evaluation is one forward, so
  ``EVAL_SHARE``·F·H·B blocks.
- **The full validation** (``full_val_loss``): every block of the split, or ``FULL_MAX_ROWS``
  spread evenly over a larger one, once, on the final model (φ after the run's last outer
  step; ZO: the final weights), reported as its own figure.

Torch-free: the daemon and ``export`` size the same sets as the worker.
"""

from training.algorithms import FORWARDS_PER_STEP
from training.settings import RunSettings

EVAL_SHARE = 0.03
"""The curve's evaluation as a share of a round's compute, by the count above (its cost
shows in utilization, compute_s / train_wall_s; measured in docs/training.md)."""
FULL_MAX_ROWS = 256
"""The full validation's blocks at most: the whole split of the embedded corpus for ``tiny``
(180 blocks of 129 bytes), a fixed sample of a larger one (``micro``'s 358 blocks of 65; an
8 GB corpus's split is millions)."""


def curve_rows(run: RunSettings) -> int:
    """How many validation blocks every point of ``run``'s loss curve is measured on."""
    forwards = FORWARDS_PER_STEP.get(run.algorithm, 3) * run.inner.steps_per_round * run.inner.batch_size
    return max(1, min(FULL_MAX_ROWS, int(EVAL_SHARE * forwards)))


def spread(num_blocks: int, num_rows: int) -> list[int]:
    """``num_rows`` of ``range(num_blocks)`` spread evenly over it, the middle of each of
    ``num_rows`` equal stretches (all of them where ``num_rows >= num_blocks``): a split's
    first blocks are one stretch of its text, not a sample of it."""
    if num_rows >= num_blocks:
        return list(range(num_blocks))
    return [(2 * i + 1) * num_blocks // (2 * num_rows) for i in range(num_rows)]
