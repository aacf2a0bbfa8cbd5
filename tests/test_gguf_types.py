"""GGUF tensor types at their own precision: the runtime's weights equal the gguf package's
dequantization bit for bit, and each kernel equals its pure-torch reference bit for bit on every
instruction set this CPU has (plus the portable loop)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from specdec.runtime import blocks, q4, q6k


def random_q6k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw Q6_K superblocks with random codes and scales (every byte pattern is valid) and finite d."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(rows, cols // 256, q6k.BLOCK_BYTES), dtype=np.uint8)
    raw[..., 208:210] = (g.standard_normal((rows, cols // 256, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_q6k_grid_dequantizes_bit_for_bit_as_gguf():
    raw = random_q6k(37, 512, seed=0)
    ours = q6k.decode_blocks(raw).dequantize()
    theirs = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q6_K))
    assert torch.equal(ours, theirs)
    assert int(q6k.decode_blocks(raw).u.max()) == 63 and int(q6k.decode_blocks(raw).sc.min()) < 0  # the full ranges
    assert torch.equal(q6k.unpack(q6k.pack(q6k.decode_blocks(raw))).dequantize()[:37], theirs)


ISAS = {"portable": 4, "avx2": 1, "avx512": 3}


def _isas():
    import torch.backends.cpu

    capability = torch.backends.cpu.get_cpu_capability()
    return ["portable", "avx2"] + (["avx512"] if capability == "AVX512" else [])


@pytest.fixture(params=_isas())
def isa(request):
    if not q4.available():
        pytest.skip("the GGUF kernels need AVX2")
    q6k.kernel().force_isa(ISAS[request.param])
    yield request.param
    q6k.kernel().force_isa(0)


@pytest.mark.parametrize("rows", [1, 3, 5, 9, 17])
def test_q6k_kernel_is_bit_identical_to_its_reference_and_batch_invariant(isa, rows):
    raw = random_q6k(40, 768, seed=1)  # 40 outputs: two full tiles and a padded one
    bias = torch.randn(40)
    state = q6k.pack(q6k.decode_blocks(raw), bias)
    layer = q6k.Q6KLinear(state)
    x = torch.randn(rows, 768) * torch.linspace(0.1, 10, 768)
    got = layer(x)
    assert torch.equal(got, q6k.reference_linear(x, state))
    assert torch.equal(got[:1], layer(x[:1]))  # a row alone equals the same row in a block
    exact = x.double() @ torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q6_K)).double().T + bias.double()
    assert ((got.double() - exact).abs().max() / exact.abs().max()) < 2e-2  # int8 activations, the file's weights


def test_q6k_reference_is_a_sharp_check():
    """A kernel that rounded each group in fp32 (another order) would differ from the reference."""
    raw = random_q6k(16, 512, seed=2)
    state = q6k.pack(q6k.decode_blocks(raw))
    x = torch.randn(4, 512)
    w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q6_K))
    assert not torch.equal(q6k.reference_linear(x, state), (x @ w.T))


def random_q4k(rows: int, cols: int, seed: int, block: int = 144) -> np.ndarray:
    """Raw Q4_K (144-byte) or Q5_K (176-byte) superblocks: random codes and 6-bit scales, finite
    d and dmin (their first four bytes)."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(rows, cols // 256, block), dtype=np.uint8)
    raw[..., 0:4] = (np.abs(g.standard_normal((rows, cols // 256, 2))) * 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


# How the tiny GGUF stores each linear, by layer: the first as Q4_K_M does (Q4_K, v and down as
# Q6_K) with a Q8_0 and an F16 tensor; the second in the other types. Every quantized type runs in
# its kernel, the float ones as fp32. With the Q6_K output, every type issue 56 names.
STORED = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q4_K",
           "ffn_up": "F16", "ffn_down": "Q6_K"},
          {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "BF16",
           "ffn_up": "Q5_K", "ffn_down": "F32"}]
TYPES = sorted({kind for layer in STORED for kind in layer.values()})
HF_NAME = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}


def _stored(kind: str, shape, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the tensor as the file holds it, its dequantized fp32 weights)."""
    rows, cols = shape
    T = GGMLQuantizationType
    values = (np.random.default_rng(seed).standard_normal(shape) * 0.05).astype(np.float32)
    if kind in ("Q4_K", "Q5_K"):  # no numpy quantizer for these: random blocks (d and dmin finite)
        raw = random_q4k(rows, cols, seed, 144 if kind == "Q4_K" else 176)
    elif kind == "Q6_K":
        raw = random_q6k(rows, cols, seed)
    elif kind in ("F32", "F16"):
        raw = values.astype(np.float32 if kind == "F32" else np.float16)
        return raw, raw.astype(np.float32)
    else:
        raw = quants.quantize(values, getattr(T, kind))
    return raw, quants.dequantize(raw, getattr(T, kind))


def _llama_file_rows(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter stores q/k rows per head as (half, pair) instead of (pair, half):
    file row r holds Hugging Face row ``index[r]``."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)


def write_tiny_gguf(tmp_path, arch: str = "qwen2", seed: int = 0):
    """A tiny model as a GGUF file of mixed tensor types, and the Hugging Face directory its
    conversion gives (the model's weights replaced by the file's dequantized ones)."""
    import gguf

    from tiny_models import hf_tiny, save_hf_dir

    hf = hf_tiny(arch, hidden=256, layers=2)
    state = hf.state_dict()
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), arch)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    writer.add_uint32(f"{arch}.attention.head_count_kv", 2)
    writer.add_uint32(f"{arch}.embedding_length", 256)
    writer.add_uint32(f"{arch}.block_count", 2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2, 2)
    for name, tensor in state.items():  # norms and biases, as F32
        if tensor.dim() == 1:
            base, suffix = name.rsplit(".", 1)
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    heads = {"attn_q": 4, "attn_k": 2} if arch == "llama" else {}
    for i in range(2):
        for short, kind in STORED[i].items():
            name = f"model.layers.{i}.{HF_NAME[short]}.weight"
            raw, weights = _stored(kind, tuple(state[name].shape), seed=100 * i + len(short))
            if short in heads:
                raw = raw[_llama_file_rows(raw.shape[0], heads[short])]
            writer.add_tensor(f"blk.{i}.{short}.weight", raw,
                              raw_dtype=None if kind in ("F16", "F32") else getattr(GGMLQuantizationType, kind))
            with torch.no_grad():
                hf.get_parameter(name).copy_(torch.from_numpy(weights))
    tops = {"token_embd.weight": "model.embed_tokens.weight"}  # Qwen2's tiny model ties the output to it
    if not hf.config.tie_word_embeddings:
        tops["output.weight"] = "lm_head.weight"
    for seed, (top, name) in enumerate(tops.items()):
        raw, weights = _stored("Q6_K", tuple(state[name].shape), seed=7 + seed)
        writer.add_tensor(top, raw, raw_dtype=GGMLQuantizationType.Q6_K)
        with torch.no_grad():
            hf.get_parameter(name).copy_(torch.from_numpy(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "tiny.gguf", save_hf_dir(hf, tmp_path / "converted-by-transformers")


@pytest.fixture(params=["qwen2", "llama"])
def tiny_gguf(tmp_path, monkeypatch, request):
    """The tiny GGUF, loadable by path: the config and tokenizer transformers' GGUF reader builds
    from its metadata (which needs a tokenizer in the file) are stood in for by a directory's."""
    import shutil

    from conftest import fresh_home
    from specdec.models import loading

    fresh_home(tmp_path, monkeypatch)
    path, converted = write_tiny_gguf(tmp_path, request.param)

    def metadata(file, tmp):
        shutil.copytree(converted, tmp, ignore=shutil.ignore_patterns("*.safetensors"))

    monkeypatch.setattr(loading, "_write_metadata", metadata)
    return path


def _weights(layer) -> torch.Tensor:
    """The fp32 weights a runtime layer multiplies."""
    from specdec.runtime.gguf_linear import ConcatLinear
    from specdec.runtime.dense import FloatLinear

    if isinstance(layer, ConcatLinear):
        return torch.cat([_weights(part) for part in layer.parts])
    if isinstance(layer, q6k.Q6KLinear):
        return q6k.unpack({"packed": layer.packed}).dequantize()[: layer.out_features]
    if isinstance(layer, blocks.BlockLinear):
        state = {"packed": layer.packed, "type": torch.tensor(layer.type_id), "in_features": torch.tensor(layer.in_features)}
        return blocks.unpack(state).dequantize()[: layer.out_features]
    if isinstance(layer, blocks.HalfLinear):
        return blocks.half_values(layer.weight16, layer.bf16)
    if isinstance(layer, FloatLinear):
        return layer.weight
    return q4.dequantize_q4k({"packed": layer.packed, "out_features": torch.tensor(layer.out_features)}, layer.in_features)


@pytest.mark.skipif(not q4.available(), reason="the GGUF kernels need AVX2")
def test_every_runtime_weight_is_the_file_weight_by_default(tiny_gguf, capsys):
    """No model a user names runs at a lower precision than its file: tensors of each of the 11
    types (F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q5_0, Q5_1, Q4_K, Q4_0, Q4_1), loaded by default, are
    multiplied exactly as gguf dequantizes them (twice: built, then read from the on-disk cache)."""
    from gguf import GGUFReader

    from specdec.models import loading

    assert len(TYPES) == 11
    reader = GGUFReader(str(tiny_gguf))
    stored = {t.name: quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    if reader.fields["general.architecture"].contents() == "llama":  # q/k rows back in transformers' order
        for name in list(stored):
            heads = {"attn_q": 4, "attn_k": 2}.get(name.split(".")[2]) if name.startswith("blk.") else None
            if heads:
                hf_rows = np.empty_like(stored[name])
                hf_rows[_llama_file_rows(len(hf_rows), heads)] = stored[name]
                stored[name] = hf_rows
    for attempt in ("built", "cached"):
        model = loading.load(str(tiny_gguf))
        assert model.model.dtype_name == "gguf"
        kernels = ", ".join(t for t in TYPES if t != "F32")
        assert model.precision == f"gguf: the stored weights exactly ({kernels} in their own kernels; F32 as exact float32)", attempt
        for i, block in enumerate(model.model.blocks):
            parts = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
                     "down": ("ffn_down",)}
            for attr, shorts in parts.items():
                expected = np.concatenate([stored[f"blk.{i}.{s}.weight"] for s in shorts]).astype(np.float32)
                assert torch.equal(_weights(getattr(block, attr)), torch.from_numpy(expected)), (attempt, i, attr)
        output = stored.get("output.weight", stored["token_embd.weight"])
        assert torch.equal(_weights(model.model.lm_head), torch.from_numpy(output))
    assert "re-quantized" not in capsys.readouterr().err


@pytest.mark.skipif(not q4.available(), reason="the GGUF kernels need AVX2")
def test_an_explicit_four_bit_dtype_says_what_it_lowers(tiny_gguf, capsys):
    from specdec.models import loading

    model = loading.load(str(tiny_gguf), "q4k")
    lowered = [line for line in capsys.readouterr().err.splitlines() if "re-quantized" in line]
    others = ", ".join(t for t in TYPES if t != "Q4_K")
    assert lowered == [f"specdec: tiny.gguf runs at q4k: Q4_K kept exactly; {others} re-quantized to 4 bits "
                       f"(q4k) (--dtype float32 multiplies the stored weights)"]
    assert model.precision.startswith("q4k:")
