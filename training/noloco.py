"""Outer steps as pure functions: NoLoCo (one random peer), DiLoCo (all peers), and the notation.

Notation (../shared/DESIGN.md): φ slow weights shared at round boundaries, θ fast weights
after H inner steps, m outer momentum, Δ = φ − θ the outer gradient. Each function takes
per-parameter lists of tensors and returns new tensors; nothing is modified in place, so
callers can check the result (finite, right shapes) before adopting it.

NoLoCo, node i paired with peer j (a group of two):

    m_i ← α·m_i − β·mean(Δ_i, Δ_j) − γ·(φ_i − mean(φ_i, φ_j))
    φ_i ← φ_i + m_i ;  θ_i ← φ_i

With a compressed payload the partner averages what it received, not our exact values;
``sent`` (what our partner saw of us) then replaces our φ and Δ inside both means and the
γ term, so the two sides compute the same means, while each keeps its own exact φ as the
base it steps from. The pair's mean is still preserved exactly (the γ terms cancel).

Without a partner this round (none free, or its payload was refused) the mean is over
ourselves alone and the γ term is skipped. With two nodes that started from the same φ,
φ_i − mean(φ_i, φ_j) is exactly zero (2φ/2 = φ in floating point), so NoLoCo reduces
bitwise to heavy-ball DiLoCo, ``diloco_step``; tests check both that and the DESIGN.md fixture.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from training.settings import OuterConfig

Params = list[torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class PartnerBounds:
    """How far a partner's payload may stray from our own round before it is refused.

    Partners are strangers: a finite payload can still carry Δ × −1000 (measured on the
    main before issue 12: the loss was destroyed) or φ = 1e30 (the weights went to NaN).
    Each tensor k is measured against our own outer gradient for it, with a floor at its
    share of our whole update (a tensor we barely moved must not refuse a partner's small
    move): ref_k = max(‖Δ_i,k‖, ‖Δ_i‖·√(n_k / n)).

    Measured between honest nodes (4 nodes, micro and tiny, H = 10-20, float32 and int8,
    /tmp-style probe kept in docs/security.md): ‖Δ_j,k‖ / ref_k ≤ 1.74 and
    ‖φ_j,k − φ_i,k‖ / ref_k ≤ 3.7 over every pair and round. The bounds are about four
    times that; an honest partner far beyond them is a bug, a stranger there an attack.
    """

    max_delta_ratio: float = 8.0
    """‖Δ_j,k‖ ≤ this × ref_k."""
    max_phi_ratio: float = 16.0
    """‖φ_j,k − φ_i,k‖ ≤ this × ref_k."""
    ban_factor: float = 8.0
    """A payload past a bound by more than this factor (Δ over 64× ours, φ over 128 of our
    updates away) is an attack and bans its sender; one nearer is refused for a point.
    Honest replicas drift apart under churn: in the 16-node soak (a quarter killed and
    restarted, most rounds alone on a loaded machine) honest φ gaps reached 16–25× at the
    end, and each refusal banned an honest peer."""


class PartnerRefused(ValueError):
    """A partner's payload is out of bounds (``PartnerBounds``): the round goes on without it.
    ``drifted``: within ``ban_factor`` of the bound (a replica that drifted, not an attack)."""

    def __init__(self, message: str, *, drifted: bool) -> None:
        super().__init__(message)
        self.drifted = drifted


def check_partner(
    phi: Params, delta: Params, peer: "PeerTensors", bounds: PartnerBounds, *, scale: float = 1.0
) -> None:
    """``PartnerRefused`` naming the tensor where ``peer`` strays furthest beyond ``bounds``
    (the furthest, not the first: whether it bans depends on how far). ``scale``: our Δ
    took 1/scale of a round's steps (a node catching up takes fewer: the partner's Δ over a
    whole round was 6.6× ours at 3 of 10 steps, a second reader measured, against 2.2× at
    10), so the reference is ours × scale. ``partner_norms`` then ``judge_partner``: a
    caller with more to read from the device reads the norms with it (training/trainer.py)."""
    if delta:
        judge_partner(partner_norms(phi, delta, peer).tolist(), [d.numel() for d in delta], bounds, scale=scale)


def partner_norms(phi: Params, delta: Params, peer: "PeerTensors") -> torch.Tensor:
    """What ``judge_partner`` judges by, on the device and not read (on a GPU each read is a
    wait for the device): the 2-norms of our Δ's tensors, of the partner's Δ's, and of its
    φ's distance from ours, one list op each (~450 launches a round for gpt-125m before,
    ~11 ms of the host's time on the H200), stacked into one float32 vector."""
    groups = ([d.float() for d in delta], [t.float() for t in peer.delta], _differences(peer.phi, phi))
    return torch.stack([norm.float() for group in groups for norm in torch._foreach_norm(group)])


def judge_partner(norms: Sequence[float], numels: Sequence[int], bounds: PartnerBounds, *, scale: float) -> None:
    """``check_partner``'s verdict from ``partner_norms``, read (three norms a tensor)."""
    count = len(numels)
    if len(norms) != 3 * count:
        raise ValueError(f"{len(norms)} norms for {count} tensors")
    ours, their_deltas, phi_gaps = norms[:count], norms[count : 2 * count], norms[2 * count :]
    total_numel = sum(numels)
    total = math.sqrt(sum(n * n for n in ours))
    worst: tuple[float, str] | None = None  # (how many bounds away, why)
    for k, (d_norm, n_k, their_delta, phi_gap) in enumerate(zip(ours, numels, their_deltas, phi_gaps, strict=True)):
        ref = scale * max(d_norm, total * math.sqrt(n_k / total_numel)) if total_numel else 0.0
        for value, bound, why in (
            (their_delta, bounds.max_delta_ratio, "its outer gradient is {:.3g}× ours"),
            (phi_gap, bounds.max_phi_ratio, "its weights are {:.3g}× our update away"),
        ):
            if value <= bound * ref:  # the rule (NaN fails it); the ratio only reports and grades
                continue
            ratio = value / max(ref, 1e-30)
            excess = ratio / bound if math.isfinite(ratio) else math.inf
            if worst is None or excess > worst[0]:
                worst = (excess, f"tensor {k}: " + why.format(ratio))
    if worst is not None:
        raise PartnerRefused(worst[1], drifted=worst[0] <= bounds.ban_factor)


def _differences(a: Params, b: Params) -> Params:
    """a − b per tensor, in float32: one list op where the dtypes allow (on a GPU, one launch
    for ~150 tensors instead of one each)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} tensors against {len(b)}")
    if all(x.dtype == y.dtype == torch.float32 and x.device == y.device for x, y in zip(a, b, strict=True)):
        return list(torch._foreach_sub(a, b))
    return [(x - y).float() for x, y in zip(a, b, strict=True)]


@dataclass(frozen=True, slots=True)
class PeerTensors:
    """What a partner sends for one round: its slow weights φ_j and outer gradient Δ_j."""

    phi: Params
    delta: Params


def outer_gradient(phi: Params, theta: Params) -> Params:
    """Δ = φ − θ."""
    if len(phi) != len(theta):
        raise ValueError(f"{len(phi)} slow weights against {len(theta)} fast ones")
    return list(torch._foreach_sub(phi, theta)) if phi else []


# The steps below work on whole lists of tensors (torch's ``_foreach`` ops: one launch for
# many tensors on a GPU, ~150 per op for gpt-125m before; the same per-tensor arithmetic
# on a CPU), each op the one the formula names, in its order: the bits are those of the
# plain per-tensor formula (tests/test_noloco.py holds it).


def _mean2(a: Params, b: Params) -> Params:
    # One rounding recipe for every mean of two, so NoLoCo and DiLoCo agree bit for bit.
    return list(torch._foreach_div(torch._foreach_add(a, b), 2))


def _heavy_ball(momentum: Params, config: OuterConfig, mean_delta: Params) -> Params:
    """α·m − β·mean(Δ)."""
    return list(
        torch._foreach_sub(torch._foreach_mul(momentum, config.alpha), torch._foreach_mul(mean_delta, config.beta))
    )


def noloco_step(
    phi: Params,
    theta: Params,
    momentum: Params,
    peer: PeerTensors | None,
    config: OuterConfig,
    *,
    sent: PeerTensors | None = None,
) -> tuple[Params, Params]:
    """One NoLoCo outer step for node i; returns (new φ, new m). θ restarts from the new φ.

    ``sent``: our φ and Δ as the partner received them (dequantized), when compressed.
    Per tensor: m ← α·m − β·Δ alone; with a partner m ← α·m − β·mean(Δ_i, Δ_j) − γ·(φ_i −
    mean(φ_i, φ_j)); then φ ← φ + m.
    """
    if not phi:
        return [], []
    delta = outer_gradient(phi, theta)
    if peer is None:
        new_momentum = _heavy_ball(momentum, config, delta)
    else:
        own_phi, own_delta = (phi, delta) if sent is None else (sent.phi, sent.delta)
        pull = torch._foreach_sub(own_phi, _mean2(own_phi, peer.phi))
        new_momentum = list(
            torch._foreach_sub(
                _heavy_ball(momentum, config, _mean2(own_delta, peer.delta)), torch._foreach_mul(pull, config.gamma)
            )
        )
    return list(torch._foreach_add(phi, new_momentum)), new_momentum


def diloco_step(phi: Params, deltas: Sequence[Params], momentum: Params, config: OuterConfig) -> tuple[Params, Params]:
    """One heavy-ball DiLoCo outer step: m ← α·m − β·mean_k(Δ_k); φ ← φ + m (γ unused).

    ``deltas`` holds every live node's Δ (ours included), in an order all nodes agree on.
    """
    if not deltas:
        raise ValueError("DiLoCo needs at least our own outer gradient")
    if not phi:
        return [], []
    if len(deltas) == 2:
        mean_delta = _mean2(deltas[0], deltas[1])
    else:
        total = [t.clone() for t in deltas[0]]
        for other in deltas[1:]:
            torch._foreach_add_(total, other)
        mean_delta = list(torch._foreach_div(total, len(deltas)))
    new_momentum = _heavy_ball(momentum, config, mean_delta)
    return list(torch._foreach_add(phi, new_momentum)), new_momentum
