"""Prefix caching: a reused prefix gives bit-identical logits to recomputing it (quantized dtypes),
greedy output is identical with and without the cache in mixed batches and multi-turn
conversations, a head reads the same features, memory stays within the budget (LRU)."""

from __future__ import annotations

import pytest
import torch

from specdec.core.engine import Engine, kv_capacity, steps

from specdec.core.rows import Request
from specdec.core.prefix_cache import PrefixCache
from specdec.proposers.head import HeadProposer, HeadTreeProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.runtime import q4
from specdec.runtime.head import DraftHead, HeadConfig
from specdec.verify.sampling import SamplingParams
from specdec.training.head_net import HeadNet
from tiny_models import hf_tiny, ours

GREEDY = SamplingParams(temperature=0.0)
DTYPES = ["int8"] + [pytest.param(d, marks=pytest.mark.skipif(not q4.available(), reason="the 4-bit kernel needs an AVX2 CPU"))
                     for d in ("q4", "q4k")]
SYSTEM = [(7 * i + 3) % 97 for i in range(37)]  # a shared "system prompt" of 37 tokens (2 full blocks + 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_reused_prefix_gives_bit_identical_logits(arch, dtype):
    """Prefill A (50 tokens) and cache it; B shares A's first 40 tokens: B's logits at every
    position it prefills after taking the cached 32 (2 blocks) == B prefilled from scratch.
    (gemma3: sliding-window layers, whose window spans the cached and prefilled slots.)"""
    model = ours(hf_tiny(arch), dtype)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 97, (50,), generator=g).tolist()
    b = a[:40] + torch.randint(0, 97, (12,), generator=g).tolist()
    prefix = PrefixCache(2**30)
    cache = model.new_cache(1, 64)
    model(torch.tensor([a]), cache)
    prefix.insert(a, cache, 0, None)
    assert len(prefix) == 3  # full blocks of 50 tokens
    chain = prefix.match(b, need_hidden=False)
    assert len(chain) == 2  # tokens 0..31; block 3 (32..47) differs from a's at 40
    warm = model.new_cache(1, 64)
    prefix.load(warm, 0, chain)
    reused = model(torch.tensor([b[32:]]), warm)  # [1, 20, V]
    cold = model(torch.tensor([b]), model.new_cache(1, 64))[:, 32:]
    assert torch.equal(reused, cold)


def test_match_needs_a_whole_block_and_leaves_the_last_token_to_prefill():
    model = ours(hf_tiny("qwen2"), "int8")
    prefix = PrefixCache(2**30, block=4)
    ids = list(range(1, 13))  # 12 tokens: 3 blocks
    cache = model.new_cache(1, 32)
    model(torch.tensor([ids]), cache)
    prefix.insert(ids, cache, 0, None)
    assert len(prefix.match(ids, False)) == 2  # the 3rd block would leave no token for the logits
    assert len(prefix.match(ids + [5], False)) == 3
    assert len(prefix.match([1, 2, 3], False)) == 0
    assert len(prefix.match([1, 2, 3, 4, 9, 9], False)) == 1
    assert len(prefix.match([2, 3, 4, 5, 6, 7], False)) == 0  # the same block elsewhere is another prefix
    assert len(prefix.match(ids + [5], need_hidden=True)) == 0  # no features were stored


def test_lru_eviction_keeps_memory_within_the_budget_and_the_first_blocks_longest():
    model = ours(hf_tiny("qwen2"), "int8")
    cache = model.new_cache(3, 64)
    seqs = [[(s + 3 * i) % 97 for i in range(40)] for s in (1, 2, 5)]
    model(torch.tensor(seqs), cache)
    per_block = sum(t.nbytes for t in cache.read(0, 0, 8))
    prefix = PrefixCache(7 * per_block, block=8)  # room for 7 of the 15 blocks
    for row, ids in enumerate(seqs):
        prefix.insert(ids, cache, row, None)
        assert prefix.bytes <= prefix.budget
    assert len(prefix) == 7 and prefix.stats.evicted_blocks == 8
    assert len(prefix.match(seqs[2] + [0], False)) == 5  # the newest sequence is whole
    assert len(prefix.match(seqs[1] + [0], False)) == 2  # the older one kept its first blocks
    assert len(prefix.match(seqs[0] + [0], False)) == 0
    assert PrefixCache.of_megabytes(0) is None
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        PrefixCache.of_megabytes(-1)


class _Logged:
    """Wraps a proposer, keeping every proposal's tokens per step (what drafting saw)."""

    def __init__(self, inner):
        self.inner, self.log = inner, []
        self.tree_mode, self.wants_target_hidden = inner.tree_mode, inner.wants_target_hidden

    def propose(self, states, k, tree, sampling):
        proposal = self.inner.propose(states, k, tree, sampling)
        self.log.append(proposal.tokens.tolist())
        return proposal

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _head(target, fp32, kind):
    cfg = HeadConfig.for_target(fp32.cfg, intermediate_size=96)
    net = HeadNet(cfg, torch.arange(97), fp32.embed, fp32.final_norm, fp32.lm_head.weight.clone(), 0)
    head = DraftHead(net.cfg, net.export(), net.vocab_ids, target, net.lm_rows, target.dtype_name)
    return HeadProposer(head, 256) if kind == "head" else HeadTreeProposer(head, 256, width=2, depth=3, min_score=0.0)


def _conversation(target, proposer, prefix, turns: int = 3):
    """Four conversations sharing SYSTEM, ``turns`` turns each: turn t's prompt is turn t-1's
    prompt + answer + a new user message. The turns of all four conversations run as one
    batch (mixed: some rows reuse more than others). Returns answers and cached tokens."""
    engine = Engine(target, proposer, capacity=kv_capacity(400, 4, 8), k=4, prefix_cache=prefix)
    history = [SYSTEM + [i + 1, i + 2, i + 3] for i in range(4)]
    answers, cached = [], []
    for t in range(turns):
        rows = [engine.add(Request(h, GREEDY, 24)) for h in history]
        for _ in steps(engine, rows):
            pass
        answers.append([r.token_ids for r in rows])
        cached.append([r.result.metrics.cached_prompt_tokens for r in rows])
        history = [h + r.token_ids + [(5 * t + i) % 97, 11] for i, (h, r) in enumerate(zip(history, rows))]
    return answers, cached


@pytest.mark.parametrize("kind", ["none", "suffix", "head", "head-tree"])
def test_greedy_output_is_identical_with_and_without_the_prefix_cache(kind):
    """Multi-turn conversations in mixed batches: the same answers, the same drafts (a head
    reads the cached features of the reused prefix), and later turns reuse their history."""
    fp32 = ours(hf_tiny("qwen2", seed=0), "float32")
    target = ours(hf_tiny("qwen2", seed=0), "int8")

    def proposer():
        if kind == "none":
            return None
        return _Logged(SuffixProposer() if kind == "suffix" else _head(target, fp32, kind))

    cold_p, warm_p = proposer(), proposer()
    cold, cold_cached = _conversation(target, cold_p, None)
    prefix = PrefixCache(2**30)
    warm, warm_cached = _conversation(target, warm_p, prefix)
    assert warm == cold
    if kind != "none":
        assert warm_p.log == cold_p.log
    assert cold_cached == [[0] * 4] * 3
    # the first turns join together: one prefills the shared system prompt, the others take its 2 blocks
    assert sorted(warm_cached[0]) == [0, 32, 32, 32]
    assert all(c >= 48 for turn in warm_cached[1:] for c in turn)  # later turns: their history
    assert prefix.stats.hit_tokens == sum(map(sum, warm_cached)) and prefix.stats.lookups == 12


def test_rows_whose_reuse_would_overflow_their_block_take_none():
    """Rows of one prefill share a block as wide as the longest remainder: a row with a long
    cached prefix beside a row with a long new prompt would pass its capacity, so it
    prefills from scratch; the output is the same."""
    target = ours(hf_tiny("qwen2", seed=0), "int8")
    long_a = [(3 * i + 1) % 97 for i in range(60)]
    long_b = [(5 * i + 2) % 97 for i in range(60)]
    capacity = kv_capacity(64, 0, 0)
    prefix = PrefixCache(2**30)
    engine = Engine(target, capacity=capacity, k_max=0, prefix_cache=prefix)
    first = engine.add(Request(long_a, GREEDY, 4))
    for _ in steps(engine, [first]):
        pass
    rows = [engine.add(Request(long_a[:-1] + [9], GREEDY, 4)), engine.add(Request(long_b, GREEDY, 4))]
    for _ in steps(engine, rows):
        pass
    assert rows[0].result.metrics.cached_prompt_tokens == 0
    assert prefix.stats.hit_tokens == 0  # (what was matched but not taken does not count)
    alone = Engine(target, capacity=capacity, k_max=0)
    ref = [alone.add(Request(r.request.prompt, GREEDY, 4)) for r in rows]
    for _ in steps(alone, ref):
        pass
    assert [r.token_ids for r in rows] == [r.token_ids for r in ref]


def test_a_row_cut_by_a_stop_string_stores_only_what_it_kept():
    target = ours(hf_tiny("qwen2", seed=0), "int8")
    prefix = PrefixCache(2**30, block=4)
    engine = Engine(target, capacity=kv_capacity(64, 0, 0), k_max=0, prefix_cache=prefix)
    row = engine.add(Request([1, 2, 3, 4, 5, 6], GREEDY, 12))
    for changed in steps(engine, [row]):
        if len(row.token_ids) >= 9:
            engine.cancel(row, "stop", keep=3)  # a stop string found in the text: 3 tokens kept
    ids = row.request.prompt + row.token_ids  # 9 tokens: 2 blocks
    assert len(prefix) == 2
    assert len(prefix.match(ids + [0], False)) == 2


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9)], ids=["greedy", "sampled"])
def test_requests_joining_together_prefill_their_common_prefix_once(params):
    """16 cold requests with one 70-token system prompt join in one step: one prefills it, the
    other 15 take its 4 whole blocks (64 tokens) from the cache in the same step, and every
    answer (greedy, or sampled with the request's seed) is the one computed without the cache."""
    target = ours(hf_tiny("qwen2", seed=0), "int8")
    system = [(7 * i + 3) % 97 for i in range(70)]
    prompts = [system + [i % 97, (3 * i + 1) % 97, 5] for i in range(16)]

    def run(prefix):
        engine = Engine(target, None, capacity=kv_capacity(120, 0, 0), prefix_cache=prefix)
        rows = [engine.add(Request(p, params, 8, seed=i)) for i, p in enumerate(prompts)]
        for _ in steps(engine, rows):
            pass
        return [r.token_ids for r in rows], [r.result.metrics.cached_prompt_tokens for r in rows]

    cold, cold_cached = run(None)
    prefix = PrefixCache(2**30)
    warm, warm_cached = run(prefix)
    assert warm == cold and cold_cached == [0] * 16
    assert sorted(warm_cached) == [0] + [64] * 15  # prefilled: 73 + 15 x 9 tokens instead of 16 x 73


def test_recorders_attach_before_rows_join_and_the_prefix_cache_keeps_no_finished_row(pair):
    """A recorder attached to an engine gets each row's features (prompt, then every committed
    position but the last), the same as a second recorder; one attached once rows are in the
    batch is refused. The engine's own recorder (prefix cache + a proposer reading features)
    drops a row's features once the row has left (they live on in the prefix cache)."""
    from specdec.core.recorder import FeatureRecorder
    from specdec.training import features
    from tiny_models import tiny_head

    target, _ = pair
    head = tiny_head(target, 97, seed=0)
    engine = Engine(target, HeadProposer(head, 64), capacity=kv_capacity(40, 3, 9), k=3,
                    prefix_cache=PrefixCache(2**30, block=4))
    first, second = FeatureRecorder(), FeatureRecorder()
    engine.attach(first)
    engine.attach(second)
    rows = [engine.add(Request(p, GREEDY, 12)) for p in ([1, 2, 3, 4, 5, 6], [7, 8, 9])]
    engine.step()
    with pytest.raises(ValueError, match="before any request joins"):
        engine.attach(FeatureRecorder())
    for _ in steps(engine, rows):
        pass
    engine.step()  # (the finished rows leave)
    for row in rows:
        ids = row.request.prompt + row.token_ids[:-1]
        torch.testing.assert_close(first.features(row), features.prefill_features(target, ids), atol=1e-4, rtol=1e-4)
        assert torch.equal(first.features(row), second.features(row))
        with pytest.raises(KeyError):
            engine._cached_features.features(row)
