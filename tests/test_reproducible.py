"""Reproducible sampling (requests with a seed): exact, and independent of what was drafted.

* The committed tokens equal plain decoding with the same seed, token for token, whatever the
  proposer (sampled drafts, n-gram, candidate trees), k (fixed or adaptive) and the batch
  around the row (other seeded rows, rows without a seed, other lengths).
* The joint law of the first three tokens at T = 0.7 top-k through an unrelated sampled draft
  (10^5 seeded rows, chi-square over <= 216 cells); its negative control — a stream that reuses
  one uniform for every position — is rejected with p < 1e-12.
* verify_chain_at / verify_tree_at against a direct reference on random cases.
"""

from __future__ import annotations

import pytest
import torch

from specdec.core.engine import Engine, generate

from specdec.core.rows import Request
from specdec.proposers import DraftModelProposer, NgramProposer, SuffixProposer
from specdec.verify.reproducible import PositionUniforms, verify_chain_at, verify_tree_at
from specdec.verify.sampling import SamplingParams, sample, sample_at
from specdec.verify.tree import depths
from stats import ALPHA, chi_square_pvalue
from tiny_models import exact_joint

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


def test_sample_at_is_sample_with_its_uniforms():
    probs = torch.softmax(torch.randn(7, 50, generator=torch.Generator().manual_seed(0)), -1)
    a = sample(probs, torch.Generator().manual_seed(3))
    u = torch.rand(7, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.equal(a, sample_at(probs, u.view(7)))


def test_position_uniforms_are_one_stream_in_order():
    a, b = PositionUniforms(9), PositionUniforms(9)
    whole = a.take(0, 40)
    parts = torch.cat([b.take(0, 3), b.take(3, 1), b.take(2, 5)[2:], b.take(7, 33)])  # peeks overlap
    assert torch.equal(whole, parts)
    assert not torch.equal(whole, PositionUniforms(10).take(0, 40))


def test_verify_chain_at_against_a_reference():
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        b, k, v = 3, int(torch.randint(0, 5, (1,), generator=g)), 5
        p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, -1)
        u = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
        drawn = sample_at(p, u)
        drafts = torch.where(torch.rand(b, k, generator=g) < 0.6, drawn[:, :k], torch.randint(0, v, (b, k), generator=g))
        out = verify_chain_at(p, drafts, u)
        for r in range(b):
            n = 0
            while n < k and int(drafts[r, n]) == int(drawn[r, n]):
                n += 1
            assert int(out.num_accepted[r]) == n
            assert out.committed(r) == drawn[r, : n + 1].tolist()


def test_verify_tree_at_follows_the_drawn_child():
    # root -> {3, 1}; 3 -> {2}; 1 -> {4, 0}
    tokens = torch.tensor([[3, 1, 2, 4, 0]])
    parents = torch.tensor([[-1, -1, 0, 1, 1]])
    d = depths(parents, tokens)
    v = 5
    for root_pick, child_pick, expect_path in [(1, 0, [1, 4]), (3, 2, [0, 2]), (3, 4, [0]), (2, 0, [])]:
        p = torch.zeros(1, 6, v)
        p[0, 0, root_pick] = 1.0  # the root's distribution is a point mass: the draw is forced
        for slot in range(1, 6):
            p[0, slot, child_pick] = 1.0
        u = torch.full((1, 3), 0.5, dtype=torch.float64)
        out = verify_tree_at(p, tokens, parents, d, u)
        assert int(out.num_accepted[0]) == len(expect_path)
        assert out.path[0, : len(expect_path)].tolist() == expect_path
        assert out.committed(0)[-1] == (root_pick if not expect_path else child_pick)


def _seeded(target, prompts, params, max_new, seeds, proposer=None, k=0, **kw):
    return [r.token_ids for r in generate(target, prompts, params, max_new, proposer=proposer, k=k, seeds=seeds, **kw)]


PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 5, 6, 7, 5], [9, 3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.mark.parametrize("kind, k", [("draft", 1), ("draft", 4), ("draft", "auto"), ("ngram", 3), ("suffix", 6), ("suffix", "auto"),
                                     ("suffix-tree", 6), ("suffix-tree", "auto")])
def test_seeded_speculation_equals_seeded_plain_decoding(unrelated_pair, kind, k, request):
    target, draft = unrelated_pair
    if kind == "suffix-tree":
        request.getfixturevalue("always_trees")  # trees although every row samples
    params = [SAMPLED, SamplingParams(0.7, top_k=10), SamplingParams(1.2, min_p=0.02)]
    seeds = [11, 12, 2**40]
    plain = [_seeded(target, [p], [params[i]], 30, [seeds[i]])[0] for i, p in enumerate(PROMPTS)]
    make = {"draft": lambda: DraftModelProposer(draft, 64), "ngram": lambda: NgramProposer(1, 3),
            "suffix": lambda: SuffixProposer(),  # chains: every row samples
            "suffix-tree": lambda: SuffixProposer()}[kind]
    assert _seeded(target, PROMPTS, params, 30, seeds, make(), k) == plain
    # the same rows in a larger batch, next to rows without a seed and another seeded row
    mixed = _seeded(target, [PROMPTS[2], [4, 4], PROMPTS[0], PROMPTS[1], [8]], [params[2], SAMPLED, params[0], params[1], SAMPLED],
                    30, [seeds[2], None, seeds[0], seeds[1], 99], make(), k)
    assert [mixed[2], mixed[3], mixed[0]] == plain


def test_seeded_rows_joining_a_running_batch(unrelated_pair):
    """Requests that join while others are mid-answer get the answers they get alone."""
    target, draft = unrelated_pair
    requests = [Request(p, SAMPLED, 25, seed=s) for p, s in zip(PROMPTS, [1, 2, 3])] + [Request([7, 7, 7], SAMPLED, 40, None)]
    alone = [_seeded(target, [r.prompt], [r.params], r.max_new_tokens, [r.seed])[0] for r in requests[:3]]
    engine = Engine(target, DraftModelProposer(draft, 80), capacity=80, k="auto", max_batch=3)
    rows = [engine.add(requests[3])]
    for r in requests[:3]:
        for _ in range(3):
            engine.step()
        rows.append(engine.add(r))  # joins after a few steps (and waits while the batch is full)
    while engine.busy:
        engine.step()
    assert [r.token_ids for r in rows[1:]] == alone


def test_cancel_frees_the_row_and_the_rest_go_on(unrelated_pair):
    target, _ = unrelated_pair
    greedy = SamplingParams(0.0)
    alone = _seeded(target, [PROMPTS[1]], [greedy], 20, [None])[0]
    engine = Engine(target, NgramProposer(), capacity=64, k=2)
    a, b = engine.add(Request(PROMPTS[0], greedy, 40)), engine.add(Request(PROMPTS[1], greedy, 20))
    engine.step()
    engine.cancel(a)
    engine.step()
    assert engine.cache.batch == 1 and a.finish_reason == "cancelled"
    while engine.busy:
        engine.step()
    assert b.token_ids == alone


V_SMALL = 6
N_SAMPLES = 100_000
LAW_PARAMS = SamplingParams(temperature=0.7, top_k=5)
PROMPT = [1, 4, 2]


def _law_counts(target, draft) -> tuple[torch.Tensor, float]:
    rows = generate(target, [PROMPT] * N_SAMPLES, LAW_PARAMS, 3, proposer=DraftModelProposer(draft, 16), k=2,
                    seeds=list(range(N_SAMPLES)))
    tokens = torch.tensor([r.token_ids for r in rows])  # [N, 3]
    counts = torch.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2], minlength=V_SMALL**3)
    return counts, rows[0].batch_metrics.acceptance.to_dict()["acceptance_rate"]


def test_seeded_first_three_tokens_follow_the_exact_target_law(small_pair):
    """Power: 10^5 samples over <= 216 cells; the negative control below fails with p < 1e-12."""
    target, draft = small_pair
    counts, acceptance = _law_counts(target, draft)
    assert 0.1 < acceptance < 0.95  # both branches (accepted draft, replacement draw) are exercised
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT, LAW_PARAMS, V_SMALL)) > ALPHA


def test_negative_control_one_uniform_for_every_position_fails(small_pair, monkeypatch):
    target, draft = small_pair
    original = PositionUniforms.take

    def reused(self, start, count):
        return original(self, 0, 1).expand(count)  # u_t = u_0: the positions are no longer independent

    monkeypatch.setattr(PositionUniforms, "take", reused)
    counts, _ = _law_counts(target, draft)
    assert chi_square_pvalue(counts, exact_joint(target, PROMPT, LAW_PARAMS, V_SMALL)) < 1e-12
