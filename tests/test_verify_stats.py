"""Statistical exactness of ``verify_chain``, with negative controls.

Harness: a first-order Markov target ``P`` and draft ``Q`` over V=5 tokens. 100,000 sequences are
generated in one batch by repeated speculative steps through ``verify_chain`` (the target rows are
looked up from each row's own drafted prefix, exactly as a model would score them), until every row
has ``length = k + 1`` tokens. Exact target sampling gives, for every position j, the pair
``(t_{j-1}, t_j)`` the law ``pi_{j-1}(a) P(a, b)`` with ``pi_{j-1} = e_start P^{j-1}``, and the
first three tokens a law over V^3 cells. Each is checked with Pearson's chi-square (p > ALPHA).

Power: the same harness with a deliberately broken verifier — accepting with ``min(1, q/p)``, or
skipping the residual (replacement drawn from ``p``) — must give p < 1e-12. The margin between
ALPHA = 1e-6 and the controls' p-values is the demonstrated power at this sample size.
"""

from __future__ import annotations

import pytest
import torch

import specdec.verify.chain as verify_module
from specdec import verify_chain
from stats import ALPHA, chi_square_pvalue

V = 5
N = 100_000
START = 0


def _sharp(seed: int, zero_mask: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g, dtype=torch.float64) * 2.5
    probs = torch.softmax(logits, -1).masked_fill(zero_mask, 0.0)
    return probs / probs.sum(-1, keepdim=True)


# Zeros in different places: q is 0 on tokens p needs (only the residual can produce them) and
# p is 0 on tokens q proposes (they must always be rejected).
P_ZERO = torch.zeros(V, V, dtype=torch.bool)
P_ZERO[:, 4] = True
P_ZERO[1, 0] = True
Q_ZERO = torch.zeros(V, V, dtype=torch.bool)
Q_ZERO[:, 3] = True
Q_ZERO[2, 1] = True
SHARP_P = _sharp(1, P_ZERO)
SHARP_Q = _sharp(2, Q_ZERO)


def _one_hot_rows(m: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(m).scatter_(-1, m.argmax(-1, keepdim=True), 1.0)


def _disjoint() -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.zeros(V, V, dtype=torch.float64)
    p[:, :3] = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    p[1, :3] = torch.tensor([0.05, 0.15, 0.8], dtype=torch.float64)
    q = torch.zeros(V, V, dtype=torch.float64)
    q[:, 3:] = torch.tensor([0.9, 0.1], dtype=torch.float64)
    return p, q


def generate(p_models, q_models, model_of_row, k, length, seed, deterministic_draft=False):
    """Speculative sequences through ``verify_chain``; returns ``[N, length]`` tokens and stats.

    p_models, q_models: ``[M, V, V]`` transition matrices; ``model_of_row``: ``[N]`` which pair each
    row uses (lets one batch mix greedy and sampled rows).
    """
    g = torch.Generator().manual_seed(seed)
    n = model_of_row.shape[0]
    rows = torch.arange(n)
    out = torch.full((n, length), -1, dtype=torch.long)
    filled = torch.zeros(n, dtype=torch.long)
    current = torch.full((n,), START, dtype=torch.long)
    accepted_total = torch.zeros(n, dtype=torch.long)
    calls = 0
    while int(filled.min()) < length:
        state, drafted, q_rows = current, [], []
        for _ in range(k):
            q = q_models[model_of_row, state]  # [N, V]
            state = q.argmax(-1) if deterministic_draft else torch.multinomial(q, 1, generator=g).squeeze(-1)
            drafted.append(state)
            q_rows.append(q)
        draft_tokens = torch.stack(drafted, 1) if k else torch.zeros(n, 0, dtype=torch.long)  # [N, k]
        prefix = torch.cat([current.unsqueeze(1), draft_tokens], 1)  # [N, k+1]
        p = p_models[model_of_row.unsqueeze(1), prefix]  # [N, k+1, V]
        q_all = None if deterministic_draft else torch.stack(q_rows, 1)  # [N, k, V]
        result = verify_chain(p, q_all, draft_tokens, g)
        calls += 1
        accepted_total += result.num_accepted
        for j in range(k + 1):
            pos = filled + j
            ok = (j < result.num_committed) & (pos < length)
            out[rows[ok], pos[ok]] = result.tokens[ok, j]
        filled += result.num_committed
        current = result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1)
    assert (out >= 0).all() and (out < V).all()
    return out, accepted_total, calls


def exact_pvalues(tokens: torch.Tensor, p: torch.Tensor) -> list[float]:
    """Chi-square p-values: every adjacent pair (t_{j-1}, t_j), and the first three tokens jointly."""
    n, length = tokens.shape
    prev = torch.cat([torch.full((n, 1), START), tokens], 1)
    pvals = []
    state = torch.zeros(V, dtype=torch.float64)
    state[START] = 1.0
    for j in range(length):
        counts = torch.bincount(prev[:, j] * V + prev[:, j + 1], minlength=V * V)
        pvals.append(chi_square_pvalue(counts, state.unsqueeze(1) * p))
        state = state @ p
    if length >= 3:
        joint = torch.einsum("a,ab,bc->abc", p[START], p, p)
        counts = torch.bincount((tokens[:, 0] * V + tokens[:, 1]) * V + tokens[:, 2], minlength=V**3)
        pvals.append(chi_square_pvalue(counts, joint))
    return pvals


def run_config(p, q, k, seed=0, deterministic_draft=False):
    tokens, accepted, calls = generate(
        p.unsqueeze(0), q.unsqueeze(0), torch.zeros(N, dtype=torch.long), k, k + 1, seed, deterministic_draft
    )
    return tokens, accepted, exact_pvalues(tokens, p)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_sharp_distributions_with_zeros(k):
    _, _, pvals = run_config(SHARP_P, SHARP_Q, k, seed=k)
    assert min(pvals) > ALPHA, pvals


def test_p_equals_q_accepts_everything():
    tokens, accepted, pvals = run_config(SHARP_P, SHARP_P.clone(), 4, seed=11)
    assert min(pvals) > ALPHA, pvals
    assert int(accepted.min()) >= 4  # first call of every row accepted all 4 (u < 1 = p/q)


def test_disjoint_supports_always_reject():
    p, q = _disjoint()
    tokens, accepted, pvals = run_config(p, q, 4, seed=12)
    assert min(pvals) > ALPHA, pvals
    assert int(accepted.max()) == 0


def test_one_hot_target_is_deterministic():
    p = _one_hot_rows(SHARP_P)
    tokens, _, pvals = run_config(p, SHARP_Q, 4, seed=13)
    expected, state = [], START
    for _ in range(5):
        state = int(p[state].argmax())
        expected.append(state)
    assert (tokens == torch.tensor(expected)).all()
    assert min(pvals) > ALPHA


def test_deterministic_draft_without_probs():
    _, _, pvals = run_config(SHARP_P, SHARP_Q, 4, seed=14, deterministic_draft=True)
    assert min(pvals) > ALPHA, pvals


def test_batch_mixing_greedy_and_sampled_rows():
    k = 4
    p_models = torch.stack([SHARP_P, _one_hot_rows(SHARP_P)])
    q_models = torch.stack([SHARP_Q, _one_hot_rows(SHARP_Q)])
    model_of_row = torch.arange(N) % 2  # odd rows greedy
    tokens, _, _ = generate(p_models, q_models, model_of_row, k, k + 1, seed=15)
    greedy, state = [], START
    for _ in range(k + 1):
        state = int(SHARP_P[state].argmax())
        greedy.append(state)
    assert (tokens[1::2] == torch.tensor(greedy)).all()
    assert min(exact_pvalues(tokens[0::2], SHARP_P)) > ALPHA


def _flaw_accept_q_over_p(p_y, q_y):
    return torch.clamp(q_y / p_y, max=1.0)


def _flaw_no_residual(p, q, tolerance=1e-6):
    return p


@pytest.mark.parametrize(
    "target, replacement",
    [("acceptance_probability", _flaw_accept_q_over_p), ("residual_distribution", _flaw_no_residual)],
)
def test_negative_control_wrong_verifier_fails(monkeypatch, target, replacement):
    monkeypatch.setattr(verify_module, target, replacement)
    _, _, pvals = run_config(SHARP_P, SHARP_Q, 4, seed=4)
    assert min(pvals) < 1e-12, f"the broken verifier ({target}) was not detected: min p = {min(pvals)}"


# Chains cut per row by a confidence rule (the draft head's ``min_score``). A chain may stop at
# any position by a rule that reads what is known before that position's draft is drawn (the
# drafts so far and the distribution the next one would be drawn from): each drafted token then
# still follows the q it is verified with, and a position not drafted is the target's own draw.
# Reading the drawn token itself (keep it only if q(token) is high) is not such a rule: a kept
# draft then follows q restricted to its likely tokens, and the verification's residual is wrong.
TAU = 0.5


def generate_cut(p, q, k, length, seed, rule):
    """As :func:`generate` with one pair, each row's chain cut by ``rule``: "prefix" (stop before
    a position whose q has no token of probability >= TAU) or "drawn" (draw, then stop unless the
    drawn token's q >= TAU: the wrong rule). Rows of each chain length are verified together."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(N)
    out = torch.full((N, length), -1, dtype=torch.long)
    filled = torch.zeros(N, dtype=torch.long)
    current = torch.full((N,), START, dtype=torch.long)
    lengths_seen = torch.zeros(k + 1, dtype=torch.long)
    while int(filled.min()) < length:
        state, drafted, q_rows = current, [], []
        active = torch.ones(N, dtype=torch.bool)
        chain = torch.zeros(N, dtype=torch.long)  # [N] drafts kept per row
        for _ in range(k):
            qi = q[state]  # [N, V]
            if rule == "prefix":
                active &= qi.max(-1).values >= TAU
            state = torch.multinomial(qi, 1, generator=g).squeeze(-1)
            if rule == "drawn":
                active &= qi.gather(1, state.unsqueeze(1)).squeeze(1) >= TAU
            chain += active.long()
            drafted.append(state)
            q_rows.append(qi)
        draft_tokens, q_all = torch.stack(drafted, 1), torch.stack(q_rows, 1)  # [N, k], [N, k, V]
        lengths_seen += torch.bincount(chain, minlength=k + 1)
        committed = torch.full((N, k + 1), -1, dtype=torch.long)
        num_accepted = torch.zeros(N, dtype=torch.long)
        for size in range(k + 1):
            group = rows[chain == size]
            if len(group) == 0:
                continue
            tokens = draft_tokens[group, :size]
            prefix = torch.cat([current[group].unsqueeze(1), tokens], 1)  # [G, size+1]
            result = verify_chain(p[prefix], q_all[group, :size], tokens, g)
            committed[group, : size + 1] = result.tokens
            num_accepted[group] = result.num_accepted
        for j in range(k + 1):
            pos = filled + j
            ok = (j <= num_accepted) & (pos < length)
            out[rows[ok], pos[ok]] = committed[ok, j]
        filled += num_accepted + 1
        current = committed.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return out, lengths_seen


@pytest.mark.parametrize("k", [2, 4])
def test_chains_cut_before_a_draft_is_drawn_keep_the_target_law(k):
    """Power: the wrong rule below, at the same sample size, gives p < 1e-12. Every chain length
    0..k occurs, so the cut acts per row."""
    tokens, lengths = generate_cut(SHARP_P, SHARP_Q, k, k + 1, seed=21 + k, rule="prefix")
    assert (lengths > 0).all(), lengths
    pvals = exact_pvalues(tokens, SHARP_P)
    assert min(pvals) > ALPHA, pvals


def test_negative_control_chains_cut_on_the_drawn_token_fail():
    tokens, lengths = generate_cut(SHARP_P, SHARP_Q, 4, 5, seed=25, rule="drawn")
    assert (lengths[:3] > 0).all(), lengths  # it cuts at several positions
    pvals = exact_pvalues(tokens, SHARP_P)
    assert min(pvals) < 1e-12, f"cutting on the drawn token was not detected: min p = {min(pvals)}"
