"""Whether a model fits in memory, decided before loading it.

A 7-8B file that cannot fit must be refused in one line naming what it needs and what there is,
not die minutes later with a MemoryError (or be killed by the kernel). The estimate:

- weights: what the runtime keeps for the dtype (the ``gguf`` dtype: :func:`gguf_runtime_bytes`;
  a lower dtype: its bits a weight; float32: 4 bytes a weight);
- the KV cache of one row at ``context`` tokens (every layer, at the runtime's KV dtype);
- a fixed allowance for the runtime, the largest matrix's repacking temporaries and torch.

It is compared with the memory available now (``MemAvailable``) and, under an address-space
limit (``ulimit -v``), with what is left of it, where the file's mapping counts too.
"""

from __future__ import annotations

import resource

import numpy as np
import torch
from pathlib import Path

from specdec.runtime.config import ModelConfig

OVERHEAD = 600 * 2**20  # runtime, temporaries of the largest repacked matrix, torch's own
BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.1, "q4": 0.63, "q4k": 0.58}


def kv_bytes(cfg: ModelConfig, context: int, dtype: str, rows: int = 1) -> int:
    """The KV cache of ``rows`` rows at ``context`` tokens for weights of ``dtype`` (its element
    size: :func:`specdec.runtime.linear.kv_dtype`)."""
    from specdec.runtime.linear import kv_dtype

    element = torch.empty(0, dtype=kv_dtype(dtype)).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element * context * rows


def weight_bytes(file, dtype: str) -> int:
    if dtype == "gguf":
        return gguf_runtime_bytes(file)
    from specdec.models.loading import parameter_count

    return int(parameter_count(file) * BYTES_PER_WEIGHT[dtype])


def gguf_runtime_bytes(file) -> int:
    """What the ``gguf`` dtype keeps: a matrix of a type with a kernel (or the mapped embedding)
    at its file bytes, any other matrix at 4 bytes a weight (it runs as fp32 until its kernel lands)."""
    from specdec.runtime.gguf_linear import KERNELS

    total = 0
    for t in file.tensors.values():
        mapped = t.name == "token_embd.weight" and "output.weight" in file.tensors
        if len(t.shape) < 2 or t.type_name in KERNELS or t.type_name == "F32" or mapped:
            total += t.n_bytes
        else:
            total += 4 * int(np.prod(t.shape))
    return total


def available() -> tuple[int | None, int | None]:
    """(bytes of memory available now, bytes of address space left under ``ulimit -v``), None where
    unknown or unlimited."""
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return mem, None
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        used = 0
    return mem, soft - used


def check(file, cfg: ModelConfig, dtype: str, context: int) -> None:
    """Raise :class:`~specdec.models.loading.ModelLoadError` when the model cannot fit."""
    from specdec.models.loading import ModelLoadError

    need = weight_bytes(file, dtype) + kv_bytes(cfg, min(context, cfg.max_position_embeddings), dtype) + OVERHEAD
    mem, address = available()
    # address space mapped beside the weights: the tensor being repacked, and the embedding table
    # (its rows are read in place)
    embed = file.tensors.get("token_embd.weight")
    mapped = max((t.n_bytes for t in file.tensors.values()), default=0) + (embed.n_bytes if embed else 0)
    for have, needed, what in ((mem, need, "memory available"), (address, need + mapped, "address space left (ulimit -v)")):
        if have is not None and needed > have:
            raise ModelLoadError(
                f"{file.path.name} does not fit: it needs ~{needed / 1e9:.1f} GB ({dtype} weights "
                f"{weight_bytes(file, dtype) / 1e9:.1f} GB + KV cache at {context} tokens "
                f"{kv_bytes(cfg, context, dtype) / 1e9:.2f} GB + runtime), and {have / 1e9:.1f} GB of {what} is there; "
                f"use a smaller file (fewer bits a weight, or a smaller model)"
                f"{' or a shorter context (specdec serve --max-model-len)' if context > 512 else ''}")


def out_of_memory(source: Path, exc: BaseException) -> str:
    mem, address = available()
    there = ", ".join(f"{v / 1e9:.1f} GB {w}" for v, w in ((mem, "available"), (address, "of address space left"))
                      if v is not None)
    return (f"out of memory while loading {Path(source).name} ({there or 'memory unknown'}): the file is not damaged; "
            f"use a smaller file or a shorter context (specdec serve --max-model-len)")
