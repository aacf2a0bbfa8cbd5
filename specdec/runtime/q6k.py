"""GGUF Q6_K weights kept exactly: the layer, its kernel and the kernel's pure-torch reference.

A Q6_K superblock (210 bytes) holds 256 weights of one row: 128 bytes of low nibbles ``ql``, 64
bytes of high bit pairs ``qh``, 16 signed 8-bit scales (one per 16 weights) and an fp16 ``d``:
``w = d * sc * (u - 32)`` with 6-bit codes ``u``. Such a ``w`` needs at most 11 + 7 + 5
significant bits, so it is exact in fp32: :meth:`Q6KGrid.dequantize` equals the gguf package's
dequantization bit for bit (tested), and the kernel multiplies exactly these weights, in the
file's 6.56 bits a weight (see ``kernels/q6k.cpp`` for the layout and the fixed order of its operations;
:func:`reference_linear` repeats them in torch and is tested bit-identical on every instruction
set this CPU has).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.runtime import native
from specdec.runtime.q4 import PackedLinear

TILE, GROUP, SUPER = 16, 16, 256  # outputs per tile; inputs per scale; inputs per superblock
BLOCK_BYTES = 210  # a Q6_K superblock in the file
GROUP_BYTES = 192  # a tile's 16 x 16 codes: two bytes of low nibbles and a quarter byte of top bits per code pair
SB_BYTES = 16 * GROUP_BYTES + 16 * 16 + 2 * 16  # a tile's superblock in the kernel's layout: codes, scales, d


@dataclass
class Q6KGrid:
    """Rows of a weight as Q6_K stores them: codes ``u`` ``[N, K]`` (0..63, uint8), scales ``sc``
    ``[N, K/16]`` (int8), ``d`` ``[N, K/256]`` (fp16); ``w = d * sc * (u - 32)``."""

    u: torch.Tensor
    sc: torch.Tensor
    d: torch.Tensor

    def rows(self) -> int:
        return self.u.shape[0]

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` fp32 in gguf's operations: ``(float(d) * float(sc)) * float(u - 32)``."""
        n, k = self.u.shape
        step = (self.d.float().repeat_interleave(SUPER // GROUP, 1) * self.sc.float()).unsqueeze(-1)  # [N, K/16, 1]
        return (step * (self.u.view(n, k // GROUP, GROUP).to(torch.int8) - 32).float()).reshape(n, k)


def decode_blocks(raw: np.ndarray) -> Q6KGrid:
    """``raw`` ``[N, K / 256 * 210]`` uint8 (N rows of Q6_K superblocks) -> their grid."""
    n = raw.shape[0]
    b = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(n, -1, BLOCK_BYTES)  # [N, S, 210]
    s = b.shape[1]
    ql, qh = b[..., :128].reshape(n, s, 2, 1, 64), b[..., 128:192].reshape(n, s, 2, 1, 32)
    # each half of 128 weights: ql's 64 bytes give weights 0-63 (low nibbles) and 64-127 (high);
    # qh's 32 bytes give the top two bits of weights 0-31, 32-63, 64-95, 96-127 (bit pairs 0, 2, 4, 6)
    low = torch.cat([ql & 0x0F, ql >> 4], 3).reshape(n, s, 2, 4, 32)
    high = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], 3)  # [N, S, 2, 4, 32]
    u = (low | (high << 4)).reshape(n, s * SUPER)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, s * 16)
    d = b[..., 208:210].contiguous().view(torch.float16).reshape(n, s)
    return Q6KGrid(u, sc, d)


def pack(grid: Q6KGrid, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A grid -> the tensors of a :class:`Q6KLinear`: ``packed`` ``[N16/16, S * 3360]`` (rows
    padded to a multiple of 16 with zero weights), ``out_features``, optionally ``bias``."""
    n, k = grid.u.shape
    n16, s = -(-n // TILE) * TILE, k // SUPER
    pad = n16 - n
    u = torch.cat([grid.u, grid.u.new_zeros(pad, k)]) if pad else grid.u
    sc = torch.cat([grid.sc, grid.sc.new_zeros(pad, k // GROUP)]) if pad else grid.sc
    d = torch.cat([grid.d, grid.d.new_zeros(pad, s)]) if pad else grid.d
    nt = n16 // TILE
    c = u.view(nt, TILE, s, 16, 4, 4).permute(0, 2, 3, 4, 1, 5)  # [NT, S, group, r, o, t]
    low = (c[:, :, :, 0::2] & 0x0F) | ((c[:, :, :, 1::2] & 0x0F) << 4)  # [NT, S, group, p, o, t]
    top = sum(((c[:, :, :, r] >> 4) & 0x03) << (2 * r) for r in range(4))  # [NT, S, group, o, t]
    codes = torch.cat([low.reshape(nt, s, 16, -1), top.reshape(nt, s, 16, -1)], -1)  # [NT, S, group, 192]
    scales = sc.view(nt, TILE, s, 16).permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [NT, S, group, o]
    ds = d.view(nt, TILE, s).permute(0, 2, 1).contiguous().view(torch.uint8)  # [NT, S, 2 o]
    packed = torch.cat([codes.reshape(nt, s, -1), scales.reshape(nt, s, -1), ds.reshape(nt, s, -1)], -1)
    state = {"packed": packed.reshape(nt, s * SB_BYTES).contiguous(), "out_features": torch.tensor(n)}
    if bias is not None:
        state["bias"] = torch.cat([bias.float(), bias.new_zeros(pad).float()])
    return state


def unpack(state: dict[str, torch.Tensor]) -> Q6KGrid:
    """The grid of a :func:`pack` state (rows padded to 16), for the reference."""
    packed = state["packed"]
    nt, s = packed.shape[0], packed.shape[1] // SB_BYTES
    p = packed.view(nt, s, SB_BYTES)
    codes = p[..., : 16 * GROUP_BYTES].reshape(nt, s, 16, GROUP_BYTES)
    low, top = codes[..., :128].reshape(nt, s, 16, 2, 64), codes[..., 128:]  # [.., p, 4o + t], [.., 4o + t]
    rows = [((low[:, :, :, r // 2] >> (4 * (r % 2))) & 0x0F) | (((top >> (2 * r)) & 0x03) << 4) for r in range(4)]
    c = torch.stack(rows, 3).reshape(nt, s, 16, 4, TILE, 4)  # [NT, S, group, r, o, t]
    u = c.permute(0, 4, 1, 2, 3, 5).reshape(nt * TILE, s * SUPER)
    at = 16 * GROUP_BYTES
    sc = p[..., at : at + 256].contiguous().view(torch.int8).reshape(nt, s, 16, TILE).permute(0, 3, 1, 2)
    d = p[..., at + 256 :].contiguous().view(torch.float16).reshape(nt, s, TILE).permute(0, 2, 1)
    return Q6KGrid(u.contiguous(), sc.reshape(nt * TILE, s * 16), d.reshape(nt * TILE, s))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> codes ``[M, K]`` int8, scales ``[M, S]`` and code sums per 16 inputs
    ``[M, K/16]`` (int64), exactly as the kernel computes them."""
    m, k = x.shape
    blocks = x.float().view(m, k // SUPER, SUPER)
    d = blocks.abs().amax(-1) / 127.0  # [M, S]
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-127, 127).reshape(m, k)
    return q.to(torch.int8), d, q.long().view(m, k // GROUP, GROUP).sum(-1)


def reference_linear(x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The kernel's computation in plain torch (slow; the bit-exact reference for the tests)."""
    grid = unpack(state)
    xq, xd, xs = quantize_activations(x)  # [M, K], [M, S], [M, K/16]
    m, k = xq.shape
    idot = torch.einsum("mgj,ngj->mng", xq.long().view(m, -1, GROUP), grid.u.long().view(grid.u.shape[0], -1, GROUP))
    t = (idot - 32 * xs.unsqueeze(1)) * grid.sc.long().unsqueeze(0)  # [M, N16, K/16], exact
    isc = t.view(m, t.shape[1], k // SUPER, SUPER // GROUP).sum(-1)  # [M, N16, S]
    acc = torch.zeros(m, t.shape[1])
    for s in range(k // SUPER):  # in order, one rounding per operation
        acc = acc + xd[:, s : s + 1] * (grid.d[:, s].float() * isc[:, :, s].to(torch.int32).float())
    if "bias" in state:
        acc = acc + state["bias"]
    return acc[:, : int(state["out_features"])]


def kernel():
    return native.kernel("q6k")


class Q6KLinear(PackedLinear):
    """A linear layer over a GGUF Q6_K weight, its weights exactly the file's."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        in_features = state["packed"].shape[1] // SB_BYTES * SUPER  # packed: [NT, S * 3360]
        super().__init__(state, in_features, kernel().q6k_linear)
