"""The method table and SpeculationConfig (specdec/speculation.py): the one place the default
method, k's defaults, the lookup sizes and the KV capacity are decided, and the one place a new
proposer is added (CONTRIBUTING.md's worked example runs here)."""

from __future__ import annotations

import pytest
import torch

import specdec.speculation as speculation
from specdec.core.adaptive import K_MAX
from specdec.api import TextGenerator
from specdec.core.engine import kv_capacity
from specdec.proposers.base import Proposal
from specdec.verify.sampling import SamplingParams
from specdec.speculation import METHODS, Method, SpeculationConfig
from tiny_models import hf_tiny, save_hf_dir

resolve = SpeculationConfig.resolve


def test_defaults_come_from_one_place():
    spec = resolve(None, draft=False, head=True)
    assert (spec.method, spec.model_side, spec.k, spec.k_max, spec.ngram) == ("hybrid", "head", "auto", K_MAX, (2, 4))
    assert resolve(None, draft=False, head=False).method == speculation.LOOKUP_ONLY
    assert resolve("hybrid", draft=False, head=False).model_side == "early-exit"
    assert resolve("ngram", draft=False, head=False, ngram=(3, None)).ngram == (3, 4)
    plain = resolve("none", draft=True, head=True)
    assert plain.k == 0 and not plain.speculates and plain.build(None, 10) is None
    assert SpeculationConfig.plain() == SpeculationConfig(requested="none")


def test_capacity_is_one_formula_for_every_k():
    assert kv_capacity(100, 12, K_MAX) == 114  # a fixed k beyond k_max: its own block and the bonus
    assert kv_capacity(100, "auto", K_MAX) == kv_capacity(100, 0, K_MAX) == 100 + K_MAX + 2


@pytest.mark.parametrize("method, kwargs, message", [
    ("draft", {}, "needs a draft model"),
    ("head-tree", {}, "needs a draft head"),
    ("bogus", {}, "unknown method"),
    ("ngram", {"ngram": (5, 3)}, "ngram sizes"),
    ("ngram", {"k": -1}, "k must be"),
    ("ngram", {"k_max": 0}, "k_max must be"),
    ("early-exit", {"exit_layer": 0}, "exit_layer must be"),
])
def test_bad_choices_name_the_parameter(method, kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve(method, draft=False, head=False, **kwargs)


def test_what_each_config_uses():
    assert resolve("hybrid", draft=True, head=True).uses_draft
    assert resolve("hybrid", draft=False, head=True).uses_head
    assert resolve("hybrid", draft=False, head=False).uses_exit_layer
    assert resolve("hybrid-tree", draft=False, head=True).trees and not resolve("ngram", draft=False, head=False).trees
    assert resolve("ngram", draft=False, head=False).with_k(0).method == "none"
    assert "as asked" in resolve("ngram", draft=False, head=False).describe()
    assert "train-head" in resolve(None, draft=False, head=False).describe()


class LastToken:
    """One row's state: its last committed token."""

    def __init__(self, token):
        self.token = token


class RepeatProposer:
    """CONTRIBUTING.md's worked example, verbatim: k copies of each row's last token."""

    tree_mode = "chains"
    wants_target_hidden = False

    def add(self, prompts, target_hidden=None):
        return [LastToken(p[-1]) for p in prompts]  # each new row's state: the row keeps it

    def feed(self, states, pending):
        for row, ids in zip(states, pending):  # the tokens committed since the last step
            if ids:
                row.token = ids[-1]
        return "default"

    def propose(self, states, k, tree, sampling):
        tokens = torch.tensor([[row.token] * k for row in states], dtype=torch.long)  # [B, k]
        return Proposal(tokens=tokens, probs=None)  # probs None: deterministic drafts

    def observe(self, states, num_accepted, target_hidden=None):
        pass

    def retain(self, rows, left):
        pass  # nothing batched (a draft model would compact its KV cache here)


def test_a_new_method_is_one_table_entry(tmp_path, monkeypatch):
    """Adding RepeatProposer to METHODS is all it takes for the API (and so the CLI, server, bench,
    profile and verify, which resolve through the same table): greedy output equals plain
    decoding's, with the drafts really scored."""
    monkeypatch.setitem(METHODS, "repeat", Method("the last token, repeated", lambda gen, c, cap: RepeatProposer()))
    gen = TextGenerator.load(str(save_hf_dir(hf_tiny("qwen2", seed=0), tmp_path / "m")), dtype="int8")
    prompt = [5, 6, 7, 7, 7]
    greedy = SamplingParams(temperature=0.0)
    plain = gen.generate([prompt, prompt[:3]], greedy, 12, speculation=gen.speculation("none"))
    for k in (2, "auto"):
        spec = gen.generate([prompt, prompt[:3]], greedy, 12, speculation=gen.speculation("repeat", k=k))
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert spec[0].batch_metrics.acceptance.drafted > 0
