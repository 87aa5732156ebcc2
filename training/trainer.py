"""One node's training state and its round: H inner AdamW steps, then an outer step.

The worker process drives a ``Trainer``; the trainer never touches the network. At a
round boundary it exports φ and Δ as one flat buffer (``outer_payload``), and applies the
outer step with a partner's buffer, or alone (``apply_outer``). A partner's buffer is
checked before anything changes: wrong size, or any NaN/Inf, and the round falls back to
the no-partner step, so bad input never reaches the weights.
"""

import math
from dataclasses import dataclass

import torch

from training.data import Shard
from training.models import GPT
from training.noloco import OuterConfig, PeerTensors, diloco_step, noloco_step, outer_gradient


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerConfig:
    steps_per_round: int = 50
    """H: inner steps between outer steps."""
    lr: float = 1e-3
    """AdamW learning rate of the inner steps."""
    weight_decay: float = 0.1
    batch_size: int = 8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.steps_per_round < 1 or self.batch_size < 1:
            raise ValueError("steps_per_round and batch_size must be >= 1")
        if not (self.lr > 0 and self.grad_clip > 0 and self.weight_decay >= 0):
            raise ValueError("lr and grad_clip must be > 0, weight_decay >= 0")


class PayloadRejected(ValueError):
    """A partner's outer payload failed the checks; the round goes on without it."""


class Trainer:
    def __init__(self, model: GPT, shard: Shard, *, inner: InnerConfig, outer: OuterConfig, seed: int) -> None:
        self.model = model
        self.shard = shard
        self.inner = inner
        self.outer = outer
        self.seed = seed
        self.step = 0
        self.round = 0
        self._params = [p for p in model.parameters()]
        self.phi = [p.detach().clone() for p in self._params]
        self.momentum = [torch.zeros_like(p) for p in self._params]
        self.optimizer = torch.optim.AdamW(self._params, lr=inner.lr, weight_decay=inner.weight_decay)
        self.payload_numel = 2 * sum(p.numel() for p in self._params)

    def inner_steps(self) -> float:
        """H AdamW steps on θ; returns the mean training loss."""
        self.model.train()
        total = 0.0
        for _ in range(self.inner.steps_per_round):
            inputs, targets = self.shard.batch(batch_size=self.inner.batch_size, seed=self.seed, step=self.step)
            loss = self.model.loss(inputs, targets)
            self.optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            torch.nn.utils.clip_grad_norm_(self._params, self.inner.grad_clip)
            self.optimizer.step()
            total += loss.item()
            self.step += 1
        return total / self.inner.steps_per_round

    @torch.no_grad()
    def val_loss(self, *, max_batches: int = 8) -> float:
        self.model.eval()
        batches = self.shard.val_batches(batch_size=self.inner.batch_size, max_batches=max_batches)
        return sum(self.model.loss(x, y).item() for x, y in batches) / len(batches)

    def theta(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._params]

    @torch.no_grad()
    def outer_payload(self) -> torch.Tensor:
        """φ then Δ, flattened into one float32 buffer (what a partner needs from us)."""
        delta = outer_gradient(self.phi, self.theta())
        return torch.cat([t.reshape(-1) for t in (*self.phi, *delta)]).to(torch.float32)

    def parse_payload(self, flat: torch.Tensor) -> PeerTensors:
        """A partner's buffer as tensors shaped like ours; ``PayloadRejected`` if unusable."""
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() != self.payload_numel:
            raise PayloadRejected(
                f"payload is {flat.dtype} × {tuple(flat.shape)}, expected float32 × ({self.payload_numel},)"
            )
        if not bool(torch.isfinite(flat).all()):
            raise PayloadRejected("payload holds NaN or Inf")
        parts = list(torch.split(flat, [p.numel() for p in self.phi] * 2))
        shaped = [part.view_as(ref).to(ref.dtype) for part, ref in zip(parts, [*self.phi, *self.phi], strict=True)]
        return PeerTensors(phi=shaped[: len(self.phi)], delta=shaped[len(self.phi) :])

    @torch.no_grad()
    def apply_outer(self, peer_flat: torch.Tensor | None, *, algorithm: str = "noloco") -> bool:
        """The outer step, then θ ← φ. Returns whether a partner's payload was used.

        ``algorithm``: "noloco" (``peer_flat`` is one partner's payload), "local" (no
        outer step: φ follows θ). A rejected payload means the no-partner NoLoCo step.
        """
        used_peer = False
        if algorithm == "local":
            self.phi = [t.clone() for t in self.theta()]
        elif algorithm == "noloco":
            peer: PeerTensors | None = None
            if peer_flat is not None:
                try:
                    peer = self.parse_payload(peer_flat)
                    used_peer = True
                except PayloadRejected:
                    peer = None
            self.phi, self.momentum = noloco_step(self.phi, self.theta(), self.momentum, peer, self.outer)
        else:
            raise ValueError(f"unknown algorithm {algorithm!r}")
        self._load_phi_into_theta()
        self.round += 1
        return used_peer

    @torch.no_grad()
    def apply_diloco(self, deltas: list[list[torch.Tensor]]) -> None:
        """DiLoCo baseline: ``deltas`` are every live node's Δ, ours included, in agreed order."""
        self.phi, self.momentum = diloco_step(self.phi, deltas, self.momentum, self.outer)
        self._load_phi_into_theta()
        self.round += 1

    def _load_phi_into_theta(self) -> None:
        for param, phi in zip(self._params, self.phi, strict=True):
            param.copy_(phi)
        if not all(math.isfinite(float(p.abs().max())) for p in self.phi if p.numel()):
            raise FloatingPointError("outer step produced non-finite weights")
