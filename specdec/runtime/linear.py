"""Linear layers for each runtime dtype, from torch's own kernels (no hand-written GEMM).

``int8``: per-channel int8 weights, int8 activations with one scale PER ROW, integer
accumulation — through fbgemm's dynamic quantized linear. fbgemm picks a single activation scale
for the whole input tensor (from its min and max), which would make a row's output depend on the
other rows in the call (a row moved by up to 0.70 when another row had a larger range). We make
that shared choice constant: each row is divided by its own max |x| and two anchor columns holding
+1 and -1 (multiplied by zero weights) are appended, so every input tensor has min -1 and max +1
and fbgemm's per-tensor scale is always the same. Each row is then quantized with its own
effective scale, the int32 accumulation is exact, and the result is rescaled by the row's max.
Outputs are therefore bit-identical whatever else shares the call (tested), and a block of 5 rows
costs about 1.3x one row on this CPU (see docs/BENCHMARKS.md).

Activation outliers. A few input channels of LLM linears are ~100x larger than the rest, and a
per-row scale set by them quantizes the other channels to a handful of levels. As in SmoothQuant
(Xiao et al. 2023) we move part of that range into the weights: with ``a_c`` the calibrated max
|activation| of input channel ``c`` and ``w_c`` the max |weight| of that column,
``s_c = sqrt(a_c / w_c)``; the layer computes ``(x / s) @ (W * s)^T``, which is the same product
in exact arithmetic. The division is elementwise, so row independence is kept.

``q4``: 4-bit weights in groups of 32 x per-group int8 activations, our own kernel; also
batch invariant (see :mod:`specdec.runtime.q4`). ``q4k``: the same kernel on GGUF Q4_K's layout
(integer sub-scales per superblock of 256 inputs, activations quantized per superblock): 7.5%
fewer weight bytes.

``float32`` / ``bfloat16``: ``F.linear`` in that dtype (summation order may differ by ~1e-6
between call shapes).
"""

from __future__ import annotations

import warnings

import torch

from specdec.runtime import q4
from specdec.runtime.dense import FloatLinear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "q4": torch.uint8,
          "q4k": torch.uint8, "gguf": torch.uint8}
QUANTIZED = ("int8", "q4", "q4k", "gguf")  # dtypes whose layers are built once and cached on disk
FOUR_BIT = ("q4", "q4k")  # the two layouts of q4.Q4Linear (per-group scales; integer sub-scales)
# The default everywhere (CLI, API, loading): 4 bits where this CPU runs the kernel (AVX2 or
# better) — faster than int8 and closer to the GGUF weights (docs/CHANGELOG.md, '4-bit
# batch-invariant runtime') — in the q4k layout: fewer bytes than q4, a GGUF file's Q4_K tensors
# kept exactly, and a vector loop for AVX-512 VNNI and (since stop 42) AVX2, where one token is
# ~6% faster than q4 on Zen 3 and the shipped head is accepted as often (docs/CHANGELOG.md, "q4k has an AVX2 loop"); else int8.
FAST_DTYPE = "q4k" if q4.available() else "int8"
# "auto", resolved per model at load (specdec.models.loading.resolve_dtype): a GGUF target at its
# file's own precision ("gguf": Q4_K and Q6_K in their kernels, other types as exact fp32), other
# sources and draft models (whose precision changes acceptance, never the output) at FAST_DTYPE.
DEFAULT_DTYPE = "auto"
DTYPE_CHOICES = (DEFAULT_DTYPE, *DTYPES)  # what --dtype accepts

_ANCHOR_COLUMNS = 8  # +1, -1, then zeros: keeps K a multiple of 8 when it was one


def quantize_int8(
    weight: torch.Tensor, bias: torch.Tensor | None, act_absmax: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The plain tensors that define a :class:`RowInt8Linear` (what the on-disk cache stores).

    qweight ``[N, K+8]`` int8 (anchor columns are zero), scale ``[N]`` fp64 per output channel,
    and optionally inv_smooth ``[K]`` and bias ``[N]``.
    """
    out_features = weight.shape[0]
    weight = weight.float()
    state: dict[str, torch.Tensor] = {}
    if act_absmax is not None:
        w_absmax = weight.abs().amax(0).clamp(min=1e-8)  # [K]
        smooth = (act_absmax.float().clamp(min=1e-5) / w_absmax).sqrt().clamp(min=1e-2, max=1e2)  # [K]
        weight = weight * smooth
        state["inv_smooth"] = 1.0 / smooth
    scale = (weight.abs().amax(1) / 127.0).clamp(min=1e-12).double()  # [N]
    q = torch.round(weight / scale.unsqueeze(1).float()).clamp_(-127, 127).to(torch.int8)
    state["qweight"] = torch.cat([q, q.new_zeros(out_features, _ANCHOR_COLUMNS)], 1)  # [N, K+8]
    state["scale"] = scale
    if bias is not None:
        state["bias"] = bias.float()
    return state


class RowInt8Linear(torch.nn.Module):
    """int8 weights (per output channel) x int8 activations (per row), fbgemm kernel; see module doc."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        qweight = state["qweight"]
        out_features = qweight.shape[0]
        self._state: dict[str, torch.Tensor] | None = state  # until packed
        self._packed = None
        self.inv_smooth = state.get("inv_smooth")
        self.bias = state.get("bias")
        anchor = torch.zeros(_ANCHOR_COLUMNS)
        anchor[0], anchor[1] = 1.0, -1.0
        self.register_buffer("_anchor", anchor, persistent=False)
        self.in_features, self.out_features = qweight.shape[1] - _ANCHOR_COLUMNS, out_features

    def pack(self) -> None:
        """Prepack the weight for fbgemm (slow: ~0.1 s per large layer; see LinearBuilder.pack_all)."""
        if self._packed is not None:
            return
        qweight, scale = self._state["qweight"], self._state["scale"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch marks quantized tensor creation as deprecated
            qtensor = torch._make_per_channel_quantized_tensor(
                qweight, scale, torch.zeros(qweight.shape[0], dtype=torch.long), 0
            )
            self._packed = torch.ops.quantized.linear_prepack(qtensor, None)
        self._state = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            self.pack()
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # [M, K]
        if self.inv_smooth is not None:
            x2 = x2 * self.inv_smooth
        row_max = x2.abs().amax(-1, keepdim=True).clamp(min=1e-30)  # [M, 1]
        xn = torch.cat([x2 / row_max, self._anchor.expand(x2.shape[0], -1)], 1)  # [M, K+8], range exactly [-1, 1]
        y = torch.ops.quantized.linear_dynamic(xn, self._packed, True) * row_max  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class LinearBuilder:
    """Builds a model's linear layers for one dtype.

    Layers are requested by name with *functions* that produce the weight and bias, so that when
    int8 layers come from the on-disk cache (``quantized``) the fp32 weights are never read.
    ``exported`` collects the quantized tensors of layers built from fp32, for saving.
    """

    def __init__(self, dtype: str, act_absmax: dict[str, torch.Tensor] | None = None,
                 quantized: dict[str, torch.Tensor] | None = None, grids=None) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        self.dtype = dtype
        self.act_absmax = act_absmax or {}
        self.quantized = quantized
        self.grids = grids  # q4k: exact 4-bit grids by parameter name (.get(name) -> Q4KGrid | None), or None
        self.exported: dict[str, torch.Tensor] = {}
        self._to_pack: list[RowInt8Linear] = []

    def pack_all(self) -> None:
        """Prepack every int8 layer, two threads at a time (the packing op releases the GIL)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, min(4, torch.get_num_threads()))) as pool:
            list(pool.map(RowInt8Linear.pack, self._to_pack))
        self._to_pack.clear()

    def __call__(self, name: str, weight_fn, bias_fn=lambda: None, parts: tuple[tuple[str, int], ...] = ()) -> torch.nn.Module:
        """``parts``: the parameter names and row counts the weight is made of, in order (a fused
        layer's q, k, v), so that q4k can use a GGUF file's own 4-bit grids for them."""
        if self.dtype not in QUANTIZED:
            return FloatLinear(weight_fn(), bias_fn(), DTYPES[self.dtype])
        if self.dtype == "gguf":
            return self._gguf(name, weight_fn, bias_fn, parts)
        if self.quantized is not None:
            prefix = name + "."
            state = {k[len(prefix):]: v for k, v in self.quantized.items() if k.startswith(prefix)}
            if ("packed" if self.dtype in FOUR_BIT else "qweight") not in state:
                raise KeyError(f"quantized cache has no layer {name!r}")
        else:
            if self.dtype in FOUR_BIT:
                if self.dtype == "q4":
                    state = q4.quantize_q4(weight_fn(), bias_fn())
                else:
                    exact = [(rows, self.grids.get(part)) for part, rows in parts] if self.grids else None
                    state = q4.quantize_q4k(weight_fn(), bias_fn(), exact)
            else:
                state = quantize_int8(weight_fn(), bias_fn(), self.act_absmax.get(name))
            self.exported.update({f"{name}.{k}": v for k, v in state.items()})
        if self.dtype in FOUR_BIT:
            return q4.Q4Linear(state)
        layer = RowInt8Linear(state)
        self._to_pack.append(layer)
        return layer


    def _gguf(self, name: str, weight_fn, bias_fn, parts) -> torch.nn.Module:
        """A layer of the ``gguf`` dtype (:mod:`specdec.runtime.gguf_linear`): each part at its
        stored type, from the file's own blocks; a layer that is not the file's (no file, no
        parts: a draft head's) is built as q4k."""
        from specdec.runtime import gguf_linear

        if self.grids is None or not parts:
            return q4.Q4Linear(q4.quantize_q4k(weight_fn(), bias_fn()))
        return gguf_linear.module(gguf_linear.from_file(self.grids, parts, bias_fn()))


def activation_dtype(dtype: str) -> torch.dtype:
    """The dtype hidden states are carried in: bf16 for bfloat16, fp32 otherwise."""
    return torch.bfloat16 if dtype == "bfloat16" else torch.float32


def kv_dtype(dtype: str) -> torch.dtype:
    """The dtype the KV cache keeps for weights of ``dtype``: the activations' for float32 (the
    runtime checked against transformers' fp32 logits) and bfloat16; fp16 for every quantized
    type, as llama.cpp keeps it by default. Half of fp32's memory (Llama-3.1-8B at a 4k context:
    0.54 GB instead of 1.07 GB) and of the attention's reads; the kernel reads the halves as
    their exact fp32 values, and a block's keys and values are rounded to them once, when stored."""
    return activation_dtype(dtype) if dtype in ("float32", "bfloat16") else torch.float16
