"""Runtime: parity with transformers, KV cache rollback, and batch invariance of the logits."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime import q4

from specdec.runtime.kv_cache import KVCache
from tiny_models import FAMILIES, hf_tiny, ours

ARCHS = ["llama", "qwen2", "gemma3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers_fp32(arch):
    hf = hf_tiny(arch)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.float(), -1)
    model = ours(hf)
    full = torch.log_softmax(model(ids, model.new_cache(2, 64)), -1)
    assert (full - ref).abs().max() <= 1e-3
    # incremental: prefill 10 tokens, then a block of 5, then one at a time
    cache = model.new_cache(2, 64)
    parts = [model(ids[:, :10], cache), model(ids[:, 10:15], cache)]
    parts += [model(ids[:, i : i + 1], cache) for i in range(15, 24)]
    incremental = torch.log_softmax(torch.cat(parts, 1), -1)
    assert (incremental - ref).abs().max() <= 1e-3


def test_gemma_sliding_window_is_exercised():
    """The tiny Gemma uses a window of 8 over 24 tokens; a model without the window must differ."""
    hf = hf_tiny("gemma3")
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    model = ours(hf)
    with_window = model(ids, model.new_cache(1, 64))
    model.cfg.__dict__["sliding_window"] = None  # frozen dataclass: test-only override
    without = model(ids, model.new_cache(1, 64))
    assert (with_window - without).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_truncate_then_continue_equals_fresh_forward(arch):
    model = ours(hf_tiny(arch))
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(3))
    junk = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(1, 64)
    model(ids[:, :12], cache)
    model(junk, cache)  # a rejected block
    cache.truncate(12)
    continued = model(ids[:, 12:], cache)
    fresh = model(ids, model.new_cache(1, 64))[:, 12:]
    assert (continued - fresh).abs().max() <= 1e-4
    assert int(cache.lengths[0]) == 20


def test_ragged_rows_truncate_independently():
    model = ours(hf_tiny("qwen2"), "int8")
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(2, 64)
    model(ids[:, :8], cache)
    model(ids[:, 8:13], cache)
    cache.truncate(torch.tensor([10, 12]))  # row 0 keeps 2 of the block, row 1 keeps 4
    out = model(ids[:, 13:14], cache)  # row 0 at position 10, row 1 at position 12
    for row, length in [(0, 10), (1, 12)]:
        c = model.new_cache(1, 64)
        model(ids[row : row + 1, :length], c)
        ref = model(ids[row : row + 1, 13:14], c)
        assert torch.equal(out[row], ref[0])


def test_cache_api_errors():
    cache = KVCache(num_layers=1, batch=2, num_kv_heads=1, head_dim=2, capacity=4)
    cache.advance(3)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(4)
    with pytest.raises(ValueError, match="overflow"):
        cache.block_slots(2)


def _row_three_ways(model):
    """Logits of row 0 at 5 positions: decoded one at a time alone, as one block of 5 alone,
    and as a block of 5 inside a batch of 4 ragged rows."""
    g = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, 97, (4, 30), generator=g)
    block = torch.randint(0, 97, (4, 5), generator=g)
    cache = model.new_cache(1, 64)
    model(prompts[:1, :20], cache)
    one_by_one = torch.cat([model(block[:1, i : i + 1], cache) for i in range(5)], 1)[0]
    cache = model.new_cache(1, 64)
    model(prompts[:1, :20], cache)
    alone = model(block[:1], cache)[0]
    cache = model.new_cache(4, 64)
    model(prompts, cache)
    cache.truncate(torch.tensor([20, 30, 20, 17]))  # row 2 shares row 0's length: grouped matmuls
    batched = model(block, cache)[0]
    return one_by_one, alone, batched


@pytest.mark.parametrize("dtype", ["int8"] + [pytest.param(d, marks=pytest.mark.skipif(
    not q4.available(), reason="the 4-bit kernel needs an AVX2 CPU")) for d in ("q4", "q4k")])
@pytest.mark.parametrize("arch", ARCHS + FAMILIES)
def test_quantized_logits_are_bit_identical_alone_in_a_block_and_in_a_batch(arch, dtype):
    one_by_one, alone, batched = _row_three_ways(ours(hf_tiny(arch), dtype))
    assert torch.equal(one_by_one, alone)
    assert torch.equal(alone, batched)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 1e-5)])
def test_float_logits_are_batch_invariant_within_tolerance(dtype, tol):
    one_by_one, alone, batched = _row_three_ways(ours(hf_tiny("qwen2"), dtype))
    assert (one_by_one - alone).abs().max() <= tol
    assert (alone - batched).abs().max() <= tol


def test_per_tensor_dynamic_quantization_is_not_batch_invariant():
    """Why the int8 path exists: torch's quantize_dynamic shares one activation scale per call."""
    import warnings

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(256, 256))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qlin = torch.ao.quantization.quantize_dynamic(lin, {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(5, 256)
    x[4] *= 50  # one row with a larger range
    alone = qlin(x[:1])
    together = qlin(x)[:1]
    assert (alone - together).abs().max() > 1e-3

    from specdec.runtime.linear import RowInt8Linear, quantize_int8

    ours_lin = RowInt8Linear(quantize_int8(lin[0].weight.detach(), lin[0].bias.detach()))
    assert torch.equal(ours_lin(x[:1]), ours_lin(x)[:1])


def test_int8_is_close_to_float32():
    hf = hf_tiny("llama")
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(7))
    f = torch.log_softmax(ours(hf)(ids, ours(hf).new_cache(1, 64)), -1)
    q8 = ours(hf, "int8")
    q = torch.log_softmax(q8(ids, q8.new_cache(1, 64)), -1)
    assert (f.exp() - q.exp()).abs().sum(-1).max() < 0.1  # total variation per position


def test_context_length_is_enforced():
    model = ours(hf_tiny("llama"))
    cache = model.new_cache(1, 600)
    with pytest.raises(ValueError, match="context length"):
        model(torch.zeros(1, 513, dtype=torch.long), cache)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_tree_mask_branches_equal_their_chains(arch):
    """A block holding two branches [a, b1, b2] and [a, c1] (tree mask + depth positions) gives
    each branch the same int8 logits as verifying that branch as a plain chain."""
    model = ours(hf_tiny(arch), "int8")
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 97, (1, 12), generator=g)
    a, b1, b2, c1 = torch.randint(0, 97, (4,), generator=g).tolist()
    block = torch.tensor([[a, b1, b2, c1]])
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]], dtype=torch.bool)
    positions = torch.tensor([[12, 13, 14, 13]])
    cache = model.new_cache(1, 64)
    model(prompt, cache)
    tree_logits = model(block, cache, tree_mask=tree, positions=positions)[0]
    for branch, rows in [([a, b1, b2], [0, 1, 2]), ([a, c1], [0, 3])]:
        cache = model.new_cache(1, 64)
        model(prompt, cache)
        chain = model(torch.tensor([branch]), cache)[0]
        assert torch.equal(tree_logits[rows], chain)
    # and a path-shaped tree mask is exactly the chain
    cache = model.new_cache(1, 64)
    model(prompt, cache)
    path = model(block, cache, tree_mask=torch.tril(torch.ones(1, 4, 4, dtype=torch.bool)))
    cache = model.new_cache(1, 64)
    model(prompt, cache)
    assert torch.equal(path, model(block, cache))


def test_kernels_are_built_with_the_model_not_at_its_first_call():
    """Building a model compiles (first time on a machine: ~35 s here) or loads its attention
    kernel, so that time is load time and never lands in a request's prefill / time to first
    token; ``native.build_all`` (the install step) builds every kernel this CPU can run."""
    from specdec.runtime import native

    native.build.cache_clear()  # as in a fresh process
    ours(hf_tiny("llama"))
    assert native.build.cache_info().currsize == 2  # attention and elementwise, loaded while building
    assert native.build_all() == (["attention", "elementwise", "q4", "q6k", "blocks", "repack", "stack"] if q4.available()
                                  else ["attention", "elementwise"])



def test_calibration_records_every_linear_input():
    """int8 calibration reads each linear's input max |x| per channel while the fp32 model runs
    (it wraps the linears' forward, which the blocks call directly): every linear has its stats,
    and layer 0's qkv input is checked against the input computed by hand."""
    from specdec.models.calibration import CALIBRATION_TEXT, calibrate
    from specdec.runtime.config import ModelConfig
    from specdec.runtime.model import rms_norm

    from tiny_models import char_tokenizer

    hf = hf_tiny("qwen2")
    cfg = ModelConfig.from_hf(hf.config)
    stats = calibrate(cfg, hf.state_dict(), char_tokenizer())
    model = ours(hf)
    assert set(stats) == set(model.linear_layers())
    assert all(bool((v > 0).all()) and bool(v.isfinite().all()) for v in stats.values())
    ids = char_tokenizer()(CALIBRATION_TEXT)["input_ids"][: cfg.max_position_embeddings]
    x = model.embed[torch.tensor([ids])]  # [1, T, E]
    expected = rms_norm(x, model.blocks[0].norms["input_layernorm"], cfg.rms_norm_eps, False).abs().amax((0, 1))
    assert torch.equal(stats["layers.0.qkv"], expected)
