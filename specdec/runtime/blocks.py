"""GGUF's 32-weight block types kept exactly: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K, IQ4_NL, IQ4_XS.

One kernel family (``kernels/blocks.cpp``): a type is a code width (4, 5 or 8 bits), a scale
rule, per group of 32 inputs and output, and for the IQ4 types a table:

- SYM (Q4_0, Q5_0, Q8_0, IQ4_NL): ``w = d * (u - z)``, ``d`` fp16, ``z`` = 8, 16, 128, 128 (Q8_0's
  signed codes are kept as ``u = q + 128``);
- AFFINE (Q4_1, Q5_1): ``w = d * u + m``;
- KQ (Q5_K): ``w = (d * sc) * u - dmin * mn`` with 6-bit ``sc``, ``mn`` per group and ``d``,
  ``dmin`` per superblock of 8 groups;
- NL (IQ4_XS): ``w = (d * (sc - 32)) * (u - 128)`` with 6-bit ``sc`` per group and ``d`` per
  superblock of 8 groups.

The IQ4 types store 4-bit indices into llama.cpp's 16 non-linear values (``kvalues_iq4nl``); the
grid keeps the indices (``codes``) and the kernel multiplies ``u = value + 128`` (:data:`IQ4`).

:class:`BlockGrid` is a matrix as the file stores it (codes and scales, rows in transformers'
order); :meth:`BlockGrid.dequantize` repeats the ``gguf`` package's operations, so the weights the
kernel multiplies are the file's bit for bit (tested). :func:`pack` is the torch reference of the
kernel's repack from the file (``blocks_repack``, compared byte for byte) and
:func:`reference_linear` the reference of its product (compared bit for bit on every instruction
set this CPU has, and the portable path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.runtime import native
from specdec.runtime.q4 import PackedLinear

TILE, GROUP, SUPER = 16, 32, 8  # outputs per tile; inputs per group; groups per Q5_K superblock
SYM, AFFINE, KQ, NL = "sym", "affine", "kq", "nl"
# IQ4_NL's and IQ4_XS's values (llama.cpp's kvalues_iq4nl) + 128: what an index's weight code is
IQ4 = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]) + 128


@dataclass(frozen=True)
class BlockType:
    id: int  # the kernel's type number
    bits: int
    rule: str
    zero: int
    block_bytes: int  # one block in the file
    block_groups: int  # groups of 32 in one block
    lut: bool = False  # codes are indices into IQ4


TYPES = {
    "Q4_0": BlockType(0, 4, SYM, 8, 18, 1),
    "Q4_1": BlockType(1, 4, AFFINE, 0, 20, 1),
    "Q5_0": BlockType(2, 5, SYM, 16, 22, 1),
    "Q5_1": BlockType(3, 5, AFFINE, 0, 24, 1),
    "Q8_0": BlockType(4, 8, SYM, 128, 34, 1),
    "Q5_K": BlockType(5, 5, KQ, 0, 176, 8),
    "IQ4_NL": BlockType(6, 4, SYM, 128, 18, 1, lut=True),
    "IQ4_XS": BlockType(7, 4, NL, 128, 136, 8, lut=True),
}


@dataclass
class BlockGrid:
    """Rows of a weight as a block type stores them: ``codes`` ``[N, K]`` uint8 (the IQ4 types'
    indices); ``d`` fp16 ``[N, G]`` (``[N, K/256]`` for KQ and NL); AFFINE ``m`` ``[N, G]`` fp16;
    KQ and NL ``sc`` ``[N, G]`` uint8; KQ ``mn`` ``[N, G]`` uint8 and ``dmin`` ``[N, K/256]`` fp16."""

    type: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None
    dmin: torch.Tensor | None = None

    def rows(self) -> int:
        return self.codes.shape[0]

    def step_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """KQ's per-group ``(d * sc, dmin * mn)``, NL's ``(d * (sc - 32), 0)`` ``[N, G]`` fp32
        (exact products)."""
        rep = lambda t: t.float().repeat_interleave(SUPER, 1)  # noqa: E731
        if TYPES[self.type].rule == NL:
            step = rep(self.d) * (self.sc.float() - 32)
            return step, torch.zeros_like(step)
        return rep(self.d) * self.sc.float(), rep(self.dmin) * self.mn.float()

    def values(self) -> torch.Tensor:
        """``[N, K]`` int64: the codes the kernel multiplies (an IQ4 index's value + 128)."""
        return IQ4[self.codes.long()] if TYPES[self.type].lut else self.codes.long()

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` fp32 in the ``gguf`` package's operations."""
        t = TYPES[self.type]
        n, k = self.codes.shape
        u = self.values().view(n, k // GROUP, GROUP)
        if t.rule == SYM:
            w = self.d.float().unsqueeze(-1) * (u.int() - t.zero).float()
        elif t.rule == AFFINE:
            w = self.d.float().unsqueeze(-1) * u.float() + self.m.float().unsqueeze(-1)
        elif t.rule == NL:
            w = self.step_offset()[0].unsqueeze(-1) * (u.int() - t.zero).float()
        else:
            step, offset = self.step_offset()
            w = step.unsqueeze(-1) * u.float() - offset.unsqueeze(-1)
        return w.reshape(n, k)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1)


def decode_blocks(raw: np.ndarray, type_name: str) -> BlockGrid:
    """``raw`` ``[N, row bytes]`` uint8 (N rows of the type's blocks) -> their grid."""
    t = TYPES[type_name]
    n = raw.shape[0]
    b = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(n, -1, t.block_bytes)  # [N, B, bytes]
    if t.rule == KQ:
        return _decode_q5k(b)
    if t.rule == NL:
        return _decode_iq4xs(b)
    at = 4 if t.rule == AFFINE else 2
    d = _fp16(b[..., 0:2])
    m = _fp16(b[..., 2:4]) if t.rule == AFFINE else None
    if t.bits == 8:
        codes = b[..., 2:34] ^ 0x80
    else:
        qh = b[..., at : at + 4] if t.bits == 5 else None
        qs = b[..., at + (4 if t.bits == 5 else 0):]  # [N, B, 16]
        codes = torch.cat([qs & 0x0F, qs >> 4], -1)  # [N, B, 32]: weight l < 16 low, 16 + l high
        if qh is not None:
            bits = torch.arange(32)
            high = (qh[..., bits // 8] >> (bits % 8).to(torch.uint8)) & 1  # [N, B, 32]
            codes = codes | (high << 4)
    return BlockGrid(type_name, codes.reshape(n, -1).contiguous(), d, m)


def _scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins ``[..., 12]`` -> ``sc``, ``mn`` ``[..., 8]``."""
    lo, hi = s[..., 0:4], s[..., 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], -1)
    mn = torch.cat([s[..., 4:8] & 0x3F, (hi >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _decode_q5k(b: torch.Tensor) -> BlockGrid:
    n, nb = b.shape[:2]
    sc, mn = _scale_min(b[..., 4:16])  # [N, B, 8]
    qh, qs = b[..., 16:48], b[..., 48:176].reshape(n, nb, 4, 32)
    groups = torch.arange(8)
    low = (qs[:, :, groups // 2] >> (4 * (groups % 2)).to(torch.uint8).view(1, 1, 8, 1)) & 0x0F  # [N, B, 8, 32]
    high = (qh.unsqueeze(2) >> groups.to(torch.uint8).view(1, 1, 8, 1)) & 1
    codes = (low | (high << 4)).reshape(n, -1)
    return BlockGrid("Q5_K", codes.contiguous(), _fp16(b[..., 0:2]), sc=sc.reshape(n, -1), mn=mn.reshape(n, -1),
                     dmin=_fp16(b[..., 2:4]))


def _decode_iq4xs(b: torch.Tensor) -> BlockGrid:
    """d fp16, scales_h u16 (2 bits a group), scales_l [4] (4 bits a group), qs [128] (16 a group)."""
    n, nb = b.shape[:2]
    groups = torch.arange(8)
    low = (b[..., 4 + groups // 2] >> (4 * (groups % 2)).to(torch.uint8)) & 0x0F  # [N, B, 8]
    high = ((b[..., 2].int() | (b[..., 3].int() << 8)).unsqueeze(-1) >> (2 * groups)) & 3
    sc = (low.int() | (high << 4)).to(torch.uint8)
    qs = b[..., 8:136].reshape(n, nb, 8, 16)
    codes = torch.cat([qs & 0x0F, qs >> 4], -1)  # [N, B, 8, 32]: weight l < 16 low, 16 + l high
    return BlockGrid("IQ4_XS", codes.reshape(n, -1).contiguous(), _fp16(b[..., 0:2]), sc=sc.reshape(n, -1))


def _chunk_header(t: BlockType) -> tuple[int, int, int]:
    """Bytes of a tile chunk's codes, of a whole chunk, and of a superblock's header."""
    code = 512 if t.bits == 8 else 320 if t.bits == 5 else 256
    chunk = code + (64 if t.rule == AFFINE else 16 if t.rule == NL else 32)
    return code, chunk, 64 if t.rule == KQ else 32 if t.rule == NL else 0


def tile_bytes(type_name: str, in_features: int) -> int:
    """Bytes of one tile of 16 outputs in the kernel's layout (see ``kernels/blocks.cpp``)."""
    _, chunk, header = _chunk_header(TYPES[type_name])
    g = in_features // GROUP
    return g * chunk + g // SUPER * header


def _padded(grid: BlockGrid) -> BlockGrid:
    pad = -grid.rows() % TILE
    if not pad:
        return grid
    grow = lambda x: None if x is None else torch.cat([x, x.new_zeros(pad, *x.shape[1:])])  # noqa: E731
    return BlockGrid(grid.type, grow(grid.codes), grow(grid.d), grow(grid.m), grow(grid.sc), grow(grid.mn), grow(grid.dmin))


def pack(grid: BlockGrid) -> torch.Tensor:
    """A grid -> the kernel's tiles ``[N16/16, tile bytes]`` (rows padded with zeros): the torch
    reference of ``blocks_repack``."""
    t = TYPES[grid.type]
    g = _padded(grid)
    n16, k = g.codes.shape
    nt, groups = n16 // TILE, k // GROUP
    tile_first = lambda x: x.reshape(nt, TILE, groups, *x.shape[2:]).transpose(1, 2)  # noqa: E731  [NT, G, 16, ...]
    if t.bits == 8:
        c = g.codes.view(nt, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [NT, G, r, o, t]
        parts = [c.reshape(nt, groups, 512)]
    else:
        c = g.codes.view(nt, TILE, groups, 2, 4, 4)  # [NT, o, G, half, r, t]
        low = (c[:, :, :, 0] & 0x0F) | ((c[:, :, :, 1] & 0x0F) << 4)  # [NT, o, G, r, t]
        parts = [low.permute(0, 2, 3, 1, 4).reshape(nt, groups, 256)]
        if t.bits == 5:
            top = c >> 4  # [NT, o, G, half, r, t]
            shift = (4 * torch.arange(2).view(2, 1) + torch.arange(4).view(1, 4)).to(torch.uint8).view(1, 1, 1, 2, 4, 1)
            hb = (top << shift).sum((3, 4), dtype=torch.int32).to(torch.uint8)  # [NT, o, G, t]: distinct bits
            parts.append(hb.permute(0, 2, 1, 3).reshape(nt, groups, 64))
    if t.rule == KQ:
        parts += [tile_first(g.sc).contiguous(), tile_first(g.mn).contiguous()]
    elif t.rule == NL:
        parts.append(tile_first(g.sc).contiguous())
    else:
        parts.append(tile_first(g.d).contiguous().view(torch.uint8).reshape(nt, groups, 32))
        if t.rule == AFFINE:
            parts.append(tile_first(g.m).contiguous().view(torch.uint8).reshape(nt, groups, 32))
    chunks = torch.cat(parts, -1)  # [NT, G, chunk]
    if t.rule in (KQ, NL):
        s = groups // SUPER
        scales = (g.d, g.dmin) if t.rule == KQ else (g.d,)
        head = torch.cat([x.view(nt, TILE, s).transpose(1, 2).contiguous().view(torch.uint8) for x in scales], -1)
        chunks = torch.cat([head, chunks.reshape(nt, s, -1)], -1)  # [NT, S, header + 8 chunks]
    return chunks.reshape(nt, -1).contiguous()


def unpack(state: dict[str, torch.Tensor]) -> BlockGrid:
    """The grid of a :class:`BlockLinear` state (rows padded to 16): the inverse of :func:`pack`,
    so that a test reads back the weights the kernel multiplies."""
    name = next(n for n, t in TYPES.items() if t.id == int(state["type"]))
    t, packed, k = TYPES[name], state["packed"], int(state["in_features"])
    nt, groups = packed.shape[0], k // GROUP
    code, chunk, header = _chunk_header(t)
    rows_first = lambda x: x.permute(0, 2, 1).reshape(nt * TILE, -1)  # noqa: E731  [NT, G, 16] -> [N16, G]
    head = None
    if header:
        p = packed.view(nt, groups // SUPER, -1)
        head, chunks = p[..., :header].contiguous(), p[..., header:].reshape(nt, groups, chunk)
    else:
        chunks = packed.view(nt, groups, chunk)
    if t.bits == 8:
        c = chunks[..., :512].reshape(nt, groups, 8, TILE, 4).permute(0, 3, 1, 2, 4)  # [NT, o, G, r, t]
    else:
        low = chunks[..., :256].reshape(nt, groups, 4, TILE, 4)  # [NT, G, r, o, t]
        c = torch.stack([low & 0x0F, low >> 4], 2)  # [NT, G, half, r, o, t]
        if t.bits == 5:
            hb = chunks[..., 256:320].reshape(nt, groups, 1, 1, TILE, 4)
            shift = (4 * torch.arange(2).view(2, 1) + torch.arange(4).view(1, 4)).to(torch.uint8).view(1, 1, 2, 4, 1, 1)
            c = c | (((hb >> shift) & 1) << 4)
        c = c.permute(0, 4, 1, 2, 3, 5)  # [NT, o, G, half, r, t]
    codes = c.reshape(nt * TILE, k).contiguous()
    scales = chunks[..., code:].contiguous()
    fp16 = lambda x: x.contiguous().view(torch.float16).permute(0, 2, 1).reshape(nt * TILE, -1)  # noqa: E731
    if t.rule == NL:
        return BlockGrid(name, codes, fp16(head), sc=rows_first(scales))
    if t.rule == KQ:
        return BlockGrid(name, codes, fp16(head[..., :32]), sc=rows_first(scales[..., :16]),
                         mn=rows_first(scales[..., 16:32]), dmin=fp16(head[..., 32:]))
    d = rows_first(scales[..., :32].view(torch.float16))
    m = rows_first(scales[..., 32:64].view(torch.float16)) if t.rule == AFFINE else None
    return BlockGrid(name, codes, d, m)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> codes ``[M, G, 32]`` int8, scales ``[M, G]``, code sums ``[M, G]``
    (int64), exactly as the kernel computes them."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP, GROUP)
    d = groups.abs().amax(-1) / 127.0  # [M, G]
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(groups * inv.unsqueeze(-1)).clamp_(-127, 127)
    return q.to(torch.int8), d, q.long().sum(-1)


def reference_linear(x: torch.Tensor, grid: BlockGrid, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's computation in plain torch, one rounding per operation in its order (slow;
    the bit-exact reference for the tests). ``x`` ``[M, K]`` -> ``[M, N]``."""
    t = TYPES[grid.type]
    xq, xd, xs = quantize_activations(x)  # [M, G, 32], [M, G], [M, G]
    n, k = grid.codes.shape
    idot = torch.einsum("mgj,ngj->mng", xq.long(), grid.values().view(n, k // GROUP, GROUP))  # [M, N, G] exact
    xs3 = xs.unsqueeze(1)  # [M, 1, G]
    if t.rule == SYM:
        tg = grid.d.float() * (idot - t.zero * xs3).float()
    elif t.rule == NL:
        tg = grid.step_offset()[0] * (idot - t.zero * xs3).float()
    elif t.rule == AFFINE:
        tg = grid.d.float() * idot.float() + grid.m.float() * xs3.float()
    else:
        step, offset = grid.step_offset()
        tg = step * idot.float() - offset * xs3.float()
    acc = torch.zeros(x.shape[0], n)
    for g in range(k // GROUP):
        acc = acc + xd[:, g : g + 1] * tg[:, :, g]
    return acc if bias is None else acc + bias.float()


def kernel():
    return native.kernel("blocks")


class BlockLinear(PackedLinear):
    """A linear layer over one of :data:`TYPES`, its weights exactly the file's: ``state`` holds
    ``packed`` ``[N16/16, tile bytes]``, ``out_features``, ``in_features``, ``type`` (the kernel's
    type number) and optionally ``bias``."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        type_id, run = int(state["type"]), kernel().blocks_linear
        super().__init__(state, int(state["in_features"]), lambda x, packed, bias: run(x, packed, bias, type_id))
        self.type_id = type_id


# ---- 16-bit floats: F16 and BF16 matrices multiplied as stored (``half_linear`` in the kernel)
HALVES = ("F16", "BF16")
LANES = 16


def half_values(w16: torch.Tensor, bf16: bool) -> torch.Tensor:
    """``[N, K]`` int16 bits -> their exact fp32 values (as gguf dequantizes F16 and BF16)."""
    if bf16:
        return (w16.int() << 16).view(torch.float32)
    return w16.view(torch.float16).float()


def reference_half_linear(x: torch.Tensor, w16: torch.Tensor, bf16: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's 16-bit float product in plain torch: per row and output, lane j sums the
    products of inputs j mod 16 in order, then the lanes are summed as a fixed tree."""
    w = half_values(w16, bf16)  # [N, K]
    m, k = x.shape
    prod = x.float().unsqueeze(1) * w.unsqueeze(0)  # [M, N, K], one rounding each
    steps = prod.view(m, w.shape[0], k // LANES, LANES)
    lanes = torch.zeros(m, w.shape[0], LANES)
    for s in range(k // LANES):
        lanes = lanes + steps[:, :, s]
    for width in (8, 4, 2, 1):
        lanes = lanes[..., :width] + lanes[..., width : 2 * width]
    out = lanes[..., 0]
    return out if bias is None else out + bias.float()


class HalfLinear(torch.nn.Module):
    """A linear layer over an F16 or BF16 matrix as the file stores it (2 bytes a weight):
    ``state`` holds ``weight16`` ``[N, K]`` int16 (K a multiple of 16), ``bf16`` and optionally
    ``bias``."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.weight16, self.bf16 = state["weight16"], bool(state["bf16"])
        self.out_features, self.in_features = self.weight16.shape
        bias = state.get("bias")
        self.bias = bias.float() if bias is not None else torch.empty(0)
        self._run = kernel().half_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        return self._run(x, self.weight16, self.bias, self.bf16)
