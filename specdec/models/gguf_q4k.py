"""GGUF Q4_K tensors as q4k grids: the 4-bit weights of a GGUF file, kept exactly as stored.

A Q4_K block holds 256 weights of one row: fp16 ``d`` and ``dmin``, eight 6-bit sub-scales
``sc`` and mins ``m`` (12 packed bytes), and 128 bytes of 4-bit codes, with
``w = d * sc[j] * q - dmin * m[j]`` for the 32 weights of sub-block ``j``. That is the q4k layout's
decomposition (:class:`specdec.runtime.q4.Q4KGrid`), so the q4k kernel runs over the file's own
codes and scales (:meth:`specdec.models.gguf_file.GGUFFile.grid`) — the weights the runtime
multiplies are exactly the ones llama.cpp multiplies.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.runtime.q4 import Q4KGrid

_BLOCK_BYTES = 144  # 2 + 2 + 12 + 128


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
