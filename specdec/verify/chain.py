"""Exact chain verification (Leviathan et al. 2023; Chen et al. 2023): pure tensor math.

Given a block of ``k`` draft tokens ``y_1..y_k`` with ``y_i ~ q_i`` and the target's processed
distributions ``p_1..p_{k+1}`` from ONE target call, commit 1..k+1 tokens whose joint distribution
is exactly that of sampling the target autoregressively:

* left to right, accept ``y_i`` with probability ``min(1, p_i(y_i) / q_i(y_i))``;
* at the first rejection, drop ``y_i`` and everything after it and sample a replacement from the
  residual ``norm([p_i - q_i]_+)``;
* if all ``k`` are accepted, sample a bonus token from ``p_{k+1}``.

Vectorised over the batch: every row uses the same ``k`` but its own outcome (ragged acceptance).
The bonus is the residual with ``q_{k+1} = 0``, so one code path samples both.

Stable residual. ``sum([p - q]_+)`` equals the total-variation distance between ``p`` and ``q``
and is exactly the probability that position ``i`` rejects. When it is below
``residual_tolerance`` we sample from ``p`` instead. This is exact in the limit: as the mass goes
to 0 the rejection it would serve has probability going to 0, so swapping the residual for ``p``
moves the committed distribution by at most ``residual_tolerance`` in total variation; and in
exact arithmetic ``p == q`` never rejects at all. Without the fallback, rounding noise of size
``~eps`` would be renormalised into an arbitrary distribution (or 0/0 = NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.verify.sampling import sample

__all__ = ["ChainVerification", "acceptance_probability", "check_probs", "residual_distribution", "verify_chain",
           "verify_chain_unchecked"]


def _sum_tolerance(dtype: torch.dtype) -> float:
    """How far from 1 a valid row's sum may be. Each entry of a normalised row is rounded to the
    dtype with relative error <= eps/2, so the exact sum of the stored entries is within eps/2 of
    1; 2 * eps leaves room for the rounding of the normalisation itself. fp16: 2e-3, bf16: 1.6e-2
    (the fixed 1e-4 rejected valid low-precision rows); fp32 keeps 1e-4, fp64 1e-6."""
    if dtype == torch.float64:
        return 1e-6
    return max(1e-4, 2 * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class ChainVerification:
    """Outcome of one chain verification for a batch of B rows.

    num_accepted: ``[B]`` long, how many draft tokens were accepted (0..k).
    tokens: ``[B, k+1]`` long, the committed tokens: the accepted drafts, then the replacement
        (or bonus) token, then ``-1`` padding after ``num_accepted + 1`` entries.
    """

    num_accepted: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, k+1]

    @property
    def num_committed(self) -> torch.Tensor:
        """``[B]`` tokens committed per row: accepted drafts plus one."""
        return self.num_accepted + 1

    def committed(self, row: int) -> list[int]:
        """The committed token ids of one row, as a plain list."""
        n = int(self.num_accepted[row]) + 1
        return self.tokens[row, :n].tolist()


def acceptance_probability(p_y: torch.Tensor, q_y: torch.Tensor) -> torch.Tensor:
    """``min(1, p(y) / q(y))`` elementwise, for proposed tokens (``q(y) > 0``)."""
    return torch.clamp(p_y / q_y, max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor, tolerance: float = 1e-6) -> torch.Tensor:
    """``norm([p - q]_+)`` over the last dimension, falling back to ``p`` where the mass is
    ``<= tolerance`` (see the module docstring for why this is exact in the limit)."""
    residual = torch.clamp(p - q, min=0.0)  # [..., V]
    mass = residual.sum(-1, keepdim=True)  # [..., 1]
    use_p = mass <= tolerance
    return torch.where(use_p, p, residual / torch.where(use_p, torch.ones_like(mass), mass))


def check_probs(name: str, probs: torch.Tensor) -> None:
    """Raise a ValueError naming ``name`` unless every row is finite, non-negative and sums to 1
    within the tolerance of its dtype (shared by the chain and tree verifiers)."""
    if probs.numel() == 0:
        return
    low, high = torch.aminmax(probs)  # one pass; NaN propagates into both
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise ValueError(f"{name} contains NaN or infinite values")
    if low < 0:
        raise ValueError(f"{name} contains negative probabilities")
    sums = probs.sum(-1, dtype=torch.float64)  # summed exactly enough whatever the input dtype
    tol = _sum_tolerance(probs.dtype)
    worst = (sums - 1).abs().max().item()
    if worst > tol:
        raise ValueError(f"{name} rows must sum to 1 (worst row is off by {worst:.3g} > {tol:g})")


def _validate(target_probs, draft_probs, draft_tokens) -> None:
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, k+1, V], got shape {tuple(target_probs.shape)}")
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, k], got shape {tuple(draft_tokens.shape)}")
    if draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be torch.long, got {draft_tokens.dtype}")
    batch, k_plus_1, vocab = target_probs.shape
    if vocab == 0:
        raise ValueError("target_probs has an empty vocabulary dimension")
    if draft_tokens.shape != (batch, k_plus_1 - 1):
        raise ValueError(
            f"draft_tokens shape {tuple(draft_tokens.shape)} does not match target_probs "
            f"{tuple(target_probs.shape)}: expected ({batch}, {k_plus_1 - 1})"
        )
    if not target_probs.is_floating_point():
        raise ValueError("target_probs must be a floating-point tensor")
    check_probs("target_probs", target_probs)
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(f"draft_tokens must be ids in [0, {vocab})")
    if draft_probs is not None:
        if draft_probs.shape != (batch, k_plus_1 - 1, vocab):
            raise ValueError(
                f"draft_probs must be [B, k, V] = ({batch}, {k_plus_1 - 1}, {vocab}), "
                f"got {tuple(draft_probs.shape)}"
            )
        if not draft_probs.is_floating_point():
            raise ValueError("draft_probs must be a floating-point tensor")
        check_probs("draft_probs", draft_probs)


def verify_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    residual_tolerance: float = 1e-6,
) -> ChainVerification:
    """Verify a block of ``k`` draft tokens per row against the target; see the module docstring.

    target_probs: ``[B, k+1, V]`` processed target distributions at the k+1 positions.
    draft_probs: ``[B, k, V]`` the distributions the drafts were sampled from, or ``None`` for a
        deterministic draft (each ``q_i`` is one-hot on ``draft_tokens[:, i]``).
    draft_tokens: ``[B, k]`` long. ``k = 0`` is valid: one token is sampled from ``p_1``.
    generator: the explicit source of randomness: k uniforms per row for the accept tests, then
        one uniform per row for the replacement/bonus draw (inverse CDF).

    Every input is validated (shapes, ids, finite rows summing to 1); the engine, which produced
    them itself, calls :func:`verify_chain_unchecked` (the same result without the O(B k V) checks).
    """
    _validate(target_probs, draft_probs, draft_tokens)
    return verify_chain_unchecked(target_probs, draft_probs, draft_tokens, generator,
                                  residual_tolerance=residual_tolerance)


def verify_chain_unchecked(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    residual_tolerance: float = 1e-6,
) -> ChainVerification:
    """:func:`verify_chain` for inputs known to be valid. Only the ``[B, V]`` rows it needs are
    materialised: ``p`` and ``q`` at the drafted tokens, and at each row's first rejected (or
    bonus) position."""
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    if draft_probs is not None:
        dtype = torch.promote_types(dtype, draft_probs.dtype)
    device = target_probs.device

    tok = draft_tokens.unsqueeze(-1)  # [B, k, 1]
    p_y = target_probs[:, :k].gather(-1, tok).squeeze(-1).to(dtype)  # [B, k]
    if draft_probs is not None:
        q_y = draft_probs.gather(-1, tok).squeeze(-1).to(dtype)  # [B, k]
    else:
        q_y = torch.ones(batch, k, dtype=dtype, device=device)
    if (q_y <= 0).any():
        raise ValueError("a draft token has zero probability under draft_probs: it cannot have been sampled from them")
    accept_prob = acceptance_probability(p_y, q_y)  # [B, k]

    uniforms = torch.rand((batch, k), generator=generator, dtype=dtype, device=device)  # [B, k]
    accepted = uniforms < accept_prob  # strict: a token with p(y) = 0 is never accepted
    num_accepted = accepted.to(torch.long).cumprod(-1).sum(-1)  # [B]

    # Residual at the first rejected position; at the bonus position (all accepted) q = 0 and
    # the residual is p itself.
    rows = torch.arange(batch, device=device)
    p_n = target_probs[rows, num_accepted].to(dtype)  # [B, V]
    q_n = torch.zeros_like(p_n)  # [B, V]
    rejected = num_accepted < k  # [B]
    if bool(rejected.any()):
        r, n = rows[rejected], num_accepted[rejected]
        if draft_probs is not None:
            q_n[r] = draft_probs[r, n].to(dtype)
        else:
            q_n[r, draft_tokens[r, n]] = 1.0
    residual = residual_distribution(p_n, q_n, residual_tolerance)  # [B, V]
    last = sample(residual, generator)  # [B]

    positions = torch.arange(k_plus_1, device=device).unsqueeze(0)  # [1, k+1]
    drafts_ext = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)  # [B, k+1]
    n = num_accepted.unsqueeze(1)  # [B, 1]
    tokens = torch.where(positions < n, drafts_ext, torch.full_like(drafts_ext, -1))
    tokens = torch.where(positions == n, last.unsqueeze(1), tokens)  # [B, k+1]
    return ChainVerification(num_accepted=num_accepted, tokens=tokens)
