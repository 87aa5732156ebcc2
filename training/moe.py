"""A mixture-of-experts feed-forward layer: top-k routing over E experts, run as one grouped matmul.

Each token's router scores (a softmax over the experts) pick its ``top_k`` experts; the
token's output is their outputs weighted by the picked scores, renormalized to sum to 1.
Experts are two-matrix GELU MLPs without biases (``w_in``: dim × hidden, ``w_out``:
hidden × dim), one ``Expert`` module each, so that a node can own and train some experts
and hold the others frozen (SPES, docs/training.md): parameters are named
``….experts.<e>.w_in`` / ``.w_out``, and ``expert_index`` reads ``e`` back from a name.

The tokens are sorted by expert and every expert's slice multiplied in one call of
``torch.nn.functional.grouped_mm`` (torch ≥ 2.9, CPU and CUDA). ``grouped=False`` runs
the same slices in a Python loop: the reference the tests hold it to (bit-identical in
float32), and the path where grouped_mm is missing.

When a node trains some experts and holds the others frozen (SPES), autograd's grouped
matmul would still compute every expert's weight gradient and drop the frozen ones'.
``_OwnedFirst`` sorts the tokens owned experts first and computes weight gradients for
those groups only (a grouped matmul over the first groups' rows), the input gradient for
all: every tensor keeps the size it has in the full path (no allocation varies with how
many tokens the owned experts got: varying sizes fragmented glibc's heap, docs/training.md).
The owned experts' gradients are bit-identical to autograd's on the same order. CPU only
for now: CUDA's grouped matmul with groups that end before the last row is not measured yet.

Balance without a global view (no node sees the others' routing):
- Auxiliary-loss-free bias (Wang et al. 2024, as in DeepSeek-V3): a per-expert bias is
  added to the scores for *choosing* experts only (never to the weights); after each
  training forward it moves by ``bias_rate`` toward balance, up for an expert that got
  fewer tokens than the mean, down for one that got more. It is local state (a buffer:
  not averaged, not sent), each node balancing its own data.
- A small auxiliary loss (Switch Transformer): E · Σ_e f_e · P_e, with f_e the share of
  routed token slots expert e got and P_e its mean router probability; 1 when balanced.
  ``aux_loss`` holds the last forward's value; the model adds it with its weight.

A preference (``preference``: SPES, training/spes.py) is added to the scores when a
training forward picks experts, on top of the bias: a node that trains only some experts
sends more of its tokens to them. Both balancers count the choice made without it, so
they do not work against it, and evaluation (no preference) routes as balanced.
"""

import re
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """The expert a parameter name belongs to (``blocks.1.moe.experts.3.w_in`` → 3), or None."""
    match = _EXPERT_NAME.search(name)
    return int(match.group(1)) if match else None


def has_grouped_mm() -> bool:
    return hasattr(F, "grouped_mm")


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(dim, hidden))
        self.w_out = nn.Parameter(torch.empty(hidden, dim))


class MoE(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        bias_rate: float = 1e-3,
        grouped: bool | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.bias_rate = bias_rate
        self.grouped = has_grouped_mm() if grouped is None else grouped
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.route_bias: torch.Tensor
        self.register_buffer("route_bias", torch.zeros(num_experts))
        self.load: torch.Tensor
        """Share of the routed token slots each expert got in the last forward (sums to 1);
        in a training forward with a ``preference``, the share it would have got without."""
        self.register_buffer("load", torch.full((num_experts,), 1.0 / num_experts), persistent=False)
        self.aux_loss = torch.zeros(())
        self.preference: torch.Tensor | None = None
        """Added to the experts' scores when a training forward picks them (SPES: a node's
        own experts get ``spes.prefer_owned``, training/spes.py); None: no preference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        scores = probs + self.route_bias
        _, chosen = torch.topk(scores, self.top_k, dim=-1)
        stepping = self.training and torch.is_grad_enabled()  # not in ZO's or eval's forwards
        balanced: torch.Tensor | None = None
        if stepping and self.preference is not None:
            # Balance is kept on the choice without the preference: the bias and the
            # auxiliary loss do not fight it, and the bias stays what balanced routing
            # needs at evaluation (where there is no preference).
            balanced = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
            _, chosen = torch.topk(scores + self.preference, self.top_k, dim=-1)
        weights = probs.gather(1, chosen)
        # Never 0/0: a bias or a preference may pick experts whose probabilities underflowed
        # to 0. A sum below float32's smallest normal counts as that (the token's output is
        # then about 0); any larger sum divides as before, the same bits.
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
        flat = chosen.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        balanced = counts if balanced is None else balanced
        owned = self._owned_first(tokens)
        if owned is None:
            order = torch.argsort(flat, stable=True)
            token_of = order // self.top_k
            routed = self._experts(tokens[token_of], counts)
        else:
            experts, num_trained = owned
            permuted = torch.tensor(experts, device=counts.device)
            position = torch.empty_like(counts)
            position[permuted] = torch.arange(self.num_experts, device=counts.device)
            order = torch.argsort(position[flat], stable=True)
            token_of = order // self.top_k
            routed = self._owned_experts(tokens[token_of], counts[permuted], experts, num_trained)
        routed = routed * weights.reshape(-1)[order].unsqueeze(1).to(routed.dtype)
        out = torch.zeros_like(tokens).index_add_(0, token_of, routed.to(tokens.dtype))
        share = balanced.to(probs.dtype) / flat.numel()
        self.aux_loss = self.num_experts * (share * probs.mean(dim=0)).sum()
        with torch.no_grad():
            self.load.copy_(share)
            if stepping:
                self.route_bias.add_(self.bias_rate * torch.sign(share.mean() - share))
        return out.reshape(shape)

    def _owned_first(self, tokens: torch.Tensor) -> tuple[list[int], int] | None:
        """The experts in the order ``_OwnedFirst`` takes them (trained ones first) and how
        many are trained, or None where the plain path serves: all or none trained, no
        gradient, or not on the CPU."""
        if not (self.grouped and torch.is_grad_enabled() and tokens.device.type == "cpu"):
            return None
        experts = cast(list[Expert], list(self.experts))
        trained = [e for e, expert in enumerate(experts) if expert.w_in.requires_grad]
        if not 0 < len(trained) < self.num_experts:
            return None
        return trained + [e for e in range(self.num_experts) if e not in trained], len(trained)

    def _owned_experts(
        self, xs: torch.Tensor, counts: torch.Tensor, order: list[int], num_trained: int
    ) -> torch.Tensor:
        """``_experts`` on tokens sorted in ``order`` (``counts`` in that order), its first
        ``num_trained`` experts trained."""
        experts = cast(list[Expert], list(self.experts))
        trained = [experts[e] for e in order[:num_trained]]
        frozen = [experts[e] for e in order[num_trained:]]
        offs = torch.cumsum(counts, 0).to(torch.int32)
        out: torch.Tensor = _OwnedFirst.apply(  # type: ignore[no-untyped-call]
            xs,
            offs,
            torch.stack([e.w_in for e in trained]).to(xs.dtype),
            torch.stack([e.w_out for e in trained]).to(xs.dtype),
            torch.stack([e.w_in.detach() for e in frozen]).to(xs.dtype),
            torch.stack([e.w_out.detach() for e in frozen]).to(xs.dtype),
        )
        return out

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's MLP on its slice of ``xs`` (sorted by expert, ``counts`` rows each)."""
        if torch.is_autocast_enabled(xs.device.type):  # grouped_mm on CUDA takes bf16
            xs = xs.to(torch.get_autocast_dtype(xs.device.type))
        experts = cast(list[Expert], list(self.experts))
        w_in = torch.stack([e.w_in for e in experts]).to(xs.dtype)
        w_out = torch.stack([e.w_out for e in experts]).to(xs.dtype)
        if self.grouped:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            hidden = F.gelu(F.grouped_mm(xs, w_in, offs=offs))
            out: torch.Tensor = F.grouped_mm(hidden, w_out, offs=offs)
            return out
        parts = []
        start = 0
        for e, count in enumerate(counts.tolist()):
            rows = xs[start : start + count]
            parts.append(F.gelu(rows @ w_in[e]) @ w_out[e])
            start += count
        return torch.cat(parts)


class _OwnedFirst(torch.autograd.Function):
    """The experts' MLPs on tokens sorted owned experts first (``offs``: each group's end);
    weight gradients for the owned groups only."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        xs: torch.Tensor,
        offs: torch.Tensor,
        w_in_owned: torch.Tensor,
        w_out_owned: torch.Tensor,
        w_in_frozen: torch.Tensor,
        w_out_frozen: torch.Tensor,
    ) -> torch.Tensor:
        w_in = torch.cat([w_in_owned, w_in_frozen])
        w_out = torch.cat([w_out_owned, w_out_frozen])
        pre = F.grouped_mm(xs, w_in, offs=offs)
        hidden = F.gelu(pre)
        ctx.save_for_backward(xs, offs, w_in, w_out, pre, hidden)
        ctx.num_owned = w_in_owned.shape[0]  # type: ignore[attr-defined]
        return F.grouped_mm(hidden, w_out, offs=offs)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xs, offs, w_in, w_out, pre, hidden = ctx.saved_tensors  # type: ignore[attr-defined]
        owned = offs[: ctx.num_owned]  # type: ignore[attr-defined]
        grad_out = grad_out.contiguous()
        # The rows past the owned groups' end are the frozen experts': left out of the sums.
        grad_w_out = F.grouped_mm(hidden.t(), grad_out, offs=owned)
        grad_pre = torch.ops.aten.gelu_backward(F.grouped_mm(grad_out, w_out.transpose(1, 2), offs=offs), pre)
        grad_w_in = F.grouped_mm(xs.t(), grad_pre, offs=owned)
        grad_xs = F.grouped_mm(grad_pre, w_in.transpose(1, 2), offs=offs)
        return grad_xs, None, grad_w_in, grad_w_out, None, None
