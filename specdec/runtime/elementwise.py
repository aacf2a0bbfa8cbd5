"""A block's elementwise steps between its linear layers — RMSNorm, the SiLU gate, rotary
embedding — and the logits' argmax, as one C++ call each (``kernels/elementwise.cpp``) instead of 3-6 small torch ops
(measured in docs/CHANGELOG.md, 'Fewer ops per layer'). Each output is one fixed sequence of fp32 operations on
its own row, so results do not depend on the other rows of the call (batch invariance); the
``reference_*`` functions below are the same operations in plain torch, tested bit for bit.
"""

from __future__ import annotations

import torch

from specdec.runtime import native
from specdec.runtime.lanes import LANES, exp16



def kernel():
    return native.kernel("elementwise")


def supported(x: torch.Tensor, width: int) -> bool:
    """Whether the kernels take this activation: fp32, rows a multiple of 16 wide."""
    return x.dtype == torch.float32 and width % LANES == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``[..., E]`` fp32 contiguous, ``weight`` ``[E]`` fp32 -> ``(x * r) * weight`` with
    ``r = 1 / sqrt(mean(x^2) + eps)``, the sum of squares in the kernel's fixed order."""
    return kernel().rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` (gate, then up) fp32 contiguous -> ``silu(gate) * up`` ``[..., I]``."""
    return kernel().silu_mul(gate_up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The first ``heads`` heads of ``x`` ``[B, T, W]`` rotated -> ``[B, T, heads, D]``;
    ``cos``/``sin`` ``[B, T, 1, D]`` from :func:`specdec.runtime.model.rope_tables` (signed sin)."""
    return kernel().rope(x, cos, sin, heads)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, -1)`` (the first maximum) for finite rows, ~15x faster on a 152k-wide
    vocabulary; other dtypes and layouts go to torch."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[-1] == 0:
        return x.argmax(-1)
    return kernel().argmax(x)


def all_finite(x: torch.Tensor) -> bool:
    """Whether no value of ``x`` is NaN or infinite, in one summing pass (a NaN or inf makes the
    sum NaN or inf; ~15x faster than ``isfinite(x).all()`` on logits). A sum that overflows
    (values ~1e33 or more) also reads as not finite: such logits are broken too."""
    return bool(torch.isfinite(x.sum()))


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    e = x.shape[-1]
    rows = x.reshape(-1, e)
    acc = torch.zeros(rows.shape[0], LANES)
    for c in range(0, e, LANES):
        acc = acc + rows[:, c : c + LANES] * rows[:, c : c + LANES]
    for half in (8, 4, 2):
        acc = acc[:, :half] + acc[:, half : 2 * half]
    total = acc[:, 0] + acc[:, 1]  # [M]
    inv_e = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(e), dtype=torch.float32)
    # torch.rsqrt is 1 / sqrt, each correctly rounded (torch.sqrt itself is not, in fp32 on CPU)
    r = torch.rsqrt(total * inv_e + torch.tensor(eps, dtype=torch.float32))
    return ((rows * r.unsqueeze(1)) * weight).view(x.shape)


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    e = exp16(-g.abs())
    sig = torch.where(g >= 0, torch.ones_like(e), e) / (1.0 + e)
    return (g * sig) * u


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, _ = x.shape
    d = cos.shape[-1]
    xh = x[..., : heads * d].reshape(b, t, heads, d)
    return xh * cos + torch.roll(xh, d // 2, -1) * sin
