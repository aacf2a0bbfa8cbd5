"""First-order Markov target and draft over V tokens, and exact (closed-form) speculation rates.

A Markov "language model" conditions only on the previous token, so the target distribution at
every position is a row of a ``[V, V]`` transition matrix. This makes the speculative protocol's
long-run rates computable exactly by conditioning on the state.

Closed form (chain length k). Let ``M[s, y] = min(P[s, y], Q[s, y])``: the probability that a
draft at state ``s`` proposes ``y`` AND it is accepted. ``M`` is sub-stochastic; ``(M^i 1)[s]`` is
the probability that the first ``i`` drafts of a call starting at ``s`` are all accepted, so

    E[accepted | s] = sum_{i=1..k} (M^i 1)[s].

A call that starts at state ``s`` ends at the state of its last committed token. It ends with a
residual draw at state ``x`` after ``i < k`` acceptances (mass ``D = [P - Q]_+``), or with a bonus
draw after ``k`` acceptances, so the call-start states form a Markov chain with kernel

    T = sum_{i=0..k-1} M^i D + M^k P.

With ``pi`` its stationary distribution, the long-run accepted drafts per call are
``pi . E[accepted | .]`` and, by the renewal-reward theorem, target calls per emitted token are
``1 / (1 + that)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEED_TARGET = torch.tensor(
    [[0.55, 0.25, 0.15, 0.05], [0.10, 0.60, 0.20, 0.10], [0.15, 0.15, 0.55, 0.15], [0.25, 0.20, 0.15, 0.40]],
    dtype=torch.float64,
)
SEED_DRAFT = torch.tensor(
    [[0.50, 0.28, 0.17, 0.05], [0.12, 0.55, 0.23, 0.10], [0.18, 0.14, 0.50, 0.18], [0.28, 0.18, 0.17, 0.37]],
    dtype=torch.float64,
)


@dataclass(frozen=True)
class MarkovPair:
    """A target and a draft transition matrix, each ``[V, V]`` with rows summing to 1."""

    target: torch.Tensor  # [V, V]
    draft: torch.Tensor  # [V, V]

    def __post_init__(self) -> None:
        for name, m in (("target", self.target), ("draft", self.draft)):
            if m.dim() != 2 or m.shape[0] != m.shape[1]:
                raise ValueError(f"{name} must be a square [V, V] matrix, got {tuple(m.shape)}")
            if (m < 0).any() or not torch.allclose(m.sum(-1), torch.ones(m.shape[0], dtype=m.dtype)):
                raise ValueError(f"{name} rows must be non-negative and sum to 1")
        if self.target.shape != self.draft.shape:
            raise ValueError("target and draft must have the same vocabulary")

    @property
    def vocab(self) -> int:
        return self.target.shape[0]

    @classmethod
    def seed(cls) -> "MarkovPair":
        return cls(SEED_TARGET.clone(), SEED_DRAFT.clone())


@dataclass(frozen=True)
class ClosedForm:
    expected_accepted_per_call: float
    target_calls_per_token: float
    call_start_distribution: torch.Tensor  # [V]


def _stationary(kernel: torch.Tensor) -> torch.Tensor:
    """Stationary distribution of a row-stochastic matrix (left eigenvector for eigenvalue 1)."""
    v = kernel.shape[0]
    # Solve pi (T - I) = 0 with sum(pi) = 1 as a least-squares system.
    a = torch.cat([(kernel - torch.eye(v, dtype=kernel.dtype)).T, torch.ones(1, v, dtype=kernel.dtype)])
    b = torch.zeros(v + 1, dtype=kernel.dtype)
    b[-1] = 1.0
    return torch.linalg.lstsq(a, b.unsqueeze(-1)).solution.squeeze(-1)


def closed_form(pair: MarkovPair, k: int) -> ClosedForm:
    """Exact long-run accepted drafts per call and target calls per emitted token (see module doc)."""
    if k < 0:
        raise ValueError("k must be >= 0")
    p, q = pair.target.to(torch.float64), pair.draft.to(torch.float64)
    m = torch.minimum(p, q)
    d = torch.clamp(p - q, min=0.0)
    ones = torch.ones(pair.vocab, dtype=torch.float64)
    expected = torch.zeros(pair.vocab, dtype=torch.float64)
    kernel = torch.zeros_like(p)
    m_pow = torch.eye(pair.vocab, dtype=torch.float64)
    for _ in range(k):
        kernel += m_pow @ d
        m_pow = m_pow @ m
        expected += m_pow @ ones
    kernel += m_pow @ p
    pi = _stationary(kernel)
    accepted = float(pi @ expected)
    return ClosedForm(accepted, 1.0 / (1.0 + accepted), pi)
