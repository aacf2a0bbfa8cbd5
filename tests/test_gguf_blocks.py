"""GGUF's 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K, IQ4_NL, IQ4_XS) in their kernel family, and
its 16-bit float types (F16, BF16) multiplied as stored.

For each type: the grid read from the file dequantizes bit for bit as the ``gguf`` package does;
the C++ repack writes the torch reference's tiles byte for byte; the kernel equals its torch
reference bit for bit on every instruction set this CPU runs plus the portable loop, and a row's
output does not depend on the rows beside it. Negative controls: a grid read with the nibbles
swapped, or a kernel state with one scale changed by one ulp, fails the same comparisons. A tiny
model stored entirely in each type decodes greedily the same tokens plainly and speculatively
(suffix lookup and a draft model), in about its file's bytes; a type without a kernel is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from specdec.runtime import blocks, q4

pytestmark = pytest.mark.skipif(not q4.available(), reason="the GGUF kernels need AVX2")
TYPES = list(blocks.TYPES)
ISAS = {"portable": 4, "avx2": 1, "avx512": 3}


# the types the gguf package cannot quantize: (weights a block, bytes a block, fp16 scales a block)
RANDOM_BLOCKS = {"Q5_K": (256, 176, 2), "IQ4_XS": (256, 136, 1), "IQ4_NL": (32, 18, 1)}


def stored(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """A matrix as the file holds it: the gguf quantizer's blocks of random weights, or (for the
    types it cannot quantize) random blocks with finite leading fp16 scales (d, and Q5_K's dmin)."""
    g = np.random.default_rng(seed)
    if kind in RANDOM_BLOCKS:
        weights, size, scales = RANDOM_BLOCKS[kind]
        raw = g.integers(0, 256, size=(rows, cols // weights, size), dtype=np.uint8)
        d = (g.standard_normal((rows, cols // weights, scales)) * 1e-3).astype(np.float16)  # signed, as IQ4's are
        raw[..., 0 : 2 * scales] = np.abs(d).view(np.uint8) if kind == "Q5_K" else d.view(np.uint8)
        return raw.reshape(rows, -1)
    w = (g.standard_normal((rows, cols)) * np.linspace(0.01, 0.2, cols)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType[kind])
    if kind == "Q8_0":  # the full code range, -128 included (the quantizer stops at -127)
        raw.reshape(rows, -1, 34)[:, 0, 2] = 0x80
    return raw


def gguf_weights(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))


def state_of(raw: np.ndarray, kind: str, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    rows, cols = raw.shape[0], raw.shape[1] // blocks.TYPES[kind].block_bytes * blocks.TYPES[kind].block_groups * 32
    packed = torch.empty(-(-rows // 16), blocks.tile_bytes(kind, cols), dtype=torch.uint8)
    blocks.kernel().blocks_repack(blocks.TYPES[kind].id, torch.from_numpy(raw), torch.arange(rows), packed, 0)
    state = {"packed": packed, "out_features": torch.tensor(rows), "in_features": torch.tensor(cols),
             "type": torch.tensor(blocks.TYPES[kind].id)}
    if bias is not None:
        state["bias"] = torch.cat([bias, bias.new_zeros(packed.shape[0] * 16 - rows)])
    return state


@pytest.mark.parametrize("kind", TYPES)
def test_the_grid_dequantizes_bit_for_bit_as_gguf_and_a_swapped_nibble_order_does_not(kind):
    raw = stored(kind, 37, 512, seed=0)
    grid = blocks.decode_blocks(raw, kind)
    assert torch.equal(grid.dequantize(), gguf_weights(raw, kind))
    top = 255 if kind == "Q8_0" else 31 if blocks.TYPES[kind].bits == 5 else 15
    assert int(grid.codes.max()) == top and int(grid.codes.min()) == 0  # the full code range is exercised
    k = grid.codes.shape[1]
    halves = grid.codes.view(37, k // 32, 2, 16).flip(2).reshape(37, k)  # each group's halves swapped
    wrong = blocks.BlockGrid(kind, halves.contiguous(), grid.d, grid.m, grid.sc, grid.mn, grid.dmin)
    assert not torch.equal(wrong.dequantize(), gguf_weights(raw, kind))


@pytest.mark.parametrize("kind", TYPES)
def test_the_repack_kernel_writes_the_reference_tiles_byte_for_byte(kind):
    raw = stored(kind, 40, 768, seed=1)  # 40 rows: two whole tiles and a padded one
    order = torch.randperm(40)  # rows taken in another order (llama's q/k are)
    packed = torch.full((3, blocks.tile_bytes(kind, 768)), 0xAB, dtype=torch.uint8)  # stale bytes are overwritten
    blocks.kernel().blocks_repack(blocks.TYPES[kind].id, torch.from_numpy(raw), order, packed, 0)
    grid = blocks.decode_blocks(raw[order.numpy()], kind)
    assert torch.equal(packed, blocks.pack(grid))
    back = blocks.unpack({"packed": packed, "type": torch.tensor(blocks.TYPES[kind].id), "in_features": torch.tensor(768)})
    assert torch.equal(back.dequantize()[:40], gguf_weights(raw, kind)[order])
    row_bytes = raw.shape[1]
    assert packed.numel() <= 1.1 * 48 * row_bytes  # the file's bytes per weight (48 rows once padded)


def _isas():
    import torch.backends.cpu

    return ["portable", "avx2"] + (["avx512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])


@pytest.fixture(params=_isas())
def isa(request):
    blocks.kernel().force_isa(ISAS[request.param])
    yield request.param
    blocks.kernel().force_isa(0)


@pytest.mark.parametrize("kind", TYPES)
def test_the_kernel_is_its_reference_bit_for_bit_and_batch_invariant(kind, isa):
    raw = stored(kind, 40, 768, seed=2)
    bias = torch.randn(40)
    layer = blocks.BlockLinear(state_of(raw, kind, bias))
    grid = blocks.decode_blocks(raw, kind)
    x = torch.randn(17, 768) * torch.linspace(0.1, 10, 768)
    x[2] = 0.0  # a zero row (scale 0)
    ref = blocks.reference_linear(x, grid, bias)
    for rows in (1, 3, 9, 17):
        assert torch.equal(layer(x[:rows]), ref[:rows]), rows
    assert torch.equal(layer(x[4:5]), layer(x[:9])[4:5])  # one token alone = the same token in a call of 9
    exact = x.double() @ gguf_weights(raw, kind).double().T + bias.double()
    assert ((ref.double() - exact).norm() / exact.norm()) < 2e-2  # int8 activations, the file's weights


@pytest.mark.parametrize("kind", TYPES)
def test_a_wrong_scale_fails_the_comparison(kind):
    raw = stored(kind, 16, 512, seed=3)
    state = state_of(raw, kind)
    x = torch.randn(3, 512)
    ref = blocks.reference_linear(x, blocks.decode_blocks(raw, kind))
    assert torch.equal(blocks.BlockLinear(state)(x), ref)
    t = blocks.TYPES[kind]
    code = 512 if t.bits == 8 else 320 if t.bits == 5 else 256
    at = {blocks.KQ: 64, blocks.NL: 32}.get(t.rule, 0) + code  # the first group's first scale of output 0
    state["packed"][0, at] ^= 1  # one ulp (or one sub-scale step) off
    assert not torch.equal(blocks.BlockLinear(state)(x), ref)


def _one_type_file(small, kind: str, monkeypatch):
    from specdec.models import synthetic

    monkeypatch.setattr(synthetic, "_mix_type", lambda name, mix, layers: "F32" if name.endswith(
        ("norm.weight", ".bias")) or name == "rope_freqs.weight" else kind)
    return small("llama-small", "q8_0")


@pytest.fixture
def small(tmp_path, monkeypatch):
    from conftest import fresh_home
    from specdec.models import synthetic

    fresh_home(tmp_path, monkeypatch)
    monkeypatch.setitem(synthetic.SHAPES, "llama-small",
                        synthetic.Shape("llama", 512, 256, 512, 2, 4, 2, 64, False, 500000.0, 4096))
    return lambda name, mix: synthetic.write(name, mix, path=tmp_path / f"{name}-{mix}.gguf", progress=False)


@pytest.mark.parametrize("kind", blocks.HALVES)
def test_the_16_bit_kernel_is_its_reference_bit_for_bit_and_batch_invariant(kind, isa):
    bf16 = kind == "BF16"
    values = torch.randn(40, 768) * 0.05
    w16 = (values.view(torch.int32) >> 16).to(torch.int16) if bf16 else values.half().view(torch.int16)
    gguf = quants.dequantize(w16.numpy().view(np.uint8), GGMLQuantizationType[kind]).reshape(40, 768)
    assert torch.equal(blocks.half_values(w16, bf16), torch.from_numpy(gguf.astype(np.float32)))
    bias = torch.randn(40)
    layer = blocks.HalfLinear({"weight16": w16, "bf16": torch.tensor(bf16), "bias": bias})
    x = torch.randn(9, 768) * torch.linspace(0.1, 10, 768)
    ref = blocks.reference_half_linear(x, w16, bf16, bias)
    for rows in (1, 3, 5, 9):
        assert torch.equal(layer(x[:rows]), ref[:rows]), rows
    assert torch.equal(layer(x[4:5]), layer(x)[4:5])
    plain = x @ blocks.half_values(w16, bf16).T + bias  # another summation order: a sharp check
    assert not torch.equal(plain, ref) and torch.allclose(plain, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", TYPES + list(blocks.HALVES))
def test_a_model_in_each_type_runs_in_its_kernel_and_speculates_exactly(kind, small, monkeypatch):
    from specdec.core.engine import generate
    from specdec.models import loading
    from specdec.models.gguf_file import GGUFFile
    from specdec.proposers import DraftModelProposer, SuffixProposer
    from specdec.verify.sampling import SamplingParams

    path = _one_type_file(small, kind, monkeypatch)
    model = loading.load(str(path)).model
    layers = [m for m in model.modules() if isinstance(m, (blocks.BlockLinear, blocks.HalfLinear))]
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the output
    file = GGUFFile(path)
    matrices = sum(t.n_bytes for n, t in file.tensors.items() if len(t.shape) == 2 and n != "token_embd.weight")
    kept = sum(m.packed.numel() if isinstance(m, blocks.BlockLinear) else 2 * m.weight16.numel() for m in layers)
    assert kept <= 1.1 * matrices
    greedy = SamplingParams(temperature=0.0)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]]
    with torch.inference_mode():
        plain = [r.token_ids for r in generate(model, prompts, greedy, 16)]
        draft = model.truncated(1)
        for proposer in (SuffixProposer(min_match=1, max_match=3), DraftModelProposer(draft, 64)):
            spec = generate(model, prompts, greedy, 16, proposer=proposer, k=3)
            assert [r.token_ids for r in spec] == plain, type(proposer).__name__


def test_a_type_without_a_kernel_is_refused_in_one_line(small, monkeypatch):
    from specdec.models import loading, synthetic
    from specdec.runtime.config import UnsupportedModel

    monkeypatch.setitem(synthetic._SCALES, "Q3_K", ((108,), 1e-3))  # 256-weight superblocks ending in an fp16 d
    path = _one_type_file(small, "Q3_K", monkeypatch)
    with pytest.raises(UnsupportedModel) as err:
        loading.load(str(path))
    message = str(err.value)
    assert "\n" not in message and "Q3_K (16 matrices)" in message and "IQ4_XS" in message and "--dtype" in message


def test_the_iq4_table_is_llama_cpps():
    from gguf.quants import IQ4_NL

    assert blocks.IQ4.tolist() == [v + 128 for v in IQ4_NL.kvalues]
