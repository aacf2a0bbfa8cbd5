"""Goodness-of-fit statistics for exactness checks (tests and ``specdec verify``): Pearson's
chi-square with its p-value, and the power of that test against a given alternative law."""

from __future__ import annotations

import torch


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's chi-square of counts ``observed`` against probabilities: ``(statistic, dof, p)``.

    Cells with zero expected probability must have zero observed counts: any count there is an
    impossible outcome and gives p = 0. Degrees of freedom: (cells with positive probability) - 1.
    The p-value is the chi-square survival function, the regularised upper incomplete gamma
    ``Q(dof/2, stat/2)``.
    """
    observed = observed.to(torch.float64).flatten()
    probs = expected_probs.to(torch.float64).flatten()
    probs = probs / probs.sum()
    impossible = probs <= 0
    if observed[impossible].sum() > 0:
        return float("inf"), int((~impossible).sum()) - 1, 0.0
    n = observed.sum()
    live = ~impossible
    expected = probs[live] * n
    stat = float(((observed[live] - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    if dof <= 0:
        return stat, dof, 1.0
    p = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0)))
    return stat, dof, p


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """The p-value of :func:`chi_square`."""
    return chi_square(observed, expected_probs)[2]


def merge_small_cells(observed: torch.Tensor, probs: torch.Tensor, samples: int, min_expected: float = 5.0):
    """Pool the cells whose expected count ``samples * prob`` is below ``min_expected`` into one
    cell (the chi-square approximation needs expected counts of about 5 or more). Cells with
    probability exactly 0 stay apart, so an impossible outcome is still caught."""
    observed, probs = observed.flatten().to(torch.float64), probs.flatten().to(torch.float64)
    small = (probs > 0) & (probs * samples < min_expected)
    keep = ~small
    obs = torch.cat([observed[keep], observed[small].sum().view(1)])
    exp = torch.cat([probs[keep], probs[small].sum().view(1)])
    return obs, exp


def power(null_probs: torch.Tensor, alternative_probs: torch.Tensor, samples: int, alpha: float,
          replicates: int = 2000, seed: int = 0) -> float:
    """Monte-Carlo power: the fraction of ``replicates`` samples of size ``samples`` drawn from
    ``alternative_probs`` that the chi-square test against ``null_probs`` rejects at ``alpha``."""
    g = torch.Generator().manual_seed(seed)
    alt = alternative_probs.flatten().to(torch.float64)
    draws = torch.multinomial(alt / alt.sum(), samples * replicates, replacement=True, generator=g)
    draws = draws.view(replicates, samples)
    rejected = 0
    for row in draws:
        counts = torch.bincount(row, minlength=alt.numel())
        obs, exp = merge_small_cells(counts, null_probs, samples)
        rejected += chi_square_pvalue(obs, exp) < alpha
    return rejected / replicates
