"""The ``gguf`` dtype: each weight of a GGUF file multiplied at its own precision.

A linear layer is made of parts (a fused q/k/v is three stored tensors, and a Q4_K_M file stores
q and k as Q4_K, v as Q6_K). Each part is built from the file's own blocks:

- Q4_K: the q4k kernel over the file's codes and scales (:func:`specdec.runtime.q4.quantize_q4k`);
- Q6_K: the Q6_K kernel over the file's codes and scales (:mod:`specdec.runtime.q6k`);
- any other type (F32, F16, BF16, Q8_0, Q5_K, ...): its dequantized values in fp32 — every stored
  weight exactly, at fp32's speed (no native kernel for them yet; ``specdec models`` and the load
  notice say which tensors run so).

Consecutive parts of one kind form one layer; a layer of several kinds runs each and concatenates
the outputs (each part is batch invariant, so the whole is). A part's weights are checked against
the dequantized weights it must reproduce: a file whose blocks do not is an error, never silently
re-quantized. A layer that is not the file's (a draft head's, a pruned output view) has no parts
in the file and is built as ``q4k``.
"""

from __future__ import annotations

import torch

from specdec.runtime import q4, q6k
from specdec.runtime.dense import FloatLinear
from specdec.runtime.q4 import Q4KGrid
from specdec.runtime.q6k import Q6KGrid

KINDS = ("q4k", "q6k", "float")


def kind_of(grid) -> str:
    return "q4k" if isinstance(grid, Q4KGrid) else "q6k" if isinstance(grid, Q6KGrid) else "float"


class ConcatLinear(torch.nn.Module):
    """Row blocks of one weight, each its own layer: ``y = [part(x) for part]`` along the last dim."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.forward(x) for part in self.parts], -1)


def segment_states(weight: torch.Tensor, bias: torch.Tensor | None,
                   grids: list[tuple[int, object]]) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """``weight`` ``[N, K]`` fp32 (the dequantized file weights of consecutive parts) and its parts'
    ``(rows, grid or None)`` -> ``[(kind, state)]``, one per run of parts of one kind."""
    runs: list[tuple[str, int, int, list]] = []  # kind, first row, end row, grids
    at = 0
    for rows, grid in grids:
        kind = kind_of(grid)
        if grid is not None and not torch.equal(grid.dequantize(), weight[at : at + rows]):
            raise ValueError(f"a {kind} tensor's blocks do not reproduce its dequantized weights")
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], at + rows, runs[-1][3] + [(rows, grid)])
        else:
            runs.append((kind, at, at + rows, [(rows, grid)]))
        at += rows
    out = []
    for kind, lo, hi, parts in runs:
        b = None if bias is None else bias[lo:hi]
        out.append((kind, _state(kind, weight[lo:hi], b, parts)))
    return out


def _state(kind: str, weight: torch.Tensor, bias: torch.Tensor | None, parts: list) -> dict[str, torch.Tensor]:
    if kind == "q4k":
        return q4.quantize_q4k(weight, bias, parts)
    if kind == "q6k":
        grid = Q6KGrid(*(torch.cat([getattr(g, f) for _, g in parts]) for f in ("u", "sc", "d")))
        return q6k.pack(grid, bias)
    state = {"weight": weight.float().contiguous()}
    if bias is not None:
        state["bias"] = bias.float()
    return state


def layer(kind: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    if kind == "q4k":
        return q4.Q4Linear(state)
    if kind == "q6k":
        return q6k.Q6KLinear(state)
    return FloatLinear(state["weight"], state.get("bias"), torch.float32)


def export(name: str, segments: list[tuple[str, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """A layer's segments as flat tensors for the on-disk cache (:func:`from_cache` reads them)."""
    out = {f"{name}.kinds": torch.tensor([KINDS.index(kind) for kind, _ in segments])}
    for i, (_, state) in enumerate(segments):
        out.update({f"{name}.s{i}.{key}": value for key, value in state.items()})
    return out


def from_cache(name: str, cached: dict[str, torch.Tensor]) -> list[tuple[str, dict[str, torch.Tensor]]] | None:
    """The segments :func:`export` stored for ``name``, or None."""
    kinds = cached.get(f"{name}.kinds")
    if kinds is None:
        return None
    segments = []
    for i, code in enumerate(kinds.tolist()):
        prefix = f"{name}.s{i}."
        segments.append((KINDS[code], {k[len(prefix):]: v for k, v in cached.items() if k.startswith(prefix)}))
    return segments


def module(segments: list[tuple[str, dict[str, torch.Tensor]]]) -> torch.nn.Module:
    layers = [layer(kind, state) for kind, state in segments]
    return layers[0] if len(layers) == 1 else ConcatLinear(layers)
