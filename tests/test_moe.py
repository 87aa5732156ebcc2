"""The mixture-of-experts layer (training/moe.py) and the MoE presets."""

import pytest
import torch

from training.models import GPT, GPTConfig, preset
from training.moe import MoE, expert_index, has_grouped_mm

needs_grouped_mm = pytest.mark.skipif(not has_grouped_mm(), reason="torch.nn.functional.grouped_mm needs torch >= 2.9")


def _layer(grouped: bool, *, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(16, 24, num_experts=4, top_k=2, grouped=grouped)
    for expert in layer.experts:
        torch.nn.init.normal_(expert.w_in, std=0.3)
        torch.nn.init.normal_(expert.w_out, std=0.3)
    return layer


def _grouped_and_loop(
    trained: list[int] | None = None,
) -> tuple[MoE, list[torch.Tensor], list[list[torch.Tensor | None]]]:
    """The same layer grouped and as a loop (``trained``: the experts left trainable), each
    run forward and backward on one input: the grouped layer, and both outputs and gradients
    (input's, then each parameter's; grouped first). Expert 3 gets no token at all: an empty group must work in both."""
    grouped, loop = _layer(True), _layer(False)
    loop.load_state_dict(grouped.state_dict())
    grouped.route_bias[3] = loop.route_bias[3] = -100.0
    x = torch.randn(5, 7, 16, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for layer in (grouped, loop):
        layer.eval()  # the routing bias stays put between the two
        if trained is not None:
            for e, expert in enumerate(layer.experts):
                expert.requires_grad_(e in trained)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad, *(p.grad for p in layer.parameters())])
    return grouped, outs, grads


@needs_grouped_mm
def test_the_grouped_matmul_matches_the_loop_bit_for_bit_forward_and_backward() -> None:
    grouped, outs, grads = _grouped_and_loop()
    assert int(grouped.load[3]) == 0 and torch.equal(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


@needs_grouped_mm
@pytest.mark.parametrize("trained", [[1, 3], [3], [0, 2, 3]])
def test_frozen_experts_get_no_weight_gradient_and_the_rest_matches_the_loop_bit_for_bit(trained: list[int]) -> None:
    """SPES: a node trains some experts. The grouped path then sorts the owned experts'
    tokens first and computes weight gradients for them only; every output and gradient is
    the loop's, bit for bit (top-2: a token's two outputs add the same in either order),
    with empty groups on both sides (expert 3 gets no token)."""
    grouped, outs, grads = _grouped_and_loop(trained)
    assert grouped._owned_first(torch.zeros(1)) is not None  # the path under test ran
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
    frozen = [e for e in range(4) if e not in trained]
    assert all(grouped.experts[e].w_in.grad is None and grouped.experts[e].w_out.grad is None for e in frozen)
    assert all(grouped.experts[e].w_in.grad is not None for e in trained)


def test_a_token_goes_to_its_top_k_experts_weighted_by_renormalized_scores() -> None:
    layer = _layer(False).eval()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(layer.router(x), dim=-1)
    expected = torch.zeros_like(x)
    for t in range(3):
        top = torch.topk(probs[t], 2).indices
        weights = probs[t, top] / probs[t, top].sum()
        for w, e in zip(weights, top.tolist(), strict=True):
            expert = layer.experts[e]
            expected[t] += w * (torch.nn.functional.gelu(x[t] @ expert.w_in) @ expert.w_out)
    with torch.no_grad():
        assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_the_routing_bias_chooses_experts_but_never_weights_them() -> None:
    layer = _layer(False).eval()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = layer(x)
        layer.route_bias += 0.5  # the same shift for every expert: the same choice
        assert torch.equal(layer(x), before)
        layer.route_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
        layer(x)
    assert layer.load.tolist() == [0.5, 0.5, 0.0, 0.0]  # every token chose experts 0 and 1


def test_the_bias_moves_toward_balance_only_in_training_steps() -> None:
    layer = _layer(False)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(4))
    layer.route_bias.copy_(torch.tensor([1.0, 1.0, 0.0, 0.0]))  # experts 0 and 1 take everything
    layer.eval()
    layer(x)
    assert layer.route_bias.tolist() == [1.0, 1.0, 0.0, 0.0]
    layer.train()
    with torch.no_grad():
        layer(x)
    assert layer.route_bias.tolist() == [1.0, 1.0, 0.0, 0.0]  # a forward without a step (ZO, eval)
    layer(x)
    rate = layer.bias_rate
    assert torch.equal(layer.route_bias, torch.tensor([1.0 - rate, 1.0 - rate, rate, rate]))


def test_a_preference_routes_training_tokens_but_balance_counts_the_choice_without_it() -> None:
    """SPES's ``spes.prefer_owned``: a training forward sends its tokens to the preferred
    experts (weighted by the router as always); the bias, the load and the auxiliary loss
    are those of the same forward without the preference; evaluation ignores it."""
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(6))
    plain, preferring = _layer(False), _layer(False)
    preferring.preference = torch.tensor([0.0, 0.0, 100.0, 100.0])
    with torch.no_grad():  # no training step: no preference
        assert torch.equal(preferring(x), plain(x))
    preferring.eval()
    plain.eval()
    assert torch.equal(preferring(x), plain(x))
    preferring.train()
    plain.train()
    out, reference = preferring(x), plain(x)
    assert torch.equal(preferring.route_bias, plain.route_bias)
    assert torch.equal(preferring.load, plain.load)
    assert torch.equal(preferring.aux_loss, plain.aux_loss)
    assert not torch.equal(plain.load, torch.tensor([0.0, 0.0, 0.5, 0.5]))  # balance saw another choice
    # Every token went to experts 2 and 3, weighted by their renormalized router scores.
    probs = torch.softmax(preferring.router(x), dim=-1).detach()
    weights = probs[:, 2:] / probs[:, 2:].sum(dim=-1, keepdim=True)
    expected = sum(
        weights[:, i : i + 1] * (torch.nn.functional.gelu(x @ preferring.experts[e].w_in) @ preferring.experts[e].w_out)
        for i, e in enumerate((2, 3))
    )
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(reference, expected, rtol=1e-5, atol=1e-6)


@needs_grouped_mm
def test_a_small_preference_tips_close_choices_alike_on_the_grouped_owned_first_path() -> None:
    """With experts 0 and 2 frozen, the grouped path (``_OwnedFirst``: owned experts' rows
    first) and the loop take the same preferred choice, bit for bit."""
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(7))
    results = []
    for grouped in (True, False):
        layer = _layer(grouped)
        for e, expert in enumerate(layer.experts):
            expert.requires_grad_(e in (1, 3))
        before = layer.load.clone()
        layer.preference = torch.tensor([0.0, 0.1, 0.0, 0.1])
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.sum().backward()
        results.append([out.detach(), xi.grad, *(p.grad for p in layer.parameters()), layer.route_bias.clone()])
        assert not torch.equal(layer.load, before)
    for got, want in zip(*results, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    layer = _layer(False)
    with torch.no_grad():
        plain = torch.topk(torch.softmax(layer.router(x), dim=-1), 2).indices
    preferred = torch.isin(plain, torch.tensor([1, 3])).sum()
    assert 0 < preferred < plain.numel()  # 0.1 changes some choices, not all: a close-call test


def test_picked_experts_whose_probabilities_underflowed_give_zero_not_nan() -> None:
    layer = _layer(False).eval()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1e4  # expert 0 takes all the probability for x[:, 0] > 0
        layer.route_bias.copy_(torch.tensor([-10.0, 0.0, 5.0, 5.0]))  # but experts 2 and 3 are picked
        x = torch.zeros(3, 16)
        x[:, 0] = 1.0
        out = layer(x)
    assert torch.equal(out, torch.zeros_like(out))


def test_the_balance_loss_is_e_times_the_sum_of_load_share_times_mean_probability() -> None:
    layer = _layer(False).eval()
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        layer(x)
        probs = torch.softmax(layer.router(x), dim=-1)
    assert torch.allclose(layer.aux_loss, 4 * (layer.load * probs.mean(dim=0)).sum())
    assert float(layer.load.sum()) == pytest.approx(1.0)


def test_expert_parameters_are_named_by_expert() -> None:
    model = GPT(GPTConfig(num_layers=2, embed_dim=32, num_heads=2, num_experts=4))
    experts = {name: expert_index(name) for name, _ in model.named_parameters()}
    assert experts["blocks.1.moe.experts.3.w_in"] == 3
    assert experts["blocks.0.moe.router.weight"] is None and experts["token_embed.weight"] is None
    assert sorted({e for e in experts.values() if e is not None}) == [0, 1, 2, 3]


def test_tiny_moe_has_the_dense_tiny_s_active_parameters() -> None:
    dense, moe = GPT(preset("tiny")), GPT(preset("tiny-moe"))
    config = preset("tiny-moe")
    per_expert = 2 * config.embed_dim * config.moe_hidden
    idle = config.num_layers * (config.num_experts - config.experts_top_k) * per_expert
    active = moe.num_params() - idle
    # The MoE drops the dense MLP's two biases and adds a router: within 0.1%.
    assert abs(active - dense.num_params()) / dense.num_params() < 1e-3
    assert moe.num_params() > 2.5 * dense.num_params()


def test_a_small_moe_gpt_fits_a_batch_and_its_experts_share_the_load() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(context_len=32, num_layers=2, num_heads=2, embed_dim=32, num_experts=4))
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(6))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    first = None
    for _ in range(60):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = float(loss.detach()) if first is None else first
    model.eval()
    with torch.no_grad():
        final = float(model.loss(tokens[:, :-1], tokens[:, 1:]))
    # ln(256) ≈ 5.55 at the start; 60 steps on one batch of 256 tokens memorize much of it.
    assert first is not None and final < first - 1.0
    for layer in model.moes():
        assert float(layer.load.min()) > 0.0  # no expert starved on this batch
