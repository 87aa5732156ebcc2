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
