"""The worker's training core in one process: inner steps, outer payloads, bad partners."""

import pytest
import torch

from training import corpus, data, encodings
from training.models import GPT, GPTConfig
from training.settings import InnerConfig, OuterConfig
from training.trainer import PayloadRejected, Trainer

SMALL = GPTConfig(context_len=32, embed_dim=32, num_layers=2, num_heads=2)
TOKENS = data.encode(corpus.embedded_corpus()[:200_000])


def trainer(node_index: int, num_nodes: int = 2, *, steps: int = 10, compression: str = "none") -> Trainer:
    torch.manual_seed(0)  # the same initial weights on every node, as a run's checkpoint would give
    shard = data.make_shard(TOKENS, context_len=SMALL.context_len, node_index=node_index, num_nodes=num_nodes)
    return Trainer(
        GPT(SMALL),
        shard,
        inner=InnerConfig(steps_per_round=steps, lr=3e-3),
        outer=OuterConfig(),
        seed=node_index,
        compression=compression,
    )


def test_local_training_lowers_validation_loss() -> None:
    t = trainer(0, 1)
    before = t.val_loss(64)
    for _ in range(4):
        t.inner_steps()
        t.apply_local()
    assert t.val_loss(64) < before - 1.0


@pytest.mark.parametrize("compression", encodings.NAMES)
def test_noloco_rounds_between_two_trainers_learn_and_keep_weights_finite(compression: str) -> None:
    a, b = trainer(0, compression=compression), trainer(1, compression=compression)
    before = a.val_loss(64)
    for _ in range(4):
        a.inner_steps()
        b.inner_steps()
        pa, pb = a.outer_payload(), b.outer_payload()
        assert a.apply_noloco(pb) and b.apply_noloco(pa)
    assert a.val_loss(64) < before - 1.0
    # Two nodes that always pair hold the same slow weights (heavy-ball DiLoCo); compressed
    # too, since both sides average the same dequantized values.
    assert all(torch.equal(x, y) for x, y in zip(a.phi, b.phi, strict=True))


@pytest.mark.parametrize("damage", ["nan", "inf", "short", "float64"])
def test_a_bad_partner_payload_is_rejected_and_the_round_goes_on_alone(damage: str) -> None:
    a, b = trainer(0), trainer(1)
    a.inner_steps()
    b.inner_steps()
    payload = b.outer_payload()
    if damage == "nan":
        payload.view(torch.float32)[123] = float("nan")
    elif damage == "inf":
        payload.view(torch.float32)[-1] = float("inf")
    elif damage == "short":
        payload = payload[:-1]
    else:
        payload = payload.view(torch.float32).double()
    with pytest.raises(PayloadRejected, match="NaN or Inf" if damage in ("nan", "inf") else "expected uint8"):
        a.parse_payload(payload)
    reference = trainer(0)
    reference.inner_steps()
    assert a.apply_noloco(payload) is False  # fell back to the no-partner step
    assert a.last_rejection is not None and a.last_rejection_drifted is False
    if damage in ("nan", "inf"):  # said as such (its norms would refuse it too, as out of bounds)
        assert "NaN or Inf" in a.last_rejection
    assert reference.apply_noloco(None) is False
    assert all(torch.equal(x, y) for x, y in zip(a.phi, reference.phi, strict=True))
    assert all(torch.isfinite(p).all() for p in a.model.parameters())


def test_payload_round_trips_into_our_shapes() -> None:
    a = trainer(0)
    a.inner_steps()
    peer = a.parse_payload(a.outer_payload())
    assert [p.shape for p in peer.phi] == [p.shape for p in a.phi]
    assert all(torch.equal(x, y) for x, y in zip(peer.phi, a.phi, strict=True))


def test_int8_payloads_are_about_four_times_smaller_and_close_to_float32() -> None:
    exact, small = trainer(0), trainer(0, compression="int8")
    assert exact.payload_nbytes / small.payload_nbytes > 3.8
    exact.inner_steps()
    small.inner_steps()
    received = small.parse_payload(small.outer_payload())
    for ours, theirs in zip(exact.phi, received.phi, strict=True):
        assert float((ours - theirs).abs().max()) <= float(ours.abs().max()) / 254 + 1e-7


@pytest.mark.parametrize("damage", ["nan-scale", "negative-scale", "float32-sized"])
def test_a_bad_int8_payload_is_rejected(damage: str) -> None:
    a, b = trainer(0, compression="int8"), trainer(1, compression="int8")
    b.inner_steps()
    payload = b.outer_payload()
    scales = payload[b.payload_numel :].clone().view(torch.float32)
    if damage == "float32-sized":  # a partner that did not compress: the sizes differ
        payload = trainer(1).outer_payload()
    else:
        scales[0] = float("nan") if damage == "nan-scale" else -1.0
        payload[b.payload_numel :] = scales.view(torch.uint8)
    with pytest.raises(PayloadRejected):
        a.parse_payload(payload)
    a.inner_steps()
    a.outer_payload()
    assert a.apply_noloco(payload) is False
    assert all(torch.isfinite(p).all() for p in a.model.parameters())


# Compiled and eager kernels sum in different orders. In float32 three AdamW steps took
# weights 5.2e-5 apart on one CPU (AdamW turns a gradient component near 0 into a step of
# ±lr, so a rounding difference there can move a weight by lr): no tolerance holds on every
# CPU. In float64 (u = 2**-53) a gradient component, a sum of at most 256 terms (8 × 32
# positions) of magnitude at most 1, differs by δ ≤ 256·u ≈ 3e-14; AdamW's steepest
# response to it is lr/ε = 3e-3/1e-8 = 3e5 (a gradient near 0), so three steps move a
# weight apart by ≤ 3 · 3e5 · 3e-14 ≈ 3e-8; 1e-7 leaves room for the second-order effect
# of one step's difference on the next. A compiled model computing anything else moves
# weights apart by about lr = 3e-3 a step.
COMPILED_ATOL = 1e-7


def test_a_compiled_model_trains_like_the_eager_one() -> None:
    eager, compiled = trainer(0, steps=3), trainer(0, steps=3)
    for t in (eager, compiled):
        t.model.double()  # the same Parameters: AdamW has no state yet
    compiled._loss = torch.compile(compiled.model.loss)  # what compile_model=True sets up
    # The mean loss of the steps: weights within COMPILED_ATOL each (34k of them: ≤ 2e-5
    # apart in norm) under a gradient norm of a few change a loss of ~5 by ≤ 1e-5 of it.
    assert eager.inner_steps() == pytest.approx(compiled.inner_steps(), rel=1e-5)
    for a, b in zip(eager.model.parameters(), compiled.model.parameters(), strict=True):
        assert a.dtype == b.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0.0, atol=COMPILED_ATOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("compression", encodings.NAMES)
def test_on_cuda_payloads_leave_as_cpu_bytes_and_pairs_stay_identical(compression: str) -> None:
    def on_cuda(node_index: int) -> Trainer:
        torch.manual_seed(0)
        shard = data.make_shard(TOKENS, context_len=SMALL.context_len, node_index=node_index, num_nodes=2)
        inner = InnerConfig(steps_per_round=5, lr=3e-3)
        return Trainer(
            GPT(SMALL), shard, inner=inner, outer=OuterConfig(), seed=node_index, compression=compression, device="cuda"
        )

    a, b = on_cuda(0), on_cuda(1)
    before = a.val_loss(64)
    for _ in range(3):
        a.inner_steps()
        b.inner_steps()
        pa, pb = a.outer_payload(), b.outer_payload()
        assert pa.device.type == "cpu" and pa.dtype == torch.uint8 and pa.numel() == a.payload_nbytes
        assert a.apply_noloco(pb) and b.apply_noloco(pa)
    assert a.val_loss(64) < before
    assert all(torch.equal(x, y) for x, y in zip(a.phi, b.phi, strict=True))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
@pytest.mark.parametrize("compression", encodings.NAMES)
def test_export_into_the_outbox_gives_the_payloads_bytes(device: str, compression: str) -> None:
    """What the worker writes to its outbox (``export_into``: straight from the GPU for a
    float32 payload) is ``outer_payload``'s bytes, and a partner parses it alike."""
    torch.manual_seed(0)
    shard = data.make_shard(TOKENS, context_len=SMALL.context_len, node_index=0, num_nodes=2)
    t = Trainer(
        GPT(SMALL), shard, inner=InnerConfig(steps_per_round=3), outer=OuterConfig(), seed=0,
        compression=compression, device=device,
    )  # fmt: skip
    t.inner_steps()
    outbox = torch.full((t.payload_nbytes,), 0xAB, dtype=torch.uint8)  # poisoned: every byte must be written
    t.export_into(outbox)
    assert torch.equal(outbox, t.outer_payload())
    t.export_into(outbox)  # again in the same round (the encoding's state moves once a round)
    assert torch.equal(outbox, t.outer_payload())


@pytest.mark.parametrize(
    ("poison", "reason"),
    [
        ("delta x -1000", "outer gradient"),
        ("delta x 1e30", "outer gradient"),
        ("phi = 1e30", "weights"),
        ("phi x 1000", "weights"),
    ],
)
def test_finite_but_poisoned_payloads_are_refused(poison: str, reason: str) -> None:
    """Finite is not enough: a stranger's Δ × −1000 destroyed the loss, φ = 1e30 the weights."""
    a, b = trainer(0), trainer(1)
    a.inner_steps()
    b.inner_steps()
    flat = b.outer_payload().view(torch.float32).clone()
    half = flat.numel() // 2
    if poison.startswith("delta"):
        flat[half:] *= -1000.0 if "-1000" in poison else 1e30
    elif poison == "phi = 1e30":
        flat[:half] = 1e30
    else:
        flat[:half] *= 1000.0
    assert bool(torch.isfinite(flat).all())
    with pytest.raises(PayloadRejected, match=reason):
        a.parse_payload(flat.view(torch.uint8))
    assert a.apply_noloco(flat.view(torch.uint8)) is False and a.last_rejection is not None
    assert a.last_rejection_drifted is False  # an attack: its sender is banned
    assert all(bool(torch.isfinite(p).all()) for p in a.phi)


def test_a_step_that_overflows_with_the_partner_is_taken_alone() -> None:
    """A payload within the bounds whose mean with ours overflows (our φ at 3e38 there, its
    the same: (a + b) / 2 is inf) is not used: the round's step is the no-partner one,
    whose φ stays finite, and the refusal says why."""
    a = trainer(0)
    with torch.no_grad():
        for t in (a.phi[0], next(a.model.parameters())):
            t.view(-1)[7] = 3e38
    reference = trainer(0)
    with torch.no_grad():
        for t in (reference.phi[0], next(reference.model.parameters())):
            t.view(-1)[7] = 3e38
    own = a.outer_payload().clone()  # a partner just like us: within every bound
    assert a.apply_noloco(own) is False
    assert a.last_rejection == "the outer step with its payload gives non-finite weights"
    assert reference.apply_noloco(None) is False
    assert all(torch.equal(x, y) for x, y in zip(a.phi, reference.phi, strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in a.phi)
    assert float(a.phi[0].view(-1)[7]) == float(torch.tensor(3e38))


def partner_payload(*, delta_times: float, updates_away: float) -> tuple[Trainer, torch.Tensor]:
    """A trainer after its inner steps, and a partner's payload (float32) made from its own:
    Δ = ``delta_times`` × ours, φ = ours + ``updates_away`` × our Δ."""
    a, b = trainer(0), trainer(1)
    a.inner_steps()
    b.inner_steps()
    flat = b.outer_payload().view(torch.float32).clone()
    half = flat.numel() // 2
    own = a.outer_payload().view(torch.float32)
    flat[half:] = delta_times * own[half:]
    flat[:half] = own[:half] + updates_away * own[half:]
    return a, flat


@pytest.mark.parametrize(("updates_away", "drifted"), [(30.0, True), (100.0, True), (200.0, False)])
def test_a_replica_that_drifted_is_refused_without_a_ban_and_an_attack_is_not(
    updates_away: float, drifted: bool
) -> None:
    """φ = ours + c·Δ: the furthest tensor is exactly c of our updates away (the one whose
    share of ‖Δ‖ is largest has ref_k = ‖Δ_k‖); past 16 it is refused, and past 8 × 16 it
    is an attack. Honest replicas reached 16–25 in the soak (training/noloco.py)."""
    a, flat = partner_payload(delta_times=1.0, updates_away=updates_away)
    with pytest.raises(PayloadRejected, match=f"{updates_away:.3g}× our update away") as refused:
        a.parse_payload(flat.view(torch.uint8))
    assert refused.value.drifted is drifted
    assert a.apply_noloco(flat.view(torch.uint8)) is False and a.last_rejection_drifted is drifted


def test_an_honest_partner_stays_far_inside_the_bounds() -> None:
    """The bounds (training/noloco.py) hold for honest partners with a wide margin: a partner
    whose Δ is twice and whose φ is three updates off ours is still taken."""
    a, flat = partner_payload(delta_times=2.0, updates_away=3.0)
    a.parse_payload(flat.view(torch.uint8))


@pytest.mark.parametrize("compression", ["none", "int8", "sparseloco"])
@pytest.mark.parametrize("partner", [True, False])
@pytest.mark.parametrize("eager", [True, False])
def test_an_overlapped_outer_step_is_the_on_time_one_with_the_steps_since_on_top(
    compression: str, partner: bool, eager: bool
) -> None:
    """``outer.overlap``: the next round's first steps run before the outer step lands. The
    step is made of θ as the round ended (φ' and m' bit-identical to a trainer that stepped
    on time); the steps start from S (eager: our own outer step alone, φ + αm − β·Δsent −
    residual; else θ as the round ended) and the step lands under what they added:
    θ = (φ' − residual) + (θ − S), one subtraction and one addition, bit for bit (θ as it
    is where that target is S)."""
    late, on_time = trainer(0, compression=compression), trainer(0, compression=compression)
    other = trainer(1, compression=compression)
    for t in (late, on_time, other):
        t.inner_steps()
    wire = other.outer_payload() if partner else None
    assert torch.equal(late.outer_payload(), on_time.outer_payload())
    ended = [p.clone() for p in late.theta()]
    late.hold_round_end(eager=eager)
    start = [p.detach().clone() for p in late.model.parameters()]
    if eager:
        residual = late.codec_state.get("residual")
        lefts = torch.split(residual, [p.numel() for p in late.phi]) if residual is not None else [0.0] * len(start)
        alpha, beta = late.outer.alpha, late.outer.beta
        guess = [
            p + (alpha * m - beta * d) - (left.view_as(p) if isinstance(left, torch.Tensor) else 0.0)
            for p, m, d, left in zip(late.phi, late.momentum, late.own_delta(), lefts, strict=True)
        ]
        assert all(torch.equal(a, b) for a, b in zip(start, guess, strict=True))
    else:
        assert all(torch.equal(a, b) for a, b in zip(start, ended, strict=True))
    late.inner_steps(3)  # the next round's first steps, while the exchange would travel
    moved = [p.detach().clone() for p in late.model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(moved, start, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(late.theta(), ended, strict=True))  # Δ stays the round's
    assert late.apply_noloco(wire) is partner and on_time.apply_noloco(wire) is partner
    for ours, theirs in ((late.phi, on_time.phi), (late.momentum, on_time.momentum)):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    # Where the step is S itself (alone, eager: our own step was the step), θ stays as is.
    expected = [m if torch.equal(s, t) else m - s + t for m, s, t in zip(moved, start, on_time.theta(), strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(late.theta(), expected, strict=True))
    assert late.round == on_time.round == 1 and late.step == on_time.step + 3
    assert late.codec_state.keys() == on_time.codec_state.keys()


@pytest.mark.parametrize("compression", ["none", "int8", "sparseloco"])
@pytest.mark.parametrize("partner", [True, False])
def test_a_restart_from_a_checkpoint_written_mid_overlap_lands_the_same_bit_for_bit(
    compression: str, partner: bool
) -> None:
    """The checkpoint the worker writes when an overlapped step lands (the staged round end:
    AdamW's moments and S; the step's result without AdamW; the round end's step count and
    3 overlapped steps): a fresh trainer restored from it takes the 3 steps again, lands the
    same step, and finishes the round with the weights of the one that never stopped."""
    a, other = trainer(0, compression=compression), trainer(1, compression=compression)
    for t in (a, other):
        t.inner_steps()
    wire = other.outer_payload() if partner else None
    a.outer_payload()
    a.hold_round_end(eager=True)
    staged = {name: t.clone() for name, t in a.round_end_state().items()}
    ended = a.step
    a.inner_steps(3)
    a.apply_noloco(wire)
    tensors, meta = a.state()
    kept = {name: t.clone() for name, t in tensors.items() if not name.startswith("adam.")}
    saved = {**staged, **kept}
    a.inner_steps(7)
    b = trainer(0, compression=compression)
    b.restore(saved, {**meta, "step": ended, "overlapped": 3})
    assert b.landing and b.landing_steps == 3 and b.round == a.round
    b.inner_steps(3)
    b.land()
    b.inner_steps(7)
    assert b.step == a.step
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_the_local_baseline_overlapped_keeps_its_weights_as_they_are() -> None:
    """Its step is φ' = θ as the round ended = S: landing it (θ − S + φ') would round θ."""
    t = trainer(0)
    t.inner_steps()
    t.outer_payload()
    t.hold_round_end(eager=False)
    t.inner_steps(3)
    moved = [p.detach().clone() for p in t.model.parameters()]
    t.apply_local()
    assert all(torch.equal(x, y) for x, y in zip(t.model.parameters(), moved, strict=True))


def test_every_point_of_a_curve_is_the_same_blocks_sized_from_the_rounds_compute() -> None:
    """A run's curve is measured on curve_rows blocks whatever the round: EVAL_SHARE of a
    round's forwards (F·H·B: F = 3 for a training step, 2 for ZO's SPSA), at least one,
    FULL_MAX_ROWS at most."""
    from training.settings import RunSettings
    from training.validation import EVAL_SHARE, FULL_MAX_ROWS, curve_rows

    def rows(algorithm: str, steps: int, batch_size: int = 8) -> int:
        run = RunSettings(algorithm=algorithm, inner=InnerConfig(steps_per_round=steps, batch_size=batch_size))
        return curve_rows(run)

    assert [rows("noloco", h) for h in (1, 10, 50, 300, 3000)] == [1, 7, 36, 216, FULL_MAX_ROWS]
    assert [rows("zo", h) for h in (1, 10, 50)] == [1, 4, 24]
    for algorithm, forwards in (("noloco", 3), ("zo", 2)):
        for steps in (10, 50, 100):
            assert rows(algorithm, steps) <= EVAL_SHARE * forwards * steps * 8 < rows(algorithm, steps) + 1


def test_validation_blocks_spread_over_the_split_and_are_every_nodes_and_every_calls() -> None:
    """The blocks a curve is measured on are spread over the whole split (its first blocks
    are one stretch of text), the same on every node's shard and at every call."""
    from training.validation import spread

    assert spread(181, 9) == [10, 30, 50, 70, 90, 110, 130, 150, 170]
    assert spread(5, 9) == spread(5, 5) == [0, 1, 2, 3, 4]
    for num_blocks, num_rows in ((181, 1), (181, 180), (1000, 7), (7, 6)):
        picked = spread(num_blocks, num_rows)
        assert len(set(picked)) == num_rows and all(0 <= r < num_blocks for r in picked) and picked == sorted(picked)
    a, b = trainer(0).shard, trainer(1).shard
    assert not torch.equal(a.train[:10], b.train[:10])  # other training blocks, the same validation ones
    first = a.val_batches(batch_size=8, num_rows=10)
    for again in (a.val_batches(batch_size=8, num_rows=10), b.val_batches(batch_size=8, num_rows=10)):
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(first, again, strict=True))
    blocks = torch.cat([x for x, _ in first])
    assert torch.equal(blocks, a.val[spread(len(a.val), 10), :-1])


@pytest.mark.parametrize("compression", encodings.NAMES)
def test_the_full_validation_measures_phi_what_export_writes_and_leaves_theta_alone(compression: str) -> None:
    """After an outer step θ = φ − what the payload left out (sparseloco's residual): the
    run's final figure is of φ, the checkpoint's and export's weights, not of θ."""
    a, b = trainer(0, compression=compression), trainer(1, compression=compression)
    for _ in range(2):
        a.inner_steps()
        b.inner_steps()
        pa, pb = a.outer_payload(), b.outer_payload()
        assert a.apply_noloco(pb) and b.apply_noloco(pa)
    theta = [p.detach().clone() for p in a.model.parameters()]
    of_phi = trainer(0)
    with torch.no_grad():
        for param, phi in zip(of_phi.model.parameters(), a.phi, strict=True):
            param.copy_(phi)
    assert a.phi_val_loss(64) == of_phi.val_loss(64)
    assert all(torch.equal(p, t) for p, t in zip(a.model.parameters(), theta, strict=True))
    if compression == "sparseloco":  # where they differ, the two measures do
        assert a.phi_val_loss(64) != a.val_loss(64)


def test_a_validation_loss_weighs_each_block_once_whatever_its_batch() -> None:
    """A short last batch weighs by its blocks: the loss of 10 blocks in batches of 8 and 2
    is their mean, one batch or two."""
    t = trainer(0)
    batches = t.shard.val_batches(batch_size=8, num_rows=10)
    assert [len(x) for x, _ in batches] == [8, 2]
    whole = trainer(0)
    whole.inner = InnerConfig(steps_per_round=10, lr=3e-3, batch_size=10)
    one_batch = whole.val_loss(10)
    two_batches = t.val_loss(10)
    # The same 10 blocks' losses, summed in another order, each through matmuls that may
    # block their float32 sums of embed_dim products differently for another batch shape:
    # a few roundings of embed_dim terms apart (≲ embed_dim · 2⁻²⁴ each, a few times over).
    assert abs(two_batches - one_batch) <= 4 * SMALL.embed_dim * 2**-24 * one_batch
