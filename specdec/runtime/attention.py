"""Attention for decoding: each query over exactly its visible slots, batch invariant by construction.

A query's visible slots are described by a :class:`Visibility`: a range ``[lo, hi)`` of cache
slots followed by an explicit list (a candidate tree's nodes), in that order. A chain query at
position ``p`` sees ``[0, p + 1)`` (or its sliding window) whatever block or batch it is in; a
tree node sees the committed range and then its ancestors' slots and its own — for a path-shaped
tree exactly the slots, in the same order, of the same chain, so the two give identical logits.

The C++ kernel (``kernels/attention.cpp``) computes every (row, query, head) with one fixed
sequence of fp32 operations over that list; :func:`reference_attend` is the same computation in
plain torch (slow), and the two are tested to be bit-identical. It replaced a per-query-group
torch formulation that cost ~20 small ops per group and layer (7 ms of a 5-token verification
step of the 1.5B target, 35 ms for 4 rows; docs/CHANGELOG.md, 'runtime at llama.cpp's bytes').
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime import native
from specdec.runtime.lanes import LANES, exp16


def kernel():
    return native.kernel("attention")


@dataclass(frozen=True)
class Visibility:
    """Visible slots of the ``Q = B * T`` queries of a block, row-major (query ``i = b * T + t``)."""

    lo: torch.Tensor  # [Q] int64: first slot of the range
    hi: torch.Tensor  # [Q] int64: end of the range (exclusive)
    extra_ptr: torch.Tensor  # [Q + 1] int64: query i's extra slots are extra[extra_ptr[i]:extra_ptr[i + 1]]
    extra: torch.Tensor  # [nnz] int64: extra slots (tree nodes), after the range


def chain(start: torch.Tensor, t: int, window: int | None = None, positions: torch.Tensor | None = None) -> Visibility:
    """Causal visibility for a block of ``t`` tokens appended at ``start`` ``[B]``: query
    ``(b, i)`` sees ``[0, start_b + i + 1)``; with ``window`` only keys at positions
    > p - window, p its rope position (``positions`` ``[B, T]``, default: its slot)."""
    hi = (start.unsqueeze(1) + torch.arange(t).unsqueeze(0) + 1).flatten()  # [B*T]
    if window is None:
        lo = torch.zeros_like(hi)
    else:
        pos = hi - 1 if positions is None else positions.flatten()
        lo = torch.minimum((pos - window + 1).clamp(min=0), hi)
    return Visibility(lo, hi, torch.zeros(hi.numel() + 1, dtype=torch.long), torch.zeros(0, dtype=torch.long))


def tree(base: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None = None,
         window: int | None = None) -> Visibility:
    """Visibility for a tree block: ``mask`` ``[B, T, W]`` says which of the ``W`` slots from
    ``base`` ``[B]`` on (earlier tree slots, then the block) each block token sees; every slot
    before ``base`` is visible. With ``window`` (sliding-window layers; ``positions`` ``[B, T]``
    are the block's rope positions and W == T), a query at position p sees only keys at
    positions > p - window: committed slots ``[p - window + 1, base)`` and the block nodes so placed."""
    bsz, t, w = mask.shape
    hi = base.repeat_interleave(t)  # [B*T]
    lo = torch.zeros_like(hi)
    if window is not None:
        pos = positions.flatten()  # [B*T]
        lo = torch.minimum((pos - window + 1).clamp(min=0), hi)
        mask = mask & (positions.unsqueeze(2) - positions.unsqueeze(1) < window)  # [B, T, T] (W == T)
    flat = mask.reshape(bsz * t, w)
    counts = flat.sum(1)  # [B*T]
    extra_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    query, col = torch.nonzero(flat, as_tuple=True)  # sorted by query, then slot
    extra = hi[query] + col
    return Visibility(lo, hi, extra_ptr, extra)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, scale: float,
           cap: float | None = None) -> torch.Tensor:
    """``q`` ``[B, T, Hq, D]``, ``k``/``v`` ``[B, Hkv, S, D]`` (a layer of the cache) ->
    ``[B, T, Hq, D]`` in ``q``'s dtype; computed in fp32. ``cap``: attention-logit softcapping
    (Gemma 2), each score ``s`` becomes :func:`softcap` ``(s, cap)`` before the softmax."""
    dtype = q.dtype
    if dtype != torch.float32:  # bf16 runtime: only the slots up to the furthest visible one
        end = int(torch.cat([vis.hi, vis.extra + 1]).max())
        q, k, v = q.float(), k[:, :, :end].float(), v[:, :, :end].float()
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        q = q.contiguous()
    out = kernel().attend(q, k, v, vis.lo, vis.hi, vis.extra_ptr, vis.extra, scale, cap or 0.0)
    return out.to(dtype)


def attend_block(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, vis: Visibility, scale: float, num_heads: int) -> torch.Tensor:
    """A llama block's attention sublayer in one kernel call: rotate the queries and keys of
    ``qkv`` ``[B, T, (Hq + 2 Hkv) D]`` (``cos``/``sin`` ``[B, T, 1, D]``, signed sin; the bits of
    :func:`specdec.runtime.model.apply_rope`), store the keys and values at ``slots`` ``[B, T]``
    of ``k``/``v`` ``[B, Hkv, S, D]`` (a layer of the cache, written in place), then
    :func:`attend` -> ``[B, T, Hq * D]``. All fp32."""
    return kernel().attend_block(qkv, cos, sin, k, v, slots, vis.lo, vis.hi, vis.extra_ptr, vis.extra, scale, num_heads)


def _dot16(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q`` ``[D]`` . ``keys`` ``[n, D]`` -> ``[n]``: 16 lane sums, then the fixed tree."""
    d = q.shape[-1]
    acc = torch.zeros(keys.shape[0], LANES)
    for c in range(0, d, LANES):
        acc = acc + q[c : c + LANES] * keys[:, c : c + LANES]
    for half in (8, 4, 2):
        acc = acc[:, :half] + acc[:, half : 2 * half]
    return acc[:, 0] + acc[:, 1]


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` as the kernel computes it: ``tanh(t) = sign(t) (1 - e) / (1 + e)``
    with ``e = exp16(-2|t|)``, one fp32 rounding per operation."""
    c = torch.tensor(cap, dtype=torch.float32)
    t = x / c
    e = exp16(-2.0 * t.abs())
    r = (1.0 - e) / (1.0 + e)
    return torch.where(t < 0, -r, r) * c


def reference_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, scale: float,
                     cap: float | None = None) -> torch.Tensor:
    """The kernel's computation in plain torch, query by query (slow; the bit-exact reference)."""
    bsz, t, hq, d = q.shape
    rep = hq // k.shape[1]
    out = torch.empty(bsz, t, hq, d)
    s = torch.tensor(scale, dtype=torch.float32)
    for i in range(bsz * t):
        b, j = divmod(i, t)
        p0, p1 = int(vis.extra_ptr[i]), int(vis.extra_ptr[i + 1])
        slots = torch.cat([torch.arange(int(vis.lo[i]), int(vis.hi[i])), vis.extra[p0:p1]])
        for head in range(hq):
            keys, values = k[b, head // rep, slots].float(), v[b, head // rep, slots].float()  # [n, D]
            scores = _dot16(q[b, j, head].float(), keys) * s  # [n]
            if cap:
                scores = softcap(scores, cap)
            probs = exp16(scores - scores.max())
            total = torch.zeros(())
            acc = torch.zeros(d)
            for n in range(slots.numel()):  # in slot-list order, one rounding per operation
                total = total + probs[n]
                acc = acc + probs[n] * values[n]
            out[b, j, head] = acc / total
    return out
