"""A GGUF file opened in place: its header parsed, its tensors memory-mapped, nothing converted.

llama.cpp runs a GGUF file from its own bytes; so does specdec. :class:`GGUFFile` reads the
header (metadata and tensor table) in well under a second, skipping the tokenizer's arrays that
the ``gguf`` package's reader turns into hundreds of thousands of numpy objects (7 s for a
Qwen2.5 file), and maps each tensor read-only when it is first read (unmapped once
forgotten). Tensors are then views of the mapped bytes:

- :meth:`GGUFFile.grid` gives a weight matrix's Q4_K or Q6_K blocks, decoded for the kernels'
  layout (the file's codes and scales exactly, in row chunks);
- :meth:`GGUFFile.tensor` dequantizes one tensor with the ``gguf`` package (norms, biases, and the
  weight matrices of types without a kernel: one tensor at a time, never a whole model);
- :class:`RowEmbedding` dequantizes only the embedding rows a call looks up.

Names are Hugging Face parameter names (``model.layers.3.mlp.up_proj.weight``), mapped to the
file's (``blk.3.ffn_up.weight``) by the ``gguf`` package's own name map for the architecture. As
transformers' GGUF reader does, a llama file's q/k rows (interleaved per head by llama.cpp's
converter for its rope) are put back in transformers' order, and Gemma's norms, stored with 1
added, have it taken off.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# GGUF value types (the gguf spec's numbering): scalar struct formats; 8 is a string, 9 an array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
MAGIC = b"GGUF"
ROW_CHUNK = 4096  # rows decoded at a time when repacking (a multiple of 16 and of every head size)


class GGUFFormatError(ValueError):
    """Not a GGUF file, or one whose header or tensor table is damaged or truncated."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first (the file's dimensions reversed)
    type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute, in the file
    n_bytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type).name


class _Header:
    """A cursor over the file's first bytes (the header is read with ``struct``, never numpy)."""

    def __init__(self, buf, path: Path) -> None:
        self.buf, self.at, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise GGUFFormatError(f"{self.path}: truncated header")
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.buf):
            raise GGUFFormatError(f"{self.path}: truncated header")
        text = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int, keep_strings: bool):
        if kind in _SCALAR:
            return self.take(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if item in _NUMPY:  # numbers: one numpy read
            size = np.dtype(_NUMPY[item]).itemsize * count
            if self.at + size > len(self.buf):
                raise GGUFFormatError(f"{self.path}: truncated header")
            out = np.frombuffer(self.buf, _NUMPY[item], count, self.at).copy()
            self.at += size
            return out
        if item == _STRING and not keep_strings:  # a tokenizer's tokens or merges: stepped over
            for _ in range(count):
                self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]
            if self.at > len(self.buf):
                raise GGUFFormatError(f"{self.path}: truncated header")
            return None
        return [self.value(item, keep_strings) for _ in range(count)]


class GGUFFile:
    """One GGUF file, memory-mapped read-only: ``metadata`` (key -> value; string arrays such as
    the token list are None), ``tensors`` (name -> :class:`TensorInfo`), ``arch``."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            if size < 24 or f.read(4) != MAGIC:
                raise GGUFFormatError(f"{self.path}: not a GGUF file")
            whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # for the header only
        view = memoryview(whole)
        try:
            self._parse(_Header(view, self.path), size)
        finally:
            view.release()
            whole.close()
        self._maps: dict[str, mmap.mmap] = {}  # tensor name -> its own mapping, made when first read

    def _parse(self, h: _Header, size: int) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        h.at = 4
        version, n_tensors, n_kv = h.take("<I"), h.take("<Q"), h.take("<Q")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = h.string()
            self.metadata[key] = h.value(h.take("<I"), keep_strings=False)
        infos = []
        for _ in range(n_tensors):
            name, dims = h.string(), h.take("<I")
            shape = tuple(h.take("<Q") for _ in range(dims))
            kind, offset = h.take("<I"), h.take("<Q")
            if kind not in GGML_QUANT_SIZES:
                raise GGUFFormatError(f"{self.path}: tensor {name} has unknown type {kind}")
            block, type_size = GGML_QUANT_SIZES[kind]
            count = int(np.prod(shape, dtype=np.int64))
            infos.append((name, tuple(reversed(shape)), kind, offset, count // block * type_size))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-h.at // align) * align
        self.tensors = {n: TensorInfo(n, s, k, start + o, b) for n, s, k, o, b in infos}
        end = max((t.offset + t.n_bytes for t in self.tensors.values()), default=start)
        if end > size:
            raise GGUFFormatError(f"{self.path}: truncated ({size} bytes, its tensors need {end})")
        self.arch = str(self.metadata.get("general.architecture", ""))
        self._names = None

    # ---- metadata -------------------------------------------------------------------------
    def field(self, key: str, default=None):
        return self.metadata.get(key, default)

    def weight_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    def type_counts(self):
        """Weight matrices (2-D tensors) by storage type name, e.g. ``{"Q4_K": 169, "Q6_K": 29}``."""
        from collections import Counter

        return Counter(t.type_name for t in self.tensors.values() if len(t.shape) == 2)

    # ---- names ----------------------------------------------------------------------------
    def gguf_name(self, hf_name: str) -> str | None:
        """The file's tensor name for a Hugging Face parameter name, or None."""
        import gguf

        if self._names is None:
            archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
            blocks = int(self.metadata.get(f"{self.arch}.block_count") or 1 + max(
                (int(n.split(".")[1]) for n in self.tensors if n.startswith("blk.")), default=-1))
            self._names = gguf.get_tensor_name_map(archs[self.arch], blocks) if self.arch in archs else None
        hf_name = hf_name.replace("model.language_model.", "model.")
        base, _, suffix = hf_name.rpartition(".")
        if hf_name == "lm_head.weight":
            return "output.weight"
        short = self._names.get_name(base) if self._names is not None else None
        return None if short is None else f"{short}.{suffix}"

    def has(self, hf_name: str) -> bool:
        name = self.gguf_name(hf_name)
        return name is not None and name in self.tensors

    def _info(self, hf_name: str) -> TensorInfo:
        name = self.gguf_name(hf_name)
        if name is None or name not in self.tensors:
            raise KeyError(hf_name)
        return self.tensors[name]

    def _row_order(self, info: TensorInfo) -> np.ndarray | None:
        """Row ``i`` of transformers' tensor is file row ``order[i]`` (llama q/k), else None."""
        if self.arch != "llama":
            return None
        part = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        heads = {"attn_q": "head_count", "attn_k": "head_count_kv"}.get(part)
        if heads is None:
            return None
        n_heads = int(self.metadata.get(f"llama.attention.{heads}") or self.metadata["llama.attention.head_count"])
        rows = info.shape[0]
        return np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(rows)

    # ---- data -----------------------------------------------------------------------------
    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes as a read-only view of its mapping: ``[rows, row bytes]``
        for a matrix (any type), else flat. Each tensor is mapped on its own, so that a tensor
        once repacked and forgotten (:meth:`forget`) costs no address space either: a process
        under ``ulimit -v`` holds the kernels' tiles, not the file beside them."""
        if info.n_bytes == 0:
            flat = np.zeros(0, np.uint8)
        else:
            m = self._maps.get(info.name)
            lo = info.offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            if m is None:
                with open(self.path, "rb") as f:
                    m = mmap.mmap(f.fileno(), info.offset + info.n_bytes - lo, offset=lo, access=mmap.ACCESS_READ)
                self._maps[info.name] = m
            flat = np.frombuffer(m, np.uint8, info.n_bytes, info.offset - lo)
        return flat.reshape(info.shape[0], -1) if len(info.shape) == 2 else flat

    def tensor(self, hf_name: str) -> torch.Tensor:
        """The tensor's values in fp32, dequantized by the ``gguf`` package (one tensor only)."""
        from gguf import quants

        info = self._info(hf_name)
        values = quants.dequantize(self.raw(info), info.type).reshape(info.shape).astype(np.float32, copy=False)
        order = self._row_order(info)
        if order is not None:
            values = values[order]
        if self.arch.startswith("gemma") and info.name.endswith("norm.weight"):
            values = values - np.float32(1)  # the file stores 1 + w (transformers' reader subtracts it too)
        values = np.ascontiguousarray(values, dtype=np.float32)
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    def rows(self, hf_name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a matrix in fp32, dequantizing only those rows."""
        from gguf import quants

        info = self._info(hf_name)
        order = self._row_order(info)
        ids = ids.long().numpy()
        file_rows = order[ids] if order is not None else ids
        raw = self.raw(info)[file_rows]  # [n, row bytes]: a copy of just these rows
        return torch.from_numpy(quants.dequantize(raw, info.type).reshape(len(ids), -1).astype(np.float32, copy=False))

    def type_of(self, hf_name: str) -> str:
        return self._info(hf_name).type_name

    def blocks(self, hf_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A matrix's stored rows of blocks as a read-only tensor view of the mapping ``[rows, row
        bytes]`` (never written: the repack kernel only reads it), and the file row of each of
        transformers' rows ``[rows]`` (int64)."""
        import warnings

        info = self._info(hf_name)
        order = self._row_order(info)
        with warnings.catch_warnings():  # torch warns of a read-only array; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(self.raw(info))
        rows = torch.from_numpy(order) if order is not None else torch.arange(info.shape[0])
        return src, rows.long()

    def grid(self, hf_name: str, lo: int = 0, hi: int | None = None):
        """Rows ``lo:hi`` of a matrix of a type with a kernel as its grid (the file's codes and
        scales, rows in transformers' order: :class:`~specdec.runtime.q4.Q4KGrid`,
        :class:`~specdec.runtime.q6k.Q6KGrid` or :class:`~specdec.runtime.blocks.BlockGrid`), or
        None for another type."""
        from specdec.models.gguf_q4k import decode_blocks
        from specdec.runtime import blocks, q6k

        info = self._info(hf_name)
        kind = info.type_name
        decode = {"Q4_K": decode_blocks, "Q6_K": q6k.decode_blocks}.get(kind)
        if decode is None and kind in blocks.TYPES:
            decode = lambda raw: blocks.decode_blocks(raw, kind)  # noqa: E731
        if decode is None:
            return None
        hi = info.shape[0] if hi is None else hi
        order = self._row_order(info)
        raw = self.raw(info)
        return decode(raw[order[lo:hi]] if order is not None else raw[lo:hi])

    def forget(self, hf_name: str) -> None:
        """Drop the tensor's mapped pages and its mapping (the pages stay in the page cache, so
        the next load reads them from memory): once a matrix is repacked, its file bytes are not
        read again, and keeping them would count the weights twice. The mapping is unmapped when
        the last view of it goes."""
        m = self._maps.pop(self._info(hf_name).name, None)
        if m is not None:
            try:
                m.madvise(mmap.MADV_DONTNEED)
            except (AttributeError, OSError, ValueError):  # no madvise here: the pages go with the mapping
                pass


class RowEmbedding:
    """An embedding table read in place: ``embed[tokens]`` dequantizes only the looked-up rows
    (exactly as the ``gguf`` package dequantizes the whole table), so the table costs its file
    bytes, not 4 bytes a weight. ``shape`` is ``[V, E]``."""

    def __init__(self, file: GGUFFile, hf_name: str, dtype: torch.dtype = torch.float32) -> None:
        self.file, self.name, self.dtype = file, hf_name, dtype
        info = file._info(hf_name)
        self.shape = torch.Size(info.shape)

    def to(self, dtype: torch.dtype) -> "RowEmbedding":
        return self if dtype == self.dtype else RowEmbedding(self.file, self.name, dtype)

    def float(self) -> "RowEmbedding":
        return self.to(torch.float32)

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens)
        unique, where = torch.unique(tokens.reshape(-1), return_inverse=True)
        rows = self.file.rows(self.name, unique)  # [U, E]
        return rows[where].reshape(*tokens.shape, rows.shape[-1]).to(self.dtype)
