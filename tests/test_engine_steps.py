"""The engine's commit and rollback steps on their own (fast; these are what mutation testing of
the engine runs against, next to the end-to-end tests in test_engine.py)."""

from __future__ import annotations

import torch

from specdec.core.blocks import ChainBlock
from specdec.core.rows import RowResult, commit_tokens
from specdec.proposers.base import Proposal
from specdec.runtime.kv_cache import KVCache
from specdec.verify.chain import ChainVerification


def _row(ids=()):
    res = RowResult()
    res.token_ids.extend(ids)
    return res


def test_commit_appends_every_token_and_goes_on():
    res = _row([1])
    assert commit_tokens(res, [2, 3, 4], set(), 10) is True
    assert res.token_ids == [1, 2, 3, 4] and res.finish_reason == "length"


def test_commit_stops_at_eos_and_keeps_it():
    res = _row()
    assert commit_tokens(res, [5, 9, 6, 7], {9}, 10) is False
    assert res.token_ids == [5, 9] and res.finish_reason == "eos"


def test_commit_stops_exactly_at_max_new_tokens():
    res = _row([1, 2])
    assert commit_tokens(res, [3, 4, 5], set(), 4) is False
    assert res.token_ids == [1, 2, 3, 4] and res.finish_reason == "length"
    res = _row([1, 2])
    assert commit_tokens(res, [3], set(), 4) is True  # one short of the limit: goes on
    assert res.token_ids == [1, 2, 3]


def test_rollback_keeps_the_fed_token_and_the_accepted_drafts():
    cache = KVCache(1, 3, 1, 2, 32, torch.float32)
    before = torch.tensor([5, 7, 9])
    cache.advance(before + 4)  # a block of k + 1 = 4 tokens was written
    result = ChainVerification(num_accepted=torch.tensor([0, 3, 1]),
                               tokens=torch.tensor([[11, -1, -1, -1], [1, 2, 3, 12], [4, 13, -1, -1]]))
    block = ChainBlock(Proposal(torch.zeros(3, 3, dtype=torch.long), None))  # k = 3
    last, hidden = block.commit_kv(cache, before, result, torch.arange(12.0).view(3, 4, 1))
    assert cache.lengths.tolist() == [6, 11, 11]  # before + 1 + accepted
    assert last.tolist() == [11, 12, 13]  # the replacement / bonus token of each row
    assert torch.equal(hidden, torch.arange(12.0).view(3, 4, 1))  # a chain's features are already in order


def test_an_empty_tree_keeps_the_root_and_its_feature():
    """Adaptive k may prune a tree to no node (plain decoding for a step): the fed token's KV and
    feature are still kept. (The feature was lost once, shifting a head's features by one
    position for the rest of the row.)"""
    from specdec.core.blocks import TreeBlock
    from specdec.verify.tree import TreeVerification

    cache = KVCache(1, 2, 1, 2, 32, torch.float32)
    before = torch.tensor([4, 6])
    cache.advance(before + 1)
    block = TreeBlock(Proposal(torch.zeros(2, 0, dtype=torch.long), None, parents=torch.zeros(2, 0, dtype=torch.long)))
    result = TreeVerification(num_accepted=torch.tensor([0, 0]), tokens=torch.tensor([[7], [8]]),
                              path=torch.zeros(2, 0, dtype=torch.long))
    last, hidden = block.commit_kv(cache, before, result, torch.arange(2.0).view(2, 1, 1))  # [B, N+1, E]
    assert cache.lengths.tolist() == [5, 7] and last.tolist() == [7, 8]
    assert hidden.tolist() == [[[0.0]], [[1.0]]]


def test_prefill_groups_bound_the_padding():
    from specdec.core.prefill import PADDING_WASTE, prefill_groups

    assert prefill_groups([7, 7, 7, 7]) == [(0, 4)]
    assert prefill_groups([500] + [30] * 15) == [(0, 1), (1, 16)]
    assert prefill_groups([10]) == [(0, 1)]
    lengths = [400, 390, 300, 120, 100, 99, 20, 3, 1]
    groups = prefill_groups(lengths)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(b == c for (_, b), (c, _) in zip(groups, groups[1:]))  # contiguous, covering every row
    for a, b in groups:
        assert (b - a) * lengths[a] <= PADDING_WASTE * sum(lengths[a:b]) or b - a == 1


def test_retain_keeps_the_rows_asked_for_in_order_whichever_way_it_copies():
    """Few rows moving (a per-row copy of the written slots), many rows (one gather), and a new
    order (a gather): the kept rows' written slots equal the originals'."""
    for order in ([0, 2, 5], list(range(0, 60, 2)), [3, 1, 0], []):
        cache = KVCache(2, 64, 1, 2, 8, torch.float32)
        g = torch.Generator().manual_seed(0)
        cache._k.copy_(torch.randn(cache._k.shape, generator=g))
        cache._v.copy_(torch.randn(cache._v.shape, generator=g))
        cache.advance(torch.randint(1, 9, (64,), generator=g))
        k, v, lengths = cache.k.clone(), cache.v.clone(), cache.lengths.clone()
        cache.retain(order)
        assert cache.lengths.tolist() == lengths[order].tolist()
        for j, s in enumerate(order):
            n = int(lengths[s])
            assert torch.equal(cache.k[:, j, :, :n], k[:, s, :, :n]) and torch.equal(cache.v[:, j, :, :n], v[:, s, :, :n])
