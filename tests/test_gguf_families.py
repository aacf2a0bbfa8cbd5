"""GGUF files of each family, converted as a user's would be: the model specdec loads from the file
computes the same logits as the same weights loaded from their Hugging Face directory.

Each file is written here the way llama.cpp's converter writes one (the gguf package's tensor name
map, its metadata keys, a llama file's q/k rows interleaved per head, Gemma's norms stored with
their 1 added, a byte-level tokenizer), from a tiny random transformers model whose settings are
the ones real models of the family have where transformers' GGUF reader assumes them (a Gemma
head size of 256, Qwen3's of 128, Gemma 3's one global layer in six). The conversion is the real
one (transformers' GGUF reader). What the reader would get wrong is refused before it runs
(tests/test_families.py).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers

from conftest import fresh_home
from specdec.models import loading
from tiny_models import char_tokenizer, save_hf_dir

ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
        "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
        "gemma3_text": gguf.MODEL_ARCH.GEMMA3}
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, num_hidden_layers=2)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [4.0, 6.0, 8.0, 10.0], "original_max_position_embeddings": 128}


def _config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**COMMON)
    if family == "llama3":  # the file holds the factors as llama.cpp's rope_freqs tensor
        return transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3)
    if family == "llama_linear":
        return transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    if family == "qwen2_yarn":
        return transformers.Qwen2Config(**COMMON, rope_parameters=YARN)
    if family == "phi3_longrope":  # Phi-3.5 / Phi-4-mini: partial rotary and LongRoPE (context capped at the original)
        return transformers.Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_parameters=LONGROPE,
                                       original_max_position_embeddings=128)
    if family == "mistral":  # the file keeps no window, so neither does the model read from it
        return transformers.MistralConfig(**COMMON, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=128)
    if family == "phi3":
        return transformers.Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "gemma2":
        return transformers.Gemma2Config(**COMMON, head_dim=256, query_pre_attn_scalar=256, sliding_window=16,
                                         attn_implementation="eager")
    return transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=256, query_pre_attn_scalar=256,
                                         sliding_window=16)


def _model(name: str):
    torch.manual_seed(3)
    family = name
    family = {"llama3": "llama", "llama_linear": "llama", "qwen2_yarn": "qwen2", "phi3_longrope": "phi3"}.get(family, family)
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "phi3": transformers.Phi3ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM,
           "gemma3": transformers.Gemma3ForCausalLM}[family]
    model = cls(_config(name)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _metadata(writer, cfg) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the global layers' base
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if cfg.rope_parameters.get("rope_type") != "longrope":
        writer.add_rope_dimension_count(head_dim)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    _rope_metadata(writer, cfg, head_dim)
    vocab = char_tokenizer().get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]  # rows the tokenizer never emits
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))  # no merges: single characters
    writer.add_eos_token_id(vocab["!"])
    writer.add_pad_token_id(0)


def _rope_metadata(writer, cfg, head_dim: int) -> None:
    """Rope scaling as llama.cpp's converter stores it."""
    rope = cfg.rope_parameters
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "llama3":  # one factor per frequency: the base frequency over llama3's
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    elif kind == "longrope":
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))


def write_gguf(hf, path) -> None:
    """``hf`` as llama.cpp's converter would write it (all tensors F32)."""
    cfg = hf.config
    arch = ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, cfg)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        short = names.get_name(base)
        x = tensor.float().numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and short.endswith(("attn_q", "attn_k")):  # rope pairs interleaved per head
            heads = cfg.num_attention_heads if short.endswith("attn_q") else cfg.num_key_value_heads
            x = x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        if cfg.model_type.startswith("gemma") and "norm" in short:
            x = x + 1  # Gemma's norms multiply by (1 + w); the file stores 1 + w
        writer.add_tensor(f"{short}.{suffix}", np.ascontiguousarray(x))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "llama3", "llama_linear",
            "qwen2_yarn", "phi3_longrope"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_file_loads_the_model_its_directory_does(family, tmp_path, monkeypatch):
    fresh_home(tmp_path, monkeypatch)
    hf = _model(family)
    path = tmp_path / f"{family}.gguf"
    write_gguf(hf, path)
    from_file = loading.load(str(path), "float32").model
    from_directory = loading.load(str(save_hf_dir(hf, tmp_path / "hf")), "float32").model
    # the file holds eps as float32, and a Mistral file is a "llama" one: otherwise the same config
    expected = dataclasses.replace(from_directory.cfg, rms_norm_eps=float(np.float32(from_directory.cfg.rms_norm_eps)),
                                   arch=from_file.cfg.arch if family == "mistral" else from_directory.cfg.arch)
    if family == "llama3":  # the file's factors, which the directory computes from llama3's parameters
        assert from_file.cfg.rope.kind == "freq_factors" and from_directory.cfg.rope.kind == "llama3"
        expected = dataclasses.replace(expected, rope=from_file.cfg.rope)
    assert from_file.cfg == expected
    ids = torch.randint(0, 97, (2, 100), generator=torch.Generator().manual_seed(0))  # past windows, original contexts
    got, want = from_file(ids, from_file.new_cache(2, 100)), from_directory(ids, from_directory.new_cache(2, 100))
    assert (got - want).abs().max() <= 1e-5
