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


def chi_square_critical(dof: int, alpha: float) -> float:
    """The statistic above which Pearson's test rejects at ``alpha`` (bisection on the survival
    function; exact to ~1e-9 relative)."""
    lo, hi = 0.0, float(dof) + 20.0 * (dof**0.5 + 10.0)
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(torch.special.gammaincc(a, torch.tensor(mid / 2, dtype=torch.float64))) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def power(dof: int, noncentrality: float, alpha: float, draws: int = 200_000, seed: int = 0) -> float:
    """Power of the chi-square test with ``dof`` degrees of freedom at ``alpha`` against an
    alternative with the given noncentrality ``lambda`` (large-sample theory: the statistic is then
    noncentral chi-square). Monte Carlo over ``draws`` draws of ``(Z + sqrt(lambda))^2 + chi2(dof - 1)``.

    For an observed statistic ``X`` of a run from the alternative, ``max(0, X - dof)`` is an
    unbiased estimate of ``lambda`` (``E[X] = dof + lambda``); using ``X`` itself would count the
    run's own sampling noise as effect and overstate the power.
    """
    if dof <= 0:
        return 0.0
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(draws, generator=g, dtype=torch.float64) + max(noncentrality, 0.0) ** 0.5
    rest = torch.distributions.Chi2(torch.tensor(float(dof - 1), dtype=torch.float64)).sample((draws,)) if dof > 1 \
        else torch.zeros(draws, dtype=torch.float64)
    return float(((z * z + rest) > chi_square_critical(dof, alpha)).double().mean())
