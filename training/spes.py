"""Sparse expert sync (SPES), worker side: a node trains only the experts it owns.

The model is a mixture of experts (training/moe.py). Its parameters split in two:
- **shared** ones (embeddings, attention, norms, routers): trained by every node and
  averaged NoLoCo-style with one partner per round (training/trainer.py, on these only);
- **experts**: expert ``e`` is every MoE layer's ``experts.<e>`` (w_in and w_out). A node
  trains the experts it owns (``set_owned``: the daemon's leases, node/algorithms/spes/);
  every other expert is frozen (``requires_grad`` off: forward only, no gradient, no
  optimizer state), which is where the memory saving comes from. Frozen experts are
  replaced, at a round boundary, by their owners' newer versions (``swap_in``).

An expert travels as one flat float32 vector (``ExpertTable``: layer by layer, w_in then
w_out, each row-major), ``expert_nbytes`` bytes; the worker and its daemon share one
block of ``num_experts`` such slots (training/algorithms/spes.py). An owner writes its
experts there at the end of its inner steps (``export_owned``); the daemon writes the
versions it fetched into the others' slots before the outer step.

A version from a peer is checked before it replaces our copy: finite, and within
``EXPERT_BOUND`` of our copy relative to our own update this round, scaled by the rounds
between the two versions (an owner moves its expert by about what any node moves its
shared weights: AdamW's steps are of one size per element). See ``check_version``.

Routing prefers the owned experts in training forwards (``spes.prefer_owned`` added to
their scores when experts are picked: training/moe.py ``preference``): an expert learns
only from its owner's steps, and only from the tokens routed to it there, a quarter of
them with top-2 of 8 experts and even balance; the preference sends it more of them.
Evaluation routes without it. See docs/training.md for what it measured.

Expert merging (early training, owners only): each owned expert moves toward the mean of
its ``merge_k`` most similar experts of the same layer (cosine of w_in),
e ← e + α_t·mean_k(e_k − e), α_t falling linearly from ``merge_alpha`` to 0 over the first
``merge_fraction`` of the run (``merge``).
"""

import logging
import math
from typing import Any, cast

import torch
from torch import nn

from training.checkpoint import CheckpointError
from training.data import Shard
from training.encodings import expert_versions
from training.finite import all_finite
from training.models import GPT
from training.moe import Expert, expert_index
from training.noloco import outer_gradient
from training.quantize import quantize
from training.settings import SpesConfig
from training.trainer import Trainer

logger = logging.getLogger("training.worker")

# A version may stray from our copy by at most this many times our own update's size
# (per expert, scaled to its share of elements), per round between the two versions.
# NoLoCo's φ bound is 16 for the same reason (training/noloco.py PartnerBounds).
EXPERT_BOUND = 16.0
# The rounds between two versions the bound grows with, at most (an honest version many
# rounds newer still moves about one update a round: far inside 16 per round).
MAX_ROUNDS_APART = 4


class ExpertTable:
    """Each expert's parameters, in the order of its flat vector."""

    def __init__(self, model: GPT) -> None:
        self.num_experts = model.config.num_experts
        if self.num_experts < 1:
            raise ValueError("SPES trains a mixture of experts; this model has none")
        self.params: list[list[nn.Parameter]] = [[] for _ in range(self.num_experts)]
        for name, param in model.named_parameters():
            index = expert_index(name)
            if index is not None:
                self.params[index].append(param)
        self.numel = sum(p.numel() for p in self.params[0])
        self.nbytes = 4 * self.numel

    def flat(self, expert: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params[expert]])

    @torch.no_grad()
    def load(self, expert: int, flat: torch.Tensor) -> None:
        sizes = [p.numel() for p in self.params[expert]]
        for param, part in zip(self.params[expert], torch.split(flat, sizes), strict=True):
            param.copy_(part.view_as(param))


def _shared_params(model: GPT) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if expert_index(name) is None]


# An honest owner's update a round, at most, in our reference's units (our own update,
# scaled to the expert's size): NoLoCo's Δ ratio between honest nodes measured 1.74
# (training/noloco.py PartnerBounds), and honest versions here at most 0.053 of the bound.
HONEST_UPDATE_RATIO = 2.0


def chain_lag_slack(chain: int, reference: float) -> float:
    """What versions in chains of ``chain`` (training/encodings/experts.py ``Sparse``) may
    trail their owner's weights by, both sides together, in ‖·‖; 0 for versions that stand
    alone. Derivation: a delta version is x̂ = x − e, the owner's weights less what was not
    sent yet; a delta sends C(v) of v = x − x̂_before, and C (top-k per chunk, each half's
    mean) is an orthogonal projection, so ‖e_after‖ = ‖v − C(v)‖ ≤ ‖v‖ ≤ ‖e_before‖ + ‖u‖,
    u the owner's update that round. From the keyframe (e its int8 rounding, in
    ``rounding_slack``) through at most chain − 1 deltas, ‖e‖ ≤ rounding + (chain − 1)·U,
    U an honest update a round (``HONEST_UPDATE_RATIO`` × our reference: not the bound's
    EXPERT_BOUND ×, which would count its margin twice and let a version move 8× further
    a round). Two versions are ‖x̂_b − x̂_a‖ ≤ ‖x_b − x_a‖ + ‖e_a‖ + ‖e_b‖ apart."""
    return 2 * (chain - 1) * HONEST_UPDATE_RATIO * reference


def rounding_slack(held: torch.Tensor, block: int | None, chain: int = 1) -> float:
    """How far two int8 versions (training/encodings/experts.py) of weights like ``held``
    can be from the weights they were made of, together: half a step (a block's largest
    magnitude / 127) per value, on each side, in ‖·‖. Measured on our own copy, never on
    the stranger's version: a peer cannot widen its own bound. Without it an honest
    owner's version was refused (and its owner banned) once its updates were smaller than
    the rounding: at ~3e-6 a value a round from the exact genesis copy (a second reader's
    probe, N(0, 0.02) weights). 0 where versions travel exactly (``block`` None).

    ``chain``: versions in a chain (``chain_lag_slack``); each of its chain − 1 deltas
    adds in float32, rounding each value by at most 2⁻²⁴ of itself, on each side: 2⁻²³ ×
    the copy's norm a delta, which is ours with a factor 2 for the other side's copy (a
    version twice our norm away is ‖held‖ off, refused unless the bound allows far more)."""
    if block is None or held.numel() == 0:
        return 0.0
    flat = held.detach().reshape(-1).float()
    _, scales = quantize(flat, block=block)  # a block's step, as the wire's int8 takes it
    counts = torch.full_like(scales, float(block))
    counts[-1] = flat.numel() - (len(scales) - 1) * block
    half_steps = scales / 2
    # Each side's rounding, and a float32 rounding of the division and product on top.
    keyframes = 2 * float(torch.sqrt((counts * half_steps**2).sum())) * (1 + 2.0**-20)
    return keyframes + (chain - 1) * 2.0**-22 * float(torch.linalg.vector_norm(flat))


def version_gap(
    new: torch.Tensor, held: torch.Tensor, *, reference: float, rounds_apart: int, slack: float = 0.0
) -> float:
    """How far a peer's version of an expert is from our copy, in bounds (``check_version``
    refuses above 1): ‖new − held‖ / (EXPERT_BOUND · reference · (1 + rounds_apart) + slack);
    ``slack``: the versions' rounding (``rounding_slack``)."""
    limit = EXPERT_BOUND * reference * (1 + max(0, rounds_apart)) + slack
    gap = float(torch.linalg.vector_norm(new - held))
    return gap / limit if limit > 0 else (0.0 if gap == 0 else math.inf)


def check_version(
    new: torch.Tensor, held: torch.Tensor, *, reference: float, rounds_apart: int, slack: float = 0.0
) -> str | None:
    """Why a peer's version of an expert is refused (None: take it).

    ``reference``: our own update's size for that many elements this round
    (``Spes.update_reference``); ``rounds_apart``: between our copy and the new version;
    ``slack``: what rounding for the wire may add (``rounding_slack``)."""
    if new.shape != held.shape:
        return f"holds {new.numel()} values, expected {held.numel()}"
    if not all_finite(new):
        return "holds NaN or Inf"
    ratio = version_gap(new, held, reference=reference, rounds_apart=rounds_apart, slack=slack)
    if not ratio <= 1.0:
        return f"is {ratio:.3g}× the bound away from our copy"
    return None


OPEN_ENDED_MERGE_ROUNDS = 100
"""A run with no budget of rounds (``rounds`` 0) merges as a run of this many would."""


def merge_rate(config: SpesConfig, round_index: int, rounds: int) -> float:
    """α_t at the end of round ``round_index``: merge_alpha falling linearly to 0 at
    merge_fraction of the run's ``rounds`` (0: of ``OPEN_ENDED_MERGE_ROUNDS``)."""
    horizon = config.merge_fraction * (rounds or OPEN_ENDED_MERGE_ROUNDS)
    if horizon <= 0:
        return 0.0
    return config.merge_alpha * max(0.0, 1.0 - (round_index + 1) / horizon)


@torch.no_grad()
def merge(model: GPT, owned: frozenset[int], *, alpha: float, k: int) -> None:
    """e ← e + α·mean_k(e_k − e) for each owned expert, per MoE layer, over its k most
    similar experts there (cosine of w_in); every move computed from the weights before any."""
    if alpha <= 0 or not owned:
        return
    for moe in model.moes():
        experts = cast(list[Expert], list(moe.experts))
        k_used = min(k, len(experts) - 1)
        if k_used < 1:
            return
        w_in = torch.stack([e.w_in.detach().reshape(-1).float() for e in experts])
        unit = w_in / w_in.norm(dim=1, keepdim=True).clamp_min(1e-12)
        similarity = unit @ unit.T
        similarity.fill_diagonal_(-math.inf)
        before = [[p.detach().clone() for p in e.parameters()] for e in experts]
        for index in sorted(owned):
            nearest = torch.topk(similarity[index], k_used).indices.tolist()
            for j, param in enumerate(experts[index].parameters()):
                mean = torch.stack([before[n][j] for n in nearest]).mean(dim=0)
                param.add_(alpha * (mean - before[index][j]))


def expert_state(table: ExpertTable) -> dict[str, torch.Tensor]:
    return {f"expert.{e}": table.flat(e) for e in range(table.num_experts)}


def check_expert_state(table: ExpertTable, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every expert of a saved state, checked; ``CheckpointError`` if one does not fit."""
    flats = []
    for e in range(table.num_experts):
        flat = tensors.get(f"expert.{e}")
        if flat is None or flat.dtype != torch.float32 or flat.shape != (table.numel,):
            raise CheckpointError(f"checkpoint's expert {e} does not fit this model")
        if not all_finite(flat):
            raise CheckpointError(f"checkpoint's expert {e} holds NaN or Inf")
        flats.append(flat)
    return flats


def load_expert_state(table: ExpertTable, tensors: dict[str, torch.Tensor]) -> None:
    """Every expert from a saved state; ``CheckpointError`` (nothing changed) if one does not fit."""
    for e, flat in enumerate(check_expert_state(table, tensors)):
        table.load(e, flat)


class SpesTrainer(Trainer):
    """A ``Trainer`` whose outer step averages the shared weights only, and whose AdamW
    steps the shared weights plus the owned experts."""

    def __init__(self, model: GPT, shard: Shard, *, spes: SpesConfig, rounds: int, **kwargs: Any) -> None:
        self.table = ExpertTable(model)
        for params in self.table.params:
            for param in params:
                param.requires_grad_(False)
        super().__init__(model, shard, outer_params=_shared_params(model), **kwargs)
        versions = expert_versions(kwargs.get("compression", "none"))
        self.version_block = versions.block
        """Versions of experts travel rounded per block of this many values (None: exactly)."""
        self.version_chain = versions.chain
        """Versions travel in chains of at most this many (1: each stands alone)."""
        self.spes = spes
        self.rounds = rounds
        self.owned: frozenset[int] = frozenset()
        self.held_rounds = [-1] * self.table.num_experts
        """The round of the version each expert copy is (-1: the genesis weights)."""
        self._saved_moments: dict[int, list[dict[str, torch.Tensor]]] = {}
        """AdamW's state of experts we owned, from a checkpoint: used if we own them again."""
        self.slots: torch.Tensor | None = None
        """The expert block shared with the daemon (one float32 row per expert), if any."""

    @property
    def expert_nbytes(self) -> int:
        return self.table.nbytes

    def set_owned(self, owned: frozenset[int]) -> None:
        """Train these experts from now on (the others frozen); AdamW keeps its state for
        what stays trainable, starts afresh for a gained expert, drops a lost one's."""
        if any(not 0 <= e < self.table.num_experts for e in owned):
            raise ValueError(f"experts {sorted(owned)} out of range [0, {self.table.num_experts})")
        if owned == self.owned:
            return
        kept = {p: self.optimizer.state[p] for p in self._trainable if p in self.optimizer.state}
        for e in self.owned - owned:
            for param in self.table.params[e]:
                param.requires_grad_(False)
                param.grad = None
        for e in owned - self.owned:
            for param, moments in zip(self.table.params[e], self._saved_moments.pop(e, []), strict=False):
                kept[param] = moments
            for param in self.table.params[e]:
                param.requires_grad_(True)
        self.owned = owned
        num_experts = self.table.num_experts
        prefer = self.spes.prefer_owned if 0 < len(owned) < num_experts else 0.0
        preference = (
            torch.tensor([prefer if e in owned else 0.0 for e in range(num_experts)], device=self.device)
            if prefer
            else None
        )
        for moe in self.model.moes():  # one tensor for every layer: read only
            moe.preference = preference
        self._trainable = [*self._params, *(p for e in sorted(owned) for p in self.table.params[e])]
        self.optimizer = self._new_optimizer()
        for param in self._trainable:
            if param in kept:
                self.optimizer.state[param] = kept[param]

    def export_owned(self, slots: torch.Tensor) -> None:
        """Our owned experts' current values into their slots (``slots``: float32, one row
        an expert): this round's versions."""
        for e in sorted(self.owned):
            slots[e].copy_(self.table.flat(e))
            self.held_rounds[e] = self.round

    def outer_payload(self) -> torch.Tensor:
        """The shared weights' payload; our experts go to their slots at the same moment."""
        if self.slots is not None:
            self.export_owned(self.slots)
        return super().outer_payload()

    def update_reference(self, numel: int) -> float:
        """Our own update this round (Δ of the shared weights), scaled to ``numel`` elements:
        what a peer's version of an expert is measured against (``check_version``)."""
        delta = outer_gradient(self.phi, self.theta())
        total = math.sqrt(sum(float(torch.linalg.vector_norm(d.float())) ** 2 for d in delta))
        shared_numel = sum(d.numel() for d in delta)
        return total * math.sqrt(numel / shared_numel) if shared_numel else 0.0

    @torch.no_grad()
    def swap_in(self, expert: int, flat: torch.Tensor, version_round: int) -> str | None:
        """Adopt a peer's version of an expert we do not own; why it was refused, or None."""
        if expert in self.owned:
            return "we own it"
        held = self.table.flat(expert)
        new = flat.to(held.device)
        reference = self.update_reference(self.table.numel)
        # The daemon takes versions of rounds up to 16 past ours; the bound grows with the
        # rounds between two versions only up to MAX_ROUNDS_APART, whatever round is claimed.
        apart = min(version_round - self.held_rounds[expert], MAX_ROUNDS_APART)
        slack = rounding_slack(held, self.version_block, self.version_chain)
        slack += chain_lag_slack(self.version_chain, reference)  # what a chain's versions may trail their owner by
        refusal = check_version(new, held, reference=reference, rounds_apart=apart, slack=slack)
        if refusal is None:
            # Honest versions' share of the bound, for the worker log (docs/training.md).
            share = version_gap(new, held, reference=reference, rounds_apart=apart, slack=slack)
            logger.info("expert %d version of round %d: %.3f of the bound", expert, version_round, share)
            self.table.load(expert, new)
            self.held_rounds[expert] = version_round
        return refusal

    def merge_owned(self, round_index: int) -> float:
        """Expert merging at the end of ``round_index``; returns the α used (0: none)."""
        alpha = merge_rate(self.spes, round_index, self.rounds)
        merge(self.model, self.owned, alpha=alpha, k=self.spes.merge_k)
        return alpha

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = super().state()
        tensors.update(expert_state(self.table))
        for e in sorted(self.owned):
            for j, param in enumerate(self.table.params[e]):
                for key, value in self.optimizer.state.get(param, {}).items():
                    tensors[f"expert_adam.{e}.{j}.{key}"] = torch.as_tensor(value, dtype=torch.float32)
        return tensors, {**meta, "held_rounds": list(self.held_rounds)}

    @torch.no_grad()
    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        held = meta.get("held_rounds")
        if not (isinstance(held, list) and len(held) == self.table.num_experts and all(type(r) is int for r in held)):
            raise CheckpointError("checkpoint has no expert rounds for this model")
        moments = _expert_moments(self.table, tensors)
        check_expert_state(self.table, tensors)  # before anything changes
        self.set_owned(frozenset())  # the daemon says what we own once we run
        super().restore(tensors, meta)
        load_expert_state(self.table, tensors)
        self.held_rounds = list(held)
        self._saved_moments = moments


def _expert_moments(table: ExpertTable, tensors: dict[str, torch.Tensor]) -> dict[int, list[dict[str, torch.Tensor]]]:
    """AdamW's saved state per expert (only whole, fitting ones: a partial one is dropped)."""
    out: dict[int, list[dict[str, torch.Tensor]]] = {}
    for e, params in enumerate(table.params):
        per_param = []
        for j, param in enumerate(params):
            found = {key: tensors.get(f"expert_adam.{e}.{j}.{key}") for key in ("step", "exp_avg", "exp_avg_sq")}
            if any(t is None for t in found.values()):
                break
            if any(t.shape != (() if key == "step" else param.shape) for key, t in found.items() if t is not None):
                break
            per_param.append(
                {
                    key: t.clone() if key == "step" else t.to(param.device, copy=True)
                    for key, t in found.items()
                    if t is not None
                }
            )
        if per_param and len(per_param) == len(params):
            out[e] = per_param
    return out
