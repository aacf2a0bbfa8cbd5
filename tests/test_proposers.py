"""Every proposer keeps the engine exact: greedy identity and the exact joint law."""

from __future__ import annotations

import pytest
import torch

import specdec.verify.chain as verify_module
from specdec.core.engine import generate
from specdec.proposers import DraftModelProposer, HybridProposer, NgramProposer, SuffixProposer
from specdec.proposers.ngram import NgramIndex
from stats import ALPHA, chi_square_pvalue
from tiny_models import GREEDY, N_SAMPLES, PARAMS, PROMPT, PROMPTS, V_SMALL, draft_step, hf_tiny, law_joint, ours


def test_ngram_index_finds_latest_longest_match():
    index = NgramIndex(2, 3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    # suffix (7, 2, 3) never occurred; (2, 3) last occurred at positions 5-6, followed by 4, 5
    assert index.lookup(3) == [4, 5, 7]
    index.extend([4])
    assert index.lookup(2) == [5, 7]  # (2, 3, 4) matched
    empty = NgramIndex(2, 3)
    empty.extend([1, 2, 3])
    assert empty.lookup(4) == []


def test_ngram_proposer_pads_rows_without_match():
    p = NgramProposer(2, 2)
    states = p.add([[1, 2, 5, 1, 2], [7, 8, 9]])
    proposal = draft_step(p, states, [[], []], 3)
    assert proposal.probs is None
    assert proposal.tokens.tolist() == [[5, 1, 2], [9, 9, 9]]


def _make(kind, target, draft, capacity):
    if kind == "ngram":
        return NgramProposer(1, 3)
    if kind == "early-exit":
        return DraftModelProposer(target.truncated(1), capacity)
    if kind == "hybrid":
        return HybridProposer(NgramProposer(1, 3), DraftModelProposer(draft, capacity))
    if kind == "hybrid-copy":  # the API's hybrids: the suffix proposer's chains as the lookup side
        lookup = SuffixProposer(min_match=1, max_match=3, tree_mode="chains")
        return HybridProposer(lookup, DraftModelProposer(draft, capacity))
    if kind == "pruned":  # FR-Spec: logits for all ids but the last (never drafted); any rows are exact
        ids = torch.arange(draft.vocab_size - 1)
        return DraftModelProposer(draft.with_output_rows(draft.embed[ids].float()), capacity,
                                  vocab_ids=ids, vocab_size=draft.vocab_size)
    return DraftModelProposer(draft, capacity)


REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 1, 2, 3, 1], [4, 4, 4, 4], [9, 3, 9, 3, 9]]


@pytest.mark.parametrize("kind", ["ngram", "early-exit", "hybrid", "hybrid-copy", "draft", "pruned"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_identity_for_every_proposer(pair, kind, k):
    target, draft = pair
    prompts = PROMPTS + REPETITIVE
    plain = generate(target, prompts, GREEDY, 30)
    proposer = _make(kind, target, draft, 64)
    spec = generate(target, prompts, GREEDY, 30, proposer=proposer, k=k, k_max=6)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_pruned_draft_never_drafts_ids_outside_its_subset(pair):
    target, draft = pair
    proposer = _make("pruned", target, draft, 64)
    states = proposer.add([[1, 2, 3]])
    proposal = draft_step(proposer, states, [[4]], 4, PARAMS, torch.Generator().manual_seed(0))
    assert proposal.probs.shape[-1] == draft.vocab_size
    assert bool((proposal.probs[..., -1] == 0).all()) and bool((proposal.tokens < draft.vocab_size - 1).all())
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(1, 4))


def test_ngram_accepts_on_repetitive_text(pair):
    target, _ = pair
    # greedy decoding of a tiny random model falls into loops, which the n-gram proposer predicts
    spec = generate(target, REPETITIVE, GREEDY, 60, proposer=NgramProposer(1, 3), k=4)
    acc = spec[0].batch_metrics.acceptance
    assert acc.accepted > 0.5 * acc.drafted > 0


def _proposer_joint_counts(kind):
    """Counts of the first three tokens over 10^5 sampled continuations, and the exact target law."""
    target = ours(hf_tiny("llama", vocab=V_SMALL, seed=3), "int8")
    draft = ours(hf_tiny("llama", vocab=V_SMALL, seed=4, layers=1), "int8")
    proposer = _make(kind, target, draft, 16)
    rows = generate(target, [PROMPT] * N_SAMPLES, PARAMS, 3, proposer=proposer, k=2, seed=21)
    tokens = torch.tensor([r.token_ids for r in rows])  # [N, 3]
    counts = torch.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2], minlength=V_SMALL**3)
    acc = rows[0].batch_metrics.acceptance
    assert 0 < acc.accepted < acc.drafted  # both verifier branches exercised
    return counts, law_joint(target)


@pytest.mark.parametrize("kind", ["ngram", "early-exit", "hybrid", "hybrid-copy", "pruned"])
def test_exact_joint_law_for_every_proposer(kind):
    """Power: 10^5 samples over 216 cells; each proposer's own negative control below fails."""
    counts, joint = _proposer_joint_counts(kind)
    assert chi_square_pvalue(counts, joint) > ALPHA


@pytest.mark.parametrize("kind", ["ngram", "early-exit", "hybrid", "hybrid-copy", "pruned"])
def test_negative_control_for_every_proposer(kind, monkeypatch):
    """The same test with a wrong verifier (after a rejection, sample from p instead of the residual)
    must fail for each proposer: with n-gram's one-hot drafts the rejected token can then be drawn
    again, with model drafts the residual's correction is lost."""
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q, tolerance=1e-6: p)
    counts, joint = _proposer_joint_counts(kind)
    assert chi_square_pvalue(counts, joint) < ALPHA


def test_a_long_prompt_is_prefilled_by_the_draft_in_chunks_with_the_bits_of_one_call():
    """DraftModelProposer.add prefills in chunks of STEP_TOKENS (a long prompt's intermediates
    stay a chunk's size): ragged prompts of 300 and 450 tokens leave the cache of one call, bit
    for bit, and the proposer drafts on from it."""
    from specdec.core.prefill import STEP_TOKENS
    from specdec.verify.sampling import SamplingMetadata

    draft = ours(hf_tiny("qwen2", seed=3), "int8")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (300, 450)]
    assert max(map(len, prompts)) > STEP_TOKENS
    proposer = DraftModelProposer(draft, 480)
    states = proposer.add(prompts)
    one = draft.new_cache(2, 480)
    padded = torch.tensor([p + [0] * (450 - len(p)) for p in prompts])
    draft(padded, one, logit_index=torch.zeros(2, 1, dtype=torch.long))
    one.truncate(torch.tensor([300, 450]))
    assert torch.equal(proposer.cache.lengths, one.lengths)
    for row, n in enumerate((300, 450)):
        assert torch.equal(proposer.cache.k[:, row, :, :n], one.k[:, row, :, :n])
        assert torch.equal(proposer.cache.v[:, row, :, :n], one.v[:, row, :, :n])
    proposer.feed(states, [[p[-1]] for p in prompts])
    drafts = proposer.propose(states, 3, False, SamplingMetadata([GREEDY, GREEDY], torch.Generator()))
    assert drafts.tokens.shape == (2, 3)
