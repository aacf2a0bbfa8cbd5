"""The controlled-acceptance bench proposer (``specdec bench --speculate``).

It runs a real draft but proposes the target's own greedy continuation with a fraction a of the
positions right (drawn once per position, the same for every k), the others wrong. Verification stays the exact one: the output equals plain
decoding at every a and k, and the per-position acceptance the verifier measures is a within
0.03 (8 rows x 160 tokens: about 2,000 reached positions a run, so a standard error of ~0.01 and
the bound at ~3 of them). The draft's vocabulary may be smaller than the target's.
"""

from __future__ import annotations

import pytest
import torch

from specdec.bench.controlled import ControlledProposer, predicted_speedup
from specdec.core.engine import generate
from specdec.verify.sampling import SamplingParams

PROMPTS = [[1 + i, 2 + i, 3 + i] for i in range(8)]


@pytest.fixture(scope="module")
def pair():
    from tiny_models import hf_tiny, ours

    return ours(hf_tiny("qwen2", vocab=97, seed=0), "float32"), ours(hf_tiny("qwen2", vocab=61, seed=5, layers=1), "float32")


@pytest.mark.parametrize("a, k", [(0.6, 3), (0.8, 4), (0.9, "auto"), (0.3, "auto"), (0.0, 2)])
def test_output_equals_plain_and_acceptance_is_controlled(pair, a, k):
    target, draft = pair
    greedy = SamplingParams(temperature=0.0)
    with torch.inference_mode():
        plain = [r.token_ids for r in generate(target, PROMPTS, greedy, 160)]
        proposer = ControlledProposer(draft, 200, plain, a, target.vocab_size, seed=1)
        spec = [r.token_ids for r in generate(target, PROMPTS, greedy, 160, proposer=proposer, k=k)]
    assert spec == plain
    # adaptive k reaches fewer positions (at a = 0.3 it mostly probes, ~150-1,000 of them): there,
    # 4 standard errors of the reached positions' mean (a false failure ~6e-5). Its steps without
    # drafts, once counted as rejections, read 0.04 at a = 0.3: 0.26 off, beyond that bound.
    bound = 0.03 if k != "auto" else 4 * (a * (1 - a) / max(proposer.attempted, 1)) ** 0.5
    assert proposer.drafted > 0 and abs(proposer.measured_acceptance() - a) < bound, (proposer.measured_acceptance(), bound)


def test_the_formula_is_the_chain_formula():
    v = {m: 1.0 for m in range(1, 10)}
    assert predicted_speedup(0.0, 3, 0.0, v) == pytest.approx(1.0)  # one token a step at a plain step's cost
    assert predicted_speedup(0.8, 4, 0.1, {**v, 5: 1.2}) == pytest.approx((1 - 0.8 ** 5) / 0.2 / (0.4 + 1.2))


def test_the_kept_run_starts_from_what_the_cold_run_learned():
    """``auto-kept`` is a second one-shot process: it reads the cold run's costs through the JSON
    form kept on disk, not the process's shared ones (nor the same object, which it would change).
    (A cold run given the target is calibrated first: tests/test_adaptive.py tests calibrate.)"""
    from specdec.bench.controlled import COLD, KEPT, _costs_for
    from specdec.core.adaptive import CallCosts

    shared = CallCosts()
    cold, _ = _costs_for(COLD, shared, None)
    assert cold is not shared and not cold.shape
    for n, seconds in ((1, 0.05), (5, 0.06), (1, 0.052)):
        cold.observe(n, seconds)
    kept, seconds = _costs_for(KEPT, shared, cold)
    assert kept is not cold and kept.state() == cold.state() and seconds == 0.0
    assert _costs_for(3, shared, None)[0] is shared and _costs_for("auto", shared, None)[0] is shared
