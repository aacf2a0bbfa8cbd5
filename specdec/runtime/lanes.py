"""What the vector kernels and their pure-torch references share: the lane width of their dot
products and their exp (``kernels/exp16.h``), reproduced bit for bit in torch."""

from __future__ import annotations

import torch

LANES = 16  # the kernels' dot products: 16 lane sums then a fixed tree (head_dim, width % 16 == 0)

# The kernel's exp: Cephes' expf polynomial with these float constants (hex = exact float values).
_EXP = {name: float.fromhex(h) for name, h in [
    ("log2e", "0x1.715476p+0"), ("c1", "0x1.63p-1"), ("c2", "-0x1.bd0106p-13"),
    ("p0", "0x1.a0d2cep-13"), ("p1", "0x1.6e879cp-10"), ("p2", "0x1.111210p-7"),
    ("p3", "0x1.555382p-5"), ("p4", "0x1.555554p-3"), ("p5", "0x1.0p-1")]}


def exp16(x: torch.Tensor) -> torch.Tensor:
    """The kernel's exp for ``x <= 0``, elementwise fp32, one rounding per operation."""
    c = {name: torch.tensor(value, dtype=torch.float32) for name, value in _EXP.items()}
    n = torch.round(x * c["log2e"])
    r = x - n * c["c1"]
    r = r - n * c["c2"]
    p = c["p0"].expand_as(r)
    for name in ("p1", "p2", "p3", "p4", "p5"):
        p = p * r + c[name]
    y = p * (r * r)
    y = y + r
    y = y + 1.0
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x < -87.0, torch.zeros_like(x), y * two_n)
