"""Statistical helpers for exactness tests: Pearson chi-square goodness of fit.

A test passes when the p-value is above ALPHA. With fixed seeds every test is deterministic; ALPHA
is small so that the many tests in the suite do not fail by chance, while the negative controls
(deliberately wrong verifiers on the same data sizes) produce p-values many orders of magnitude
below it — that gap is each test's demonstrated power.
"""

from specdec.verify.stats import chi_square_pvalue

ALPHA = 1e-6

__all__ = ["ALPHA", "chi_square_pvalue"]
