"""A Llama-like pipeline stage for the GPU fidelity check (bench/fidelity_cuda.py): `blocks`
transformer blocks at real width, and the FLOPs each op does.

A block: RMSNorm, multi-head attention (q, k, v, o without bias, heads of 128, torch's
`scaled_dot_product_attention`, causal; on CUDA restricted to the flash kernel), RMSNorm, SwiGLU MLP
(ffn = 8/3 x width rounded up to 256: 11008 at 4096, as Llama 2 7B), residual adds. No rotary
embedding (element-wise, a few percent of a block's time) and one microbatch of one sequence.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DIM = 128


def ffn_width(width: int) -> int:
    return 256 * math.ceil(8 * width / 3 / 256)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    """One transformer block; input and output are (batch, seq, width)."""

    def __init__(self, width: int):
        super().__init__()
        if width % HEAD_DIM:
            raise ValueError(f"width {width} is not a multiple of the head size {HEAD_DIM}")
        self.heads = width // HEAD_DIM
        ffn = ffn_width(width)
        self.attention_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(width, ffn, bias=False), nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        h = self.attention_norm(x)
        q, k, v = (p(h).view(b, s, self.heads, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        with _flash_only(x):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, w))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _flash_only(x: torch.Tensor):
    """On CUDA, the flash attention kernel and no other (an error rather than a silent fallback)."""
    if not x.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def make_stage(width: int, blocks: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[Block]:
    """`blocks` blocks with a fixed initialization (the same on every run)."""
    torch.manual_seed(seed)
    layers = [Block(width) for _ in range(blocks)]
    for layer in layers:
        for p in layer.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
    return [layer.to(device=device, dtype=dtype) for layer in layers]


def block_flops(width: int, seq: int, batch: int = 1) -> dict[str, float]:
    """FLOPs of one block's F, B (input gradients) and W (weight gradients).

    Linear layers: 2 x tokens x weights for each of F, B and W. Causal attention: QK^T and AV are
    2 x 2 x batch x seq^2 x width, halved by the causal mask, in F; B does twice that (the gradients
    of Q, K, V and of the probabilities); W has none (attention has no weights). Norms and
    element-wise ops are not counted (the usual model-FLOPs convention).
    """
    tokens = batch * seq
    weights = 4 * width * width + 3 * width * ffn_width(width)
    linear = 2.0 * tokens * weights
    attention = 2.0 * batch * seq * seq * width
    return {"F": linear + attention, "B": linear + 2 * attention, "W": linear}


def weight_grad_bytes(width: int, seq: int, element_size: int, batch: int = 1) -> float:
    """What split backward keeps from B to W: the inputs of the linear layers (q, k, v share one,
    gate and up share one): 3 x width + ffn per token."""
    return float(batch * seq * (3 * width + ffn_width(width)) * element_size)
