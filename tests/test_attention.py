"""The attention kernel: bit-identical to its pure-torch reference, each query independent of the
others in the call, a path-shaped tree equal to its chain, and close to textbook softmax attention."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.runtime import attention, lanes


def _qkv(seed: int, b=3, t=4, hq=4, hkv=2, d=32, s=40, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g) * spread
    k = torch.randn(b, hkv, s, d, generator=g) * spread
    v = torch.randn(b, hkv, s, d, generator=g)
    return q, k, v


def _textbook(q, k, v, vis, cap=None):
    """Softmax attention in float64 over each query's listed slots (not the kernel's order);
    ``cap``: softcapped scores, ``cap * tanh(s / cap)``."""
    bsz, t, hq, d = q.shape
    rep = hq // k.shape[1]
    out = torch.empty(bsz, t, hq, d, dtype=torch.float64)
    for i in range(bsz * t):
        b, j = divmod(i, t)
        p0, p1 = int(vis.extra_ptr[i]), int(vis.extra_ptr[i + 1])
        slots = torch.cat([torch.arange(int(vis.lo[i]), int(vis.hi[i])), vis.extra[p0:p1]])
        for h in range(hq):
            keys, values = k[b, h // rep, slots].double(), v[b, h // rep, slots].double()
            scores = keys @ q[b, j, h].double() / math.sqrt(d)
            w = torch.softmax(scores if cap is None else cap * torch.tanh(scores / cap), -1)
            out[b, j, h] = w @ values
    return out


CASES = {
    "chain": lambda: attention.chain(torch.tensor([5, 0, 30]), 4),
    "window": lambda: attention.chain(torch.tensor([5, 0, 30]), 4, window=7),
    "tree": lambda: attention.tree(torch.tensor([6, 1, 20]), torch.tensor(
        [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]] * 3, dtype=torch.bool)),
    "tree_window": lambda: attention.tree(torch.tensor([6, 1, 20]), torch.tensor(
        [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]] * 3, dtype=torch.bool),
        positions=torch.tensor([[6, 7, 7, 8], [1, 2, 2, 3], [20, 21, 21, 22]]), window=3),
}


@pytest.fixture(params=["vector", "portable"])
def code_path(request):
    """The AVX-512 loops (where this CPU has them) and the plain C++ loops: the same bits."""
    attention.kernel().force_portable(request.param == "portable")
    yield request.param
    attention.kernel().force_portable(False)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("spread", [0.3, 3.0, 30.0])  # 30: scores far below the max (exp's underflow cut)
def test_kernel_is_bit_identical_to_the_reference(case, spread, code_path):
    q, k, v = _qkv(len(case), spread=spread, s=57)  # 57 keys: 16-wide exp chunks plus a tail
    vis = CASES[case]()
    scale = 1.0 / math.sqrt(q.shape[-1])
    got = attention.attend(q, k, v, vis, scale)
    assert torch.equal(got, attention.reference_attend(q, k, v, vis, scale))
    # not a vacuous equality: close to textbook attention, but computed in its own fixed order
    expected = _textbook(q, k, v, vis)
    assert (got.double() - expected).abs().max() < 1e-4 * max(1.0, spread)


@pytest.mark.parametrize("case", ["chain", "window", "tree"])
@pytest.mark.parametrize("spread, cap", [(0.3, 50.0), (3.0, 5.0), (30.0, 2.0)])
def test_softcapped_kernel_is_bit_identical_to_the_reference(case, spread, cap, code_path):
    """Gemma 2's attention-logit softcapping: the kernel's tanh (from its exp16) in the same bits
    as the reference, close to float64 tanh, and it bites (without it the output differs)."""
    q, k, v = _qkv(len(case) + 7, spread=spread, s=57)
    vis = CASES[case]()
    scale = 1.0 / math.sqrt(q.shape[-1])
    got = attention.attend(q, k, v, vis, scale, cap)
    assert torch.equal(got, attention.reference_attend(q, k, v, vis, scale, cap))
    assert (got.double() - _textbook(q, k, v, vis, cap)).abs().max() < 1e-4 * max(1.0, spread)
    if spread >= 3.0:
        assert (got - attention.attend(q, k, v, vis, scale)).abs().max() > 1e-2


def test_softcap_is_tanh_within_float_rounding():
    x = torch.linspace(-400.0, 400.0, 100_001)
    for cap in (2.0, 30.0, 50.0):
        exact = cap * torch.tanh(x.double() / cap)
        assert (attention.softcap(x, cap).double() - exact).abs().max() < 4e-7 * cap


def test_bit_equality_is_a_sharp_check():
    """torch's own softmax attention (another summation order and exp) differs in the last bits:
    the reference test above would catch a kernel that drifted from its documented order."""
    q, k, v = _qkv(1)
    vis = CASES["chain"]()
    got = attention.attend(q, k, v, vis, 0.25)
    other = torch.empty_like(got)
    for i in range(12):
        b, j = divmod(i, 4)
        slots = torch.arange(int(vis.lo[i]), int(vis.hi[i]))
        for h in range(4):
            w = torch.softmax((k[b, h // 2, slots] @ q[b, j, h]) * 0.25, -1)
            other[b, j, h] = w @ v[b, h // 2, slots]
    assert not torch.equal(got, other)
    assert torch.allclose(got, other, atol=1e-5)


def test_each_query_is_independent_of_the_call():
    """A row's query gives the same bits alone, in its block, and in a batch of rows."""
    q, k, v = _qkv(2)
    scale = 0.2
    together = attention.attend(q, k, v, attention.chain(torch.tensor([5, 0, 30]), 4), scale)
    for b, start in enumerate([5, 0, 30]):
        for j in range(4):
            alone = attention.attend(q[b : b + 1, j : j + 1].contiguous(), k[b : b + 1], v[b : b + 1],
                                     attention.chain(torch.tensor([start + j]), 1), scale)
            assert torch.equal(alone[0, 0], together[b, j])


def test_a_path_shaped_tree_equals_its_chain():
    q, k, v = _qkv(3, b=1)
    chain = attention.attend(q, k, v, attention.chain(torch.tensor([9]), 4), 0.2)
    path = torch.tril(torch.ones(4, 4, dtype=torch.bool)).unsqueeze(0)
    tree = attention.attend(q, k, v, attention.tree(torch.tensor([9]), path), 0.2)
    assert torch.equal(chain, tree)


def test_exp_is_accurate():
    x = -torch.linspace(0, 87, 200_001)
    rel = ((lanes.exp16(x).double() - x.double().exp()) / x.double().exp()).abs()
    assert rel.max() < 4e-7  # a few float ulps


@pytest.mark.parametrize("bad, match", [
    (lambda v: attention.Visibility(v.lo, v.hi + 100, v.extra_ptr, v.extra), "bad visible range"),
    (lambda v: attention.Visibility(v.lo, v.lo, v.extra_ptr, v.extra), "sees no key"),
    (lambda v: attention.Visibility(v.lo, v.hi, v.extra_ptr[:-1], v.extra), "shapes disagree"),
])
def test_bad_visibility_is_a_clear_error(bad, match):
    q, k, v = _qkv(4)
    with pytest.raises(RuntimeError, match=match):
        attention.attend(q, k, v, bad(CASES["chain"]()), 0.2)


@pytest.mark.parametrize("hq, hkv", [(3, 3), (7, 1), (12, 2), (9, 1)])  # 1, 7, 6 heads per kv head; 9: the generic loop
def test_every_group_size_matches_the_reference(hq, hkv, code_path):
    q, k, v = _qkv(hq * hkv, b=2, t=3, hq=hq, hkv=hkv, s=40)
    vis = attention.chain(torch.tensor([4, 20]), 3)
    assert torch.equal(attention.attend(q, k, v, vis, 0.3), attention.reference_attend(q, k, v, vis, 0.3))


@pytest.mark.parametrize("d", [16, 48, 128])  # the value loop's one- and two-chunk passes
@pytest.mark.parametrize("start", [15, 31, 60])  # key counts at, below and above multiples of 16
def test_head_dims_and_key_counts_match_the_reference(d, start, code_path):
    q, k, v = _qkv(d + start, b=1, t=5, hq=7, hkv=1, d=d, s=72)
    vis = attention.chain(torch.tensor([start]), 5)
    assert torch.equal(attention.attend(q, k, v, vis, 0.3), attention.reference_attend(q, k, v, vis, 0.3))


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_fp16_cache_is_read_as_its_exact_values(case, code_path):
    """The KV cache of quantized runtimes holds fp16 (runtime.linear.kv_dtype): the kernel reads
    each half as its exact float, so its output equals the fp32 kernel's on the converted cache,
    and the reference's, bit for bit (every group size's loop, a key count with a tail)."""
    q, k, v = _qkv(len(case) + 7, hq=6, hkv=2, s=57)
    vis = CASES[case]()
    kh, vh = k.half(), v.half()
    got = attention.attend(q, kh, vh, vis, 0.25)
    assert torch.equal(got, attention.attend(q, kh.float(), vh.float(), vis, 0.25))
    assert torch.equal(got, attention.reference_attend(q, kh, vh, vis, 0.25))
    assert not torch.equal(got, attention.attend(q, k, v, vis, 0.25))  # the cache's rounding is there
    with pytest.raises(RuntimeError, match="both fp32 or both fp16"):
        attention.attend(q, kh, v, vis, 0.25)


def test_quantized_runtimes_keep_an_fp16_cache_of_half_the_bytes():
    from specdec.models import memory
    from tiny_models import hf_tiny, ours

    model = ours(hf_tiny("qwen2"), "int8")
    assert model.new_cache(1, 8).k.dtype == torch.float16
    assert ours(hf_tiny("qwen2"), "float32").new_cache(1, 8).k.dtype == torch.float32
    assert memory.kv_bytes(model.cfg, 4096, "q4k") * 2 == memory.kv_bytes(model.cfg, 4096, "float32")


def _block_run(model, fused: bool):
    """Logits and cache of a prefill, a 3-token chain block and a 4-node tree block (rows at
    different lengths), with every block run fused (one kernel call for rope, cache write and
    attention) or op by op."""
    for block in model.blocks:
        block.fused = fused
    cache = model.new_cache(2, 32)
    g = torch.Generator().manual_seed(3)
    out = [model(torch.randint(0, 97, (2, 7), generator=g), cache)]
    cache.truncate(torch.tensor([7, 4]))  # ragged rows: the next blocks start at different slots
    out.append(model(torch.randint(0, 97, (2, 3), generator=g), cache))
    parents = [-1, 0, 0, 1]  # a root child with two children, one grandchild
    mask = torch.eye(4, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p], p = True, parents[p]
    depth = torch.tensor([0, 1, 1, 2])
    out.append(model(torch.randint(0, 97, (2, 4), generator=g), cache, tree_mask=mask.expand(2, 4, 4),
                     positions=cache.lengths.unsqueeze(1) + depth))
    return out, cache.k.clone(), cache.v.clone()


@pytest.mark.parametrize("kind, dtype", [("qwen2", "float32"), ("llama", "float32"), ("qwen2", "int8"), ("qwen2", "q4"),
                                         ("qwen2", "q4k")])
def test_fused_block_gives_the_bits_of_the_op_by_op_block(kind, dtype):
    """Issue 11: the fused sublayer (kernels/attention.cpp attend_block) must not change a bit:
    logits of prefill, chain and tree blocks and every cache entry equal the op-by-op path's
    (rope kernel, cache.write, attend) — two separate implementations, compared exactly."""
    from specdec.runtime import q4
    from tiny_models import hf_tiny, ours

    if dtype in ("q4", "q4k") and not q4.available():
        pytest.skip("the 4-bit kernel needs an AVX2 CPU")
    model = ours(hf_tiny(kind), dtype)
    assert all(block.fused for block in model.blocks)  # the default for fp32 llama-family blocks
    fused, k1, v1 = _block_run(model, True)
    ops, k0, v0 = _block_run(model, False)
    for a, b in zip(fused, ops):
        assert torch.equal(a, b)
    assert torch.equal(k1, k0) and torch.equal(v1, v0)


@pytest.mark.parametrize("dtype", ["q4", "q4k"])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_layer_stack_gives_the_bits_of_the_per_layer_loop(kind, dtype):
    """Issue 11: running every layer in one C++ call (kernels/stack.cpp) must not change a bit:
    prefill, chain and tree logits and the whole cache equal the per-layer Python loop's, for
    the model and for an early-exit view of its first layers (which gets a stack of its own)."""
    from specdec.runtime import q4
    from tiny_models import hf_tiny, ours

    if not q4.available():
        pytest.skip("the 4-bit kernel needs an AVX2 CPU")
    model = ours(hf_tiny(kind), dtype)
    for m in (model, model.truncated(1)):
        assert m.stack is not None  # fused q4 blocks over whole tiles: the stack is the default
        m.use_stack = True
        one_call, k1, v1 = _block_run(m, True)
        m.use_stack = False
        loop, k0, v0 = _block_run(m, True)
        for a, b in zip(one_call, loop):
            assert torch.equal(a, b)
        assert torch.equal(k1, k0) and torch.equal(v1, v0)
        assert k1.abs().sum() > 0  # the stack wrote the cache


def test_layer_stack_is_only_built_for_what_it_runs():
    from tiny_models import hf_tiny, ours

    assert ours(hf_tiny("qwen2"), "int8").stack is None  # int8 linears: the per-layer loop
    assert ours(hf_tiny("gemma3"), "q4").stack is None  # Gemma blocks are not fused


def test_fused_block_rejects_a_slot_outside_the_cache():
    q, k, v = _qkv(0, b=1, t=1, hq=2, hkv=1, d=16, s=8)
    qkv = torch.randn(1, 1, 4 * 16)
    cos, sin = torch.ones(1, 1, 1, 16), torch.zeros(1, 1, 1, 16)
    vis = attention.chain(torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        attention.attend_block(qkv, cos, sin, k, v, torch.tensor([[8]]), vis, 0.25, 2)
