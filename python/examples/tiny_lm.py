"""A tiny causal language model for torpor's GPU tests and the RL-loop example.

What matters for torpor is what it holds: parameters (reloadable), buffers computed at
construction and found in no checkpoint (the rotary tables), a persistent buffer, and a KV
cache that generation reads only where it wrote. Plain float32 PyTorch ops, so greedy
outputs are reproducible token for token on one GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    dim: int = 256
    layers: int = 4
    heads: int = 4
    max_seq: int = 128
    rope_base: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, device=None, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    """Rotary position embedding of x [B, T, H, hd] with cos/sin [T, hd/2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg: Config, device=None):
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = RMSNorm(cfg.dim, device)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False, device=device)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False, device=device)
        self.mlp_norm = RMSNorm(cfg.dim, device)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False, device=device)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=False, device=device)

    def forward(self, x, cos, sin, k_cache=None, v_cache=None, start: int = 0):
        B, T, D = x.shape
        H, hd = self.heads, D // self.heads
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, H, hd).unbind(2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if k_cache is not None:
            k_cache[:B, start : start + T] = k
            v_cache[:B, start : start + T] = v
            # Only what was written: the rest of the cache is undefined (after a sleep it is
            # discarded memory, NaN when torpor poisons it).
            k, v = k_cache[:B, : start + T], v_cache[:B, : start + T]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = torch.ones(T, k.shape[1], dtype=torch.bool, device=x.device).tril(diagonal=start)
        attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        x = x + self.out(torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(B, T, D))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self, cfg: Config = Config(), device=None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim, device=device)
        self.blocks = nn.ModuleList(Block(cfg, device) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, device)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False, device=device)
        hd = cfg.dim // cfg.heads
        # Computed here, in no checkpoint: a sleep that lost them would need the model rebuilt.
        inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(cfg.max_seq, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.register_buffer("logit_scale", torch.full((), 1.0 / math.sqrt(cfg.dim) * 8, device=device))

    def forward(self, tokens, start: int = 0, cache=None):
        T = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        for i, block in enumerate(self.blocks):
            k_cache, v_cache = (cache[0][i], cache[1][i]) if cache is not None else (None, None)
            x = block(x, cos, sin, k_cache, v_cache, start)
        return self.head(self.norm(x)) * self.logit_scale


def kv_cache_bytes(cfg: Config, batch: int) -> int:
    return 2 * cfg.layers * batch * cfg.max_seq * cfg.dim * 4


def make_kv_cache(cfg: Config, batch: int, storage=None, device="cuda"):
    """(k, v), each [layers, batch, max_seq, heads, head_dim] float32; views into `storage`
    (a uint8 tensor, e.g. a large KV-cache pool) when given, else a new allocation."""
    shape = (cfg.layers, batch, cfg.max_seq, cfg.heads, cfg.dim // cfg.heads)
    n = kv_cache_bytes(cfg, batch)
    if storage is None:
        storage = torch.empty(n, dtype=torch.uint8, device=device)
    if storage.numel() < n:
        raise ValueError(f"KV cache storage of {storage.numel()} bytes is smaller than the {n} bytes needed")
    flat = storage[:n].view(torch.float32)
    half = flat.numel() // 2
    return flat[:half].view(shape), flat[half:].view(shape)


@torch.no_grad()
def generate(model: TinyLM, prompt, new_tokens: int, cache):
    """Greedy decoding: [B, new_tokens] token ids."""
    B, P = prompt.shape
    if P + new_tokens > model.cfg.max_seq:
        raise ValueError(f"prompt {P} + {new_tokens} new tokens exceed max_seq {model.cfg.max_seq}")
    logits = model(prompt, 0, cache)
    out = []
    for step in range(new_tokens):
        token = logits[:, -1].argmax(-1)
        out.append(token)
        if step + 1 < new_tokens:
            logits = model(token[:, None], P + step, cache)
    return torch.stack(out, dim=1)
