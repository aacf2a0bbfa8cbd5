"""The speculative engine on tiny random models: greedy identity, exact sampling, stops, errors."""

from __future__ import annotations


import pytest
import torch

import specdec.verify.chain as verify_module
from specdec.core.adaptive import K_MAX
from specdec.core.engine import Engine, generate, kv_capacity
from specdec.core.rows import Request
from specdec.proposers import DraftModelProposer
from specdec.verify.sampling import SamplingParams
from specdec.text.session import Session
from stats import ALPHA, chi_square_pvalue
from tiny_models import GREEDY, N_SAMPLES, PARAMS, PROMPT, PROMPTS, V_SMALL, hf_tiny, law_joint, ours, perturbed


def _spec(target, draft, prompts, params, max_new, k, seed=0, **kw):
    """``k`` an int or "auto" (then up to 8 draft tokens)."""
    proposer = DraftModelProposer(draft, max(len(p) for p in prompts) + max_new + (8 if k == "auto" else k) + 2)
    return generate(target, prompts, params, max_new, proposer=proposer, k=k, seed=seed, **kw)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_is_token_identical_to_plain_decoding(pair, k, batch):
    target, draft = pair
    prompts = PROMPTS[:batch]
    plain = generate(target, prompts, GREEDY, 40)
    spec = _spec(target, draft, prompts, GREEDY, 40, k)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(len(r.token_ids) == 40 for r in spec)
    acc = spec[0].metrics.acceptance
    # the test exercises both acceptance and rejection
    assert 0 < acc.accepted < acc.drafted
    assert spec[0].metrics.target_calls < plain[0].metrics.target_calls


def test_gemma_and_llama_targets_greedy_identity():
    for arch in ["gemma3", "llama"]:
        target = ours(hf_tiny(arch, seed=0), "int8")
        draft = ours(perturbed(hf_tiny(arch, seed=0), 0.01, seed=2), "int8")
        plain = generate(target, PROMPTS, GREEDY, 30)
        spec = _spec(target, draft, PROMPTS, GREEDY, 30, 4)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        acc = spec[0].batch_metrics.acceptance
        assert 0 < acc.accepted < acc.drafted, arch  # drafts accepted and rejected: both paths ran


def test_self_draft_accepts_everything(pair):
    """Draft == target at temperature 0: every draft must be accepted (batch-invariant numerics)."""
    target, _ = pair
    spec = _spec(target, target, PROMPTS, GREEDY, 33, 4)
    acc = spec[0].metrics.acceptance
    assert acc.accepted == acc.drafted > 0


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_never_exceeds_max_new_tokens(pair, max_new, k):
    target, draft = pair
    spec = _spec(target, draft, PROMPTS, GREEDY, max_new, k)
    plain = generate(target, PROMPTS, GREEDY, max_new)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(len(r.token_ids) == max_new for r in spec)


def test_stops_exactly_at_eos_inside_an_accepted_block(pair):
    target, draft = pair
    plain = generate(target, PROMPTS[:1], GREEDY, 40)[0].token_ids
    eos = plain[17]
    first = plain.index(eos)
    spec = _spec(target, draft, PROMPTS[:1], GREEDY, 40, 8, eos_token_ids={eos})[0]
    assert spec.token_ids == plain[: first + 1]
    assert spec.finish_reason == "eos"


class _CharTokenizer:
    """Each id decodes to a character of its own: a stop string is then a token sequence."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + i) for i in ids)


def test_stop_string_spanning_blocks_ends_the_row_where_it_appears(pair):
    """The session's stop handling: a 3-token stop string that spans verification blocks for
    small k ends the row at its last token (later tokens of the block dropped), the text is cut
    where it begins, and the streamed pieces add up to that text."""
    target, draft = pair
    plain = generate(target, PROMPTS[:1], GREEDY, 40)[0].token_ids
    stop = plain[20:23]
    tok = _CharTokenizer()
    expected = next(e for e in range(3, 41) if plain[e - 3 : e] == stop)
    for k in [1, 2, 4]:
        capacity = kv_capacity(len(PROMPTS[0]) + 40, k, K_MAX)
        engine = Engine(target, DraftModelProposer(draft, capacity), capacity=capacity, k=k)
        pieces = []
        res = Session(engine, tok).run([Request(PROMPTS[0], GREEDY, 40)], [tok.decode(stop)],
                                       on_text=lambda i, text: pieces.append(text))[0]
        assert res.token_ids == plain[:expected]
        assert res.finish_reason == "stop"
        assert res.text == tok.decode(plain[: expected - 3]) == "".join(pieces)


def test_seeded_sampling_is_reproducible(pair):
    target, draft = pair
    params = SamplingParams(temperature=0.9, top_p=0.95)
    a = _spec(target, draft, PROMPTS, params, 20, 4, seed=5)
    b = _spec(target, draft, PROMPTS, params, 20, 4, seed=5)
    c = _spec(target, draft, PROMPTS, params, 20, 4, seed=6)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_errors(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="k must be"):
        _spec(target, draft, PROMPTS, GREEDY, 5, -1)
    with pytest.raises(ValueError, match="context length"):
        generate(target, [[1] * 500], GREEDY, 100)
    with pytest.raises(ValueError, match="at least one token"):
        generate(target, [[]], GREEDY, 5)


def test_non_finite_logits_are_reported(pair, monkeypatch):
    target, draft = pair
    original = type(draft).forward

    def broken(self, tokens, cache, **kw):
        out = original(self, tokens, cache, **kw)
        return out if self is not draft else out * float("nan")

    monkeypatch.setattr(type(draft), "forward", broken)
    with pytest.raises(ValueError, match="draft model produced non-finite logits"):
        _spec(target, draft, PROMPTS, SamplingParams(temperature=1.0), 5, 2)


# ---- exact sampling: joint law of the first three generated tokens ---------------------------


def _sampled_joint_counts(target, draft, k) -> tuple[torch.Tensor, float]:
    rows = _spec(target, draft, [PROMPT] * N_SAMPLES, PARAMS, 3, k, seed=11)
    tokens = torch.tensor([r.token_ids for r in rows])  # [N, 3]
    counts = torch.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2], minlength=V_SMALL**3)
    return counts, rows[0].batch_metrics.acceptance.to_dict()["acceptance_rate"]


@pytest.mark.parametrize("k", [2])
def test_first_three_tokens_follow_the_exact_target_law(small_pair, k):
    """Power: 10^5 samples over <= 216 cells; the negative control below fails with p < 1e-12."""
    target, draft = small_pair
    joint = law_joint(target)
    counts, acceptance = _sampled_joint_counts(target, draft, k)
    assert 0.1 < acceptance < 0.95  # both branches of the verifier are exercised
    assert chi_square_pvalue(counts, joint) > ALPHA


def test_negative_control_engine_without_residual_fails(small_pair, monkeypatch):
    target, draft = small_pair
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q, tolerance=1e-6: p)
    counts, _ = _sampled_joint_counts(target, draft, 2)
    assert chi_square_pvalue(counts, law_joint(target)) < 1e-12


@pytest.mark.parametrize("k", [4, 8, "auto"])
def test_batched_speculation_never_passes_the_context_length(pair, k):
    """A long and a short prompt whose budgets end exactly at the context length (512): ragged
    acceptance lets the short row hold k high while the long row is near its end, and the
    long row's block used to run past position 511 ("position 512 is beyond the model's context
    length") after the up-front check had passed. k is now capped by each row's room."""
    target, draft = pair
    context = target.cfg.max_position_embeddings
    g = torch.Generator().manual_seed(11)
    for trial in range(4):
        long_prompt = torch.randint(0, 97, (440 - trial,), generator=g).tolist()
        prompts = [long_prompt, PROMPTS[trial % len(PROMPTS)]]
        max_new = context - len(long_prompt)
        plain = generate(target, prompts, GREEDY, max_new)
        spec = _spec(target, draft, prompts, GREEDY, max_new, k)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert [r.finish_reason for r in spec] == ["length", "length"]
        assert len(spec[0].token_ids) == max_new


# ---- one broken row fails alone ----------------------------------------------------------------

@pytest.mark.parametrize("at_prefill", [False, True])
def test_a_poisoned_row_fails_alone_and_the_others_match_their_solo_answers(pair, at_prefill):
    """Server hardening: one row of a batch of 8 gets NaN logits (at its prefill, or after it
    has committed 3 tokens); it ends with finish_reason "error" and a message, and the 7 others
    (greedy and seeded sampling, with a draft model at k = 3) finish token-identical to their
    answers run alone. Before per-row failure the whole step raised and every row was lost."""
    from specdec.core.engine import Engine
    from specdec.core.rows import Request

    target, draft = pair
    prompts = [[1 + i, 5, 9 + i, 2] for i in range(8)]
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.9, top_k=20) for i in range(8)]
    poisoned = 3

    def run(rows, engine_cls=Engine):
        proposer = DraftModelProposer(draft, 64)
        engine = engine_cls(target, proposer, capacity=64, k=3, seed=0)
        states = [engine.add(Request(prompts[i], params[i], 12, seed=100 + i)) for i in rows]
        while engine.busy:
            engine.step()
        return states

    class Poisoning(Engine):
        def _verify(self, rows, logits, proposal, sampling):
            for b, row in enumerate(rows):
                if row.request.prompt == prompts[poisoned] and (at_prefill or len(row.token_ids) >= 3):
                    logits = logits.clone()
                    logits[b, -1, 7] = float("nan")
            return super()._verify(rows, logits, proposal, sampling)

    solo = [run([i])[0] for i in range(8)]
    batch = run(range(8), Poisoning)
    bad = batch[poisoned]
    assert bad.finish_reason == "error" and "non-finite logits" in bad.result.error
    assert len(bad.token_ids) == 0 if at_prefill else len(bad.token_ids) >= 3
    for i in range(8):
        if i != poisoned:
            assert batch[i].finish_reason == solo[i].finish_reason != "error"
            assert batch[i].token_ids == solo[i].token_ids, i
