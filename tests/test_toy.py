"""The seed experiment: digit-for-digit reproduction, the batched fast mode, and the closed form."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.cli import main
from specdec.toy import MarkovPair, closed_form, run_fast, run_reference
from stats import ALPHA, chi_square_pvalue

SEED_LINES = [
    "tokens=100000 vocab=4 proposal_len=4",
    "baseline_vs_target_max_error=0.00635",
    "speculative_vs_target_max_error=0.00498",
    "baseline_vs_speculative_max_error=0.01029",
    "mean_accepted_draft_tokens_per_call=3.512",
    "target_calls_per_emitted_token=0.222",
]


def test_cli_reproduces_the_seed_digits(capsys):
    assert main(["toy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("python=")
    assert lines[1 : 1 + len(SEED_LINES)] == SEED_LINES


def test_cli_fast_json(capsys):
    assert main(["toy", "--fast", "--json", "--tokens", "20000"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in [
        "baseline_vs_target_max_error",
        "speculative_vs_target_max_error",
        "baseline_vs_speculative_max_error",
        "mean_accepted_draft_tokens_per_call",
        "target_calls_per_emitted_token",
    ]:
        assert isinstance(data[key], float)


def _sharp_pair() -> MarkovPair:
    g = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(6, 6, generator=g, dtype=torch.float64) * 2, -1)
    draft = torch.softmax(torch.randn(6, 6, generator=g, dtype=torch.float64) * 2, -1)
    return MarkovPair(target, draft)


@pytest.mark.parametrize("pair_name, k", [("seed", 1), ("seed", 4), ("sharp", 2), ("sharp", 8)])
def test_fast_mode_matches_closed_form_within_3_standard_errors(pair_name, k):
    pair = MarkovPair.seed() if pair_name == "seed" else _sharp_pair()
    result = run_fast(pair, tokens=400_000, k=k, streams=4000)
    exact = closed_form(pair, k)
    se = result.accepted_per_call_stderr
    assert 0 < se < 0.02
    assert abs(result.mean_accepted_draft_tokens_per_call - exact.expected_accepted_per_call) < 3 * se
    assert abs(result.target_calls_per_emitted_token - exact.target_calls_per_token) < 3 * result.calls_per_token_stderr + 1e-3


def test_closed_form_is_not_trivially_matched():
    """Power check: the figures for the wrong k are many standard errors away."""
    pair = MarkovPair.seed()
    result = run_fast(pair, tokens=400_000, k=4, streams=4000)
    wrong = closed_form(pair, 3).expected_accepted_per_call
    assert abs(result.mean_accepted_draft_tokens_per_call - wrong) > 10 * result.accepted_per_call_stderr


def test_closed_form_edge_cases():
    pair = MarkovPair.seed()
    assert closed_form(pair, 0).expected_accepted_per_call == 0.0
    same = MarkovPair(pair.target, pair.target.clone())
    assert closed_form(same, 5).expected_accepted_per_call == pytest.approx(5.0)


def test_markov_run_through_verify_chain_matches_target_transitions():
    """A full Markov run driven by verify_chain: per previous-token next-token counts vs the target."""
    pair = _sharp_pair()
    result = run_fast(pair, tokens=300_000, k=4, streams=3000)
    assert result.speculative_vs_target_max_error < 0.01
    counts = torch.tensor(result.extra["speculative_transition_counts"])
    for row in range(pair.vocab):
        assert chi_square_pvalue(counts[row], pair.target[row]) > ALPHA


def test_reference_and_fast_agree_on_a_small_run():
    ref = run_reference(tokens=20_000)
    fast = run_fast(tokens=20_000)
    assert abs(ref.mean_accepted_draft_tokens_per_call - fast.mean_accepted_draft_tokens_per_call) < 0.1
