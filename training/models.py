"""A small GPT (nanoGPT-style): token + position embeddings, pre-norm blocks, tied head.

Presets: ``micro`` (~0.1 M parameters, for multi-node simulations on a small CPU), ``tiny``
(~3.3 M parameters, byte vocabulary, trains on a CPU here in minutes) and ``gpt-125m``
(GPT-2 small shape, for GPUs). Attention uses PyTorch's fused
``scaled_dot_product_attention`` (flash kernels on CUDA, a fused CPU path elsewhere).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "num_layers", "num_heads", "embed_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


PRESETS: dict[str, GPTConfig] = {
    # ~0.2 M parameters: several of them train side by side on a 2-core CPU in a simulation.
    "micro": GPTConfig(context_len=64, num_layers=2, num_heads=4, embed_dim=64),
    "tiny": GPTConfig(),
    "gpt-125m": GPTConfig(vocab_size=50304, context_len=1024, num_layers=12, num_heads=12, embed_dim=768),
}


def preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})") from None


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.norm1 = nn.LayerNorm(config.embed_dim)
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)
        self.norm2 = nn.LayerNorm(config.embed_dim)
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
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        for name, param in self.named_parameters():
            if name.endswith(("proj.weight", "mlp_out.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.num_layers))

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
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
