"""Models of the course: toy MLPs, test models with frozen/tied/unused parameters, transformer LM presets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class ToyModel(nn.Module):
    """A small MLP: the model of lessons 02-04."""

    def __init__(self, in_dim: int = 32, hidden: int = 64, out_dim: int = 8, depth: int = 2):
        super().__init__()
        dims = [in_dim] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


class ManySmallParams(nn.Module):
    """Many tiny layers: every gradient is small, so per-tensor communication is latency-bound."""

    def __init__(self, dim: int = 16, n_layers: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class NormedBlocks(nn.Module):
    """A deep stack of narrow residual blocks, x + relu(LayerNorm(Linear(x))): four gradient tensors per block
    (weight, bias, norm weight, norm bias), most of them tiny, as in a transformer's layers."""

    def __init__(self, width: int = 160, depth: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + F.relu(block(x))
        return x


class FrozenModel(nn.Module):
    """An MLP whose first layer is frozen and which carries a buffer: what DDP init must broadcast too."""

    def __init__(self, in_dim: int = 16, hidden: int = 32, out_dim: int = 4):
        super().__init__()
        self.frozen = nn.Linear(in_dim, hidden)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(hidden, out_dim)
        self.register_buffer("scale", torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.frozen(x)) * self.scale)


class TiedModel(nn.Module):
    """A tiny LM whose output projection is its embedding (one parameter used twice)."""

    def __init__(self, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.embed(tokens)))).mean(dim=1)


class UnusedBranchModel(nn.Module):
    """`unused` never takes part in forward; `sometimes` only when asked (e.g. on one rank)."""

    def __init__(self, dim: int = 16, out_dim: int = 4):
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, dim)
        self.sometimes = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, use_sometimes: bool = False) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


class MixedDtypeModel(nn.Module):
    """Bias-free linears whose dtypes alternate (e.g. bf16 weights between fp32 ones): one dtype per parameter."""

    def __init__(self, dim: int = 16, out_dim: int = 4, n_layers: int = 8,
                 dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False, dtype=dtypes[i % len(dtypes)])
                                    for i in range(n_layers - 1))
        self.head = nn.Linear(dim, out_dim, bias=False, dtype=dtypes[(n_layers - 1) % len(dtypes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return self.head(x.to(self.head.weight.dtype)).float()


# ---------------------------------------------------------------- transformer LM presets


@dataclass(frozen=True)
class LMConfig:
    """Shape of a decoder-only transformer LM."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    vocab_size: int = 10_000
    context_length: int = 256


LM_PRESETS: dict[str, LMConfig] = {
    # tiny/mini run in seconds on a CPU; small..xl are the usual GPT-2-style course sizes
    "tiny": LMConfig(d_model=64, n_layers=2, n_heads=4, d_ff=256, vocab_size=512, context_length=64),
    "mini": LMConfig(d_model=256, n_layers=4, n_heads=4, d_ff=1024, vocab_size=4096, context_length=128),
    "small": LMConfig(d_model=768, n_layers=12, n_heads=12, d_ff=3072),
    "medium": LMConfig(d_model=1024, n_layers=24, n_heads=16, d_ff=4096),
    "large": LMConfig(d_model=1280, n_layers=36, n_heads=20, d_ff=5120),
    "xl": LMConfig(d_model=1600, n_layers=48, n_heads=25, d_ff=6400),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class TransformerLM(nn.Module):
    """GPT-style LM with tied input/output embeddings."""

    def __init__(self, cfg: LMConfig | str = "tiny"):
        super().__init__()
        cfg = LM_PRESETS[cfg] if isinstance(cfg, str) else cfg
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context_length, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of `model` on a batch of token ids."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (tied ones once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
