"""Deterministic properties of the verifier: the acceptance/residual identity, edge cases, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import verify_chain
from specdec.verify.sampling import sample
from specdec.verify.chain import acceptance_probability, residual_distribution


def _distribution(draw, vocab, allow_zeros=True):
    weights = draw(st.lists(st.floats(0.0 if allow_zeros else 1e-3, 1.0), min_size=vocab, max_size=vocab))
    w = torch.tensor(weights, dtype=torch.float64)
    if w.sum() <= 1e-9:
        w[draw(st.integers(0, vocab - 1))] = 1.0
    # Sharpen so that many cases are far from uniform.
    w = w ** draw(st.sampled_from([1.0, 3.0, 8.0]))
    if w.sum() <= 1e-12:
        w = torch.ones(vocab, dtype=torch.float64)
    return w / w.sum()


@st.composite
def pq_pairs(draw):
    vocab = draw(st.integers(2, 12))
    p = _distribution(draw, vocab)
    kind = draw(st.sampled_from(["independent", "equal", "nearly_equal", "one_hot"]))
    if kind == "equal":
        q = p.clone()
    elif kind == "nearly_equal":
        q = (p + 1e-9 * torch.rand(vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
        q = q / q.sum()
    elif kind == "one_hot":
        q = torch.zeros(vocab, dtype=torch.float64)
        q[draw(st.integers(0, vocab - 1))] = 1.0
    else:
        q = _distribution(draw, vocab)
    return p, q


@settings(max_examples=400, deadline=None)
@given(pq_pairs())
def test_acceptance_plus_residual_reconstructs_p(pq):
    """q*a + (1 - sum(q*a)) * residual == p: the one-step output distribution is exactly p."""
    p, q = pq
    proposed = q > 0
    a = torch.zeros_like(p)
    a[proposed] = acceptance_probability(p[proposed], q[proposed])
    accept_mass = q * a  # [V] probability of proposing y and accepting it
    reject_prob = 1.0 - accept_mass.sum()
    reconstructed = accept_mass + reject_prob * residual_distribution(p, q, tolerance=1e-12)
    torch.testing.assert_close(reconstructed, p, atol=1e-9, rtol=0)


@settings(max_examples=200, deadline=None)
@given(pq_pairs(), st.integers(0, 2**31 - 1), st.integers(0, 4))
def test_outputs_are_valid_ids_never_nan(pq, seed, k):
    p, q = pq
    vocab = p.shape[0]
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q.expand(3, vocab), k, replacement=True, generator=g) if k else torch.zeros(3, 0, dtype=torch.long)
    target_probs = p.expand(3, k + 1, vocab).float()
    draft_probs = q.expand(3, k, vocab).float()
    result = verify_chain(target_probs, draft_probs, draft, g)
    assert result.tokens.shape == (3, k + 1)
    assert ((result.num_accepted >= 0) & (result.num_accepted <= k)).all()
    for row in range(3):
        n = int(result.num_accepted[row]) + 1
        committed = result.tokens[row, :n]
        assert ((committed >= 0) & (committed < vocab)).all()
        assert (result.tokens[row, n:] == -1).all()
        assert torch.equal(committed[:-1], draft[row, : n - 1])
        assert p[committed[-1]] > 0  # the last token always has target probability > 0


def test_k_zero_samples_one_target_token():
    p = torch.tensor([[[0.0, 0.25, 0.75]]]).expand(20000, 1, 3)
    result = verify_chain(p, None, torch.zeros(20000, 0, dtype=torch.long), torch.Generator().manual_seed(0))
    assert result.tokens.shape == (20000, 1)
    assert (result.num_accepted == 0).all()
    counts = torch.bincount(result.tokens[:, 0], minlength=3)
    assert counts[0] == 0 and abs(counts[2] / 20000 - 0.75) < 0.02


def test_greedy_rows_accept_matching_drafts_and_correct_the_rest():
    # target argmax chain: 2 -> 1 -> 0 ; draft proposes [2, 1, 3]
    target = torch.zeros(1, 4, 4)
    target[0, 0, 2] = target[0, 1, 1] = target[0, 2, 0] = target[0, 3, 3] = 1.0
    result = verify_chain(target, None, torch.tensor([[2, 1, 3]]), torch.Generator().manual_seed(0))
    assert result.num_accepted.tolist() == [2]
    assert result.tokens.tolist() == [[2, 1, 0, -1]]
    # everything matches: bonus token from the last position
    result = verify_chain(target, None, torch.tensor([[2, 1, 0]]), torch.Generator().manual_seed(0))
    assert result.tokens.tolist() == [[2, 1, 0, 3]]


def test_p_equal_q_with_rounding_never_produces_nan():
    vocab = 1000
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(64, 3, vocab, generator=g), -1)
    q = (p[:, :2] * (1 + 1e-7 * torch.randn(64, 2, vocab, generator=g))).clamp(min=0)
    q = q / q.sum(-1, keepdim=True)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(64, 2)
    result = verify_chain(p, q, draft, g)
    assert ((result.tokens >= -1) & (result.tokens < vocab)).all()
    last = result.tokens[torch.arange(64), result.num_accepted]
    assert (last >= 0).all()
    assert (p[torch.arange(64), result.num_accepted, last] > 0).all()
    # p == q exactly: the residual has zero mass everywhere. With the fallback it is p; without
    # it (tolerance below 0) it is 0/0 = NaN, and sampling must fail loudly, not return an id:
    # this is what makes the test above able to fail.
    assert torch.equal(residual_distribution(p, p), p)
    with pytest.raises(ValueError, match="NaN"):
        sample(residual_distribution(p, p, tolerance=-1.0), g)


def _good_inputs(batch=2, k=3, vocab=5):
    p = torch.full((batch, k + 1, vocab), 1.0 / vocab)
    q = torch.full((batch, k, vocab), 1.0 / vocab)
    t = torch.zeros(batch, k, dtype=torch.long)
    return p, q, t


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p, q, t: (p[0], q, t), "target_probs must be"),
        (lambda p, q, t: (p, q, t[0]), "draft_tokens must be"),
        (lambda p, q, t: (p, q, t[:, :2]), "does not match"),
        (lambda p, q, t: (p, q[:, :2], t), "draft_probs must be"),
        (lambda p, q, t: (p, q, t.float()), "torch.long"),
        (lambda p, q, t: (p, q, t + 7), "ids in"),
        (lambda p, q, t: (p.index_fill(2, torch.tensor([0]), float("nan")), q, t), "NaN"),
        (lambda p, q, t: (p, q.index_fill(2, torch.tensor([0]), float("inf")), t), "NaN or infinite"),
        (lambda p, q, t: (p - 0.5, q, t), "negative"),
        (lambda p, q, t: (p * 1.1, q, t), "sum to 1"),
        (lambda p, q, t: (p, q * 0.9, t), "sum to 1"),
        (lambda p, q, t: (p, torch.eye(5)[[1, 1, 1]].expand(2, 3, 5), t), "zero probability"),
    ],
)
def test_invalid_inputs_raise_clear_errors(mutate, message):
    p, q, t = mutate(*_good_inputs())
    with pytest.raises(ValueError, match=message):
        verify_chain(p, q, t)


def test_seeded_runs_are_reproducible():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, 5, 50, generator=g), -1)
    q = torch.softmax(torch.randn(8, 4, 50, generator=g), -1)
    t = torch.multinomial(q.reshape(-1, 50), 1, generator=g).view(8, 4)
    a = verify_chain(p, q, t, torch.Generator().manual_seed(9))
    b = verify_chain(p, q, t, torch.Generator().manual_seed(9))
    assert torch.equal(a.tokens, b.tokens)


def test_residual_is_normalised_per_row_with_the_documented_fallback():
    p = torch.tensor([[0.5, 0.5], [0.1, 0.9]], dtype=torch.float64)
    q = torch.tensor([[0.75, 0.25], [0.1, 0.9]], dtype=torch.float64)
    # row 0: residual [0, 0.25] has mass 0.25 -> normalised to [0, 1]; row 1: mass 0 -> p
    out = residual_distribution(p, q)
    assert out.tolist() == [[0.0, 1.0], [0.1, 0.9]]
    # "falls back to p where the mass is <= tolerance": equality included
    assert residual_distribution(p[:1], q[:1], tolerance=0.25).tolist() == [[0.5, 0.5]]
    assert residual_distribution(p[:1], q[:1], tolerance=0.2499).tolist() == [[0.0, 1.0]]


# --- properties pinned down by mutation testing ---


def test_sum_tolerance_per_dtype_and_its_boundary():
    def check(row, dtype):
        p = torch.tensor([[row]], dtype=dtype)  # [1, 1, V]: k = 0
        return verify_chain(p, None, torch.zeros(1, 0, dtype=torch.long), torch.Generator().manual_seed(0))

    with pytest.raises(ValueError, match="must sum to 1"):
        check([0.5, 0.501], torch.float64)  # off by 1e-3: far beyond fp64's 1e-6
    check([1.0, 0.015625], torch.bfloat16)  # off by exactly 2 bf16 eps: the largest allowed
    with pytest.raises(ValueError, match="must sum to 1"):
        check([1.0, 0.0234375], torch.bfloat16)  # 3 eps
    check([0.5, 0.5015], torch.float16)  # 1.5e-3 < 2 fp16 eps (1.95e-3)
    with pytest.raises(ValueError, match="must sum to 1"):
        check([0.5, 0.5025], torch.float16)  # 2.5e-3


def test_vocabulary_of_one_and_of_zero():
    one = verify_chain(torch.ones(2, 1, 1), None, torch.zeros(2, 0, dtype=torch.long), torch.Generator().manual_seed(0))
    assert one.tokens.tolist() == [[0], [0]]
    with pytest.raises(ValueError, match="^target_probs has an empty vocabulary dimension$"):
        verify_chain(torch.ones(2, 1, 0), None, torch.zeros(2, 0, dtype=torch.long))


def test_committed_returns_the_accepted_drafts_and_the_last_token():
    from specdec.verify.chain import ChainVerification

    result = ChainVerification(torch.tensor([0, 2]), torch.tensor([[5, -1, -1], [1, 2, 7]]))
    assert result.committed(0) == [5] and result.committed(1) == [1, 2, 7]
    assert result.num_committed.tolist() == [1, 3]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p, q, t: (p.long(), q, t), r"^target_probs must be a floating-point tensor$"),
        (lambda p, q, t: (p, q.long(), t), r"^draft_probs must be a floating-point tensor$"),
        (lambda p, q, t: (p.index_fill(2, torch.tensor([0]), float("nan")), q, t), r"^target_probs contains NaN"),
        (lambda p, q, t: (p, q.index_fill(2, torch.tensor([0]), -0.5), t), r"^draft_probs contains negative"),
        (lambda p, q, t: (p, q, t[:, :2]), r"expected \(2, 3\)$"),
        (lambda p, q, t: (p, q[:, :2], t), r"^draft_probs must be \[B, k, V\] = \(2, 3, 5\), got \(2, 2, 5\)$"),
        (lambda p, q, t: (p, q, t.fill_(5)), r"^draft_tokens must be ids in \[0, 5\)$"),
    ],
)
def test_error_messages_name_the_argument_and_the_expected_shape(mutate, message):
    with pytest.raises(ValueError, match=message):
        verify_chain(*mutate(*_good_inputs()))


def test_a_zero_probability_draft_is_rejected_with_the_message():
    p, q, t = _good_inputs()
    q = q.clone()
    q[:, :, 0] = 0.0
    q[:, :, 1] += 0.2
    with pytest.raises(ValueError, match=r"^a draft token has zero probability under draft_probs: it cannot have been sampled from them$"):
        verify_chain(p, q, t)


def test_acceptance_is_strict_so_p_zero_is_never_accepted_even_for_u_zero(monkeypatch):
    """u ~ U[0, 1) can be exactly 0; accepting when u <= p/q would then accept a token the
    target gives probability 0."""
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # p(token 0) = 0 at the first position
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.zeros_like(real_rand(*a, **kw)))
    result = verify_chain(p, None, torch.tensor([[0]]), torch.Generator().manual_seed(0))
    assert result.num_accepted.tolist() == [0] and result.tokens.tolist() == [[1, -1]]


def test_residual_tolerance_is_passed_through():
    """With the default tolerance the replacement after rejecting a one-hot draft on token 0 is
    always token 1 (the residual); a tolerance of 1 turns the residual into p (the negative
    control of specdec verify) and token 0 comes back."""
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]).expand(2000, 2, 2)
    drafts = torch.zeros(2000, 1, dtype=torch.long)
    exact = verify_chain(p, None, drafts, torch.Generator().manual_seed(0))
    rejected = exact.num_accepted == 0
    assert (exact.tokens[rejected, 0] == 1).all()
    wrong = verify_chain(p, None, drafts, torch.Generator().manual_seed(0), residual_tolerance=1.0)
    assert (wrong.tokens[wrong.num_accepted == 0, 0] == 0).any()


def test_low_precision_inputs_are_verified_in_fp32():
    g = torch.Generator().manual_seed(4)

    def dyadic(*shape):  # k/64 with every k >= 1 and sum 64: exact in bf16, sums to exactly 1
        w = torch.rand(*shape, 6, generator=g) ** 3
        w = (w / w.sum(-1, keepdim=True) * 58).floor() + 1
        w[..., 0] += 64 - w.sum(-1)
        return (w / 64).bfloat16()

    p, q = dyadic(4000, 3), dyadic(4000, 2)
    drafts = torch.multinomial(q.float().view(-1, 6), 1, generator=g).view(4000, 2)
    low = verify_chain(p, q, drafts, torch.Generator().manual_seed(1))
    high = verify_chain(p.float(), q.float(), drafts, torch.Generator().manual_seed(1))
    assert torch.equal(low.tokens, high.tokens)
