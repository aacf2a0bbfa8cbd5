"""What a GGUF file says about its model, checked before it is converted.

specdec converts a GGUF file through transformers' GGUF reader (weights and tokenizer), whose
config mapping drops several things llama.cpp stores: rope scaling (``{arch}.rope.scaling.*``),
per-frequency rope factors (the ``rope_freqs`` tensor of Llama 3.1+, LongRoPE's
``rope_factors_long``/``rope_factors_short`` of Phi-3.5/Phi-4-mini), a partial rotary dimension
(``{arch}.rope.dimension_count`` below the head size), Gemma 2's softcapping values and its query
scale (and Gemma 3's: both assume a head size of 256). A model converted without them would load
and compute something else. :func:`check`
refuses such a file with one line naming what is not read, before anything is written to the
cache; the model's Hugging Face directory (whose config specdec reads in full) is the way to run it.

:func:`tensor_types` counts the file's weight matrices by storage type, for the precision notice.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from specdec.runtime.config import UnsupportedModel

# llama.cpp's architecture names that specdec converts (Mistral files are "llama").
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
ROPE_TENSORS = {"rope_freqs.weight": "per-frequency rope factors (Llama 3.1+ rope scaling)",
                "rope_factors_long.weight": "LongRoPE factors", "rope_factors_short.weight": "LongRoPE factors"}
# Gemma 2's values that transformers' reader assumes (its config defaults)
GEMMA2_ASSUMED = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def _field(reader, name: str):
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def check(reader, path: Path) -> None:
    """Raise :class:`UnsupportedModel` where converting ``path`` (opened as ``reader``) would
    drop something its model needs."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"{path.name}: GGUF architecture {arch!r} is not supported "
                               f"(specdec converts {', '.join(ARCHITECTURES)})")
    refuse = lambda what: UnsupportedModel(  # noqa: E731
        f"{path.name}: {what} in this GGUF file are not read by specdec's GGUF conversion yet; "
        f"load the model's Hugging Face directory instead (--target DIR)")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise refuse(f"rope scaling {scaling!r} settings")
    names = {t.name for t in reader.tensors}
    for name, what in ROPE_TENSORS.items():
        if name in names:
            raise refuse(what)
    heads = _field(reader, f"{arch}.attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length") or (
        _field(reader, f"{arch}.embedding_length") // heads if heads else None)
    rotary = _field(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and head_dim is not None and rotary != head_dim:
        raise refuse(f"a partial rotary dimension ({rotary} of {head_dim})")
    if arch == "gemma2":
        _check_gemma2(reader, head_dim, refuse)
    if arch in ("gemma2", "gemma3") and head_dim != 256:  # transformers assumes query_pre_attn_scalar = 256
        raise refuse(f"Gemma's query scale for a head size of {head_dim} (27B models scale by another)")


def _check_gemma2(reader, head_dim, refuse) -> None:
    for key, assumed in GEMMA2_ASSUMED.items():
        value = _field(reader, f"gemma2.{key}")
        if value is not None and abs(float(value) - assumed) > 1e-6:
            raise refuse(f"a {key} of {value} (transformers' reader assumes {assumed})")


def sliding_window(path: Path) -> int | None:
    """The attention window ``path`` stores (``{arch}.attention.sliding_window``), or None."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return _field(reader, f"{_field(reader, 'general.architecture')}.attention.sliding_window")


def tensor_types(reader) -> Counter:
    """Weight matrices (2-D tensors) by storage type name, e.g. ``{"Q4_K": 169, "Q6_K": 29}``."""
    return Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)


# What each runtime dtype does to a file's weight matrices: the storage types it keeps exactly,
# and how it lowers the others. Float32 holds every dequantized value exactly.
KEPT = {"q4k": {"Q4_K"}, "q4": set(), "int8": set(), "bfloat16": {"BF16"}, "float32": None}
NATIVE = ("Q4_K", "Q6_K")  # the types the gguf dtype runs in their own kernels
LOWERED_TO = {"q4k": "4 bits (q4k)", "q4": "4 bits (q4)", "int8": "8 bits (int8)", "bfloat16": "bf16"}


def precision(types: Counter, dtype: str) -> tuple[str, bool]:
    """``(description, lowered)``: what the runtime ``dtype`` multiplies for a file whose weight
    matrices have storage ``types``, e.g. ``("q4k: Q4_K kept exactly; Q6_K re-quantized to 4 bits
    (q4k)", True)``. Q4_K under q4k is kept where its blocks reproduce the file's weights bit for
    bit (:func:`specdec.runtime.q4.quantize_q4k`); the embedding lookup always reads the exact
    dequantized rows."""
    if dtype == "gguf":
        native = sorted(t for t in types if t in NATIVE)
        others = sorted(t for t in types if t not in NATIVE)
        parts = ([f"{', '.join(native)} in their own kernels"] if native else []) + (
            [f"{', '.join(others)} as exact float32 (no native kernel yet)"] if others else [])
        return f"gguf: the stored weights exactly ({'; '.join(parts) or 'no weight matrices'})", False
    kept = KEPT[dtype]
    if kept is None:
        return f"{dtype}: the stored weights exactly ({_names(types)})", False
    exact = sorted(t for t in types if t in kept)
    lowered = sorted(t for t in types if t not in kept)
    parts = ([f"{', '.join(exact)} kept exactly"] if exact else []) + (
        [f"{', '.join(lowered)} re-quantized to {LOWERED_TO[dtype]}"] if lowered else [])
    return f"{dtype}: {'; '.join(parts)}", bool(lowered)


def _names(types: Counter) -> str:
    return ", ".join(sorted(types)) or "no weight matrices"
