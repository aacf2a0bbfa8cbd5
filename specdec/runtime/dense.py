"""A dense linear layer at a float dtype: what every quantized format falls back to (the layers
left in float, and a GGUF file's F16/F32 parts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FloatLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight.to(dtype).contiguous()  # [N, K]
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features = self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)
