"""Candidate trees and exact multi-candidate verification (pure tensor math; no models).

A tree hangs from the *root*, the last committed token. Node ``i`` has a candidate token
``tokens[b, i]`` and a parent ``parents[b, i]`` (``-1``: the root; always ``< i``, so nodes are
in topological order). Row 0 of ``target_probs`` is the target's distribution at the root and
row ``i + 1`` the distribution after node ``i``; ``draft_probs`` likewise gives the distribution
the children of the root / of node ``i`` were drawn from.

Verification walks down from the root. At a node with current target distribution ``p``, its
children are tried in index order; child ``x`` is accepted with probability
``min(1, p(x) / q(x))``. After a rejection ``p`` becomes the residual ``norm([p - q]+)`` and the
next sibling is tried. When a child is accepted the walk moves to it (its own row of
``target_probs``); when every child is rejected, or the node is a leaf, one token is sampled from
the current ``p`` (the residual, or the bonus at a leaf) and the walk stops.

Why it is exact (SpecInfer's multi-step speculative sampling; Miao et al. 2024): with children
drawn **independently from the same q** (with replacement), each try is a chain verification of
one draft against the current ``p``: the accepted-or-residual mixture reproduces ``p`` exactly,
and the residual is exactly the law of the target's token *given* that this candidate was not
the one chosen. Induction over siblings, then over depth, gives the target's joint law. Children
drawn **without replacement** (distinct tokens, as from top-k of a head or stochastic beam) are
not independent: after rejecting ``x`` the next sibling was drawn from ``q`` with ``x`` removed,
so ``q`` must be updated to ``norm(q with x zeroed)`` too (recursive rejection sampling; Yang et
al. 2024). Using one rule for candidates drawn by the other biases the output; the tests show it.
Deterministic candidates (``draft_probs=None``) are one-hot ``q``: a rejected token is simply
removed from ``p``.

Randomness: one uniform per node (``[B, N]``, drawn up front), used when that node is tried, then
one uniform per row for the final token. A tree shaped like a path therefore consumes the
generator exactly as :func:`specdec.verify.chain.verify_chain` and gives bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.verify.sampling import sample
from specdec.verify.chain import acceptance_probability, check_probs, residual_distribution

__all__ = ["TreeVerification", "ancestor_mask", "children_table", "depths", "verify_tree", "verify_tree_unchecked"]


@dataclass(frozen=True)
class TreeVerification:
    """num_accepted ``[B]``: accepted nodes (0..depth). tokens ``[B, D+1]``: the accepted path's
    tokens then the replacement or bonus token, ``-1`` padded. path ``[B, D]``: node indices of the
    accepted path, ``-1`` padded. ``D`` is the deepest node's depth over the batch."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    path: torch.Tensor

    def committed(self, row: int) -> list[int]:
        return self.tokens[row, : int(self.num_accepted[row]) + 1].tolist()


def depths(parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` depth of each node (1 for children of the root), 0 for padding nodes."""
    out = torch.zeros_like(parents)
    for i in range(parents.shape[1]):
        par = parents[:, i]
        parent_depth = torch.where(par >= 0, out.gather(1, par.clamp(min=0).unsqueeze(1)).squeeze(1), 0)
        out[:, i] = torch.where(tokens[:, i] >= 0, parent_depth + 1, 0)
    return out


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]`` bool: ``mask[b, i, j]`` is True when node ``j`` is node ``i`` or one of its
    ancestors (what node ``i`` may attend to inside the tree block)."""
    batch, n = parents.shape
    mask = torch.zeros(batch, n, n, dtype=torch.bool)
    for i in range(n):
        mask[:, i, i] = True
        par = parents[:, i]
        has = par >= 0
        if has.any():
            rows = has.nonzero().squeeze(1)
            mask[rows, i] |= mask[rows, par[rows]]
    return mask


def _validate(target_probs, draft_probs, tokens, parents) -> None:
    if tokens.dim() != 2 or parents.shape != tokens.shape:
        raise ValueError(f"tokens and parents must both be [B, N], got {tuple(tokens.shape)} and {tuple(parents.shape)}")
    if tokens.dtype != torch.long or parents.dtype != torch.long:
        raise ValueError("tokens and parents must be torch.long")
    batch, n = tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, n + 1):
        raise ValueError(f"target_probs must be [B, N+1, V] = ({batch}, {n + 1}, V), got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    if not target_probs.is_floating_point() or vocab == 0:
        raise ValueError("target_probs must be a floating-point tensor with a non-empty vocabulary")
    if draft_probs is not None and (draft_probs.shape != target_probs.shape or not draft_probs.is_floating_point()):
        raise ValueError(f"draft_probs must be a floating-point [B, N+1, V] tensor like target_probs, got {tuple(draft_probs.shape)}")
    if ((tokens < -1) | (tokens >= vocab)).any():
        raise ValueError(f"tokens must be ids in [0, {vocab}) or -1 for padding")
    index = torch.arange(n).unsqueeze(0)
    if ((parents < -1) | (parents >= index)).any():
        raise ValueError("parents[b, i] must be -1 (the root) or a node index < i")
    used = tokens >= 0
    par_used = torch.where(parents >= 0, used.gather(1, parents.clamp(min=0)), True)
    if (used & ~par_used).any():
        raise ValueError("a node hangs from a padding node (tokens == -1)")
    check_probs("target_probs", target_probs)
    if draft_probs is not None:
        check_probs("draft_probs", draft_probs)


def verify_tree(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    without_replacement: bool = False,
    residual_tolerance: float = 1e-6,
) -> TreeVerification:
    """Exact multi-candidate verification of a token tree per row; see the module docstring.

    target_probs ``[B, N+1, V]``, draft_probs ``[B, N+1, V]`` or ``None`` (deterministic
    candidates), tokens / parents ``[B, N]`` long. ``without_replacement``: the proposer drew the
    siblings without replacement (distinct tokens); then ``q`` is updated after each rejection.
    """
    _validate(target_probs, draft_probs, tokens, parents)
    return verify_tree_unchecked(target_probs, draft_probs, tokens, parents, generator,
                                 without_replacement=without_replacement, residual_tolerance=residual_tolerance)


def verify_tree_unchecked(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    without_replacement: bool = False,
    residual_tolerance: float = 1e-6,
) -> TreeVerification:
    """:func:`verify_tree` without the O(B N V) validation, for inputs the engine produced."""
    batch, n = tokens.shape
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    if draft_probs is not None:
        dtype = torch.promote_types(dtype, draft_probs.dtype)
    p_all = target_probs.to(dtype)  # [B, N+1, V]
    q_all = None if draft_probs is None else draft_probs.to(dtype)
    uniforms = torch.rand((batch, n), generator=generator, dtype=dtype)  # [B, N]: one per node
    node_depth = depths(parents, tokens)  # [B, N]
    max_depth = int(node_depth.max()) if n else 0
    kids = children_table(tokens, parents)  # [B, N+1, C]: children of the root / node i, in order

    # All rows walk down in lockstep: per level, the c-th child of every row's current node is
    # tried at once (rows without one skip it). Row-wise the arithmetic is verify_chain's.
    rows = torch.arange(batch)
    node = torch.full((batch,), -1, dtype=torch.long)  # current node (-1: the root)
    walking = torch.ones(batch, dtype=torch.bool)  # rows still descending
    p = p_all[:, 0].clone()  # [B, V] the current target distribution (updated by residuals)
    q = None if q_all is None else q_all[:, 0].clone()  # [B, V]
    finals = torch.empty_like(p)  # [B, V] the distribution of each row's last token
    path = torch.full((batch, max_depth), -1, dtype=torch.long)
    num_accepted = torch.zeros(batch, dtype=torch.long)
    for depth in range(max_depth + 1):
        options = kids[rows, node + 1]  # [B, C]
        has_children = walking & (options[:, 0] >= 0)
        accepted = _try_children(options, walking, tokens, uniforms, p, q, without_replacement, residual_tolerance)
        stop = walking & (accepted < 0)
        if bool(stop.any()):
            # all children rejected: p is already the residual; a leaf: the bonus, normalised
            # exactly as verify_chain does it (the residual against q = 0)
            leaf = stop & ~has_children
            finals[stop] = p[stop]
            if bool(leaf.any()):
                finals[leaf] = residual_distribution(p[leaf], torch.zeros_like(p[leaf]), residual_tolerance)
        walking = walking & (accepted >= 0)
        if not bool(walking.any()):
            break
        w = walking.nonzero().squeeze(1)
        path[w, depth] = accepted[w]
        num_accepted[w] += 1
        node = torch.where(walking, accepted, node)
        p[w] = p_all[w, accepted[w] + 1]
        if q is not None:
            q[w] = q_all[w, accepted[w] + 1]
    out_tokens = torch.full((batch, max_depth + 1), -1, dtype=torch.long)
    if max_depth:
        out_tokens[:, :max_depth] = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1)
    last = sample(finals, generator)  # [B]
    out_tokens[rows, num_accepted] = last
    return TreeVerification(num_accepted=num_accepted, tokens=out_tokens, path=path)


def _try_children(options: torch.Tensor, walking: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor,
                  p: torch.Tensor, q: torch.Tensor | None, without_replacement: bool, tolerance: float) -> torch.Tensor:
    """One level of the walk: the children ``options`` ``[B, C]`` of each walking row's node are
    tried in order, the first accepted wins; each rejection turns the row's ``p`` ``[B, V]`` (and
    ``q``, for siblings drawn without replacement) into its residual, in place. Returns the
    accepted child per row ``[B]`` (-1: none)."""
    accepted = torch.full((options.shape[0],), -1, dtype=torch.long)
    for c in range(options.shape[1]):
        child = options[:, c]  # [B]
        trying = walking & (accepted < 0) & (child >= 0)
        if not bool(trying.any()):
            continue
        r = trying.nonzero().squeeze(1)  # [R]
        x = tokens[r, child[r]]  # [R]
        p_x = p[r, x]
        q_x = torch.ones_like(p_x) if q is None else q[r, x]
        if bool((q_x <= 0).any()):
            bad = int(r[(q_x <= 0).nonzero()[0, 0]])
            raise ValueError(f"row {bad}: candidate {int(tokens[bad, child[bad]])} of node {int(child[bad])} "
                             "has zero probability under draft_probs")
        ok = uniforms[r, child[r]] < acceptance_probability(p_x, q_x)  # [R]
        accepted[r[ok]] = child[r[ok]]
        if bool((~ok).any()):
            _reject(p, q, r[~ok], x[~ok], without_replacement, tolerance)
    return accepted


def _reject(p: torch.Tensor, q: torch.Tensor | None, rows: torch.Tensor, x: torch.Tensor, without_replacement: bool,
            tolerance: float) -> None:
    """Candidate ``x`` ``[R]`` rejected in ``rows`` ``[R]``: p becomes the residual (p - q)+ there
    (a one-hot q when ``q`` is None: x removed from p), and q, drawn without replacement, loses x."""
    if q is None:  # one-hot q: the rejected token is removed from p
        q_rows = torch.zeros_like(p[rows])
        q_rows[torch.arange(rows.numel()), x] = 1.0
    else:
        q_rows = q[rows]
    p[rows] = residual_distribution(p[rows], q_rows, tolerance)
    if q is not None and without_replacement:
        q_rows = q_rows.clone()
        q_rows[torch.arange(rows.numel()), x] = 0.0
        mass = q_rows.sum(-1, keepdim=True)
        q[rows] = torch.where(mass > 0, q_rows / torch.where(mass > 0, mass, 1.0), q_rows)


def children_table(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """``[B, N+1, C]``: entry ``[b, j]`` lists the children of the root (j = 0) or of node
    ``j - 1``, in index order, ``-1`` padded (padding nodes are not children)."""
    batch, n = tokens.shape
    used = tokens >= 0
    slot = torch.where(used, parents + 1, n + 1)  # [B, N] the parent's row (n + 1: discard)
    one_hot = torch.nn.functional.one_hot(slot, n + 2)[..., : n + 1]  # [B, N, N+1]
    rank = one_hot.cumsum(1) - 1  # [B, N, N+1] each child's rank among its siblings
    width = max(int(one_hot.sum(1).max()) if n else 0, 1)
    table = torch.full((batch, n + 2, width), -1, dtype=torch.long)
    b, i = torch.nonzero(used, as_tuple=True)
    table[b, slot[b, i], rank[b, i, slot[b, i]]] = i
    return table[:, : n + 1]
