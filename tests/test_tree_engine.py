"""Candidate trees through the engine: tree proposers (suffix lookup, the draft head's dynamic
trees), greedy identity, the exact joint law at T = 0.7 with its negative control, cache
compaction, pruning and the tree budget controller."""

from __future__ import annotations

import pytest
import torch

import specdec.verify.tree as tree_module
from specdec.core.adaptive import CallCosts, TreeBudget
from specdec.core.blocks import TreeBlock
from specdec.core.engine import Engine, generate
from specdec.core.rows import Request
from specdec.proposers import HybridProposer
from specdec.proposers.base import Proposal, tree_shape
from specdec.proposers.head import HeadTreeProposer
from specdec.proposers.suffix import SuffixHistory, SuffixIndex, SuffixProposer, best_path, build_tree
from specdec.verify.sampling import SamplingMetadata, SamplingParams, probs_from_logits
from specdec.verify.tree import TreeVerification, verify_tree
from stats import ALPHA, chi_square_pvalue
from tiny_models import draft_step, exact_joint, hf_tiny, ours, tiny_head

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 4, 5], [7, 8, 9, 7, 8, 9, 7], [3]]


@pytest.fixture(scope="module")
def target():
    return ours(hf_tiny("qwen2", seed=0), "int8")


def _proposers(target):
    head = tiny_head(target, 64, seed=1)
    return {
        "suffix": lambda: SuffixProposer(min_match=1),
        "head-tree": lambda: HeadTreeProposer(head, 96, width=3, depth=4),
        "hybrid-tree": lambda: HybridProposer(SuffixProposer(), HeadTreeProposer(head, 96, width=2, depth=3)),
    }


@pytest.mark.parametrize("kind", ["suffix", "head-tree", "hybrid-tree"])
@pytest.mark.parametrize("k", [1, 4, 9, "auto"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_is_token_identical_to_plain_decoding(target, kind, k, batch):
    prompts = PROMPTS[:batch]
    plain = generate(target, prompts, GREEDY, 40)
    spec = generate(target, prompts, GREEDY, 40, proposer=_proposers(target)[kind](), k=k, k_max=9)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    if kind != "head-tree":  # (this untrained head's candidates are never accepted: test_head.py's
        # test_trained_head_trees_are_accepted_and_token_identical covers head trees with accepted drafts)
        assert spec[0].batch_metrics.acceptance.accepted > 0  # not plain decoding in disguise
    if kind == "suffix" and k != 1:  # the repetitive prompts are predicted: fewer target calls
        assert spec[0].batch_metrics.target_calls < plain[0].batch_metrics.target_calls


def test_trees_are_used_and_bushy(target):
    """The head's trees really branch (more nodes than depth), and the stats say so."""
    spec = generate(target, PROMPTS, GREEDY, 24, proposer=_proposers(target)["head-tree"](), k=9)
    acc = spec[0].batch_metrics.acceptance
    assert acc.calls > 0 and acc.scored > acc.drafted  # nodes scored > depth positions


# -- exactness under sampling ---------------------------------------------------------------------
V_SMALL, N_SAMPLES = 6, 100_000
PARAMS = SamplingParams(temperature=0.7, top_k=5)
PROMPT = [1, 4, 2]


@pytest.fixture(scope="module")
def small():
    return ours(hf_tiny("llama", vocab=V_SMALL, seed=3), "int8")


def _counts(target, proposer, k):
    # 4 tokens, of which the first 3 are counted: the step after the first token then drafts
    # trees of depth 2 (a step drafts at most one token fewer than the row still needs)
    rows = generate(target, [PROMPT] * N_SAMPLES, PARAMS, 4, proposer=proposer, k=k, seed=11)
    tokens = torch.tensor([r.token_ids[:3] for r in rows])  # [N, 3]
    counts = torch.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2], minlength=V_SMALL**3)
    return counts, rows[0].batch_metrics.acceptance


def _small_tree_proposer(target):
    # 5 of 6 ids in the head's vocabulary: one id is never a candidate; 2 children per node, depth 2
    return HeadTreeProposer(tiny_head(target, 5, seed=2), 16, width=2, depth=2)


def test_first_three_tokens_follow_the_exact_target_law(small, always_trees):
    """Power: 10^5 samples over <= 216 cells (every committed position of the first three); the
    negative control below, the same run with a verifier that does not update the target
    distribution after a rejected sibling, fails with p < 1e-12."""
    counts, acc = _counts(small, _small_tree_proposer(small), 4)
    assert acc.scored > acc.drafted  # real trees (siblings) were verified
    assert 0.1 < acc.accepted / acc.drafted < 0.95  # acceptance and rejection both happen
    assert chi_square_pvalue(counts, exact_joint(small, PROMPT, PARAMS, V_SMALL)) > ALPHA


def test_negative_control_without_the_sibling_residual_fails(small, monkeypatch, always_trees):
    monkeypatch.setattr(tree_module, "residual_distribution", lambda p, q, tolerance=1e-6: p)
    counts, _ = _counts(small, _small_tree_proposer(small), 4)
    assert chi_square_pvalue(counts, exact_joint(small, PROMPT, PARAMS, V_SMALL)) < 1e-12


def test_seeded_sampling_with_trees_is_reproducible(target, always_trees):
    params = SamplingParams(temperature=0.8)
    head = tiny_head(target, 64, seed=1)
    runs = [generate(target, PROMPTS, params, 30, proposer=HeadTreeProposer(head, 96, width=3, depth=4),
                     k=6, seed=5) for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert runs[0][0].batch_metrics.acceptance.scored > runs[0][0].batch_metrics.acceptance.drafted  # trees


# -- tree proposers draft chains while every row samples --------------------------------------------
def test_tree_proposers_draft_chains_while_every_row_samples(target):
    """All rows sampled: chains (a tree's extra nodes measured slower at T > 0: docs/CHANGELOG.md, 'all layers in one call'); any greedy
    row: trees. The engine decides the shape (tree_shape), the same for a hybrid's two sides."""
    proposers = _proposers(target)
    sampled = generate(target, PROMPTS, SamplingParams(temperature=0.7), 24, proposer=proposers["hybrid-tree"](), k=6, seed=1)
    acc = sampled[0].batch_metrics.acceptance
    assert acc.calls > 0 and acc.scored == acc.drafted  # chains: one token scored per drafted position
    for kind in ("suffix", "head-tree", "hybrid-tree"):
        mode = proposers[kind]().tree_mode
        assert mode == "trees"
        sampled, greedy = [SamplingParams(temperature=0.7)], [SamplingParams(temperature=0.0)]
        both = SamplingMetadata(sampled + greedy)
        assert not tree_shape(mode, True, SamplingMetadata(sampled))
        assert tree_shape(mode, True, both)
        assert not tree_shape(mode, False, both)  # the engine's ShapeRace asks for chains
        assert not tree_shape("chains", True, SamplingMetadata(greedy))


def test_greedy_rows_stay_identical_when_the_batch_switches_to_chains(target):
    """A greedy row that finishes first leaves only sampled rows: the proposer switches from trees
    to chains mid-run (its head cache and queues carry over); the greedy row equals plain
    decoding and the sampled rows carry on."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)]
    engine = Engine(target, _proposers(target)["hybrid-tree"](), capacity=96, k="auto", k_max=6)
    greedy = engine.add(Request(PROMPTS[0], params[0], 10, None))
    sampled = engine.add(Request(PROMPTS[1], params[1], 30, None))
    while engine.busy:
        engine.step()
    assert greedy.token_ids == generate(target, [PROMPTS[0]], GREEDY, 10)[0].token_ids
    assert len(sampled.token_ids) == 30
    assert {key.split(":")[1] for key in engine.controllers} == {"tree", "chain"}
    assert any(set(race.seconds) == {True, False} for race in engine.races.values())  # a race measured both shapes
    # one measure of what a call costs, learned from every source's and shape's calls
    assert all(c.verify_cost is engine.call_costs for c in engine.controllers.values())
    assert len(engine.call_costs.shape) >= 2


def test_suffix_best_path_follows_the_most_frequent_children():
    assert best_path([1, 2, 3, 4], [-1, 0, 0, 1], [1.0, 0.25, 0.75, 0.25]) == [1, 3]
    assert best_path([], [], []) == []
    proposer = SuffixProposer(min_match=1)
    states = proposer.add([[5, 6, 7, 5, 6, 8, 5, 6, 7, 5]])
    chain = draft_step(proposer, states, [[]], 3, SamplingParams(temperature=0.9), torch.Generator())
    assert not chain.is_tree and chain.tokens.tolist() == [[6, 8, 5]]  # after the longest earlier match "5 6 7 5"


def test_the_chains_of_a_tree_proposer_follow_the_exact_target_law(small):
    """The chain mode (every row sampled) through the tree proposer: the first three tokens'
    joint law, 10^5 samples (the chain verifier's negative controls are in test_exactness)."""
    counts, acc = _counts(small, HeadTreeProposer(tiny_head(small, 5, seed=2), 16, width=2, depth=2), 4)
    assert acc.scored == acc.drafted and 0.1 < acc.accepted / acc.drafted < 0.95
    assert chi_square_pvalue(counts, exact_joint(small, PROMPT, PARAMS, V_SMALL)) > ALPHA


# -- the head's tree drafting, the cache, pruning ---------------------------------------------------
def test_head_tree_candidates_are_the_heads_own_best_guesses(target):
    """Level 1 of the tree = the head's top-`width` tokens at the root; a chain head with the same
    weights drafts the first of them greedily; scores never increase down the tree."""
    from specdec.proposers.head import HeadProposer

    head = tiny_head(target, 64, seed=1)
    prompt = [[4, 8, 15, 16, 23, 42]]
    hidden = target(torch.tensor(prompt), target.new_cache(1, 32), return_hidden=True)[1]
    tree = HeadTreeProposer(head, 32, width=3, depth=3, min_score=0.0)  # (an untrained head is unsure)
    chain = HeadProposer(head, 32)
    t = draft_step(tree, tree.add(prompt, target_hidden=hidden), [[7]], 9, tree=True)
    c = draft_step(chain, chain.add(prompt, target_hidden=hidden), [[7]], 3)
    roots = t.tokens[0][t.parents[0] == -1]
    assert c.tokens[0, 0] == roots[0]
    assert roots.numel() == 3
    par = t.parents[0]
    has = par >= 0
    assert bool((t.scores[0][has] <= t.scores[0][par[has]] + 1e-6).all())
    # the deepest path the chain drafted is in the tree when the tree keeps its best branch
    first_child = t.tokens[0][(par == int(torch.nonzero(t.tokens[0] == c.tokens[0, 0])[0]))]
    assert int(c.tokens[0, 1]) in first_child.tolist()


def test_compaction_after_a_tree_step_equals_fresh_computation(target):
    """One engine tree step whose accepted branch is out of place (a rejected sibling first):
    after compaction the cache's committed K/V equal a fresh prefill of the committed text, bit
    for bit (int8), and the next logits agree."""
    prompt = [5, 9, 14, 2, 7, 31, 40]
    a, b, c = generate(target, [prompt], GREEDY, 3)[0].token_ids
    wrong = lambda t: (t + 1) % target.vocab_size  # noqa: E731
    tokens = torch.tensor([[wrong(a), a, wrong(b), b, c]])
    parents = torch.tensor([[-1, -1, 1, 1, 3]])  # accepted path: nodes 1 -> 3 -> 4
    cache = target.new_cache(1, 64)
    target(torch.tensor([prompt[:-1]]), cache)
    before = cache.lengths.clone()
    proposal = Proposal(tokens, None, parents=parents, scores=torch.ones(1, 5))
    logits, _ = TreeBlock(proposal).score(target, cache, torch.tensor([prompt[-1]]), False)
    result = verify_tree(probs_from_logits(logits, GREEDY), None, tokens, parents)
    assert result.path.tolist() == [[1, 3, 4]]
    last, _ = TreeBlock(proposal).commit_kv(cache, before, result, None)
    committed = prompt + [a, b, c]
    fresh = target.new_cache(1, 64)
    target(torch.tensor([committed]), fresh)
    n = len(committed)
    assert cache.lengths.tolist() == [n]
    assert torch.equal(cache.k[:, :, :, :n], fresh.k[:, :, :, :n]) and torch.equal(cache.v[:, :, :, :n], fresh.v[:, :, :, :n])
    assert torch.equal(target(last.view(1, 1), cache), target(last.view(1, 1), fresh))


def test_prune_keeps_a_valid_tree_of_the_best_nodes():
    tokens = torch.tensor([[10, 11, 12, 13, 14, -1]])
    parents = torch.tensor([[-1, -1, 0, 0, 2, -1]])
    scores = torch.tensor([[0.6, 0.3, 0.5, 0.05, 0.4, 0.0]])
    p = Proposal(tokens, None, parents=parents, scores=scores)
    kept = p.prune(3)
    assert kept.tokens.tolist() == [[10, 12, 14]]
    assert kept.parents.tolist() == [[-1, 0, 1]]
    assert p.prune(0).size == 0 and p.prune(9) is p
    bad = Proposal(tokens, None, parents=parents, scores=torch.tensor([[0.1, 0.3, 0.5, 0.0, 0.4, 0.0]]))
    with pytest.raises(ValueError, match="parent"):
        bad.prune(2)
    sampled = Proposal(tokens, torch.full((1, 7, 20), 0.05), parents=parents, scores=scores)
    with pytest.raises(ValueError, match="bias"):  # keeping a sampled node by its own value biases it
        sampled.prune(3)


def test_suffix_tree_merges_continuations_by_frequency():
    tokens, parents, scores, _ = build_tree([[1, 2, 3], [1, 2, 4], [1, 5], [6]], budget=4)
    # the 4 heaviest nodes (ties: the earlier), breadth first: 1 (3 of 4), 2 (2 of 4), 3 and 4 (1 each)
    assert tokens == [1, 2, 3, 4] and parents == [-1, 0, 1, 1] and scores == [0.75, 0.5, 0.25, 0.25]
    tokens, parents, scores, states = build_tree([[7, 8], [9]], budget=3, weights=[3.0, 1.0],
                                                 states=[["a", "b"], ["c"]])
    assert tokens == [7, 9, 8] and scores == [0.75, 0.25, 0.75] and states == ["a", "c", "b"]
    index = SuffixIndex(4)
    index.extend([1, 2, 3, 9, 1, 2, 4, 9, 1, 2])
    assert index.continuations((1, 2), 2, 8, before=9) == [[4, 9], [3, 9]]


def test_suffix_proposer_learns_from_finished_outputs(target):
    """The shared history: a request whose text another request produced before is predicted."""
    proposer = SuffixProposer(min_match=2)
    first = generate(target, [[3, 1, 4, 1, 5]], GREEDY, 30, proposer=proposer, k=6)
    again = generate(target, [[3, 1, 4, 1, 5]], GREEDY, 30, proposer=proposer, k=6)
    assert again[0].token_ids == first[0].token_ids
    assert again[0].batch_metrics.target_calls < first[0].batch_metrics.target_calls


def test_tree_budget_prefers_nodes_that_pay(target):
    budget = TreeBudget(8)
    budget.verify_cost = CallCosts.measured({1: 1.0, 9: 1.8})
    tokens = torch.arange(8).unsqueeze(0)
    parents = torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6]])
    sure = Proposal(tokens, None, parents=parents, scores=torch.ones(1, 8))
    hopeless = Proposal(tokens, None, parents=parents, scores=torch.full((1, 8), 1e-4))
    assert budget.nodes(sure) == 8
    assert budget.nodes(hopeless) == 0
    # after a step that accepted nothing at depth 1 with confident scores, calibration drops
    result = TreeVerification(torch.tensor([0]), torch.tensor([[1]]), torch.full((1, 8), -1))
    for _ in range(100):  # (forgetting 0.97: the estimates settle within ~100 steps)
        budget.observe_step(sure, result, 0.0, 1.8, caught_up=False)
    assert budget.calibration(1) < 0.1
    assert all(budget.nodes(sure) == 0 for _ in range(20))  # (the gain's average settles below 1)
    assert budget.gain < 1
    assert [budget.choose() for _ in range(8)] == [0] * 7 + [8]  # drafting pauses, with a probe


def test_suffix_history_is_bounded_and_never_matches_across_outputs():
    history = SuffixHistory(max_match=4, max_tokens=40)
    for i in range(30):
        history.add([i, i + 1, i + 2])
    assert len(history.index.tokens) <= 40
    assert history.index.continuations((29, 30), 3, 8) == [[31]]  # cut at the output's end
    assert history.index.continuations((2,), 3, 8) == []  # the oldest outputs were dropped
    assert history.index.continuations((31, -1), 3, 8) == []  # no n-gram spans a separator


# -- the suffix proposer's copy cursor, re-entry points and learned replacements -------------------
class _OneRow:
    """A suffix proposer with one row, called as the engine calls it (the row's state kept here)."""

    def __init__(self, prompt, **options):
        self.proposer = SuffixProposer(**options)
        self.states = self.proposer.add([prompt])

    @property
    def row(self):
        return self.states[0]

    def feed(self, pending):
        self.proposer.feed(self.states, pending)

    def lookup(self, k):
        return self.proposer.lookup(self.states, k)


def _copy_proposer(prompt):
    return _OneRow(prompt)


def _best(proposal) -> list[int]:
    tokens, parents, scores = (proposal.tokens[0].tolist(), proposal.parents[0].tolist(), proposal.scores[0].tolist())
    return best_path(tokens, parents, scores)


def test_suffix_proposer_follows_the_copy_it_is_making():
    """A 10-token segment occurs twice, followed by 60 the first time and 61 the second. Copying
    the first occurrence, the context's longest suffix the index keeps (8 tokens) matches both
    and the latest would win a lookup; the copy's cursor knows the text continues with 60."""
    seg = list(range(1, 11))
    source = [50] + seg + [60] + [51] + seg + [61] + [99]
    lookup_only = _OneRow(source + seg)
    assert _best(lookup_only.lookup(1)) == [61]
    proposer = _copy_proposer(source + [50, 1])
    proposer.feed([[]])
    assert _best(proposer.lookup(4)) == [2, 3, 4, 5]  # "50 1": the first occurrence only
    proposer.feed([seg[1:]])  # accepted: 2 3 4 5, then the text goes on copying
    assert _best(proposer.lookup(2)) == [60, 51]


def test_suffix_proposer_reenters_the_source_after_a_replacement_and_learns_it():
    """A rename: the source says `cfg` (token 50) twice; the answer writes 60 61 instead. After
    the first occurrence the copy comes back one source token on (a re-entry point), and the
    second occurrence is drafted already renamed; the raw copy stays in the tree as a sibling,
    and a rule the text does not follow is dropped."""
    source = [10, 11, 12, 50, 13, 14, 15, 16, 17, 50, 18, 19, 20]
    proposer = _copy_proposer(source + [10, 11])
    proposer.feed([[]])
    assert _best(proposer.lookup(4)) == [12, 50, 13, 14]
    proposer.feed([[12, 60, 61]])  # 12 copied, then the copy breaks off at 50 (position 3)
    reentry = proposer.lookup(8)
    assert 13 in reentry.tokens[0].tolist()  # source position 4: one token skipped
    proposer.feed([[13, 14]])  # the text is back at the source: 50 -> 60 61 learned
    assert proposer.row.rules == {(50,): (60, 61)}
    tree = proposer.lookup(16)
    assert _best(tree)[:6] == [15, 16, 17, 60, 61, 18]
    assert 50 in tree.tokens[0].tolist()  # the unreplaced copy as an alternative
    proposer.feed([[15, 16, 17, 50]])  # this time the source stayed: the rule is dropped
    assert proposer.row.rules == {}
    assert _best(proposer.lookup(3)) == [18, 19, 20]


def test_suffix_proposer_scores_a_longer_copy_as_more_certain():
    """Laplace's rule of succession along the copy: after r agreeing tokens, depth d scores
    (r+1)/(r+1+d) of the copy's weight; a longer run scores every depth higher, and scores never
    increase down the tree (what pruning needs)."""
    source = list(range(100, 140))
    short, long_ = _copy_proposer(source + [100, 101]), _copy_proposer(source + [100, 101])
    for proposer, accepted in ((short, source[2:3]), (long_, source[2:30])):
        proposer.feed([[]])
        proposer.lookup(len(accepted))
        proposer.feed([accepted])  # the drafted copy, accepted: 3 and 30 tokens of agreement
    a, b = short.lookup(5), long_.lookup(5)
    assert a.parents[0].tolist() == [-1, 0, 1, 2, 3] == b.parents[0].tolist()
    sa, sb = a.scores[0].tolist(), b.scores[0].tolist()
    assert all(x < y for x, y in zip(sa, sb))
    assert sa == sorted(sa, reverse=True) and sb == sorted(sb, reverse=True)


def test_call_costs_are_learned_by_every_engine_that_is_given_them(target):
    """The target's call costs outlive an engine: plain decoding measures one position's call,
    a fixed k measures k + 1 positions, and an adaptive-k engine given the same object starts
    from those sizes instead of the prior (a cold start cost adaptive k 3-6% at 7B)."""
    costs = CallCosts()
    plain = generate(target, [PROMPTS[1]], GREEDY, 6, call_costs=costs)[0].token_ids
    assert set(costs.shape) == {1}
    fixed = generate(target, [PROMPTS[0]], GREEDY, 12, proposer=SuffixProposer(min_match=1), k=3, call_costs=costs)
    assert 4 in costs.shape  # (and shorter blocks where the suffix found fewer)
    known = dict(costs.shape)
    engine = Engine(target, SuffixProposer(min_match=1), capacity=96, k="auto", k_max=3, call_costs=costs)
    assert engine.call_costs is costs
    row = engine.add(Request(PROMPTS[1], GREEDY, 6, None))
    while engine.busy:
        engine.step()
    assert row.token_ids == plain
    assert set(known) <= set(costs.shape)
    assert fixed[0].token_ids == generate(target, [PROMPTS[0]], GREEDY, 12)[0].token_ids
