"""The reference step (specdec/core/reference.py) as the batched engine's oracle: one row, the
same seed and fixed k, token-identical output, greedy and sampled, for each kind of proposer.

Power: every comparison is token-for-token over up to 40 new tokens on 4 prompts, so a single
token the engine commits differently fails it; with a sampled draft model ~25% of the drafts are
rejected here, so the residual and the bonus paths are taken too (asserted). Negative control: the
reference with a wrong verifier (every draft accepted) must differ from the engine on the same runs.
"""

from __future__ import annotations

import pytest
import torch

import specdec.core.reference as reference
from specdec.core.engine import generate
from specdec.core.reference import reference_generate
from specdec.proposers import HybridProposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.head import HeadProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.verify.chain import ChainVerification
from specdec.verify.sampling import SamplingParams
from tiny_models import GREEDY, PROMPTS, tiny_head

SAMPLED = SamplingParams(temperature=0.9, top_k=20)
K, NEW = 3, 40


def _proposers(target, draft):
    head = tiny_head(target, 64, seed=1)
    return {
        "draft model": lambda: DraftModelProposer(draft, 128),
        "draft head": lambda: HeadProposer(head, 128),
        "n-gram": lambda: NgramProposer(1, 3),
        "hybrid (suffix, draft model)": lambda: HybridProposer(SuffixProposer(tree_mode="chains"),
                                                                DraftModelProposer(draft, 128)),
    }


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["plain", "draft model", "draft head", "n-gram", "hybrid (suffix, draft model)"])
def test_the_engine_commits_what_the_reference_step_commits(pair, kind, params):
    target, draft = pair
    make = _proposers(target, draft).get(kind)
    for seed, prompt in enumerate(PROMPTS):
        engine = generate(target, [prompt], params, NEW, proposer=make() if make else None, k=K if make else 0,
                          k_max=K, seed=seed)[0]
        assert engine.token_ids == reference_generate(target, make() if make else None, prompt, params, NEW,
                                                      K if make else 0, seed=seed), (kind, prompt)
        if kind == "draft model" and params is SAMPLED:
            acc = engine.metrics.acceptance
            assert 0 < acc.accepted < acc.drafted  # some drafts rejected: the residual path ran


def test_a_batch_commits_per_row_what_the_reference_step_commits_alone(pair):
    """Greedy rows of one batch (drafts from one draft model): each row's output is its own run."""
    target, draft = pair
    batch = generate(target, PROMPTS, GREEDY, NEW, proposer=DraftModelProposer(draft, 128), k=K, k_max=K)
    for prompt, row in zip(PROMPTS, batch):
        assert row.token_ids == reference_generate(target, DraftModelProposer(draft, 128), prompt, GREEDY, NEW, K)


def test_the_reference_stops_after_an_end_token_as_the_engine_does(pair):
    target, _ = pair
    plain = reference_generate(target, None, PROMPTS[0], GREEDY, NEW, 0)
    eos = frozenset({plain[5]})
    cut = reference_generate(target, None, PROMPTS[0], GREEDY, NEW, 0, eos=eos)
    engine = generate(target, [PROMPTS[0]], GREEDY, NEW, eos_token_ids=eos)[0]
    assert cut == engine.token_ids == plain[: plain.index(plain[5]) + 1]


def test_negative_control_a_wrong_verifier_in_the_reference_is_caught(pair, monkeypatch):
    """Accept every draft (no p/q test, the bonus token always): the comparison must fail."""
    target, draft = pair

    def accept_all(p, q, drafts, generator):
        batch, k = drafts.shape
        bonus = torch.multinomial(p[:, k], 1, generator=generator)  # [B, 1]
        return ChainVerification(torch.full((batch,), k), torch.cat([drafts, bonus], 1))

    monkeypatch.setattr(reference, "verify_chain", accept_all)
    differ = 0
    for seed, prompt in enumerate(PROMPTS):
        engine = generate(target, [prompt], SAMPLED, NEW, proposer=DraftModelProposer(draft, 128), k=K, k_max=K,
                          seed=seed)[0]
        differ += engine.token_ids != reference_generate(target, DraftModelProposer(draft, 128), prompt, SAMPLED,
                                                         NEW, K, seed=seed)
    assert differ >= 3
