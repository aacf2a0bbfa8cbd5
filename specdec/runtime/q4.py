"""4-bit weights x per-group int8 activations: batch invariant and exactly reproducible.

Format (what :func:`quantize_q4` produces and the on-disk cache stores). Weights are split into
groups of 32 inputs; each group has its own fp16 ``scale`` and ``min`` and 4-bit codes ``q``, so
``w = scale * q - min``. This is the grid of GGUF's Q4_K sub-blocks (32 weights, a scale and a
min each), so re-quantizing a Q4_K tensor that was dequantized to fp32 finds its own codes again
(up to the fp16 rounding of the scales); Q6_K/Q8_0 tensors lose precision (measured in
docs/BENCHMARKS.md). About 0.625 bytes per weight, against 1 for int8.

Layout: output channels in tiles of 16; everything the kernel needs for one tile and one group
(256 bytes of codes, 16 fp16 scales, 16 fp16 mins) is one contiguous 320-byte chunk, and a
tile's chunks follow each other group by group. A thread therefore reads ONE sequential stream
(with software prefetch ahead of it) instead of six — what makes a single-row step
memory-bandwidth-bound (measured in docs/CHANGELOG.md, 'runtime at llama.cpp's bytes').

Product. Each activation row is quantized per group of 32 with its own scale ``d = max|x|/127``
(so a row never depends on another row, and an outlier only coarsens its own group), the 4-bit x
int8 dot products of a group are exact integers, and the groups are accumulated in a fixed order:

    y[m, n] = sum_g  d[m,g] * (scale[n,g] * idot[m,n,g] - min[n,g] * isum[m,g])     (fp32, g = 0, 1, ...)

``isum`` is the sum of the row's int8 codes in group g (it carries the ``min`` term). The C++
kernel (``kernels/q4.cpp``, AVX2 / AVX-512 VNNI, compiled once per machine with the system's
compiler) performs exactly these fp32 operations in this order for every output element,
whatever the number of rows or threads; :func:`reference_linear` is the same computation in
plain torch, and the two are tested to be bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime import native

GROUP = 32  # inputs per quantization group
TILE = 16  # output channels per tile (one 512-bit register of int32 lanes)
CODE_BYTES = TILE * GROUP // 2  # 256: the 4-bit codes of one tile and one group
CHUNK = CODE_BYTES + 2 * TILE * 2  # 320: codes, then 16 fp16 scales, then 16 fp16 mins

def available() -> bool:
    """Whether this CPU can run the kernel (AVX2 or better)."""
    return native.has_avx2()


def supported(in_features: int) -> bool:
    return in_features % GROUP == 0


def _padded_rows(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as fp32 with zero rows appended up to a multiple of 16 (whole tiles);
    a clear error where K is not a multiple of 32."""
    n, k = weight.shape
    if not supported(k):
        raise ValueError(f"4-bit layers need in_features divisible by {GROUP}, got {k}")
    w = weight.float()
    n16 = -(-n // TILE) * TILE
    return torch.cat([w, w.new_zeros(n16 - n, k)]) if n16 != n else w


def quantize_q4(weight: torch.Tensor, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``weight`` ``[N, K]`` (K a multiple of 32) -> the tensors of a :class:`Q4Linear`:
    ``packed`` ``[N16/16, G, 320]`` uint8 (see the module docstring and :func:`_pack`),
    ``out_features`` and optionally ``bias`` ``[N16]``; N is padded to N16, a multiple of 16, with
    zero rows.

    Asymmetric per group: ``scale = (max - min) / 15``, ``min = -min(w)``, both rounded to fp16
    first; the codes are then chosen for the rounded values, ``q = round((w + min) / scale)``.
    """
    w = _padded_rows(weight)  # [N16, K]
    n, k = weight.shape
    n16 = w.shape[0]
    g = k // GROUP
    groups = w.view(n16, g, GROUP)  # [N16, G, 32]
    lo, hi = groups.amin(-1), groups.amax(-1)  # [N16, G]
    scale = ((hi - lo) / 15.0).half()
    minimum = (-lo).half()
    s32, m32 = scale.float().unsqueeze(-1), minimum.float().unsqueeze(-1)
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    q = torch.where(s32 > 0, torch.round((groups + m32) / safe), torch.zeros_like(groups)).clamp_(0, 15)
    nt = n16 // TILE
    q = q.to(torch.uint8).view(nt, TILE, g, GROUP).transpose(1, 2)  # [NT, G, 16, 32]
    per_tile = lambda t: t.view(nt, TILE, g).transpose(1, 2).contiguous().view(torch.uint8)  # noqa: E731  [NT, G, 32]
    state = {
        "packed": torch.cat([_pack(q), per_tile(scale), per_tile(minimum)], -1).contiguous(),  # [NT, G, 320]
        "out_features": torch.tensor(n),
    }
    if bias is not None:
        state["bias"] = torch.cat([bias.float(), bias.new_zeros(n16 - n).float()])
    return state


def _pack(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[NT, G, 16, 32]`` (0..15) -> the kernel's bytes ``[NT, G, 256]``: byte ``64r + 4o + t``
    holds input ``4r + t`` of output ``o`` in its low nibble and input ``16 + 4r + t`` in its high
    nibble (r, t = 0..3, o = 0..15), so each 32-bit lane of a 512-bit register of the kernel's
    products belongs to one output (and the two 256-bit halves to outputs 0-7 and 8-15)."""
    nt, g = q.shape[:2]
    lo, hi = q[..., :16].reshape(nt, g, TILE, 4, 4), q[..., 16:].reshape(nt, g, TILE, 4, 4)  # [NT, G, o, r, t]
    return (lo | (hi << 4)).permute(0, 1, 3, 2, 4).reshape(nt, g, CODE_BYTES).contiguous()


def _unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[NT, G, 320]`` -> codes ``[NT, G, 16, 32]`` (the inverse of :func:`_pack`), scales and
    mins ``[NT, G, 16]`` (fp32)."""
    nt, g = packed.shape[:2]
    b = packed[..., :CODE_BYTES].reshape(nt, g, 4, TILE, 4).permute(0, 1, 3, 2, 4).reshape(nt, g, TILE, 16)
    codes = torch.cat([b & 0x0F, b >> 4], -1)
    half = lambda lo: packed[..., lo : lo + 2 * TILE].contiguous().view(torch.float16).float()  # noqa: E731
    return codes, half(CODE_BYTES), half(CODE_BYTES + 2 * TILE)


def dequantize_q4(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ``[N, K]`` fp32 weights that a 4-bit state represents."""
    codes, scale, minimum = _unpack(state["packed"])  # [NT, G, 16, 32], [NT, G, 16] x 2
    nt, g = codes.shape[:2]
    w = (scale.unsqueeze(-1) * codes.float() - minimum.unsqueeze(-1)).transpose(1, 2).reshape(nt * TILE, g * GROUP)
    return w[: int(state["out_features"])]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` fp32 -> int8 codes ``[M, G, 32]``, scales ``d`` ``[M, G]`` and code sums
    ``[M, G]`` (fp32), exactly as the kernel computes them."""
    groups = x.float().view(x.shape[0], -1, GROUP)
    d = groups.abs().amax(-1) / 127.0  # [M, G]
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    xq = torch.round(groups * inv.unsqueeze(-1)).clamp_(-127, 127)
    return xq.to(torch.int8), d, xq.sum(-1)


def reference_linear(x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The kernel's computation in plain torch (slow; the bit-exact reference for the tests)."""
    xq, d, isum = quantize_activations(x)  # [M, G, 32], [M, G], [M, G]
    codes, scale, minimum = _unpack(state["packed"])  # [NT, G, 16, 32], [NT, G, 16] x 2
    nt, g = codes.shape[:2]
    q = codes.permute(0, 2, 1, 3).reshape(nt * TILE, g, GROUP)  # [N16, G, 32]
    scale = scale.permute(0, 2, 1).reshape(nt * TILE, g)  # [N16, G]
    minimum = minimum.permute(0, 2, 1).reshape(nt * TILE, g)
    idot = torch.einsum("mgj,ngj->mng", xq.long(), q.long()).float()  # [M, N16, G], exact integers
    acc = torch.zeros(x.shape[0], nt * TILE)
    for i in range(g):  # fixed order, one rounding per operation, as in the kernel
        t = scale[:, i] * idot[:, :, i]
        u = minimum[:, i] * isum[:, i : i + 1]
        acc = acc + d[:, i : i + 1] * (t - u)
    if "bias" in state:
        acc = acc + state["bias"]
    return acc[:, : int(state["out_features"])]


SUPER = 8  # groups per superblock in the q4k format (256 inputs)


def _superblocks(g: int) -> list[tuple[int, int]]:
    """``(first group, group count)`` of each superblock of a row of ``g`` groups."""
    return [(s, min(SUPER, g - s)) for s in range(0, g, SUPER)]


@dataclass
class Q4KGrid:
    """Rows of a weight in the q4k decomposition ``w[n, 32g + j] = d[n, g // 8] * sc[n, g] *
    codes[n, g, j] - dmin[n, g // 8] * m[n, g]``: codes ``[N, G, 32]`` (0..15), ``sc`` ``[N, G]``
    (0..255), ``m`` ``[N, G]`` (-127..127), ``d`` and ``dmin`` ``[N, S]`` fp16. GGUF's Q4_K blocks
    are exactly such rows (6-bit ``sc`` and ``m``), see :mod:`specdec.models.gguf_q4k`."""

    codes: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    def rows(self) -> int:
        return self.codes.shape[0]

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` fp32, as GGUF dequantizes Q4_K: ``(d * sc) * q - dmin * m``."""
        s_of_g = torch.arange(self.sc.shape[1]) // SUPER
        step = self.d.float()[:, s_of_g] * self.sc.float()  # [N, G]
        offset = self.dmin.float()[:, s_of_g] * self.m.float()
        w = step.unsqueeze(-1) * self.codes.float() - offset.unsqueeze(-1)
        return w.reshape(w.shape[0], -1)


def _decompose_q4k(w: torch.Tensor) -> Q4KGrid:
    """Our own q4k decomposition of ``w`` ``[N, K]`` (see :func:`quantize_q4k`)."""
    n, k = w.shape
    g = k // GROUP
    groups = w.view(n, g, GROUP)  # [N, G, 32]
    lo, hi = groups.amin(-1), groups.amax(-1)  # [N, G]
    scale, minimum = (hi - lo) / 15.0, -lo
    codes, scs, ms, ds, dmins = [], [], [], [], []
    for g0, ng in _superblocks(g):
        s_g, m_g = scale[:, g0 : g0 + ng], minimum[:, g0 : g0 + ng]  # [N, ng]
        d = (s_g.amax(-1) / 255.0).half()  # [N]
        dmin = (m_g.abs().amax(-1) / 127.0).half()
        d32, dm32 = d.float().unsqueeze(-1), dmin.float().unsqueeze(-1)
        sc = torch.where(d32 > 0, torch.ceil(s_g / torch.where(d32 > 0, d32, torch.ones_like(d32))), torch.zeros_like(s_g))
        m = torch.where(dm32 > 0, torch.round(m_g / torch.where(dm32 > 0, dm32, torch.ones_like(dm32))), torch.zeros_like(m_g))
        sc, m = sc.clamp_(0, 255), m.clamp_(-127, 127)
        step, offset = (d32 * sc).unsqueeze(-1), (dm32 * m).unsqueeze(-1)  # [N, ng, 1]
        safe = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.where(step > 0, torch.round((groups[:, g0 : g0 + ng] + offset) / safe), torch.zeros_like(step))
        codes.append(q.clamp_(0, 15).to(torch.uint8))
        scs.append(sc.long())
        ms.append(m.long())
        ds.append(d)
        dmins.append(dmin)
    return Q4KGrid(torch.cat(codes, 1), torch.cat(scs, 1), torch.cat(ms, 1), torch.stack(ds, 1), torch.stack(dmins, 1))


def _pack_q4k(grid: Q4KGrid) -> torch.Tensor:
    """A grid of N16 rows (a multiple of 16) -> the kernel's bytes ``[N16/16, tile bytes]``."""
    n16, g = grid.sc.shape
    nt = n16 // TILE
    pieces = []
    for s, (g0, ng) in enumerate(_superblocks(g)):
        q = grid.codes[:, g0 : g0 + ng].reshape(nt, TILE, ng, GROUP).transpose(1, 2)  # [NT, ng, 16, 32]
        m = grid.m[:, g0 : g0 + ng]
        mp = torch.cat([m, m.new_zeros(n16, ng % 2)], 1) if ng % 2 else m  # [N16, 2 * pairs]
        mp = mp.to(torch.int8).view(nt, TILE, -1, 2).transpose(1, 2).contiguous().view(torch.uint8)  # [NT, pairs, 16, 2]
        pieces += [
            _pack(q).reshape(nt, -1),
            grid.sc[:, g0 : g0 + ng].to(torch.uint8).view(nt, TILE, ng).transpose(1, 2).reshape(nt, -1),
            mp.reshape(nt, -1),
            grid.d[:, s].contiguous().view(nt, TILE).view(torch.uint8),
            grid.dmin[:, s].contiguous().view(nt, TILE).view(torch.uint8),
        ]
    return torch.cat(pieces, 1).contiguous()


def quantize_q4k(weight: torch.Tensor, bias: torch.Tensor | None = None,
                 exact: list[tuple[int, Q4KGrid | None]] | None = None) -> dict[str, torch.Tensor]:
    """``weight`` ``[N, K]`` (K a multiple of 32) -> the tensors of a :class:`Q4Linear` in the
    superblock (``q4k``) layout: ``packed`` ``[N16/16, tile bytes]`` uint8, ``out_features``,
    ``in_features``, optionally ``bias``.

    The format of GGUF's Q4_K, with 8-bit sub-scales: in each superblock of up to 8 groups of 32
    inputs, ``w = d * sc[g] * q - dmin * m[g]`` with 4-bit codes ``q``, ``sc[g]`` in 0..255,
    ``m[g]`` in -127..127 and ``d``, ``dmin`` fp16 per output and superblock. Each group's range
    gives ``scale = (max - min) / 15`` and ``min = -min(w)``; ``d = max(scale) / 255`` and
    ``sc = ceil(scale / d)`` (the group's range still fits its 16 levels), ``dmin = max|min| / 127``,
    ``m = round(min / dmin)``; the codes are chosen for these values, ``q = round((w + dmin * m) /
    (d * sc))``. Layout per tile and superblock: the codes of its groups (:func:`_pack`), ``sc``
    ``[ng, 16]``, ``m`` as pairs of groups ``[ceil(ng/2), 16, 2]`` (zero-padded), ``d`` and ``dmin``
    ``[16]`` fp16 — 2,368 bytes for 4,096 weights (4.625 bits each, against 5 for ``q4``).

    ``exact``: ``(rows, grid or None)`` for consecutive row blocks of ``weight`` (e.g. q, k, v of a
    fused layer): the decomposition a block came from (GGUF Q4_K blocks). A grid is taken as it is
    when it reproduces its rows bit for bit (the weights are then exactly the file's), else the
    block is re-quantized like the rest.
    """
    w = _padded_rows(weight)  # [N16, K]
    n, k = weight.shape
    n16 = w.shape[0]
    grid = _decompose_q4k(w)
    at = 0
    for rows, part in exact or ():
        if part is not None and part.rows() == rows and at + rows <= n and part.sc.shape[1] == k // GROUP \
                and torch.equal(part.dequantize(), w[at : at + rows]):
            grid.codes[at : at + rows] = part.codes
            grid.sc[at : at + rows] = part.sc
            grid.m[at : at + rows] = part.m
            grid.d[at : at + rows] = part.d
            grid.dmin[at : at + rows] = part.dmin
        at += rows
    state = {"packed": _pack_q4k(grid), "out_features": torch.tensor(n), "in_features": torch.tensor(k)}
    if bias is not None:
        state["bias"] = torch.cat([bias.float(), bias.new_zeros(n16 - n).float()])
    return state


def pack_q4k_grid(grid: Q4KGrid, bias: torch.Tensor | None, in_features: int) -> dict[str, torch.Tensor]:
    """A grid taken as it is (a GGUF file's Q4_K blocks) -> the tensors of a :class:`Q4Linear`,
    without ever forming its weights: rows padded to a multiple of 16 with zero codes and scales."""
    n = grid.rows()
    pad = -n % TILE
    if pad:
        grid = Q4KGrid(*(torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in
                         (grid.codes, grid.sc, grid.m, grid.d, grid.dmin)))
    state = {"packed": _pack_q4k(grid), "out_features": torch.tensor(n), "in_features": torch.tensor(in_features)}
    if bias is not None:
        state["bias"] = torch.cat([bias.float(), bias.new_zeros(pad).float()])
    return state


def _unpack_q4k(packed: torch.Tensor, g: int) -> tuple[torch.Tensor, ...]:
    """``[NT, tile bytes]`` -> codes ``[N16, G, 32]``, ``sc`` and ``m`` ``[N16, G]`` (int64),
    ``d`` and ``dmin`` ``[N16, S]`` (fp32): the inverse of :func:`quantize_q4k`'s layout."""
    nt = packed.shape[0]
    codes, sc, m, d, dmin = [], [], [], [], []
    at = 0
    for _, ng in _superblocks(g):
        pairs = -(-ng // 2)
        cut = [ng * CODE_BYTES, ng * TILE, pairs * 2 * TILE, 2 * TILE, 2 * TILE]
        parts = []
        for size in cut:
            parts.append(packed[:, at : at + size].contiguous())
            at += size
        b = parts[0].view(nt, ng, 4, TILE, 4).permute(0, 3, 1, 2, 4).reshape(nt * TILE, ng, 16)  # [N16, ng, 16]
        codes.append(torch.cat([b & 0x0F, b >> 4], -1))
        sc.append(parts[1].view(nt, ng, TILE).transpose(1, 2).reshape(nt * TILE, ng).long())
        mm = parts[2].view(torch.int8).view(nt, pairs, TILE, 2).transpose(1, 2).reshape(nt * TILE, 2 * pairs)
        m.append(mm[:, :ng].long())
        d.append(parts[3].view(torch.float16).float().reshape(nt * TILE, 1))
        dmin.append(parts[4].view(torch.float16).float().reshape(nt * TILE, 1))
    if at != packed.shape[1]:
        raise ValueError(f"a q4k weight of {g} groups has {at} bytes per tile, got {packed.shape[1]}")
    return torch.cat(codes, 1), torch.cat(sc, 1), torch.cat(m, 1), torch.cat(d, 1), torch.cat(dmin, 1)


def grid_of(packed: torch.Tensor, out_features: int, in_features: int) -> Q4KGrid:
    """The :class:`Q4KGrid` of a packed q4k weight (``quantize_q4k(w)["packed"]`` of an
    ``[out_features, in_features]`` weight): the inverse of its packing, padding rows dropped."""
    codes, sc, m, d, dmin = _unpack_q4k(packed, in_features // GROUP)
    n = out_features
    return Q4KGrid(codes[:n], sc[:n], m[:n], d[:n].half(), dmin[:n].half())


def dequantize_q4k(state: dict[str, torch.Tensor], in_features: int) -> torch.Tensor:
    """The ``[N, K]`` fp32 weights that a q4k state represents."""
    g = in_features // GROUP
    codes, sc, m, d, dmin = _unpack_q4k(state["packed"], g)
    s_of_g = torch.tensor([i // SUPER for i in range(g)])
    step = d[:, s_of_g] * sc.float()  # [N16, G]
    w = step.unsqueeze(-1) * codes.float() - (dmin[:, s_of_g] * m.float()).unsqueeze(-1)
    return w.reshape(w.shape[0], in_features)[: int(state["out_features"])]


def quantize_activations_q4k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` fp32 -> int8 codes ``[M, G, 32]``, scales ``[M, S]`` (one per superblock)
    and code sums per group ``[M, G]`` (int64), exactly as the kernel computes them."""
    m_rows, k = x.shape
    g = k // GROUP
    codes, scales = [], []
    for g0, ng in _superblocks(g):
        part = x.float()[:, g0 * GROUP : (g0 + ng) * GROUP]
        d = part.abs().amax(-1) / 127.0  # [M]
        inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
        codes.append(torch.round(part * inv.unsqueeze(-1)).clamp_(-127, 127))
        scales.append(d)
    xq = torch.cat(codes, 1).view(m_rows, g, GROUP)
    return xq.to(torch.int8), torch.stack(scales, 1), xq.long().sum(-1)


def reference_linear_q4k(x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The kernel's q4k computation in plain torch (slow; the bit-exact reference for the tests)."""
    g = x.shape[1] // GROUP
    xq, xd, xs = quantize_activations_q4k(x)  # [M, G, 32], [M, S], [M, G]
    codes, sc, m, d, dmin = _unpack_q4k(state["packed"], g)
    idot = torch.einsum("mgj,ngj->mng", xq.long(), codes.long())  # [M, N16, G], exact integers
    acc = torch.zeros(x.shape[0], codes.shape[0])
    for s, (g0, ng) in enumerate(_superblocks(g)):
        isc = (idot[:, :, g0 : g0 + ng] * sc[:, g0 : g0 + ng]).sum(-1)  # [M, N16], exact
        imin = (xs[:, None, g0 : g0 + ng] * m[None, :, g0 : g0 + ng]).sum(-1)
        fs = d[:, s] * isc.to(torch.int32).float()
        fm = dmin[:, s] * imin.to(torch.int32).float()
        acc = acc + xd[:, s : s + 1] * (fs - fm)
    if "bias" in state:
        acc = acc + state["bias"]
    return acc[:, : int(state["out_features"])]


def kernel():
    """The compiled kernel module (built on first use, cached per machine under $SPECDEC_HOME)."""
    return native.kernel("q4")


class PackedLinear(torch.nn.Module):
    """A linear layer over packed integer weights in rows of 16 (``state``'s ``packed``,
    ``out_features``, optional ``bias``), computed by a C++ kernel ``run(x, packed, bias)`` on
    float32 input: the wrapper the q4/q4k and q6k layers share."""

    def __init__(self, state: dict[str, torch.Tensor], in_features: int, run) -> None:
        super().__init__()
        self.packed = state["packed"]
        self.out_features, self.in_features = int(state["out_features"]), in_features
        bias = state.get("bias")
        self.bias = bias if bias is not None else torch.empty(0)
        self._run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        y = self._run(x, self.packed, self.bias)  # [..., N16]
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]


class Q4Linear(PackedLinear):
    """A linear layer with 4-bit weights; see the module docstring."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        packed = state["packed"]  # [NT, G, 320] (q4) or [NT, tile bytes] (q4k)
        in_features = packed.shape[1] * GROUP if packed.dim() == 3 else int(state["in_features"])
        super().__init__(state, in_features, kernel().q4_linear)
