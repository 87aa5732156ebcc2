"""The outer steps against the DESIGN.md fixture, and NoLoCo's 2-node reduction to DiLoCo."""

import pytest
import torch

from training.noloco import PeerTensors, diloco_step, noloco_step, outer_gradient
from training.settings import OuterConfig

CONFIG = OuterConfig(alpha=0.5, beta=0.7, gamma=0.7)


def rows(values: list[list[float]]) -> list[torch.Tensor]:
    """The fixture's two rows are the two nodes of the pair."""
    return [torch.tensor(row, dtype=torch.float64) for row in values]


PHI = rows([[1, -2, 0.5], [3, 0, -1.5]])
THETA = rows([[0.6, -1, 0.25], [2.4, -0.5, -0.75]])
MOMENTUM = rows([[0.2, -0.4, 0.1], [-0.3, 0.6, -0.2]])
EXPECTED_PHI = rows([[1.45, -1.325, 0.025], [1.8, -0.225, -0.725]])
EXPECTED_MOMENTUM = rows([[0.45, 0.675, -0.475], [-1.2, -0.225, 0.775]])


@pytest.mark.parametrize(("i", "j"), [(0, 1), (1, 0)])
def test_design_fixture(i: int, j: int) -> None:
    peer = PeerTensors(phi=[PHI[j]], delta=outer_gradient([PHI[j]], [THETA[j]]))
    (phi,), (momentum,) = noloco_step([PHI[i]], [THETA[i]], [MOMENTUM[i]], peer, CONFIG)
    torch.testing.assert_close(phi, EXPECTED_PHI[i], rtol=0, atol=1e-12)
    torch.testing.assert_close(momentum, EXPECTED_MOMENTUM[i], rtol=0, atol=1e-12)


def test_gamma_term_preserves_the_pair_mean_of_phi_minus_momentum_drift() -> None:
    # Summed over the pair the γ terms cancel: mean φ' = mean φ + α·mean m − β·mean Δ.
    new = [noloco_step([PHI[i]], [THETA[i]], [MOMENTUM[i]], peer_of(1 - i), CONFIG)[0][0] for i in (0, 1)]
    deltas = outer_gradient(PHI, THETA)
    expected = (
        (PHI[0] + PHI[1]) / 2
        + CONFIG.alpha * (MOMENTUM[0] + MOMENTUM[1]) / 2
        - CONFIG.beta * (deltas[0] + deltas[1]) / 2
    )
    torch.testing.assert_close((new[0] + new[1]) / 2, expected, rtol=0, atol=1e-12)


def test_with_compressed_payloads_the_pair_mean_moves_by_the_shared_averages() -> None:
    # Each side steps from its exact φ but averages what was sent (here: rounded to 0.25).
    def coarse(t: torch.Tensor) -> torch.Tensor:
        return torch.round(t * 4) / 4

    sent = [PeerTensors(phi=[coarse(PHI[i])], delta=[coarse(PHI[i] - THETA[i])]) for i in (0, 1)]
    steps = [noloco_step([PHI[i]], [THETA[i]], [MOMENTUM[i]], sent[1 - i], CONFIG, sent=sent[i]) for i in (0, 1)]
    mean_delta = (sent[0].delta[0] + sent[1].delta[0]) / 2
    for i in (0, 1):  # both sides used the same mean Δ and opposite pulls
        pull = sent[i].phi[0] - (sent[0].phi[0] + sent[1].phi[0]) / 2
        expected_m = CONFIG.alpha * MOMENTUM[i] - CONFIG.beta * mean_delta - CONFIG.gamma * pull
        torch.testing.assert_close(steps[i][1][0], expected_m, rtol=0, atol=1e-12)
        torch.testing.assert_close(steps[i][0][0], PHI[i] + expected_m, rtol=0, atol=1e-12)
    expected_mean = (PHI[0] + PHI[1]) / 2 + CONFIG.alpha * (MOMENTUM[0] + MOMENTUM[1]) / 2 - CONFIG.beta * mean_delta
    torch.testing.assert_close((steps[0][0][0] + steps[1][0][0]) / 2, expected_mean, rtol=0, atol=1e-12)


def peer_of(j: int) -> PeerTensors:
    return PeerTensors(phi=[PHI[j]], delta=outer_gradient([PHI[j]], [THETA[j]]))


def test_without_a_partner_the_step_is_local_heavy_ball() -> None:
    (phi,), (momentum,) = noloco_step([PHI[0]], [THETA[0]], [MOMENTUM[0]], None, CONFIG)
    expected_m = CONFIG.alpha * MOMENTUM[0] - CONFIG.beta * (PHI[0] - THETA[0])
    torch.testing.assert_close(momentum, expected_m, rtol=0, atol=0)
    torch.testing.assert_close(phi, PHI[0] + expected_m, rtol=0, atol=0)


def test_inputs_are_not_modified() -> None:
    phi, theta, momentum = [t.clone() for t in PHI], [t.clone() for t in THETA], [t.clone() for t in MOMENTUM]
    noloco_step(phi[:1], theta[:1], momentum[:1], peer_of(1), CONFIG)
    diloco_step(phi, [outer_gradient(phi, theta)], momentum, CONFIG)
    for before, after in zip(PHI + THETA + MOMENTUM, phi + theta + momentum, strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_two_nodes_reduce_bitwise_to_heavy_ball_diloco(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    start = [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    noloco = [([t.clone() for t in start], [torch.zeros_like(t) for t in start]) for _ in range(2)]
    diloco = [([t.clone() for t in start], [torch.zeros_like(t) for t in start]) for _ in range(2)]
    for _ in range(5):  # rounds; each node's inner steps are stood in for by a random walk
        thetas = [
            [p - 0.1 * torch.randn(p.shape, generator=generator).to(dtype) for p in noloco[0][0]] for _ in range(2)
        ]
        deltas = [outer_gradient(noloco[i][0], thetas[i]) for i in range(2)]
        noloco = [
            noloco_step(noloco[i][0], thetas[i], noloco[i][1], PeerTensors(noloco[1 - i][0], deltas[1 - i]), CONFIG)
            for i in range(2)
        ]
        diloco = [diloco_step(diloco[i][0], [deltas[0], deltas[1]], diloco[i][1], CONFIG) for i in range(2)]
        for i in range(2):
            for a, b in zip(noloco[i][0] + noloco[i][1], diloco[i][0] + diloco[i][1], strict=True):
                assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(noloco[0][0], noloco[1][0], strict=True))


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="gamma"):
        OuterConfig(gamma=-1)


def per_tensor_noloco(
    phi: list[torch.Tensor],
    theta: list[torch.Tensor],
    momentum: list[torch.Tensor],
    peer: PeerTensors | None,
    sent: PeerTensors | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The step as DESIGN.md writes it, one tensor at a time (what training/noloco.py did
    before it worked on whole lists)."""
    new_phi, new_momentum = [], []
    for k, (p, t, m) in enumerate(zip(phi, theta, momentum, strict=True)):
        d = p - t
        if peer is None:
            m_new = CONFIG.alpha * m - CONFIG.beta * d
        else:
            own_phi, own_delta = (p, d) if sent is None else (sent.phi[k], sent.delta[k])
            mean_delta = (own_delta + peer.delta[k]) / 2
            pull = own_phi - (own_phi + peer.phi[k]) / 2
            m_new = CONFIG.alpha * m - CONFIG.beta * mean_delta - CONFIG.gamma * pull
        new_momentum.append(m_new)
        new_phi.append(p + m_new)
    return new_phi, new_momentum


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
def test_the_list_steps_give_the_per_tensor_formulas_bits(device: str) -> None:
    """On a GPU the list ops are other kernels (one launch for many tensors): the same bits
    as the per-tensor formula all the same, so every node's outer step agrees with the
    DESIGN.md recipe whatever runs it."""
    generator = torch.Generator().manual_seed(7)
    shapes = [(64, 33), (1,), (1000,), (3, 5, 7), (0,), (257,)]

    def tensors(scale: float) -> list[torch.Tensor]:
        return [(torch.randn(s, generator=generator) * scale).to(device) for s in shapes]

    phi, theta, momentum = tensors(1.0), tensors(1.0), tensors(0.1)
    peer = PeerTensors(phi=tensors(1.0), delta=tensors(0.01))
    sent = PeerTensors(phi=tensors(1.0), delta=tensors(0.01))
    for partner, as_sent in ((None, None), (peer, None), (peer, sent)):
        got = noloco_step(phi, theta, momentum, partner, CONFIG, sent=as_sent)
        want = per_tensor_noloco(phi, theta, momentum, partner, as_sent)
        for ours, theirs in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
            assert torch.equal(ours.view(-1).view(torch.int32), theirs.view(-1).view(torch.int32))
    deltas = [tensors(0.01) for _ in range(3)]
    new_phi, new_momentum = diloco_step(phi, deltas, momentum, CONFIG)
    for k, (p, m) in enumerate(zip(phi, momentum, strict=True)):
        mean = (deltas[0][k].clone() + deltas[1][k] + deltas[2][k]) / 3
        m_want = CONFIG.alpha * m - CONFIG.beta * mean
        assert torch.equal(new_momentum[k], m_want) and torch.equal(new_phi[k], p + m_want)
    assert noloco_step([], [], [], None, CONFIG) == ([], [])
