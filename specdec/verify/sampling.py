"""Logits -> processed probabilities, and sampling with an explicit generator.

Exact speculative decoding is exact with respect to the *processed* target distribution: the
temperature, top-k, top-p and min-p applied here are applied identically to the target's logits
(giving ``p``) and to the draft's logits (giving the ``q`` the draft actually sampled from).

Order of processing (the same as Hugging Face's default warper order):
temperature -> top-k -> top-p -> min-p, then renormalise.

Temperature 0 means greedy: a one-hot distribution on the argmax, ties going to the lowest id
(``torch.argmax`` returns the first maximal index). A greedy row is an ordinary distribution to
the verifier, so greedy and sampled rows can share one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Above this the processed distribution is uniform noise over the kept tokens for any real logits
# (and inf is not a temperature): such a value is a mistake, not a request.
MAX_TEMPERATURE = 100.0
# Below this a temperature is greedy. Logits are processed in fp32, where a temperature under
# ~7e-46 rounds to 0: the max logit's 0 / 0 would be NaN and the row could not be sampled (a
# request with temperature 1e-50 used to take the server down). 1e-40 is still a (subnormal)
# non-zero fp32 number, so every temperature from here up divides stably. At any temperature this
# small the distribution is the argmax already, but for exact ties, which greedy breaks towards
# the lowest id.
GREEDY_BELOW = 1e-40

__all__ = ["GREEDY_BELOW", "MAX_TEMPERATURE", "SamplingMetadata", "SamplingParams", "greedy_one_hot", "probs_from_logits", "probs_per_row", "sample", "sample_at"]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn a row of logits into the distribution that is sampled from.

    temperature: 0 means greedy (one-hot argmax); > 0 divides the logits; below
        :data:`GREEDY_BELOW` it is stored as 0 (greedy).
    top_k: keep the k most likely tokens (0 or None: off).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0: off).
    min_p: drop tokens whose probability is below min_p * max probability (0.0: off).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE):  # also rejects NaN
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 or None, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingMetadata:
    """How the rows of one step sample: built once per step by the engine and handed to the
    proposer and to verification (vLLM's ``SamplingMetadata``), so that no one else keeps a
    per-row params list or asks "is this row greedy?" again.

    ``params``: one :class:`SamplingParams` per row, in batch order. ``generator``: the engine's
    draft stream (what proposers sample their drafts from; None where nothing is drawn)."""

    __slots__ = ("params", "generator", "all_greedy", "all_random")

    def __init__(self, params: list[SamplingParams] | tuple[SamplingParams, ...],
                 generator: torch.Generator | None = None) -> None:
        self.params = tuple(params)
        self.generator = generator
        self.all_greedy = all(p.greedy for p in self.params)  # (True for no rows)
        self.all_random = bool(self.params) and not any(p.greedy for p in self.params)

    def __len__(self) -> int:
        return len(self.params)

    def ranking(self) -> list[SamplingParams]:
        """Per row, the params that rank draft candidates: the row's own, or temperature 1 for a
        greedy row (whose processed distribution is one-hot and would rank nothing)."""
        return [p if not p.greedy else SamplingParams(temperature=1.0) for p in self.params]


def greedy_one_hot(logits: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One-hot distribution on the argmax of the last dimension (lowest id wins ties)."""
    idx = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
    out = torch.zeros(logits.shape, dtype=dtype or _prob_dtype(logits), device=logits.device)
    return out.scatter_(-1, idx, 1.0)


def _prob_dtype(logits: torch.Tensor) -> torch.dtype:
    # Probabilities are kept in at least fp32: bf16 cannot represent small residual masses.
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed probabilities for logits of shape ``[..., V]``; the result has the same shape.

    Every row sums to 1 and is finite; tokens removed by top-k/top-p/min-p have probability 0.
    """
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    if params.greedy:
        return greedy_one_hot(logits)
    # Shift by the row max before dividing (softmax is shift-invariant): the largest logit becomes
    # 0 and the rest <= 0, so even a tiny temperature (1e-38) cannot overflow to inf - inf = NaN;
    # it tends to the greedy one-hot as it should.
    x = logits.to(_prob_dtype(logits))
    x = (x - x.amax(dim=-1, keepdim=True)) / params.temperature  # [..., V]
    vocab = x.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., V]
        drop_sorted = mass_before >= params.top_p  # the first token always has mass_before == 0
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def probs_per_row(logits: torch.Tensor, params: list[SamplingParams] | tuple[SamplingParams, ...]) -> torch.Tensor:
    """``logits`` ``[B, ..., V]`` with one :class:`SamplingParams` per row -> probabilities.

    One vectorised call when every row shares its parameters (the common case)."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} sampling parameter sets for {logits.shape[0]} rows")
    if all(p == params[0] for p in params):
        return probs_from_logits(logits, params[0])
    return torch.stack([probs_from_logits(logits[b], params[b]) for b in range(logits.shape[0])])


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token id per row of ``probs`` ``[..., V]`` (rows need not be normalised);
    returns ``[...]`` long.

    Inverse-CDF sampling with ONE uniform per row: ``torch.multinomial`` draws V exponentials
    per row, ~3 ms for a 152k vocabulary here, against ~0.3 ms for a cumulative sum. A token with
    probability 0 is never returned: its CDF step is empty, and ``searchsorted(right=True)``
    returns the first index whose CDF exceeds the uniform.

    Raises ``ValueError`` for a row with no mass to sample from (all zeros, or any NaN / inf /
    negative entry makes its total non-finite or non-positive): such a row is a bug upstream, and
    returning some id for it would hide the bug.
    """
    rows = probs.reshape(-1, probs.shape[-1]).shape[0]
    u = torch.rand(rows, 1, generator=generator, dtype=torch.float64, device=probs.device)
    return sample_at(probs, u.view(probs.shape[:-1]))


def sample_at(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse CDF of each row of ``probs`` ``[..., V]`` at the given ``uniforms`` ``[...]``
    (float64 in [0, 1)): :func:`sample` with its uniforms supplied (what reproducible sampling
    uses, :mod:`specdec.verify.reproducible`)."""
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.to(torch.float64).cumsum(-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("cannot sample from a row whose probabilities are all zero, NaN or infinite")
    u = uniforms.reshape(-1, 1).to(torch.float64)  # [N, 1]
    ids = torch.searchsorted(cdf, u * total, right=True)  # [N, 1]
    # u < 1, so u * total < total and searchsorted finds an id < V, except when rounding makes
    # u * total == total for u within ~1e-16 of 1: the clamp keeps that id in range.
    ids = ids.clamp_(max=flat.shape[-1] - 1)
    return ids.reshape(probs.shape[:-1])
