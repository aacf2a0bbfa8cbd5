"""Rotary embedding frequencies for every rope scaling specdec runs (:data:`config.ROPE_KINDS`).

Each kind gives the inverse frequencies ``[dim / 2]`` (fp32) and an attention factor that
multiplies ``cos`` and ``sin``, following the published formulas with the same fp32 operations
as transformers' rope initialisation (the parity tests compare logits against it):

- ``linear``: frequencies divided by ``factor`` (position interpolation);
- ``dynamic``: NTK-aware scaling, which only starts past ``max_position_embeddings`` — the end of
  the context specdec runs — so it is the default rope there;
- ``llama3``: wavelengths longer than ``original / low_freq_factor`` divided by ``factor``, shorter
  than ``original / high_freq_factor`` kept, a smooth blend between (Llama 3.1-3.3);
- ``yarn``: a blend of interpolated and extrapolated frequencies over a ramp between the
  dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original context, and
  ``0.1 ln(factor) + 1`` on cos/sin (Qwen, YaRN);
- ``freq_factors``: a GGUF file's ``rope_freqs`` (Llama 3.1+ as llama.cpp stores it): each
  frequency divided by its factor, as llama.cpp computes it;
- ``longrope``: per-frequency ``short_factor`` divisors (the long ones are never used, see
  :func:`specdec.runtime.config._context_length`) and ``sqrt(1 + ln(factor) / ln(original))``.
"""

from __future__ import annotations

import math

import torch

from specdec.runtime.config import Rope


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """``1 / theta^(2i / dim)`` ``[dim / 2]`` fp32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(rope: Rope) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2] fp32, attention factor)`` of ``rope``."""
    base = base_inv_freq(rope.theta, rope.dim)
    if rope.kind in ("default", "dynamic"):
        return base, 1.0
    if rope.kind == "linear":
        return base / rope.param("factor"), 1.0
    if rope.kind == "llama3":
        return _llama3(base, rope), 1.0
    if rope.kind == "yarn":
        return _yarn(rope)
    if rope.kind == "longrope":
        return _longrope(rope)
    if rope.kind == "freq_factors":
        return base / torch.tensor(rope.param("factors"), dtype=torch.float32), 1.0
    raise ValueError(f"rope scaling {rope.kind!r}")  # config.py refuses it first


def _llama3(base: torch.Tensor, rope: Rope) -> torch.Tensor:
    factor, low, high = rope.param("factor"), rope.param("low_freq_factor"), rope.param("high_freq_factor")
    original = rope.param("original_max_position_embeddings")
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > original / low, base / factor, base)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: Rope) -> tuple[torch.Tensor, float]:
    dim, theta = rope.dim, rope.theta
    original = rope.param("original_max_position_embeddings")
    factor = rope.param("factor") or rope.max_positions / original
    attention = rope.param("attention_factor")
    if attention is None:
        mscale, mscale_all = rope.param("mscale"), rope.param("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    fast, slow = rope.param("beta_fast") or 32, rope.param("beta_slow") or 1

    def turns_dim(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = turns_dim(fast), turns_dim(slow)
    if rope.param("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    powers = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # share of the original frequency
    freq = (1.0 / (factor * powers)) * (1 - extrapolate) + (1.0 / powers) * extrapolate
    return freq, float(attention)


def _longrope(rope: Rope) -> tuple[torch.Tensor, float]:
    original = rope.param("original_max_position_embeddings")
    factor = rope.param("factor") or rope.max_positions / original
    attention = rope.param("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(rope.param("short_factor"), dtype=torch.float32)
    if short.numel() != rope.dim // 2:
        raise ValueError(f"longrope short_factor has {short.numel()} entries, the rotary dimension needs {rope.dim // 2}")
    shape = torch.arange(0, rope.dim, 2, dtype=torch.int64).float() / rope.dim
    return 1.0 / (short * rope.theta**shape), float(attention)


def tables(rope: Rope, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and the signed ``sin`` tables ``[P, dim]`` (first half of ``sin`` negated, so that
    rotating is ``x * cos + roll(x, dim/2) * sin``), times the attention factor."""
    freq, attention = inv_freq(rope)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), freq)  # [P, dim/2]
    emb = torch.cat([freqs, freqs], -1)  # [P, dim]
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    sin[:, : rope.dim // 2].neg_()
    return cos, sin
