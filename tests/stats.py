"""Statistical helpers for exactness tests: Pearson chi-square goodness of fit.

A test passes when the p-value is above ALPHA. With fixed seeds every test is deterministic; ALPHA
is small so that the many tests in the suite do not fail by chance, while the negative controls
(deliberately wrong verifiers on the same data sizes) produce p-values many orders of magnitude
below it — that gap is each test's demonstrated power.
"""

from __future__ import annotations

import torch

ALPHA = 1e-6


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square for counts ``observed`` against probabilities.

    Cells with zero expected probability must have zero observed counts; any count there is an
    impossible outcome and returns p = 0. Degrees of freedom: (cells with positive probability) - 1.
    """
    observed = observed.to(torch.float64).flatten()
    probs = expected_probs.to(torch.float64).flatten()
    probs = probs / probs.sum()
    impossible = probs <= 0
    if observed[impossible].sum() > 0:
        return 0.0
    n = observed.sum()
    live = ~impossible
    expected = probs[live] * n
    stat = ((observed[live] - expected) ** 2 / expected).sum()
    dof = int(live.sum()) - 1
    if dof <= 0:
        return 1.0
    # Chi-square survival function: regularised upper incomplete gamma Q(dof/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))
