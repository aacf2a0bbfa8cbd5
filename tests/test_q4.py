"""The 4-bit kernel: bit-identical to its pure-torch reference, batch invariant, and a model built
on it decodes speculatively with greedy output identical to plain decoding."""

from __future__ import annotations

import pytest
import torch

from specdec.core.engine import generate
from specdec.proposers import DraftModelProposer
from specdec.runtime import q4
from specdec.verify.sampling import SamplingParams
from tiny_models import hf_tiny, ours

pytestmark = pytest.mark.skipif(not q4.available(), reason="the 4-bit kernel needs an AVX2 CPU")


@pytest.mark.parametrize("n, k, rows, bias", [(8, 32, 1, False), (13, 64, 5, True), (200, 96, 17, True),
                                              (64, 1536, 9, False), (3, 32, 33, True)])
def test_kernel_is_bit_identical_to_the_reference(n, k, rows, bias):
    g = torch.Generator().manual_seed(n * k + rows)
    state = q4.quantize_q4(torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)  # rows of very different range
    x[0, :32] = 0.0  # an all-zero group (scale 0)
    x[-1, 5] = 1e4  # an outlier: coarsens only its own group
    got = q4.Q4Linear(state)(x)
    assert got.shape == (rows, n)
    assert torch.equal(got, q4.reference_linear(x, state))


@pytest.mark.parametrize("quantize, k", [(q4.quantize_q4, 128), (q4.quantize_q4k, 640)])
def test_kernel_rows_are_independent_of_the_call(quantize, k):
    """Both layouts: a row's output is the same alone, in any block, and with a 100x larger row."""
    g = torch.Generator().manual_seed(0)
    layer = q4.Q4Linear(quantize(torch.randn(48, k, generator=g)))
    x = torch.randn(20, k, generator=g)
    x[7] *= 100
    together = layer(x)
    for i in range(20):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])
    assert torch.equal(layer(x[3:8]), together[3:8])


def test_quantization_is_idempotent_on_its_own_grid():
    """Re-quantizing dequantized 4-bit weights finds the same codes: why GGUF Q4_K tensors, which
    have this grid (32 weights, a scale and a min), survive our conversion nearly unchanged."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    once = q4.dequantize_q4(q4.quantize_q4(w))
    twice = q4.dequantize_q4(q4.quantize_q4(once))
    assert torch.equal(once, twice)
    assert (once - w).abs().max() <= (w.abs().max() * 2 / 15)


def test_quantization_error_is_bounded_by_half_a_step():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    state = q4.quantize_q4(w)
    step = q4._unpack(state["packed"])[1].permute(0, 2, 1).reshape(16, 2)  # [N, G]
    err = (q4.dequantize_q4(state) - w).abs().view(16, 2, 32).amax(-1)
    assert (err <= step * 0.5 + 1e-3 * w.abs().max()).all()  # + fp16 rounding of scale and min


@pytest.mark.parametrize("quantize", [q4.quantize_q4, q4.quantize_q4k])
def test_unsupported_width_is_a_clear_error(quantize):
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(8, 48))


@pytest.mark.parametrize("dtype", ["q4", "q4k"])
def test_q4_speculative_greedy_equals_plain(dtype):
    target = ours(hf_tiny("qwen2", seed=0), dtype)
    draft = ours(hf_tiny("qwen2", seed=0, layers=1), dtype)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
    greedy = SamplingParams(temperature=0.0)
    plain = generate(target, prompts, greedy, 30)
    spec = generate(target, prompts, greedy, 30, proposer=DraftModelProposer(draft, 64), k=4)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert spec[0].metrics.acceptance.drafted > 0


def test_every_instruction_set_gives_the_same_bits():
    """AVX2, AVX-512 VNNI (256-bit halves of a tile) and AVX-512 (whole tiles) compute the same integers and
    the same per-lane float operations: identical outputs (paths this CPU lacks fall back)."""
    g = torch.Generator().manual_seed(9)
    state = q4.quantize_q4(torch.randn(72, 256, generator=g), torch.randn(72, generator=g))  # 4.5 tiles: padded
    x = torch.randn(18, 256, generator=g)
    layer = q4.Q4Linear(state)
    outputs = []
    try:
        for isa in (1, 2, 3):
            q4.kernel().force_isa(isa)
            outputs.append(layer(x))
    finally:
        q4.kernel().force_isa(0)
    reference = q4.reference_linear(x, state)
    assert all(torch.equal(out, reference) for out in outputs)


def test_the_largest_integer_dots_are_exact_on_every_instruction_set():
    """The AVX2 paths (q4 and q4k) sum eight vpmaddubsw results in int16 before widening: exact while every
    lane's 16 products of a code (<= 15) and an activation (|.| <= 127) stay within int16
    (16 * 15 * 127 = 30480). Codes 15 against activations of +-127 reach that bound (and a group
    of -127s its negative); any overflow or saturation would differ from the reference."""
    k = 64
    w = torch.ones(16, k)
    w[:, ::32] = 0.0  # one code 0 per group, the other 31 at 15
    state = q4.quantize_q4(w)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, :32], x[2, 32:] = 5.0, -5.0
    layer = q4.Q4Linear(state)
    assert (q4.dequantize_q4(state) - w).abs().max() < 1e-3  # (so the codes are 0 and 15: scale ~1/15, min 0)
    state_k = q4.quantize_q4k(w)  # q4k (AVX2 loop): the same int16 sums, then the sub-scales
    layer_k = q4.Q4Linear(state_k)
    try:
        for isa in (1, 2, 3, 4):
            q4.kernel().force_isa(isa)
            assert torch.equal(layer(x), q4.reference_linear(x, state))
            assert torch.equal(layer_k(x), q4.reference_linear_q4k(x, state_k))
    finally:
        q4.kernel().force_isa(0)


# ---- the superblock layout (dtype q4k) ----

@pytest.mark.parametrize("n, k, rows, bias", [(8, 32, 1, False), (13, 96, 5, True), (200, 256, 17, True),
                                              (64, 1536, 9, False), (40, 896, 16, True), (3, 288, 33, True)])
def test_q4k_kernel_is_bit_identical_to_the_reference(n, k, rows, bias):
    """Full and partial superblocks (896 = 3.5 x 256, 96 and 288: an odd group count, a zero-padded
    pair of mins), 1..33 rows (the 16-row register blocks and their tail), outputs padded to tiles."""
    g = torch.Generator().manual_seed(n * k + rows)
    state = q4.quantize_q4k(torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0, :256] = 0.0  # an all-zero superblock (scale 0)
    x[-1, 5] = 1e4  # an outlier: coarsens only its own superblock
    layer = q4.Q4Linear(state)
    got = layer(x)
    assert got.shape == (rows, n) and layer.in_features == k
    reference = q4.reference_linear_q4k(x, state)
    assert torch.equal(got, reference)
    try:  # the AVX2 loop (CPUs without AVX-512 VNNI) and the plain C++ one: the same integers and floats
        for isa in (1, 4):
            q4.kernel().force_isa(isa)
            assert torch.equal(layer(x), reference), isa
    finally:
        q4.kernel().force_isa(0)


def test_q4k_reference_catches_a_wrong_rescaling_order():
    """Negative control for the bit-exact test above: the same sums with the float rescaling done
    per group (the q4 order) instead of per superblock differ in the last bits somewhere."""
    g = torch.Generator().manual_seed(3)
    state = q4.quantize_q4k(torch.randn(32, 512, generator=g))
    x = torch.randn(4, 512, generator=g)
    xq, xd, xs = q4.quantize_activations_q4k(x)
    codes, sc, m, d, dmin = q4._unpack_q4k(state["packed"], 16)
    idot = torch.einsum("mgj,ngj->mng", xq.long(), codes.long())
    wrong = torch.zeros(4, 32)
    for i in range(16):
        s = i // q4.SUPER
        wrong = wrong + xd[:, s : s + 1] * (d[:, s] * (sc[:, i] * idot[:, :, i]).float() - dmin[:, s] * (m[:, i] * xs[:, i : i + 1]).float())
    right = q4.Q4Linear(state)(x)
    assert (wrong - right).abs().max() < 1e-3 * right.abs().max()  # the same product...
    assert not torch.equal(wrong, right)  # ...but not the same bits


def test_q4k_error_is_bounded_by_its_step():
    """Each weight is within half a quantization step (d * sc) plus half the min's step (dmin / 2)
    of its value: ``sc`` is rounded up, so a group's range always fits its 16 levels."""
    w = torch.randn(32, 640, generator=torch.Generator().manual_seed(2)) * torch.logspace(-2, 0, 640)
    state = q4.quantize_q4k(w)
    codes, sc, m, d, dmin = q4._unpack_q4k(state["packed"], 20)
    s_of_g = torch.arange(20) // q4.SUPER
    step = d[:, s_of_g] * sc.float()  # [N, G]
    err = (q4.dequantize_q4k(state, 640) - w).abs().view(32, 20, 32).amax(-1)
    assert (err <= 0.5 * step + 0.5 * dmin[:, s_of_g] + 1e-6).all()
    assert (sc <= 255).all() and (m.abs() <= 127).all()


def test_q4k_uses_fewer_bytes_than_q4():
    w = torch.randn(64, 1536, generator=torch.Generator().manual_seed(4))
    assert q4.quantize_q4k(w)["packed"].numel() / q4.quantize_q4(w)["packed"].numel() == 2368 / 2560


def _random_q4k_blocks(rows: int, superblocks: int, seed: int):
    """Raw GGUF Q4_K blocks with random codes, sub-scales and mins, and finite fp16 d / dmin."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, superblocks, 144), dtype=np.uint8)
    raw[..., 0:2] = np.float16(rng.uniform(1e-4, 1e-2, size=(rows, superblocks))).view(np.uint8).reshape(rows, superblocks, 2)
    raw[..., 2:4] = np.float16(rng.uniform(1e-4, 1e-2, size=(rows, superblocks))).view(np.uint8).reshape(rows, superblocks, 2)
    return raw.reshape(rows, superblocks * 144)


def test_gguf_q4k_blocks_decode_to_the_files_weights_and_are_kept_exactly():
    """A GGUF Q4_K tensor's blocks, decoded, dequantize to exactly what gguf-py dequantizes; the
    q4k layer built with them represents exactly those weights (not a re-quantization of them),
    and a grid that does not reproduce its rows is ignored."""
    from gguf import GGMLQuantizationType, dequantize

    from specdec.models.gguf_q4k import decode_blocks

    raw = _random_q4k_blocks(40, 2, seed=0)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).copy())  # [40, 512]
    grid = decode_blocks(raw)
    assert torch.equal(grid.dequantize(), weight)
    assert int(grid.sc.max()) <= 63 and int(grid.m.max()) <= 63
    extra = torch.randn(8, 512) * 0.01  # rows of another tensor type (re-quantized)
    fused = torch.cat([weight, extra])
    state = q4.quantize_q4k(fused, exact=[(40, grid), (8, None)])
    assert torch.equal(q4.dequantize_q4k(state, 512)[:40], weight)
    assert not torch.equal(q4.dequantize_q4k(q4.quantize_q4k(weight), 512), weight)  # without it: re-quantized
    wrong = decode_blocks(_random_q4k_blocks(40, 2, seed=1))
    ignored = q4.quantize_q4k(weight, exact=[(40, wrong)])
    assert torch.equal(ignored["packed"], q4.quantize_q4k(weight)["packed"])
    x = torch.randn(3, 512)
    assert torch.equal(q4.Q4Linear(state)(x), q4.reference_linear_q4k(x, state))


def test_q4k_model_keeps_the_exact_grids_it_is_given_for_each_part_of_a_fused_layer():
    """The model hands each linear its parts (q, k, v of the fused qkv; gate, up; o; down; the
    output layer) by parameter name and row count: weights that came from a 4-bit grid are kept as
    exactly that grid — here every other part, so both the exact and the re-quantized rows of a
    fused layer are exercised."""
    from specdec.runtime.config import ModelConfig
    from specdec.runtime.model import Transformer

    hf = hf_tiny("llama", hidden=64)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    grids = {}
    for i, (name, w) in enumerate(sorted(state.items())):
        if w.dim() == 2 and name.endswith("proj.weight") and i % 2 == 0:
            grid = q4._decompose_q4k(w.float())
            grid.sc = grid.sc.clamp(max=63)  # a 6-bit grid, as GGUF's; not what re-quantizing would find
            state[name] = grid.dequantize()
            grids[name] = grid

    class Grids:
        def get(self, name):
            return grids.get(name)

    model = Transformer(ModelConfig.from_hf(hf.config), state, "q4k", grids=Grids())
    kept = 0
    for layer, block in enumerate(model.blocks):
        p = f"model.layers.{layer}."
        parts = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
                 "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
        for attr, names in parts.items():
            lin = getattr(block, attr)
            got = q4.dequantize_q4k({"packed": lin.packed, "out_features": torch.tensor(lin.out_features)}, lin.in_features)
            at = 0
            for n in names:
                rows = state[p + n + ".weight"].shape[0]
                if p + n + ".weight" in grids:
                    assert torch.equal(got[at : at + rows], state[p + n + ".weight"])
                    kept += 1
                at += rows
    assert kept == len(grids) > 0
