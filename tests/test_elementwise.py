"""The elementwise kernels (RMSNorm, SiLU gate, rope) against their pure-torch references, bit
for bit; batch invariance; accuracy against torch's own ops; and a check that the equality test
has teeth (a reference with one operation rounded differently fails it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.runtime import elementwise as ew
from specdec.runtime.model import apply_rope, rms_norm, rope_tables

SHAPES = [(1, 1, 64), (3, 7, 896), (2, 5, 1536), (1, 300, 1536)]  # the last one runs on both threads


def _data(shape, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale, torch.randn(shape[-1], generator=g)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_kernel_equals_reference_and_is_batch_invariant(shape):
    x, w = _data(shape, shape[-1])
    y = ew.rms_norm(x, w, 1e-6)
    assert torch.equal(y, ew.reference_rms_norm(x, w, 1e-6))
    flat = x.reshape(-1, shape[-1])
    for i in range(0, flat.shape[0], max(1, flat.shape[0] // 7)):  # a row alone == the same row in the call
        assert torch.equal(ew.rms_norm(flat[i : i + 1], w, 1e-6), y.reshape(-1, shape[-1])[i : i + 1])
    assert (y - F.rms_norm(x, w.shape, w, 1e-6)).abs().max() <= 1e-5 * y.abs().max()  # it is an RMSNorm
    assert torch.equal(rms_norm(x, w, 1e-6, False), y)  # what the runtime calls for fp32 llama norms


def test_rms_norm_equality_has_teeth():
    """torch.sqrt is not correctly rounded in fp32 on this CPU (torch.rsqrt is 1/sqrt exactly);
    a reference using it differs on a few percent of rows, and the bit-for-bit test sees it."""
    x, w = _data((1, 300, 1536), 7)
    y = ew.rms_norm(x, w, 1e-6)
    rows = x.reshape(-1, 1536)
    acc = torch.zeros(rows.shape[0], 16)
    for c in range(0, 1536, 16):
        acc = acc + rows[:, c : c + 16] * rows[:, c : c + 16]
    for half in (8, 4, 2):
        acc = acc[:, :half] + acc[:, half : 2 * half]
    total = acc[:, 0] + acc[:, 1]
    inv_e = torch.tensor(1.0) / torch.tensor(1536.0)
    wrong = ((rows * (1.0 / torch.sqrt(total * inv_e + torch.tensor(1e-6))).unsqueeze(1)) * w).view(x.shape)
    assert not torch.equal(y, wrong)


def test_rms_norm_keeps_autograd_for_training():
    x, w = _data((2, 3, 64), 1)
    w.requires_grad_(True)
    rms_norm(x, w, 1e-6, False).sum().backward()  # the kernel has no backward: torch's op is used
    assert w.grad is not None


@pytest.mark.parametrize("shape", [(1, 1, 128), (2, 5, 17920), (1, 40, 17920)])
def test_silu_mul_kernel_equals_reference(shape):
    gu, _ = _data(shape, shape[-1] + 1, scale=6.0)
    gu[0, 0, :4] = torch.tensor([0.0, -0.0, -100.0, 100.0])  # exp underflow, both signs of zero
    y = ew.silu_mul(gu)
    assert torch.equal(y, ew.reference_silu_mul(gu))
    assert torch.equal(ew.silu_mul(gu[:1, :1].contiguous()), y[:1, :1])
    gate, up = gu.chunk(2, -1)
    assert torch.allclose(y, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    wrong = gate * torch.sigmoid(gate) * up  # torch's sigmoid: other last bits
    assert not torch.equal(y, wrong)


@pytest.mark.parametrize("bt", [(1, 1), (2, 5), (1, 64)])
def test_rope_kernel_gives_apply_rope_bits(bt):
    b, t = bt
    heads, d = 16, 128
    qkv, _ = _data((b, t, (heads + 2) * d), t)
    qkv = qkv[..., : (heads + 2) * d - 8]  # a strided view (rows longer than the rotated part)
    cos, sin = rope_tables(1e6, d, 512)
    pos = torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(3))
    c, s = cos[pos].unsqueeze(2), sin[pos].unsqueeze(2)  # [B, T, 1, D]
    y = ew.rope(qkv, c, s, heads)
    assert torch.equal(y, apply_rope(qkv[..., : heads * d].reshape(b, t, heads, d), c, s))
    assert torch.equal(y, ew.reference_rope(qkv, c, s, heads))


@pytest.mark.parametrize("shape", [(1, 151936), (2, 5, 151936), (3, 97), (1, 1), (4, 17)])
def test_argmax_kernel_equals_torch_first_maximum(shape):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(*shape, generator=g) * 10
    assert torch.equal(ew.argmax(x), x.argmax(-1))
    ties = torch.randint(0, 3, shape, generator=g).float()  # many equal maxima: the first one wins
    ties[..., -1] = 2.0
    assert torch.equal(ew.argmax(ties), ties.argmax(-1))
    x[..., 0] = float("-inf")  # masked ids (top-k, subsets) are never the maximum of a finite row
    assert torch.equal(ew.argmax(x), x.argmax(-1))


def test_all_finite_sees_nan_and_inf_anywhere():
    x = torch.randn(2, 5, 1000)
    assert ew.all_finite(x)
    for value in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 3, 777] = value
        assert not ew.all_finite(y)
    y = x.clone()
    y[0, 0, 0], y[1, 1, 1] = float("inf"), float("-inf")
    assert not ew.all_finite(y)
