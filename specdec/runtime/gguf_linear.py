"""The ``gguf`` dtype: each weight of a GGUF file multiplied at its own precision.

A linear layer is made of parts (a fused q/k/v is three stored tensors, and a Q4_K_M file stores
q and k as Q4_K, v as Q6_K). Each part is built from the file's own blocks:

- Q4_K: the q4k kernel over the file's codes and scales (:func:`specdec.runtime.q4.quantize_q4k`);
- Q6_K: the Q6_K kernel over the file's codes and scales (:mod:`specdec.runtime.q6k`);
- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K: one kernel family over the file's codes and scales
  (:mod:`specdec.runtime.blocks`);
- F16, BF16: multiplied as stored, 2 bytes a weight (:class:`specdec.runtime.blocks.HalfLinear`);
- F32 (and a 16-bit matrix whose rows are not a multiple of 16 weights): its values in fp32.
Any other type is refused at load (:func:`specdec.models.gguf_meta.check_kernels`).

Consecutive parts of one kind form one layer; a layer of several kinds runs each and concatenates
the outputs (each part is batch invariant, so the whole is). The blocks are read from the file in
place (:mod:`specdec.models.gguf_file`) and repacked into the kernels' tiles by a byte-shuffling
kernel (``kernels/repack.cpp``, against its torch reference :func:`packed_run_reference`): no
weight matrix of a kernel's type is ever dequantized. A layer that is not the file's (a draft head's, a pruned output view)
has no parts in the file and is built as ``q4k``.
"""

from __future__ import annotations

import torch

from specdec.runtime import blocks, native, q4, q6k
from specdec.runtime.dense import FloatLinear

# storage type -> the kernel that runs it in place (a block or 16-bit type's kind is its name); F32
# runs as fp32 ("float")
KERNELS = {"Q4_K": "q4k", "Q6_K": "q6k", **{t: t for t in (*blocks.TYPES, *blocks.HALVES)}}
FLOATS = ("F32",)
KINDS = ("q4k", "q6k", *blocks.TYPES, *blocks.HALVES, "float")
# a 256-input superblock of one 16-row tile, in each kernel's layout
TILE_SUPERBLOCK_BYTES = {"q4k": 8 * q4.CODE_BYTES + 8 * 16 * 2 + 4 * q4.TILE, "q6k": q6k.SB_BYTES}


class ConcatLinear(torch.nn.Module):
    """Row blocks of one weight, each its own layer: ``y = [part(x) for part]`` along the last dim."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.forward(x) for part in self.parts], -1)


def from_file(file, parts: tuple[tuple[str, int], ...], bias: torch.Tensor | None) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """The layer made of ``parts`` (``(parameter name, rows)``, in order) of a GGUF ``file``
    (:class:`specdec.models.gguf_file.GGUFFile`) -> ``[(kind, state)]``, one per run of parts of
    one kind. Q4_K and Q6_K parts are repacked from the file's blocks a row chunk at a time (never
    dequantized), and each part's mapped pages are dropped once repacked."""
    runs: list[tuple[str, int, int, list[str]]] = []  # kind, first row, end row, part names
    at = 0
    for name, rows in parts:
        kind = KERNELS.get(file.type_of(name), "float")
        if kind in blocks.HALVES and file.tensors[file.gguf_name(name)].shape[1] % blocks.LANES:
            kind = "float"
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], at + rows, runs[-1][3] + [name])
        else:
            runs.append((kind, at, at + rows, [name]))
        at += rows
    out = []
    for kind, lo, hi, names in runs:
        b = None if bias is None else bias[lo:hi]
        if kind == "float":  # F32: its values, one tensor at a time
            out.append((kind, {"weight": torch.cat([file.tensor(n) for n in names]), **({} if b is None else {"bias": b.float()})}))
        elif kind in blocks.HALVES:
            out.append((kind, _half_run(file, kind, names, b)))
        else:
            out.append((kind, _packed_run(file, kind, names, b)))
        for n in names:
            file.forget(n)
    return out


def _packed_run(file, kind: str, names: list[str], bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Consecutive parts of one kernel's type as one packed layer, written by a repack kernel
    straight from the mapped blocks into one preallocated tensor (tiles of 16 rows are
    independent; a part whose rows are not a multiple of 16 is only allowed last: its padding
    ends the layer)."""
    rows = [file.tensors[file.gguf_name(n)].shape[0] for n in names]
    cols = file.tensors[file.gguf_name(names[0])].shape[1]
    if any(r % q4.TILE for r in rows[:-1]):  # odd part sizes mid-layer: decode whole parts and concatenate
        return _pack(kind, [file.grid(n) for n in names], bias, cols)
    total = sum(rows)
    tile_bytes = blocks.tile_bytes(kind, cols) if kind in blocks.TYPES else cols // 256 * TILE_SUPERBLOCK_BYTES[kind]
    packed = torch.empty(-(-total // q4.TILE), tile_bytes, dtype=torch.uint8)
    tile = 0
    for n, r in zip(names, rows):
        src, order = file.blocks(n)  # [file rows, row bytes], [r]
        _repack(kind)(src, order, packed, tile)
        tile += -(-r // q4.TILE)
    return _state(kind, packed, total, cols, bias)


def _half_run(file, kind: str, names: list[str], bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Consecutive F16 (or BF16) parts as one ``[rows, K]`` int16 matrix: the stored bits, rows
    in transformers' order (a copy of the file's bytes, whose mapped pages are then dropped)."""
    pieces = [file.blocks(n) for n in names]  # ([file rows, 2K] uint8, [rows])
    weight = torch.empty(sum(len(order) for _, order in pieces), pieces[0][0].shape[1] // 2, dtype=torch.int16)
    at = 0
    for src, order in pieces:
        torch.index_select(src.view(torch.int16), 0, order, out=weight[at : at + len(order)])
        at += len(order)
    state = {"weight16": weight, "bf16": torch.tensor(kind == "BF16")}
    if bias is not None:
        state["bias"] = bias.float()
    return state


def _repack(kind: str):
    """The repack kernel of ``kind``: ``(src, rows, out, tile0)``."""
    if kind in blocks.TYPES:
        run, type_id = blocks.kernel().blocks_repack, blocks.TYPES[kind].id
        return lambda src, rows, out, tile0: run(type_id, src, rows, out, tile0)
    repack = native.kernel("repack")
    return repack.q4k_repack if kind == "q4k" else repack.q6k_repack


def packed_run_reference(file, kind: str, names: list[str], bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """:func:`_packed_run` in torch, over decoded grids a row chunk at a time: the repack
    kernel's reference (the tests compare them byte for byte)."""
    from specdec.models.gguf_file import ROW_CHUNK

    rows = [file.tensors[file.gguf_name(n)].shape[0] for n in names]
    cols = file.tensors[file.gguf_name(names[0])].shape[1]
    pieces = [_pack(kind, [file.grid(n, lo, min(r, lo + ROW_CHUNK))], None, cols)["packed"]  # [tiles, bytes]
              for n, r in zip(names, rows) for lo in range(0, r, ROW_CHUNK)]
    return _state(kind, torch.cat(pieces), sum(rows), cols, bias)


def _state(kind: str, packed: torch.Tensor, total: int, cols: int, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    state = {"packed": packed, "out_features": torch.tensor(total)}
    if kind == "q4k" or kind in blocks.TYPES:
        state["in_features"] = torch.tensor(cols)
    if kind in blocks.TYPES:
        state["type"] = torch.tensor(blocks.TYPES[kind].id)
    if bias is not None:
        state["bias"] = torch.cat([bias.float(), bias.new_zeros(packed.shape[0] * q4.TILE - total).float()])
    return state


def _pack(kind: str, grids: list, bias: torch.Tensor | None, cols: int) -> dict[str, torch.Tensor]:
    """Grids of one kind, concatenated by rows -> that kernel's state."""
    import dataclasses

    cls = type(grids[0])
    cat = lambda parts: parts[0] if not isinstance(parts[0], torch.Tensor) else torch.cat(parts)  # noqa: E731
    grid = grids[0] if len(grids) == 1 else cls(**{f.name: None if getattr(grids[0], f.name) is None else
                                                   cat([getattr(g, f.name) for g in grids])
                                                   for f in dataclasses.fields(cls)})
    if kind in blocks.TYPES:
        return _state(kind, blocks.pack(grid), grid.rows(), cols, bias)
    if kind == "q6k":
        return q6k.pack(grid, bias)
    return q4.pack_q4k_grid(grid, bias, cols)


def layer(kind: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    if kind == "q4k":
        return q4.Q4Linear(state)
    if kind == "q6k":
        return q6k.Q6KLinear(state)
    if kind in blocks.TYPES:
        return blocks.BlockLinear(state)
    if kind in blocks.HALVES:
        return blocks.HalfLinear(state)
    return FloatLinear(state["weight"], state.get("bias"), torch.float32)


def module(segments: list[tuple[str, dict[str, torch.Tensor]]]) -> torch.nn.Module:
    layers = [layer(kind, state) for kind, state in segments]
    return layers[0] if len(layers) == 1 else ConcatLinear(layers)
