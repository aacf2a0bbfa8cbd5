"""GGUF Q4_K tensors as q4k grids: the 4-bit weights of a GGUF file, kept exactly as stored.

A Q4_K block holds 256 weights of one row: fp16 ``d`` and ``dmin``, eight 6-bit sub-scales
``sc`` and mins ``m`` (12 packed bytes), and 128 bytes of 4-bit codes, with
``w = d * sc[j] * q - dmin * m[j]`` for the 32 weights of sub-block ``j``. That is the q4k layout's
decomposition (:class:`specdec.runtime.q4.Q4KGrid`), so the q4k runtime can use the file's own
codes and scales instead of re-quantizing the dequantized weights — the weights the runtime
multiplies are then exactly the ones llama.cpp multiplies. Other tensor types (Q6_K, Q8_0, ...)
are re-quantized as before.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from specdec.runtime.q4 import Q4KGrid

# Hugging Face parameter name -> GGUF tensor name, for the blocks specdec runs.
_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # the last two: Phi-3's fused
_TOP = {"lm_head.weight": "output.weight", "model.embed_tokens.weight": "token_embd.weight"}
_BLOCK_BYTES = 144  # 2 + 2 + 12 + 128


def gguf_name(hf_name: str) -> str | None:
    if hf_name in _TOP:
        return _TOP[hf_name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf_name)
    if match and match.group(2) in _BLOCK:
        return f"blk.{match.group(1)}.{_BLOCK[match.group(2)]}.weight"
    return None


def decode_blocks(raw: np.ndarray) -> Q4KGrid:
    """``raw`` ``[N, K / 256 * 144]`` uint8 (N rows of Q4_K blocks) -> a grid of N rows."""
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(n, -1, _BLOCK_BYTES)  # [N, S, 144]
    s = blocks.shape[1]
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, s)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).view(n, s)
    scales = blocks[..., 4:16].long()  # [N, S, 12]
    lo6, mid6, high = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    # sub-blocks 0-3: 6 low bits of bytes 0-3 (sc) and 4-7 (m); 4-7: a nibble of bytes 8-11 plus
    # the top 2 bits of bytes 0-3 (sc) and 4-7 (m)
    sc = torch.cat([lo6 & 0x3F, (high & 0x0F) | ((lo6 >> 6) << 4)], -1)  # [N, S, 8]
    m = torch.cat([mid6 & 0x3F, (high >> 4) | ((mid6 >> 6) << 4)], -1)
    qs = blocks[..., 16:].view(n, s, 4, 1, 32)  # 4 chunks of 32 bytes: low nibbles sub-block 2c, high 2c + 1
    codes = torch.cat([qs & 0x0F, qs >> 4], 3).reshape(n, s * 8, 32)  # [N, G, 32]
    return Q4KGrid(codes, sc.reshape(n, s * 8), m.reshape(n, s * 8), d, dmin)


class Q4KTensors:
    """The Q4_K tensors of one GGUF file by Hugging Face parameter name (read on request,
    memory-mapped); :meth:`get` is None for a tensor of another type or an unknown name."""

    def __init__(self, path: Path) -> None:
        from gguf import GGMLQuantizationType, GGUFReader

        self._tensors = {t.name: t for t in GGUFReader(str(path)).tensors
                         if t.tensor_type == GGMLQuantizationType.Q4_K}

    def get(self, hf_name: str) -> Q4KGrid | None:
        name = gguf_name(hf_name)
        tensor = self._tensors.get(name) if name else None
        return None if tensor is None else decode_blocks(np.asarray(tensor.data))


class GGUFTensors:
    """A GGUF file's weight matrices as the grids the ``gguf`` dtype multiplies, by Hugging Face
    parameter name: :meth:`get` is a :class:`Q4KGrid` (Q4_K), a :class:`~specdec.runtime.q6k.Q6KGrid`
    (Q6_K), or None (another type, which then runs as its exact fp32 values; or a name the file
    does not have). Rows follow the Hugging Face layout: a llama file's q and k rows, which
    llama.cpp's converter interleaved per head for its rope, are put back in transformers' order."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        self._tensors = {t.name: t for t in reader.tensors}
        arch = reader.fields["general.architecture"].contents()
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads} if arch == "llama" else {}

    def get(self, hf_name: str):
        from gguf import GGMLQuantizationType as T

        from specdec.runtime import q6k

        name = gguf_name(hf_name)
        tensor = self._tensors.get(name) if name else None
        decode = {T.Q4_K: decode_blocks, T.Q6_K: q6k.decode_blocks}.get(tensor.tensor_type) if tensor is not None else None
        if decode is None:
            return None
        grid = decode(np.asarray(tensor.data))
        parts = name.split(".")  # blk.{i}.{kind}.weight, or output.weight / token_embd.weight
        heads = self._heads.get(parts[2]) if len(parts) == 4 else None
        return grid if heads is None else _rows(grid, _unpermute(grid.rows(), heads))


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row ``i`` of transformers' q/k weight is row ``index[i]`` of a llama GGUF file's: the file
    holds each head's rope pairs as (first halves, second halves) interleaved, transformers them
    as two halves (the inverse of llama.cpp's converter's permutation)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _rows(grid, index: torch.Tensor):
    import dataclasses

    return type(grid)(**{f.name: getattr(grid, f.name)[index] for f in dataclasses.fields(grid)})
