"""A small GPT (nanoGPT-style): token + position embeddings, pre-norm blocks, tied head.

Presets: ``micro`` (~0.1 M parameters, for multi-node simulations on a small CPU), ``tiny``
(~3.3 M parameters, byte vocabulary, trains on a CPU here in minutes) and ``gpt-125m``
(GPT-2 small shape, for GPUs); their mixture-of-experts versions ``micro-moe``, ``tiny-moe`` and
``gpt-125m-moe`` (8 experts per block, top-2, each expert half the dense MLP's width, so a
token's active parameters equal the dense model's: training/moe.py). Attention uses PyTorch's fused
``scaled_dot_product_attention`` (flash kernels on CUDA, a fused CPU path elsewhere).
"""

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from training.moe import MoE


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 256
    """Token ids are in [0, vocab_size)."""
    context_len: int = 128
    """Longest sequence the position embedding covers."""
    num_layers: int = 4
    num_heads: int = 4
    embed_dim: int = 256
    dropout: float = 0.0
    num_experts: int = 0
    """0: dense MLPs; else a mixture of this many experts in every block (training/moe.py)."""
    experts_top_k: int = 2
    expert_hidden: int = 0
    """Each expert's hidden width; 0: 4 · embed_dim / experts_top_k (active MLP = dense)."""
    moe_aux_weight: float = 0.01
    """Weight of the balance loss added to the loss (E · Σ f·P, 1 when balanced)."""
    moe_bias_rate: float = 1e-3
    """Step of the auxiliary-loss-free routing bias after each training forward."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "num_layers", "num_heads", "embed_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.experts_top_k <= self.num_experts):
            raise ValueError(
                f"need 0 experts, or top_k in [1, num_experts]; got {self.num_experts}, {self.experts_top_k}"
            )

    @property
    def moe_hidden(self) -> int:
        return self.expert_hidden or 4 * self.embed_dim // self.experts_top_k


PRESETS: dict[str, GPTConfig] = {
    # ~0.2 M parameters: several of them train side by side on a 2-core CPU in a simulation.
    "micro": GPTConfig(context_len=64, num_layers=2, num_heads=4, embed_dim=64),
    "tiny": GPTConfig(),
    "gpt-125m": GPTConfig(vocab_size=50304, context_len=1024, num_layers=12, num_heads=12, embed_dim=768),
    # ~9.6 M parameters, ~3.3 M active per token: the dense tiny's shape, 8 experts per block.
    "tiny-moe": GPTConfig(num_experts=8),
    # ~0.32 M parameters (~0.12 M active), micro's shape with 8 experts: SPES simulations and tests on a small CPU.
    "micro-moe": GPTConfig(context_len=64, num_layers=2, num_heads=4, embed_dim=64, num_experts=8),
    "gpt-125m-moe": GPTConfig(
        vocab_size=50304, context_len=1024, num_layers=12, num_heads=12, embed_dim=768, num_experts=8
    ),
}


def preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})") from None


def configured(name: str, overrides: Mapping[str, Any]) -> GPTConfig:
    """Preset ``name`` with some fields replaced (a run's tokenizer sets ``vocab_size``);
    ``ValueError`` for an unknown preset or value, ``TypeError`` for an unknown field."""
    return dataclasses.replace(preset(name), **overrides)


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.norm1 = nn.LayerNorm(config.embed_dim)
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)
        self.norm2 = nn.LayerNorm(config.embed_dim)
        self.moe: MoE | None = None
        if config.num_experts:
            self.moe = MoE(
                config.embed_dim,
                config.moe_hidden,
                config.num_experts,
                config.experts_top_k,
                bias_rate=config.moe_bias_rate,
            )
        else:
            self.mlp_in = nn.Linear(config.embed_dim, 4 * config.embed_dim)
            self.mlp_out = nn.Linear(4 * config.embed_dim, config.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        heads = (batch, seq, self.num_heads, dim // self.num_heads)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        if self.moe is not None:
            mixed: torch.Tensor = x + self.moe(self.norm2(x))
            return mixed
        out: torch.Tensor = x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))
        return out


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embed = nn.Embedding(config.vocab_size, config.embed_dim)
        self.pos_embed = nn.Embedding(config.context_len, config.embed_dim)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.embed_dim)
        self.apply(self._init)
        residual_std = 0.02 / math.sqrt(2 * config.num_layers)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        for name, param in self.named_parameters():
            if name.endswith(("proj.weight", "mlp_out.weight", "w_out")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            elif name.endswith("w_in"):
                nn.init.normal_(param, mean=0.0, std=0.02)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for token ids of shape (batch, seq)."""
        _, seq = tokens.shape
        if seq > self.config.context_len:
            raise ValueError(f"sequence of {seq} tokens exceeds the context of {self.config.context_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embed(tokens) + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.token_embed.weight)  # tied output head

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy; in training mode plus the experts' weighted balance loss (mixture of
        experts), so validation losses of dense and MoE models compare as they are."""
        logits = self(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        moes = self.moes()
        if moes and self.training and self.config.moe_aux_weight:
            loss = loss + self.config.moe_aux_weight * torch.stack([m.aux_loss for m in moes]).mean()
        return loss

    def moes(self) -> list[MoE]:
        return [block.moe for block in self.blocks if isinstance(block, _Block) and block.moe is not None]
