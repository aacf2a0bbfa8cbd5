"""``specdec verify`` and the library check behind it, on tiny random models.

Power: the negative control (residual replaced by p) is rejected at alpha = 1e-3 in every run
here, and an engine whose verifier is broken the same way is reported "NOT exact"."""

from __future__ import annotations

import json


import specdec.verify.chain as verify_module
from specdec.cli import main
from specdec.exactness import exact_joint_law, verify_deployment
from specdec.proposers import DraftModelProposer
from specdec.verify.sampling import SamplingParams
from tiny_models import hf_tiny, save_hf_dir
from conftest import fresh_home

PROMPTS = [[1, 2, 3], [7, 8, 9, 10]]


def _check(unrelated_pair, **kw):
    target, draft = unrelated_pair
    return verify_deployment(target, lambda capacity: DraftModelProposer(draft, capacity), "draft", PROMPTS,
                             k=2, samples=1000, greedy_tokens=12, **kw)


def test_exact_law_sums_to_one_over_top_k_cells(unrelated_pair):
    law = exact_joint_law(unrelated_pair[0], PROMPTS[0], SamplingParams(temperature=0.8, top_k=3), 3)
    assert len(law) == 27 and abs(sum(law.values()) - 1) < 1e-6  # fp32 conditionals


def test_a_correct_engine_is_shown_exact_and_its_control_rejected(unrelated_pair):
    report = _check(unrelated_pair)
    assert report.greedy_identical == len(PROMPTS)
    assert report.law.p_value >= report.alpha
    assert report.law.drafted > 0 and report.law.accepted < report.law.drafted
    assert report.negative_control.p_value < report.alpha
    assert report.power_vs_control > 0.9
    assert report.verdict == "exact"


def test_a_broken_verifier_is_reported_not_exact(unrelated_pair, monkeypatch):
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q, tolerance=1e-6: p)
    report = _check(unrelated_pair)
    assert report.law.p_value < report.alpha
    assert report.verdict == "NOT exact"


def test_cli_verify_json_and_exit_code(tmp_path, monkeypatch, capsys):
    fresh_home(tmp_path, monkeypatch)
    target = save_hf_dir(hf_tiny("qwen2", seed=0), tmp_path / "target")
    draft = save_hf_dir(hf_tiny("qwen2", seed=5, layers=1), tmp_path / "draft")
    code = main(["verify", "--target", str(target), "--draft", str(draft), "--k", "2", "--samples", "600",
                 "--prompt", "abc", "--prompt", "x = 1", "--greedy-tokens", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["verdict"] == "exact" and out["greedy_identical"] == 2
    assert main(["verify", "--target", str(target)]) == 2  # nothing to verify: a usage error


def test_power_of_the_chi_square_test():
    from specdec.verify.stats import chi_square_critical, power

    assert abs(chi_square_critical(1, 0.05) - 3.8415) < 1e-3  # the textbook value
    assert abs(power(10, 0.0, 0.01) - 0.01) < 0.002  # no effect: rejects at the level alpha
    assert power(10, 30.0, 0.01) > power(10, 10.0, 0.01) > 0.2  # grows with the effect


def test_cli_verify_inconclusive_has_its_own_exit_code(tmp_path, monkeypatch, capsys):
    """A run whose proposer never drafts cannot reject the negative control: "inconclusive",
    exit 3 (not 1, which means NOT exact)."""
    fresh_home(tmp_path, monkeypatch)
    target = save_hf_dir(hf_tiny("qwen2", seed=0), tmp_path / "target")
    code = main(["verify", "--target", str(target), "--proposer", "ngram", "--k", "2", "--samples", "300",
                 "--prompt", "xyz", "--greedy-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "inconclusive" and out["law"]["drafted"] == 0
    assert code == 3


def test_the_lookup_law_prompt_drafts_at_every_step_with_an_uncertain_next_symbol():
    """`specdec verify` samples the first built-in prompt's continuation. For a lookup method it must
    be BRANCH_PROMPT, where every symbol bigram has occurred before (an n-gram or suffix lookup
    drafts at once and after either next symbol) and each symbol has been followed by both symbols
    (the text itself does not decide the next one, so the target is uncertain and drafts get
    rejected: the negative control can show). On smollm2-135m this gives "exact" with the control
    rejected at p ~ 1e-69 (the slow tier runs it)."""
    from specdec.bench.prompts import BRANCH_PROMPT, COPY_PROMPT, LOOKUP_METHODS, verify_prompts

    symbols = BRANCH_PROMPT.split()
    assert set(symbols) == {"a", "b"}
    pairs = list(zip(symbols, symbols[1:]))
    assert set(pairs) == {("a", "a"), ("a", "b"), ("b", "a"), ("b", "b")}
    for nxt in "ab":  # whatever comes next, the last bigram (the lookup's key) has occurred before
        assert (symbols[-1], nxt) in pairs[:-1] and tuple(symbols[-2:]) in pairs[:-1]
    for method in LOOKUP_METHODS:
        assert verify_prompts(lookup=method in LOOKUP_METHODS)[0] == BRANCH_PROMPT
    assert verify_prompts(lookup=False)[0] != BRANCH_PROMPT and COPY_PROMPT in verify_prompts(lookup=False)


def test_cli_profile_runs_on_its_built_in_prompts(tmp_path, monkeypatch, capsys):
    """`specdec profile` with no --prompt (a lookup method: BRANCH_PROMPT first) prints its table."""
    fresh_home(tmp_path, monkeypatch)
    target = save_hf_dir(hf_tiny("qwen2", seed=0), tmp_path / "target")
    config = json.loads((target / "tokenizer_config.json").read_text())  # built-in prompts are chat
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    code = main(["profile", "--target", str(target), "--proposer", "ngram", "--max-new-tokens", "6", "--k-max", "3",
                 "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["verify_cost_ratio"][0] == 1.0 and len(result["verify_cost_s"]) == 4
    assert len(result["acceptance_per_position"]) == 3 and all(0 <= a <= 1 for a in result["acceptance_per_position"])
    assert 0 <= result["recommended_k"] <= 3 and result["draft_to_target_cost_ratio"] >= 0
    assert result["plain_decode_tok_s"] > 0 and result["measured_speedup"] > 0 and result["predicted_speedup"] > 0
