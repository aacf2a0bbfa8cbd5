"""What a GGUF file says about its model, beyond what transformers' GGUF reader maps.

specdec builds a GGUF file's config and tokenizer through transformers' GGUF reader (the weights
load in place, :mod:`specdec.models.gguf_file`), whose config mapping drops what llama.cpp stores
about rope: its scaling (``{arch}.rope.scaling.*``:
linear, YaRN), per-frequency factors (the ``rope_freqs`` tensor of Llama 3.1+), LongRoPE's
``rope_factors_long``/``rope_factors_short`` and a partial rotary dimension (Phi-3.5, Phi-4-mini).
:func:`rope_settings` reads them into the config, so such files load as the model they
are. What cannot be mapped exactly is refused by :func:`check` with one line naming it, before
anything is written to the cache: another architecture, a YaRN attention factor (llama.cpp's and
transformers' differ), partial rotary outside Phi-3, Gemma's softcapping values or query scale
where they differ from what the reader assumes (Gemma 2/3 27B).

:func:`tensor_types` counts the file's weight matrices by storage type, for the precision notice.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from specdec.runtime.config import UnsupportedModel
from specdec.runtime.gguf_linear import FLOATS, KERNELS

# llama.cpp's architecture names that specdec converts (Mistral files are "llama").
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
LONGROPE = ("rope_factors_short.weight", "rope_factors_long.weight")
# Gemma 2's values that transformers' reader assumes (its config defaults)
GEMMA2_ASSUMED = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def _field(reader, name: str):
    """A metadata value as Python data (the header parser returns ints, floats, strings, lists)."""
    return reader.field(name)


def check(reader, path: Path) -> None:
    """Raise :class:`UnsupportedModel` where converting ``path`` (opened as ``reader``) would
    drop something its model needs."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"{path.name}: GGUF architecture {arch!r} is not supported "
                               f"(specdec converts {', '.join(ARCHITECTURES)})")
    refuse = lambda what: UnsupportedModel(  # noqa: E731
        f"{path.name}: {what} in this GGUF file cannot be converted exactly; "
        f"load the model's Hugging Face directory instead (--target DIR)")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear", "yarn", "longrope"):
        raise refuse(f"rope scaling {scaling!r}")
    attn_factor = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if scaling == "yarn" and attn_factor is not None and abs(float(attn_factor) - 1.0) > 1e-6:
        raise refuse(f"a YaRN attention factor of {attn_factor}")
    head_dim = _head_dim(reader, arch)
    rotary = _field(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and head_dim is not None and rotary != head_dim and arch != "phi3":
        raise refuse(f"a partial rotary dimension ({rotary} of {head_dim})")
    if arch == "gemma2":
        _check_gemma2(reader, refuse)
    if arch in ("gemma2", "gemma3") and head_dim != 256:  # transformers assumes query_pre_attn_scalar = 256
        raise refuse(f"Gemma's query scale for a head size of {head_dim} (27B models scale by another)")


def check_kernels(reader, path: Path) -> None:
    """Raise :class:`UnsupportedModel` (one line) where a weight matrix of ``path`` has a storage
    type the ``gguf`` dtype has no kernel for: such a file is never run as fp32 or re-quantized
    unless asked (``--dtype``)."""
    types = tensor_types(reader)
    missing = sorted(t for t in types if t not in KERNELS and t not in FLOATS)
    if missing:
        listed = ", ".join(f"{t} ({types[t]} matrices)" for t in missing)
        raise UnsupportedModel(f"{path.name}: no kernel for {listed}; specdec runs {', '.join(sorted(NATIVE))} in place "
                               f"and {', '.join(FLOATS)} as fp32 (--dtype q4k re-quantizes every matrix to 4 bits, "
                               f"--dtype float32 dequantizes them)")


def _head_dim(reader, arch: str) -> int | None:
    heads = _field(reader, f"{arch}.attention.head_count")
    return _field(reader, f"{arch}.attention.key_length") or (
        _field(reader, f"{arch}.embedding_length") // heads if heads else None)


def head_settings(reader) -> dict:
    """``head_dim`` where the file stores it (``attention.key_length``): transformers' reader
    drops it for some families, whose config default (Qwen3's 128) would then be taken."""
    arch = _field(reader, "general.architecture")
    key_length = _field(reader, f"{arch}.attention.key_length")
    return {"head_dim": int(key_length)} if key_length else {}


def _tensor(reader, name: str):
    """A small F32 tensor of the file (rope factors) as a float array, or None."""
    info = reader.tensors.get(name)
    return None if info is None else reader.raw(info).view(np.float32).astype(float)


def rope_settings(reader) -> dict:
    """Config attributes for what the file says about rope (applied to the converted config):
    ``rope_parameters`` for linear, YaRN and LongRoPE scaling and a partial rotary dimension,
    ``rope_freq_factors`` for a ``rope_freqs`` tensor (each frequency divided by its factor, as
    llama.cpp does; :mod:`specdec.runtime.rope`'s ``freq_factors``)."""
    arch = _field(reader, "general.architecture")
    theta = float(_field(reader, f"{arch}.rope.freq_base") or 10000.0)
    params: dict = {"rope_type": "default", "rope_theta": theta}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(_field(reader, f"{arch}.rope.scaling.factor")))
    elif scaling == "yarn":
        params.update(rope_type="yarn", factor=float(_field(reader, f"{arch}.rope.scaling.factor")),
                      original_max_position_embeddings=int(original))
    short, long = (_tensor(reader, name) for name in LONGROPE)
    if short is not None and long is not None:
        attn = _field(reader, f"{arch}.rope.scaling.attn_factor")
        params.update(rope_type="longrope", short_factor=short.tolist(),
                      long_factor=long.tolist(),
                      original_max_position_embeddings=int(original), **({"attention_factor": float(attn)} if attn else {}))
    head_dim, rotary = _head_dim(reader, arch), _field(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and head_dim and rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    out = {"rope_parameters": params} if len(params) > 2 else {}
    if params["rope_type"] in ("longrope", "yarn"):  # Phi-3's config reads it from here too
        out["original_max_position_embeddings"] = int(original)
    if arch == "gemma3" and out:  # scaling applies to the global layers; the local ones keep transformers' default
        out["rope_parameters"] = {"full_attention": params, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    freqs = _tensor(reader, "rope_freqs.weight")
    if freqs is not None:
        out["rope_freq_factors"] = freqs.tolist()
    return out


def _check_gemma2(reader, refuse) -> None:
    for key, assumed in GEMMA2_ASSUMED.items():
        value = _field(reader, f"gemma2.{key}")
        if value is not None and abs(float(value) - assumed) > 1e-6:
            raise refuse(f"a {key} of {value} (transformers' reader assumes {assumed})")


def sliding_window(reader) -> int | None:
    """The attention window the file stores (``{arch}.attention.sliding_window``), or None."""
    return _field(reader, f"{_field(reader, 'general.architecture')}.attention.sliding_window")


def tensor_types(reader) -> Counter:
    """Weight matrices (2-D tensors) by storage type name, e.g. ``{"Q4_K": 169, "Q6_K": 29}``."""
    return reader.type_counts()


# What each runtime dtype does to a file's weight matrices: the storage types it keeps exactly,
# and how it lowers the others. Float32 holds every dequantized value exactly.
KEPT = {"q4k": {"Q4_K"}, "q4": set(), "int8": set(), "bfloat16": {"BF16"}, "float32": None}
NATIVE = tuple(KERNELS)  # the types the gguf dtype runs in their own kernels
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
            [f"{', '.join(others)} as exact float32"] if others else [])
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


def repair_special_tokens(gguf_path: Path, directory: Path) -> int:
    """Make the saved tokenizer in ``directory`` read the special tokens of the GGUF file at
    ``gguf_path`` as the file does.

    Transformers' GGUF converter byte-level-encodes control and user-defined tokens whose text is
    not ASCII (DeepSeek-R1-Distill's ``<｜User｜>``, ``<｜begin▁of▁sentence｜>``): such a token then
    matches only its mojibake, its literal text (in the chat template) is split into pieces, and
    named as bos/eos it is added again past the model's vocabulary, where the embedding has no row.
    Every such token becomes an added token with its literal text at its own id, and the copies
    past the file's vocabulary go. Tokenizers of ASCII special tokens are left as they are.
    Returns how many entries were changed."""
    import json

    import gguf

    fields = gguf.GGUFReader(str(gguf_path)).fields
    if "tokenizer.ggml.tokens" not in fields or "tokenizer.ggml.token_type" not in fields:
        return 0
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    special = {i: t for i, (t, kind) in enumerate(zip(tokens, types)) if int(kind) in (3, 4)}  # control, user-defined
    path, config_path = directory / "tokenizer.json", directory / "tokenizer_config.json"
    data, config = json.loads(path.read_text()), json.loads(config_path.read_text())
    added, decoder = {a["id"]: a for a in data["added_tokens"]}, config.get("added_tokens_decoder", {})
    vocab = data["model"]["vocab"]  # string -> id: such a token is there under its mojibake
    by_id = {i: key for key, i in vocab.items() if i in special and not special[i].isascii()}
    changed = 0
    for i, text in special.items():
        if i in by_id and by_id[i] != text:
            vocab[text] = vocab.pop(by_id[i])
        if not text.isascii() and added.get(i, {}).get("content") != text:
            added[i] = {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": int(types[i]) == 3}
            decoder[str(i)] = {k: v for k, v in added[i].items() if k != "id"}
            changed += 1
    texts = set(special.values())
    for i in [i for i, a in added.items() if i >= len(tokens) and a["content"] in texts]:
        del added[i]
        decoder.pop(str(i), None)
        changed += 1
    if changed:
        data["added_tokens"] = [added[i] for i in sorted(added)]
        config["added_tokens_decoder"] = decoder
        path.write_text(json.dumps(data, ensure_ascii=False))
        config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2))
    return changed
