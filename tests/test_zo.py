"""Zeroth-order pieces: one-byte scalars, SPSA that leaves no trace, and fine-tuning that learns."""

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.test_trainer import trainer
from training import zo
from training.settings import ZoConfig

G_MAX = 8.0


def test_the_decoding_table_is_the_published_one() -> None:
    # Any implementation must decode the 128 levels to these float32 values, bit for bit.
    published = json.loads((Path(__file__).parent / "vectors" / "zo_g_v1.json").read_text())
    assert [float.fromhex(v) for v in published["magnitudes_float32_hex"]] == zo.MAGNITUDES.tolist()
    assert zo.MAGNITUDES[zo.LEVELS].item() == 1.0 and zo.MAGNITUDES[0].item() == 0.0


@given(st.floats(min_value=G_MAX * 2**-10, max_value=G_MAX), st.booleans())
def test_one_byte_keeps_g_within_three_percent(magnitude: float, negative: bool) -> None:
    g = -magnitude if negative else magnitude
    code = zo.encode_g(g, G_MAX)
    assert 0 <= code <= 0xFF
    decoded = zo.decode_g(code, G_MAX)
    assert math.copysign(1.0, decoded) == math.copysign(1.0, g)
    assert abs(decoded - g) / abs(g) <= 2 ** (1 / 24) - 1 + 1e-6


def test_zero_saturation_and_bad_values() -> None:
    assert zo.decode_g(zo.encode_g(0.0, G_MAX), G_MAX) == 0.0
    assert zo.decode_g(zo.encode_g(1e-9, G_MAX), G_MAX) == 0.0
    assert zo.decode_g(zo.encode_g(1e6, G_MAX), G_MAX) == G_MAX  # saturates like clipping
    assert zo.decode_g(zo.encode_g(-1e6, G_MAX), G_MAX) == -G_MAX
    assert all(abs(zo.decode_g(code, G_MAX)) <= G_MAX for code in range(256))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="encode"):
            zo.encode_g(bad, G_MAX)
    with pytest.raises(ValueError, match="one byte"):
        zo.decode_g(256, G_MAX)


@pytest.mark.parametrize("signs", [1, 2])
def test_spsa_leaves_the_weights_exactly_as_they_were_and_estimates_the_slope(signs: int) -> None:
    t = trainer(0)
    params = list(t.model.parameters())
    before = [p.detach().clone() for p in params]
    x, y = t.shard.batch(batch_size=8, seed=0, step=0)
    g = zo.spsa(params, lambda: t.model.loss(x, y).item(), seed=11, eps=1e-3, signs=signs)
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    # The directional derivative along z, from autograd, for comparison.
    loss = t.model.loss(x, y)
    grads = torch.autograd.grad(loss, params)
    from kernels import rng

    z = [rng.rademacher(11, k, gr.numel(), version=signs).view_as(gr) for k, gr in enumerate(grads)]
    slope = sum(float((gr * zk).sum()) for gr, zk in zip(grads, z, strict=True))
    assert g == pytest.approx(slope, rel=0.05, abs=1e-3)


def test_zo_fine_tuning_lowers_the_loss() -> None:
    t = trainer(0, steps=100)
    t.inner_steps()  # a briefly pretrained model, as ZO fine-tuning starts from one
    params = list(t.model.parameters())
    config = ZoConfig(lr=3e-3)
    before = t.val_loss(64)
    for step in range(300):
        x, y = t.shard.batch(batch_size=16, seed=1, step=step)
        seed = zo.step_seed(1, 0, step)
        g = zo.spsa(params, lambda x=x, y=y: t.model.loss(x, y).item(), seed, config.eps, signs=config.signs)  # type: ignore[misc]
        zo.apply_updates(params, [[(seed, zo.encode_g(g, config.g_max))]], config)
    assert t.val_loss(64) < before - 0.005


def test_the_default_step_size_scales_with_the_model() -> None:
    from training.models import GPT, preset

    micro = GPT(preset("micro")).num_params()
    assert zo.step_size(ZoConfig(), micro) == zo.LR_TIMES_PARAMS / micro
    assert 2.9e-3 < zo.step_size(ZoConfig(), micro) < 3.1e-3  # the value tuned on micro before
    assert zo.step_size(ZoConfig(lr=1e-3), micro) == 1e-3  # a run's explicit choice stands
    with pytest.raises(ValueError, match="step_size"):
        zo.apply_updates([torch.zeros(3)], [[(1, 0x7F)]], ZoConfig())


def test_coefficients_at_once_are_the_one_by_one_recipe_for_every_code() -> None:
    from kernels import zo_apply

    config = ZoConfig(lr=3.7e-4, g_max=11.0)
    codes = list(range(256))
    one_by_one = zo_apply.coefficients(config.lr, [zo.decode_g(code, config.g_max) for code in codes])
    at_once = zo.coefficients(codes, config)
    assert torch.equal(one_by_one.view(torch.int32), at_once.view(torch.int32))  # −0.0 for code 0x80 too
    with pytest.raises(ValueError, match="one byte"):
        zo.coefficients([256], config)


def test_pending_rounds_go_together_with_the_bits_of_one_pass_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    from training.algorithms import zo as zo_worker

    config = ZoConfig(lr=1e-2)
    rounds = [[(1, 10), (2, 200)], [], [(3, 40)], [(4, 90), (5, 7)], [(6, 255)], [(8, 1)]]
    one_by_one = [torch.linspace(-1, 1, 301), torch.ones(5, 7)]
    batched = [t.clone() for t in one_by_one]
    for group in rounds:
        zo.apply_updates(one_by_one, [group], config)
    passes: list[int] = []
    real = zo.apply_updates

    def counted(params: list[torch.Tensor], groups: list[list[tuple[int, int]]], cfg: ZoConfig) -> None:
        passes.append(len(groups))
        real(params, groups, cfg)

    monkeypatch.setattr(zo, "apply_updates", counted)
    monkeypatch.setattr(zo_worker, "REPLAY_BATCH_UPDATES", 3)
    pending = zo_worker.Pending(batched, config)
    for group in rounds:
        pending.add(group)
    assert passes == [2, 2]  # at three updates pending (the empty round is none): one pass for two rounds
    pending.flush()
    assert passes == [2, 2, 1]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(one_by_one, batched, strict=True))
    pending.add([(7, 3)])
    pending.drop()  # a rewind or rebuild replaces the weights: nothing pending is applied
    pending.flush()
    assert passes == [2, 2, 1]
